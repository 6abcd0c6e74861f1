"""Sparsifiers: send ``k`` (value, index) pairs of the gradient.

All of them share the payload ``(values, int32 indices)`` and its aggregation: the
allgather concatenates the ranks' pairs and decoding is a scatter-*add* into zeros, so
an index chosen by several ranks gets the sum of their values (Aji & Heafield 2017,
"Sparse communication for distributed gradient descent").  They are biased, so error
feedback is on by default (``ef=0`` turns it off).

Non-finite gradients: when the (compensated) gradient holds NaN or Inf the tensor is
sent whole, every index, so the aggregate is non-finite exactly where uncompressed
Horovod's would be (loss scalers see it), and the residual is left as it was.

Imports: the standard library, ``hvd_compress.ops``; and modules of its own package.
"""
import math

from ..ops import ops_for
from . import aggregation, dgc_recipe
from .base import Compressor, Ctx, OwnPayload, register


def check_density(density):
    """Return ``density`` as float, or raise ValueError when it is not in (0, 1]."""
    try:
        value = float(density)
    except (TypeError, ValueError):
        raise ValueError(f"density must be a number in (0, 1], got {density!r}") from None
    if not 0.0 < value <= 1.0:   # also rejects NaN
        raise ValueError(f"density must be in (0, 1], got {density!r}")
    return value


class Sparsifier(Compressor):
    """Base of the sparsifiers: subclasses implement :meth:`select`.

    ``values``: how the selected values travel: ``float`` (their own dtype, default) or
    ``rangefloat4/6/8/12/16`` (payload ``(bytes, header, indices)``).
    """

    collective = "allgather"
    biased = True
    segmented = False     #: True where select() handles ``ctx.segments`` (per tensor)

    def __init__(self, ef=None, values=None):
        super().__init__(ef=ef)
        from .rangefloat import RangeFloatCodec
        self.codec = RangeFloatCodec.from_name(values)
        self.values = None if self.codec is None else values

    def select(self, flat, ctx, ops, step):
        """int32 indices of the entries to send (may be empty)."""
        raise NotImplementedError

    def select_checked(self, flat, ctx, ops, step):
        """``(indices, finite)``: every index of ``flat`` when it holds any NaN/Inf, else
        :meth:`select`'s.  Here a finiteness check (``ctx.finite`` when the caller has
        it), then :meth:`select`; ``finds_nonfinite`` sparsifiers learn both in one pass."""
        finite = ops.all_finite(flat) if ctx.finite is None else ctx.finite
        idx = ops.cond(finite,
                       lambda: self.select(flat, ctx, ops, step),
                       lambda: ops.arange(ctx.numel, flat))
        return idx, finite

    def encode(self, flat, ctx, ops, step):
        return self.encode_checked(flat, ctx, ops, step)[0]

    def encode_checked(self, flat, ctx, ops, step):
        idx, finite = self.select_checked(flat, ctx, ops, step)
        return self._payload(flat, idx, ctx, ops), finite

    def _payload(self, flat, idx, ctx, ops, values=None, counts=None, lengths=None):
        """The payload of the entries ``idx`` of ``flat``; ``values`` and ``counts`` (their
        number per tensor of a bucket), where the selection's launch has them already, or
        ``lengths`` (that number known on the host)."""
        if values is None:
            values = ops.gather(flat, idx)
        if self.codec is None:
            return values, idx
        lay = ctx.bucket
        if lay is not None:                                  # an exponent range per tensor
            seg = None if counts is not None or lengths is not None else ops.gather(
                ops.segment_ids(lay, flat), idx)
            if not self.ef:
                return (*self.codec.encode_segments(values, seg, len(lay.names), ops, lengths,
                                                    counts=counts), idx)
            payload, sent = self.codec.encode_segments_own(values, seg, len(lay.names), ops,
                                                           lengths, counts=counts)
            return (*payload, idx) if sent is None else OwnPayload((*payload, idx), sent=sent)
        return (*self.codec.encode(values, ops), idx)

    sparse_residual = True   #: payload indices are element indices of the input

    def subtract_sent(self, compensated, payload, ctx, ops, inplace):
        """``c - scatter(payload)`` touching only the sent entries (own indices are
        distinct); the same bits as the dense subtraction."""
        if not self.sparse_residual:
            return super().subtract_sent(compensated, payload, ctx, ops, inplace)
        values, idx = self.own_values(payload, ops)
        return ops.subtract_at(compensated, idx, values, inplace)

    def own_values(self, payload, ops):
        """``(values, indices)`` of this rank's *own* payload: the values decoded knowing
        that there are as many as indices, nothing checked (no host synchronisation)."""
        if self.codec is None:
            return payload
        idx = payload[2]
        sent = getattr(payload, "sent", None)            # decoded by the encode's launch
        if sent is not None:
            return sent, idx
        return self.codec.decode(payload[0], payload[1], ops, total=ops.length(idx)), idx

    def decode(self, payload, ctx, ops):
        parts = 2 if self.codec is None else 3
        if len(payload) != parts:
            raise ValueError(f"{self.name}: a payload is ({'values' if parts == 2 else 'bytes, header'}"
                             f", indices), got {len(payload)} tensors")
        idx = payload[-1]
        # the indices' range check: read back with the values' header check where that
        # makes a host readback anyway (values=rangefloat* on CUDA), else on its own
        check = ops.index_check(idx, ctx.numel, f"{self.name} ({ctx.name or 'tensor'})")
        if self.codec is None:
            values = payload[0]
        else:
            try:
                values = self.codec.decode(payload[0], payload[1], ops, check=check)
            except ValueError as e:
                raise ValueError(f"{self.name} ({ctx.name or 'tensor'}) values: {e}") from None
        nv, ni = ops.length(values), ops.length(idx)
        if isinstance(nv, int) and isinstance(ni, int) and nv != ni:
            raise ValueError(f"{self.name}: payload has {nv} values but {ni} indices")
        idx = check.finish()           # clamped where deferred (ops.deferred_checks)
        # (each rank's pairs, where the exchange knows how many: added rank by rank)
        return ops.scatter_sum(ctx.numel, idx, values, ops.float32,
                               segments=ops.rank_rows(parts - 1, ni))


class DensitySparsifier(Sparsifier):
    """A sparsifier that sends ``k = ceil(density * n)`` entries (at least 1).

    ``agg``: how the ranks' selections are aggregated, ``local`` (default: own pairs,
    allgathered), ``union``, ``leader`` or ``hint`` (a two-round exchange whose values
    are summed by an allreduce; ``beta`` and ``hint`` tune ``agg=hint``).  See
    :mod:`hvd_compress.compressors.aggregation`.

    DGC's training recipe for SGD-momentum (:mod:`.dgc_recipe`): ``momentum`` (momentum
    correction; use the optimizer without momentum), ``clip`` (local gradient
    clipping, per tensor), ``mask`` (momentum factor masking), ``warmup_steps``
    (density warm-up from 25%).
    """

    def __init__(self, density=0.01, ef=None, values=None, agg=None, beta=None, hint=None,
                 momentum=None, clip=None, mask=None, warmup_steps=None):
        super().__init__(ef=ef, values=values)
        self.density = check_density(density)
        self.momentum, self.clip, self.mask, self.warmup_steps = dgc_recipe.check(
            momentum, clip, mask, warmup_steps, agg)
        if self.momentum and self.mask is None:
            self.mask = True                  # DGC masks by default
        if self.warmup_steps:
            self.uses_step = True
        agg, self.beta, self.hint = aggregation.check_agg(agg, beta, hint, self.values)
        self.agg = None if agg == "local" else agg
        if self.agg is not None:
            self.collective = "two_round"
            self.rounds = (("allgather", "idx"), ("allreduce", "val"))

    def k(self, n):
        return max(1, min(n, math.ceil(self.density * n)))

    def default_ef_decay(self, kind):
        """Compressed updates' residuals (``kind == "updates"``) decay by default:
        ``beta = max(0.9, 1 - 10 density)`` (0.9 at densities from 1%, 0.99 at 0.1%), so
        what is not sent fades within about a tenth of the ``1/density`` steps a
        coordinate waits between sends, instead of arriving as one late, large step
        (SparseLoCo's decayed error feedback: Sarfi, Therien, Lidin & Belilovsky,
        arXiv:2508.15706, 2025).  Measured with AdamW on a GPT-2 (docs/adam-adamw.md):
        at 1% 0.9 brought the loss from 5-11% above dense to within -3..+2%, at 10% from
        12% above to 2% below, at 0.1% 0.99 gained 1% where 0.9 lost 4%.  Gradients'
        residuals: 1 (plain error feedback)."""
        return max(0.9, 1.0 - 10.0 * self.density) if kind == "updates" else 1.0

    def _compress_flat(self, flat, ctx, ops, step, parts, own=False):
        if not (self.momentum or self.clip or self.warmup_steps):
            return super()._compress_flat(flat, ctx, ops, step, parts, own)
        return dgc_recipe.compress(self, flat, ctx, ops, step, parts, own,
                                   super()._compress_flat)

    # -- aggregation-aware exchange (agg=union/leader/hint): two rounds ----------------
    def compress(self, tensor, name=None):
        self._one_round()
        return super().compress(tensor, name)

    def compress_bucket(self, flat, layout):
        self._one_round()
        return super().compress_bucket(flat, layout)

    def _one_round(self):
        if self.agg is not None:
            raise TypeError(f"{self.spec!r} is a two-round exchange (propose, agree, finish: "
                            "see hvd_compress.compressors.aggregation), not compress(); "
                            "hvd_compress.torch.DistributedOptimizer and hvd_compress."
                            "tensorflow.DistributedGradientTape run it")

    @property
    def hint_beta(self):
        return aggregation.DEFAULT_BETA if self.beta is None else self.beta

    def domain_ctx(self, ctx):
        """The Ctx of the values selection works on (DCT coefficients for dct)."""
        return ctx

    def to_domain(self, flat, ctx, ops):
        """The values selection works on, and :meth:`domain_ctx`."""
        return flat, ctx

    def from_domain(self, coefs, ctx, ops):
        """Inverse of :meth:`to_domain` (flat float32)."""
        return coefs

    def propose(self, tensor, name, rank, size):
        """Round 1 for one tensor: ``(int32 indices to allgather, Round)``."""
        ops = ops_for(tensor)
        ctx = Ctx(ops.shape(tensor), tensor.dtype, ops.numel(tensor), name)
        return aggregation.propose(self, ops.flatten(tensor), ctx, ops, self._steps(ops, [name]),
                                   ((name, ctx.numel),), False, rank, size)

    def propose_bucket(self, flat, layout, rank, size):
        """Round 1 for a bucket (as :meth:`compress_bucket`; ``flat`` may be overwritten)."""
        ops = ops_for(flat)
        ctx = Ctx((layout.total,), flat.dtype, layout.total, layout.key, segments=layout)
        return aggregation.propose(self, flat, ctx, ops, self._steps(ops, layout.names),
                                   tuple(zip(layout.names, layout.numels)), True, rank, size)

    def agree(self, gathered, rnd):
        """``(values at U to allreduce with Sum, Round)`` from every rank's indices."""
        return aggregation.agree(self, gathered, rnd)

    def finish(self, summed, rnd):
        """The sum over ranks, shaped like the tensor (a bucket: flat), in its dtype."""
        ops = rnd.ops
        out = ops.cast(aggregation.finish(self, summed, rnd), rnd.ctx.dtype)
        return out if rnd.ctx.segments is not None else ops.reshape(out, rnd.ctx.shape)

    def traffic(self, proposal, gathered, values, rnd, size):
        """Bytes sent and received, and the union and k, of one exchange."""
        return aggregation.traffic(self, proposal, gathered, values, rnd, size)

    def subtract_union(self, compensated, union, values, rnd, inplace):
        """The residual after sending this rank's ``values`` at ``union``."""
        ops = rnd.ops
        if self.sparse_residual:
            return ops.subtract_at(compensated, union, values, inplace)
        sent = self.from_domain(ops.scatter_sum(rnd.dctx.numel, union, values, ops.float32,
                                                meeting=1), rnd.ctx, ops)
        return ops.subtract(compensated, ops.cast(sent, compensated.dtype), inplace)


def per_segment(select_one, flat, ctx, ops, step):
    """Indices into a bucket from ``select_one(segment, n, step)`` run on each tensor of
    ``ctx.segments`` (one framework call per tensor, offset to the bucket); ``flat``
    itself when there is no bucket."""
    lay = ctx.bucket
    if lay is None:
        return select_one(flat, ctx.numel, step)
    parts = []
    for i, (off, n) in enumerate(zip(lay.offsets, lay.numels)):
        idx = select_one(flat[off:off + n], n, step[i] if isinstance(step, list) else step)
        parts.append(idx + off if off else idx)
    return ops.concat(parts)


@register
class TopK(DensitySparsifier):
    """Exact top-k by magnitude with the framework's own selection.

    ``S = argtop_k |g|``, ``k = ceil(density * n)``.  ``torch.topk`` is a radix select
    (CUDA); CPU tensors take numpy's introselect (``np.partition``, ties by lowest
    index; 1.8-7.4x faster than torch.topk there from 1M to 25M values, 2026-11-25,
    ``benchmarks/results/select_cpu_onepass_*``; TensorFlow's eager tensors too, 2.8-3.8x
    faster than ``tf.math.top_k`` at density 0.01, ``select_tf_cpu_*``); ``tf.function``
    keeps ``tf.math.top_k``.  On a GPU the framework breaks ties its own way.
    """

    name = "topk"
    segmented = True
    finds_nonfinite = True    # CPU: NaN/Inf surface among the k largest |g|

    def select(self, flat, ctx, ops, step):
        return per_segment(lambda seg, n, _: ops.topk_indices(ops.abs(seg), self.k(n)),
                           flat, ctx, ops, step)

    def select_checked(self, flat, ctx, ops, step):
        """On CPU tensors (TensorFlow: eager) one numpy partition per tensor gives the k largest
        ``|g|`` and, among them, any NaN/Inf (:func:`top_k_checked`), so no separate
        finiteness pass; elsewhere a check, then :meth:`select`."""
        found = top_k_checked(self, flat, ctx, ops)
        return found if found is not None else super().select_checked(flat, ctx, ops, step)


def top_k_checked(sparsifier, flat, ctx, ops, drop_zeros=False):
    """``(indices, finite)``: each tensor's ``sparsifier.k(n)`` largest ``|g|`` (without
    zeros with ``drop_zeros``) and the finiteness of ``flat`` from one selection
    (``ops.segment_abs_topk``), every index when ``flat`` holds NaN/Inf; None where the
    framework or device has no such path."""
    return ops.segment_abs_topk(flat, ctx.numels, [sparsifier.k(n) for n in ctx.numels],
                                drop_zeros)


@register
class RandomK(DensitySparsifier):
    """``k`` indices drawn uniformly without replacement, values sent unscaled.

    The draw is a pure function of ``(seed, step)``, where ``step`` counts this
    tensor's compressions, so every rank picks the *same* indices (the union stays
    ``k``; cf. seed 001) and the state to checkpoint is just the counter.
    """

    name = "randomk"
    segmented = True
    uses_step = True

    def __init__(self, density=0.01, ef=None, seed=0, values=None, **kw):
        super().__init__(density=density, ef=ef, values=values, **kw)
        self.seed = int(seed)

    def default_ef_decay(self, kind):
        """1 (plain error feedback) also for updates: a random draw does not leave out
        the smaller part, so what decay would fade is not what mattered least."""
        return 1.0

    def select(self, flat, ctx, ops, step):
        lay = ctx.bucket
        if lay is None:
            return ops.random_indices(ctx.numel, self.k(ctx.numel), self.seed, step, flat)
        steps = step if isinstance(step, list) else [step] * len(lay.numels)
        return ops.random_indices_segments(lay.numels, [self.k(n) for n in lay.numels],
                                           self.seed, steps, flat)


@register
class Threshold(Sparsifier):
    """Send every entry with ``|g| > threshold`` (fixed; possibly none at all)."""

    name = "threshold"
    segmented = True

    def __init__(self, threshold=0.001, ef=None, values=None):
        super().__init__(ef=ef, values=values)
        value = float(threshold)
        if not value >= 0.0 or math.isinf(value):
            raise ValueError(f"threshold must be a finite number >= 0, got {threshold!r}")
        self.threshold = value

    def select(self, flat, ctx, ops, step):
        return ops.where_indices(ops.abs(flat) > self.threshold)
