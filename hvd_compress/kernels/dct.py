"""Blocked orthonormal DCT-II and its inverse: a small matrix product per block.

``X = x.view(-1, B) @ D^T`` with ``D[k, i] = a_k cos(pi (2i + 1) k / (2B))``,
``a_0 = sqrt(1/B)``, ``a_k = sqrt(2/B)``; the inverse is ``x = X @ D`` (D is orthogonal).
The kernel is a tiled matmul with IEEE float32 products (``input_precision="ieee"``:
TF32 would cost the 1e-5 round-trip accuracy).

Buckets (:func:`dct_segments`, :func:`idct_segments`): tensors of ``numels`` end to end,
each zero-padded to whole blocks, the padded tensors end to end (tensor ``i``'s
coefficients at ``sum_{j<i} ceil(n_j / B) B``).  The kernel reads each padded row straight
from the unpadded bucket through a row table (``src[r]``: where row ``r``'s values start,
``stop[r]``: the end of its tensor; entries past it read as 0, fp16/bf16 cast in the
kernel) and the inverse writes each row back the same way, dropping the padding: one
launch per direction whatever the number of tensors, no padded copy.  Each row's
products are those of :func:`dct` of its tensor alone.  The torch reference goes tensor
by tensor (:func:`dct` of each), bit for bit the single-tensor result.

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
def basis_t(block, device="cpu"):
    """``basis(block, device).T``, contiguous: the forward transform's right factor (made
    once, not a copy per call)."""
    return basis(block, device).T.contiguous()


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

    @triton.jit
    def _segment_matmul_kernel(a_ptr, w_ptr, out_ptr, src_ptr, stop_ptr, M, K: tl.constexpr,
                               N: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                               BK: tl.constexpr, GATHER: tl.constexpr):
        # GATHER: rows read from the unpadded bucket (src/stop), written densely (forward);
        # else rows read densely and written to the unpadded bucket, padding dropped
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        rm = pid_m.to(tl.int64) * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        row_ok = rm < M
        src = tl.load(src_ptr + rm, mask=row_ok, other=0)
        stop = tl.load(stop_ptr + rm, mask=row_ok, other=0)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            rk = k0 + tl.arange(0, BK)
            if GATHER:
                pos = src[:, None] + rk[None, :]
                a = tl.load(a_ptr + pos, mask=row_ok[:, None] & (pos < stop[:, None]), other=0.0)
            else:
                a = tl.load(a_ptr + rm[:, None] * K + rk[None, :], mask=row_ok[:, None], other=0.0)
            w = tl.load(w_ptr + rk[:, None] * N + rn[None, :])
            acc += tl.dot(a.to(tl.float32), w, input_precision="ieee")
        if GATHER:
            tl.store(out_ptr + rm[:, None] * N + rn[None, :], acc, mask=row_ok[:, None])
        else:
            pos = src[:, None] + rn[None, :]
            tl.store(out_ptr + pos, acc, mask=row_ok[:, None] & (pos < stop[:, None]))

    return triton, _matmul_kernel, _segment_matmul_kernel


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
    triton, matmul, _ = _kernels()
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
    return _apply(_pad(x, block), basis_t(block, x.device), backend).reshape(-1)


def idct(coefs, block, backend=None):
    """Inverse of :func:`dct` (the padding is kept; trim it)."""
    check_block(block)
    return _apply(coefs.reshape(-1, block).float(), basis(block, coefs.device), backend).reshape(-1)


# -- buckets: tensors end to end, each padded to whole blocks ----------------------------

def padded_numels(numels, block):
    """Each length rounded up to whole blocks."""
    return tuple(-(-int(n) // block) * block for n in numels)


@functools.lru_cache(maxsize=256)
def _rows(numels, block, device):
    """int64 ``(src, stop)`` per padded row of a bucket (cached: copied to the device once)."""
    src, stop, at = [], [], 0
    for n in numels:
        src += range(at, at + n, block)
        stop += [at + n] * len(range(at, at + n, block))
        at += n
    return (torch.tensor(src, dtype=torch.int64, device=device),
            torch.tensor(stop, dtype=torch.int64, device=device))


def _segment_apply(x, numels, block, forward, backend):
    """The kernel launch of :func:`dct_segments` (``forward``) or :func:`idct_segments`."""
    triton, _, kernel = _kernels()
    numels = tuple(int(n) for n in numels)
    src, stop = _rows(numels, block, str(x.device))
    rows = src.numel()
    w = basis_t(block, x.device) if forward else basis(block, x.device)
    x = x.reshape(-1).contiguous()
    out = (torch.empty(rows * block, dtype=torch.float32, device=x.device) if forward
           else torch.empty(sum(numels), dtype=torch.float32, device=x.device))
    if rows == 0:
        return out
    bm, bn, bk = 32, min(64, block), 32
    count_launch("dct_segments" if forward else "idct_segments")
    kernel[(triton.cdiv(rows, bm), triton.cdiv(block, bn))](
        x, w, out, src, stop, rows, K=block, N=block, BM=bm, BN=bn, BK=bk, GATHER=forward)
    return out


def dct_segments(flat, numels, block, backend=None):
    """Blocked DCT-II of every tensor of a bucket (``numels`` end to end in ``flat``),
    each zero-padded to whole blocks, coefficients end to end (float32): one launch
    (Triton), else :func:`dct` tensor by tensor."""
    check_block(block)
    if pick_backend(flat, backend) == "torch":
        if len(numels) == 1:
            return dct(flat, block, "torch")
        pieces = torch.split(flat.reshape(-1), [int(n) for n in numels])
        return torch.cat([dct(p, block, "torch") for p in pieces])
    return _segment_apply(flat, numels, block, True, backend)


def idct_segments(coefs, numels, block, backend=None):
    """Inverse of :func:`dct_segments`: the tensors of ``numels`` end to end (float32),
    padding dropped: one launch (Triton), else :func:`idct` tensor by tensor."""
    check_block(block)
    if pick_backend(coefs, backend) == "torch":
        if len(numels) == 1:
            return idct(coefs, block, "torch")[:int(numels[0])]
        pieces = torch.split(coefs.reshape(-1), list(padded_numels(numels, block)))
        return torch.cat([idct(p, block, "torch")[:int(n)] for p, n in zip(pieces, numels)])
    return _segment_apply(coefs, numels, block, False, backend)
