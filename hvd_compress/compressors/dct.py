"""DCT-domain sparsification with range-based float values (seed 002).

    c = DCT-II_blocks(pad(g))          orthonormal, per block of ``block`` values
    S = the ~k largest |c|, k = ceil(density * len(c))   (laplace_topk's selection)
    send  rangefloat_bits(c[S]), S
    g_hat = trim(IDCT_blocks(scatter(S, decode(values))))

Gradients are smooth along their memory layout in places (convolution kernels, rows of
embeddings), so energy concentrates in few low-frequency coefficients there; elsewhere a
DCT spreads it (see benchmarks/dct.py for where it wins).  Error feedback works in the
gradient domain: the residual is the compensated gradient minus exactly ``g_hat``, what
the receivers reconstruct (quantization of the values included).

Buckets (``segmented``, with ``agg`` local): per-tensor semantics.  Each tensor is padded
to whole blocks on its own and the padded tensors lie end to end (the *coefficient
layout*, :func:`padded_layout`); each tensor keeps its own k, selection and exponent range,
and its own residual.  The bucket payload is ``(bytes, headers, indices)``: the tensors'
value codes end to end with one ``[E, count]`` header per tensor (as tensor by tensor),
and int32 indices into the coefficient layout (tensor ``i``'s coefficient ``j`` at its
padded offset + ``j``); it decodes to the tensor-by-tensor aggregate.

Where the kernels run (CUDA; ``HVD_COMPRESS_BACKEND=triton``) a compress is a fixed number
of launches whatever the number of tensors, for one tensor as for a bucket: one DCT launch
reading the unpadded bucket (``ops.dct_segments``), laplace_topk's fused search over the
coefficients of every tensor (:func:`~.fused_search.select_histogram`: one host synchronisation,
which also finds NaN/Inf), the bucket rangefloat codec, and one inverse DCT launch in
decode.  Elsewhere (CPU, TensorFlow) the transform and selection go tensor by tensor as
before (laplace_topk's selection per tensor, the framework's top-k below ``small``).

Imports: the standard library, ``hvd_compress.buckets``; on first use,
``hvd_compress.kernels``; and modules of its own package.
"""
import functools

from ..buckets import layout as _layout
from .base import register
from .fused_search import fused_payload
from .laplace import LaplaceTopK
from .sparse import DensitySparsifier


def check_dct_block(block):
    """``block`` as an int, if the block DCT kernels take it (ValueError otherwise)."""
    from ..kernels.dct import BLOCKS     # imported here: the kernels import torch
    try:
        value = int(block)
    except (TypeError, ValueError):
        value = None
    if value not in BLOCKS:
        raise ValueError(f"block must be one of {', '.join(map(str, BLOCKS))}, got {block!r}")
    return value


@functools.lru_cache(maxsize=256)
def padded_layout(lay, block):
    """The coefficient layout of the bucket ``lay``: each tensor padded to whole blocks."""
    return _layout(lay.names, [(-(-n // block) * block,) for n in lay.numels])


@register
class DCTSparse(DensitySparsifier):
    """Keep the largest DCT coefficients (``density`` of all, padding included), values
    as ``bits``-bit range-based floats; error feedback on by default.

    ``padded=1`` (PyTorch, ``agg`` local): the selection is laplace_topk's fused search
    with a payload of fixed size on every device (``laplace_topk:padded=1``: each
    tensor's coefficients in ``min(n, k + floor(k / 100))`` slots, padding 0.0 at its
    first coefficient), so compress reads nothing back; a gradient holding NaN/Inf sends
    NaN in every slot.  Elsewhere the selection's count is read back (one host
    synchronisation where the kernels run)."""

    name = "dct"
    sparse_residual = False   # indices are of coefficients; the residual is in the gradient domain
    finds_nonfinite = True    # encode_checked says whether the gradient held NaN/Inf

    def __init__(self, density=0.01, block=256, bits=8, ef=None, agg=None, beta=None, hint=None,
                 padded=None):
        local = agg in (None, "local")   # summed coefficients (agg!=local) travel as floats
        super().__init__(density=density, ef=ef, values=f"rangefloat{bits}" if local else None,
                         agg=agg, beta=beta, hint=hint)
        self.block, self.bits = check_dct_block(block), int(bits)
        self.padded = None if padded is None else bool(int(padded))
        if self.padded and not local:
            raise ValueError(f"padded=1 sends each rank's own pairs (agg=local); got agg={agg}")
        self._select = LaplaceTopK(density=self.density, ef=False, padded=self.padded)
        self.fixed_size = bool(self.padded)

    @property
    def segmented(self):
        """Buckets of several tensors, in the one-round exchange (``agg`` local)."""
        return self.agg is None

    def domain_ctx(self, ctx):
        if ctx.segments is None:
            padded = -(-ctx.numel // self.block) * self.block
            return ctx._replace(numel=padded, shape=(padded,), finite=None)  # may overflow
        lay = padded_layout(ctx.segments, self.block)
        return ctx._replace(numel=lay.total, shape=(lay.total,), finite=None, segments=lay)

    def to_domain(self, flat, ctx, ops):
        return ops.dct_segments(flat, ctx.numels, self.block), self.domain_ctx(ctx)

    def from_domain(self, coefs, ctx, ops):
        return ops.idct_segments(coefs, ctx.numels, self.block)

    def select(self, coefs, cctx, ops, step):
        return self._select.select(coefs, cctx, ops, step)

    def fused_here(self, coefs, ops):
        """Does the fused search select (the kernels run, one-round exchange)?"""
        return (self.agg is None and ops.bucket_codec_kernels(coefs)
                and ops.histogram_search_supported())

    def encode(self, flat, ctx, ops, step):
        return self._encode(flat, ctx, ops, step, False)[0]

    def encode_checked(self, flat, ctx, ops, step):
        return self._encode(flat, ctx, ops, step, True)

    def _encode(self, flat, ctx, ops, step, check):
        """``(payload, finite)``; ``finite`` (the gradient held no NaN/Inf) only when
        ``check`` or where the fused search finds it anyway."""
        coefs, cctx = self.to_domain(flat, ctx, ops)
        if self.padded or self.fused_here(coefs, ops):   # (values, counts from its write)
            return fused_payload(self, self._select, coefs, cctx, ops)[:2]
        finite = (ops.all_finite(flat) if ctx.finite is None else ctx.finite) if check else None
        idx = ops.cond(ops.all_finite(coefs),          # coefficients may overflow
                       lambda: self.select(coefs, cctx, ops, step),
                       lambda: ops.arange(cctx.numel, coefs))
        return self._payload(coefs, idx, cctx, ops), finite

    def subtract_sent(self, compensated, payload, ctx, ops, inplace):
        """``c - IDCT(scatter(own payload))``: this rank's own payload, decoded with its
        known count and unchecked indices (no host synchronisation)."""
        values, idx = self.own_values(payload, ops)
        coefs = ops.scatter_sum(self.domain_ctx(ctx).numel, idx, values, ops.float32)
        sent = ops.cast(self.from_domain(coefs, ctx, ops), compensated.dtype)
        return ops.subtract(compensated, sent, inplace)

    def decode(self, payload, ctx, ops):
        lay = ctx.bucket
        if lay is not None and len(payload) == 3:
            n = ops.length(payload[1])
            if isinstance(n, int) and n % (2 * len(lay.names)):
                raise ValueError(f"dct ({ctx.name}): {n} header values are not an [E, count] "
                                 f"pair per tensor ({len(lay.names)}) and rank; the payload "
                                 "is malformed")
        return self.from_domain(super().decode(payload, self.domain_ctx(ctx), ops), ctx, ops)
