"""PowerSGD: rank-``r`` approximation by one step of power iteration (peer baseline).

Vogels, Karimireddy & Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for
Distributed Optimization", NeurIPS 2019; the same steps as PyTorch's
``torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py``.  Each gradient is
viewed as a matrix ``M`` (``shape[0]`` rows, the rest as columns) and, with the
compensated gradient ``M = G + E`` of every rank ``w``::

    P_w = M_w Q                   Q: (cols, r), the last step's (warm start)
    P   = sum_w P_w               allreduce 1 (<name>.p)
    P^  = orthonormal(P)          reduced QR, identical on every rank
    Q_w = M_w^T P^
    Q   = sum_w Q_w               allreduce 2 (<name>.q)
    out = P^ Q^T  = sum_w P^ P^T M_w      (the sum over ranks; the glue averages)
    E_w = M_w - P^ Q_w^T          error feedback: what this rank's part lost

Each rank sends ``(rows + cols) r`` float32 values instead of ``rows cols``.  The
residual is this rank's own loss, so ``sum_t P^ Q_w^T + E_w`` conserves its gradients;
summed over ranks the residuals equal the hook's (which keeps ``M_w - out / P``).

Warm start as the hook: the next step starts from this step's averaged ``Q``;
the first ``Q`` is drawn from N(0, 1), identically on every rank (``seed`` and the
tensor's name).  As in the hook, vectors and tensors that would not shrink at least
``min_compression_rate`` times (``(rows + cols) r * rate >= rows cols``) are sent
uncompressed (``for_tensor`` gives them to one shared ``none`` compressor, so buckets
group them).  Computed in float32 whatever the gradient's dtype.  A NaN/Inf on any
rank makes the aggregate non-finite (as uncompressed), and leaves every rank's
residual and ``Q`` as they were.

A two-round exchange (:mod:`.base`): ``propose`` / ``agree`` / ``finish`` run by the
glue layers, not ``compress``; the warm-start ``Q`` of every tensor is in
``state_dict()`` beside the residuals.

Imports: the standard library, numpy, ``hvd_compress.ops``,
``hvd_compress.stats``; and modules of its own package.
"""
import zlib
from typing import Any, NamedTuple

import numpy as np

from ..ops import ops_for
from ..stats import ring_received
from .base import Compressor, Ctx, register
from .dense import NoneCompressor

Q_PREFIX = "q/"


class Round(NamedTuple):
    """What a rank keeps between the two allreduces; never sent."""
    ctx: Any
    ops: Any
    compensated: Any    #: the compensated gradient, flat (residual update)
    parts: Any          #: ((name, numel), ...) end to end
    finite: Any         #: this rank's compensated gradient is finite
    memory: Any         #: ResidualMemory, or None without error feedback
    mats: Any           #: per tensor (M, Q, rows, cols, r)
    size: int           #: ranks in the exchange
    phats: Any = None   #: per tensor P^ (after ``agree``)


@register
class PowerSGD(Compressor):
    """Rank-``rank`` PowerSGD with error feedback and warm start (see the module docstring)."""

    name = "powersgd"
    collective = "two_round"
    rounds = (("allreduce", "p"), ("allreduce", "q"))
    biased = True
    segmented = True

    def __init__(self, rank=1, ef=None, min_compression_rate=2.0, seed=0):
        super().__init__(ef=ef)
        if int(rank) < 1 or int(rank) != float(rank):
            raise ValueError(f"rank must be an integer >= 1, got {rank!r}")
        if not float(min_compression_rate) >= 1:
            raise ValueError(f"min_compression_rate must be >= 1, got {min_compression_rate!r}")
        self.rank = int(rank)
        self.min_compression_rate = float(min_compression_rate)
        self.seed = int(seed)
        self._dense = NoneCompressor()

    def matrix(self, shape):
        """``(rows, cols, r)`` of a tensor of ``shape`` compressed, or None if sent as is."""
        if len(shape) < 2:
            return None
        rows = int(shape[0])
        cols = 1
        for d in shape[1:]:
            cols *= int(d)
        if rows == 0 or cols == 0:
            return None
        r = min(self.rank, rows, cols)
        if not (rows + cols) * r * self.min_compression_rate < rows * cols:
            return None
        return rows, cols, r

    def for_tensor(self, name, tensor):
        """Matrices that shrink: this compressor; the rest (vectors, small or integer
        tensors) one shared ``none``."""
        chosen = super().for_tensor(name, tensor)
        if chosen is not self:
            return chosen
        return self if self.matrix(tuple(ops_for(tensor).shape(tensor))) else self._dense

    def compress(self, tensor, name=None):
        raise TypeError(f"{self.spec!r} is a two-round exchange (propose, agree, finish; see "
                        "hvd_compress.compressors.lowrank), not compress(); hvd_compress."
                        "torch.DistributedOptimizer, hvd_compress.tensorflow."
                        "DistributedGradientTape and hvd_compress.ddp run it")

    compress_bucket = compress

    # -- round 1 -----------------------------------------------------------------------
    def propose(self, tensor, name, rank, size):
        """``(P_w flat, Round)`` for one tensor."""
        ops = ops_for(tensor)
        shape = tuple(ops.shape(tensor))
        ctx = Ctx(shape, tensor.dtype, ops.numel(tensor), name)
        return self._propose(ops.flatten(tensor), ctx, ops, ((name, ctx.numel),), (shape,),
                             False, size)

    def propose_bucket(self, flat, layout, rank, size):
        """``(P_w of every tensor end to end, Round)`` for a bucket (``flat`` may be
        overwritten)."""
        ops = ops_for(flat)
        ctx = Ctx((layout.total,), flat.dtype, layout.total, layout.key, segments=layout)
        return self._propose(flat, ctx, ops, tuple(zip(layout.names, layout.numels)),
                             layout.shapes, True, size)

    def _propose(self, flat, ctx, ops, parts, shapes, own, size):
        memory, compensated = None, flat
        if self.ef:
            memory = self.error_feedback(ops)
            compensated = memory.compensate_parts(parts, flat, own=own and len(parts) > 1)
        finite = ops.all_finite(compensated)
        x = ops.to_float32(compensated)
        mats, ps, at = [], [], 0
        for (name, n), shape in zip(parts, shapes):
            found = self.matrix(shape)
            if found is None:
                raise ValueError(f"powersgd: {name!r} of shape {tuple(shape)} is not a matrix "
                                 "it compresses; for_tensor() sends it uncompressed")
            rows, cols, r = found
            m = ops.reshape(x[at:at + n], [rows, cols])
            q = self._q(name, cols, r, ops, x)
            mats.append((m, q, rows, cols, r))
            ps.append(ops.matmul(m, q))
            at += n
        return ops.concat(ps), Round(ctx, ops, compensated, parts, finite, memory, mats, size)

    def _q(self, name, cols, r, ops, like):
        """The warm-start Q of tensor ``name`` (first: N(0, 1), the same on every rank)."""
        def init():
            rng = np.random.RandomState(zlib.crc32(f"{self.seed}/{name}".encode()))
            return ops.constant(rng.standard_normal((cols, r)).astype(np.float32), like)
        return self._state(ops).get(Q_PREFIX + name, init)

    # -- round 2 -----------------------------------------------------------------------
    def agree(self, p_sum, rnd):
        """``(Q_w of every tensor end to end, Round)`` from the summed P; error feedback
        keeps ``M_w - P^ Q_w^T``."""
        ops = rnd.ops
        _check_length(p_sum, sum(rows * r for _, _, rows, _, r in rnd.mats), "P", rnd)
        phats, qs, at = [], [], 0
        for m, _, rows, cols, r in rnd.mats:
            phat = ops.orthonormal_columns(ops.reshape(p_sum[at:at + rows * r], [rows, r]))
            phats.append(phat)
            qs.append(ops.matmul(m, phat, transpose_a=True))
            at += rows * r
        if rnd.memory is not None:
            finite = rnd.finite & ops.all_finite(p_sum)
            sent = list(zip(phats, qs))                      # P^ Q_w^T, tensor by tensor
            rnd.memory.update_parts(
                rnd.parts, rnd.compensated,
                lambda c, inplace: ops.subtract_low_rank_products(c, sent, inplace), finite)
        return ops.concat(qs), rnd._replace(phats=phats)

    def finish(self, q_sum, rnd):
        """The sum over ranks ``P^ Q^T`` (shaped like the tensor; a bucket: flat), in the
        gradient's dtype; keeps the averaged Q for the next step's warm start."""
        ops = rnd.ops
        _check_length(q_sum, sum(cols * r for _, _, _, cols, r in rnd.mats), "Q", rnd)
        finite = ops.all_finite(q_sum)
        state = self._state(ops)
        qs, at = [], 0
        for (name, _), (_, q_old, _, cols, r) in zip(rnd.parts, rnd.mats):
            q = ops.reshape(q_sum[at:at + cols * r], [cols, r])
            qs.append(q)
            state.set(Q_PREFIX + name, ops.select(finite, q / float(rnd.size), q_old))
            at += cols * r
        flat = ops.cast(ops.low_rank_products(list(zip(rnd.phats, qs))), rnd.ctx.dtype)
        return flat if rnd.ctx.segments is not None else ops.reshape(flat, rnd.ctx.shape)

    def traffic(self, proposal, gathered, values, rnd, size):
        """Two ring allreduces: of P, then of Q."""
        ops = rnd.ops
        p, q = ops.size_bytes(proposal), ops.size_bytes(values)
        received = ring_received(p, size) + ring_received(q, size)
        return p + q, received, received, 0, 0


def _check_length(summed, expected, what, rnd):
    """ValueError unless the aggregate of ``what`` (P or Q) has ``expected`` values."""
    n = rnd.ops.length(summed)
    if isinstance(n, int) and n != expected:
        raise ValueError(f"powersgd ({rnd.ctx.name or 'tensor'}): {n} summed values of {what}, "
                         f"expected {expected}; the payload is malformed")
