"""Convolution-kernel selection (Hylo, seed 004; Peng 2021, "Communication optimization
of distributed deep learning systems based on model structure characteristics").

A convolution weight ``(out, in, *k)`` (PyTorch) or ``(*k, in, out)`` (Keras) holds
``out * in`` kernels of ``prod(k)`` values.  Each kernel of the error-compensated
gradient is scored by its L2 norm (per (out, in) kernel, not per output channel: it
keeps the selection as fine as the structure allows, and a channel's kernels differ
widely in norm); the top fraction is sent whole (kernel ids + values), the rest stays
in the residual.

The fraction adapts to the layer's parameter count ``P`` unless ``fraction`` is given::

    fraction(P) = clip(base * sqrt(ref / P), min_fraction, max_fraction)

with ``base = 0.25``, ``ref = 10_000``, clipped to [0.01, 0.5]: a 10k-parameter layer
sends a quarter of its kernels, a 1M-parameter layer 2.5%.

Imports: the standard library; and modules of its own package.
"""
import math

from .base import register
from .sparse import Sparsifier

BASE, REF, MIN_FRACTION, MAX_FRACTION = 0.25, 10_000, 0.01, 0.5


def adaptive_fraction(params):
    """The fraction of kernels a layer of ``params`` parameters sends (see above)."""
    return min(MAX_FRACTION, max(MIN_FRACTION, BASE * math.sqrt(REF / max(params, 1))))


@register
class KernelSelect(Sparsifier):
    """Send the convolution kernels with the largest L2 norm; ``fraction`` fixed or
    adaptive.  Payload: (values of the chosen kernels, int32 kernel ids)."""

    name = "kernel_select"
    sparse_residual = False   # ids are of whole kernels, not of elements

    def __init__(self, fraction=None, ef=None):
        super().__init__(ef=ef)
        if fraction is not None and not 0.0 < float(fraction) <= 1.0:
            raise ValueError(f"fraction must be in (0, 1], got {fraction!r}")
        self.fraction = None if fraction is None else float(fraction)

    @staticmethod
    def kernel_size(ctx, ops):
        if len(ctx.shape) < 3:
            raise ValueError(f"kernel_select needs a convolution weight (out, in, *kernel), "
                             f"got {ctx.name or 'a tensor'} of shape {ctx.shape}")
        dims = ctx.shape[2:] if ops.__name__.endswith("torch_ops") else ctx.shape[:-2]
        return math.prod(dims)

    def kernels_to_send(self, ctx, ops):
        n_kernels = ctx.numel // self.kernel_size(ctx, ops)
        fraction = self.fraction if self.fraction is not None else adaptive_fraction(ctx.numel)
        return max(1, min(n_kernels, math.ceil(fraction * n_kernels)))

    def encode(self, flat, ctx, ops, step):
        rows = ops.kernel_matrix(flat, ctx.shape)
        ksize = self.kernel_size(ctx, ops)
        ids = ops.cond(ops.all_finite(flat) if ctx.finite is None else ctx.finite,
                       lambda: ops.topk_indices(ops.row_norms(rows), self.kernels_to_send(ctx, ops)),
                       lambda: ops.arange(ctx.numel // ksize, flat))
        return ops.reshape(ops.gather(rows, ids), [-1]), ids

    def decode(self, payload, ctx, ops):
        if len(payload) != 2:
            raise ValueError("kernel_select: a payload is (values, kernel ids)")
        values, ids = payload
        ksize = self.kernel_size(ctx, ops)
        n_kernels = ctx.numel // ksize
        nv, ni = ops.length(values), ops.length(ids)
        if isinstance(nv, int) and isinstance(ni, int) and nv != ni * ksize:
            raise ValueError(f"kernel_select: {nv} values for {ni} kernels of {ksize}")
        # clamped into range when deferred (the exchange driver's ops.deferred_checks)
        ids = ops.index_check(ids, n_kernels, f"kernel_select ({ctx.name or 'tensor'})").finish()
        flat_idx = ops.reshape(ops.cast(ids, ops.int32)[:, None] * ksize
                               + ops.arange(ksize, ids)[None, :], [-1])
        rows = ops.reshape(ops.scatter_sum(ctx.numel, flat_idx, values, ops.float32),
                           [n_kernels, ksize])
        return ops.from_kernel_matrix(rows, ctx.shape)
