"""Blocked orthonormal DCT-II and its inverse: a small matrix product per block.

``X = x.view(-1, B) @ D^T`` with ``D[k, i] = a_k cos(pi (2i + 1) k / (2B))``,
``a_0 = sqrt(1/B)``, ``a_k = sqrt(2/B)``; the inverse is ``x = X @ D`` (D is orthogonal).
The kernel is a tiled matmul with IEEE float32 products (``input_precision="ieee"``:
TF32 would cost the 1e-5 round-trip accuracy).

Imports: the standard library, torch; on first use, Triton; and modules of its own
package.
"""
import functools
import math

import torch

from ._backend import count_launch, pick_backend

BLOCKS = (32, 64, 128, 256, 512, 1024)


@functools.lru_cache(maxsize=None)
def basis(block, device="cpu"):
    """The orthonormal DCT-II matrix ``D`` (block x block, float32)."""
    k = torch.arange(block, dtype=torch.float64)[:, None]
    i = torch.arange(block, dtype=torch.float64)[None, :]
    d = torch.cos(math.pi * (2 * i + 1) * k / (2 * block)) * math.sqrt(2.0 / block)
    d[0] /= math.sqrt(2.0)
    return d.to(torch.float32).to(device)


@functools.lru_cache(maxsize=None)
def _kernels():
    """Import Triton and define the kernel (once, on first launch)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _matmul_kernel(a_ptr, w_ptr, out_ptr, M, K: tl.constexpr, N: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        rm = pid_m.to(tl.int64) * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            rk = k0 + tl.arange(0, BK)
            a = tl.load(a_ptr + rm[:, None] * K + rk[None, :], mask=rm[:, None] < M, other=0.0)
            w = tl.load(w_ptr + rk[:, None] * N + rn[None, :])
            acc += tl.dot(a, w, input_precision="ieee")
        tl.store(out_ptr + rm[:, None] * N + rn[None, :], acc, mask=rm[:, None] < M)

    return triton, _matmul_kernel


def check_block(block):
    if block not in BLOCKS:
        raise ValueError(f"block must be one of {', '.join(map(str, BLOCKS))}, got {block!r}")


def _pad(x, block):
    xf = x.reshape(-1).float()
    if xf.numel() % block == 0:
        return xf.view(-1, block)                 # no copy when the blocks are whole
    return torch.nn.functional.pad(xf, (0, -xf.numel() % block)).view(-1, block)


def _apply(rows, w, backend):
    if pick_backend(rows, backend) == "torch" or rows.numel() == 0:
        return rows @ w
    triton, matmul = _kernels()
    rows, w = rows.contiguous(), w.contiguous()
    m, k = rows.shape
    out = torch.empty(m, w.shape[1], dtype=torch.float32, device=rows.device)
    bm, bn, bk = 32, min(64, w.shape[1]), 32
    count_launch("dct_matmul")
    matmul[(triton.cdiv(m, bm), triton.cdiv(w.shape[1], bn))](rows, w, out, m, K=k, N=w.shape[1],
                                                             BM=bm, BN=bn, BK=bk)
    return out


def dct_reference(x, block):
    """Flat DCT-II coefficients of ``x`` padded to whole blocks (torch)."""
    return (_pad(x, block) @ basis(block, x.device).T).reshape(-1)


def idct_reference(coefs, block):
    return (coefs.reshape(-1, block).float() @ basis(block, coefs.device)).reshape(-1)


def dct(x, block, backend=None):
    """Blocked DCT-II of flat ``x`` (zero-padded to a multiple of ``block``)."""
    check_block(block)
    return _apply(_pad(x, block), basis(block, x.device).T.contiguous(), backend).reshape(-1)


def idct(coefs, block, backend=None):
    """Inverse of :func:`dct` (the padding is kept; trim it)."""
    check_block(block)
    return _apply(coefs.reshape(-1, block).float(), basis(block, coefs.device), backend).reshape(-1)
