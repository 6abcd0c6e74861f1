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

Imports: nothing at import time; on first use, ``hvd_compress.kernels``; and modules of
its own package.
"""
from .base import register
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


@register
class DCTSparse(DensitySparsifier):
    """Keep the largest DCT coefficients (``density`` of all, padding included), values
    as ``bits``-bit range-based floats; error feedback on by default."""

    name = "dct"
    sparse_residual = False   # indices are of coefficients; the residual is in the gradient domain

    def __init__(self, density=0.01, block=256, bits=8, ef=None, agg=None, beta=None, hint=None):
        local = agg in (None, "local")   # summed coefficients (agg!=local) travel as floats
        super().__init__(density=density, ef=ef, values=f"rangefloat{bits}" if local else None,
                         agg=agg, beta=beta, hint=hint)
        self.block, self.bits = check_dct_block(block), int(bits)
        self._select = LaplaceTopK(density=self.density, ef=False)

    def domain_ctx(self, ctx):
        padded = -(-ctx.numel // self.block) * self.block
        return ctx._replace(numel=padded, shape=(padded,), finite=None)   # coefficients may overflow

    def to_domain(self, flat, ctx, ops):
        return ops.block_dct(flat, self.block), self.domain_ctx(ctx)

    def from_domain(self, coefs, ctx, ops):
        return ops.head(ops.block_idct(coefs, self.block), ctx.numel)

    def select(self, coefs, cctx, ops, step):
        return self._select.select(coefs, cctx, ops, step)

    def encode(self, flat, ctx, ops, step):
        return super().encode(*self.to_domain(flat, ctx, ops), ops, step)

    def decode(self, payload, ctx, ops):
        return self.from_domain(super().decode(payload, self.domain_ctx(ctx), ops), ctx, ops)
