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

On the CPU, blocks from :data:`FFT_FROM_BLOCK` values go through a real FFT instead of
the product (:func:`fft_dct_rows`: Makhoul's algorithm).

Imports: the standard library, numpy, torch; on first use, Triton; and modules of its own
package.
"""
import functools
import math
import threading

import numpy as np
import torch

from ._backend import count_launch, pick_backend
from ._launch import cached

BLOCKS = (32, 64, 128, 256, 512, 1024)
#: on the CPU, blocks of at least this many values are transformed through a real FFT
#: (:func:`fft_dct_rows`), smaller ones by the product, which is faster there (measured:
#: benchmarks/results/dct_fft_cpu_2026-11-28.json); GPUs keep the product (unmeasured)
FFT_FROM_BLOCK = 256


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

    return triton, cached(_matmul_kernel), cached(_segment_matmul_kernel)


def check_block(block):
    if block not in BLOCKS:
        raise ValueError(f"block must be one of {', '.join(map(str, BLOCKS))}, got {block!r}")


def _pad(x, block):
    xf = x.reshape(-1).float()
    if xf.numel() % block == 0:
        return xf.view(-1, block)                 # no copy when the blocks are whole
    return torch.nn.functional.pad(xf, (0, -xf.numel() % block)).view(-1, block)


# -- the CPU path: the same transform through a real FFT ---------------------------------

@functools.lru_cache(maxsize=None)
def _fft_tables(block, device="cpu"):
    """``(forward_in, coef_at, pair, inverse_out, forward_twiddle, inverse_twiddle)`` for
    blocks of ``block`` values, on ``device``: int64 gathers along a row and complex64
    factors of length ``block // 2 + 1`` (:func:`fft_dct_rows`).

    - ``forward_in``: the FFT's input ``v'_j = x[forward_in[j]]``;
    - ``coef_at``: coefficient ``X_k`` at ``[Re Z'_0, Im Z'_0, Re Z'_1, ...][coef_at[k]]``;
    - ``pair``: the inverse's input ``(X_k, X_{B-k})`` pairs, ``X_0``'s partner to be
      zeroed (it stands for ``X_B``);
    - ``inverse_out``: ``x_i = w[inverse_out[i]]``."""
    half, n = block // 2, np.arange(block)
    v = np.concatenate([n[0::2], n[1::2][::-1]])          # v_j = x_{v[j]}
    forward_in = v[(-n) % block]
    k = np.arange(half + 1)
    coef_at = np.empty(block, dtype=np.int64)
    coef_at[:half + 1] = 2 * k                            # X_k = Re Z_k
    coef_at[half + 1:] = (2 * k[1:half] + 1)[::-1]        # X_{B-k} = -Im Z_k
    pair = np.stack([k, (block - k) % block], 1).reshape(-1)
    inverse_out = np.empty(block, dtype=np.int64)
    inverse_out[v] = (-n) % block                         # x_{v[j]} = w_{-j}
    w = np.exp(-1j * math.pi * k / (2 * block))
    scale = np.full(half + 1, math.sqrt(2.0 / block))
    scale[0] = math.sqrt(1.0 / block)
    tables = (forward_in, coef_at, pair, inverse_out,
              np.conj(w * scale).astype(np.complex64), (w / scale).astype(np.complex64))
    return tuple(torch.from_numpy(t).to(device) for t in tables)


_local = threading.local()


def _workspaces(m, b):
    """Two float32 buffers kept for the thread and grown as needed: ``(m, b)`` and
    ``(m, b + 2)`` (the spectrum's real view).  The FFT path's intermediates live there:
    three fresh tensors of a bucket's size per transform, against the product's one, cost
    their page faults on every call (6.3M values in 256-value blocks: 13-18 ms per gather
    inside a compress against 2.2 ms in warm memory; measured 2026-11-28).  The cost: 8
    bytes per value of the largest tensor transformed (a bucket goes tensor by tensor),
    held per thread: 50 MB for a 6.3M-value tensor.  Made outside inference mode, so that
    a first call under ``torch.inference_mode()`` leaves a buffer later calls may write."""
    need = m * (b + 2)
    have = getattr(_local, "buffers", None)
    if have is None or have.numel() < 2 * need:
        with torch.inference_mode(False):
            have = _local.buffers = torch.empty(2 * need, dtype=torch.float32)
    return have[:m * b].view(m, b), have[need:2 * need].view(m, b + 2)


def fft_dct_rows(rows, out=None):
    """The orthonormal DCT-II of each row of ``rows`` (float32, ``(m, B)``) through one
    real FFT of length ``B``: :func:`dct_reference`'s coefficients up to float32 rounding
    (written into ``out``, a contiguous ``(m, B)`` float32 tensor, if given).

    For a block ``x`` of ``B`` values (Makhoul, "A fast cosine transform in one and two
    dimensions", IEEE Trans. ASSP 28(1), 1980):

        v = (x_0, x_2, ..., x_{B-2}, x_{B-1}, ..., x_3, x_1),   V = rfft(v)
        Z_k = a_k W_k V_k,   W_k = exp(-i pi k / (2B)),   k = 0..B/2
        X_k = Re Z_k  (k <= B/2),   X_{B-k} = -Im Z_k  (0 < k < B/2)

    is the orthonormal DCT-II, ``X_k = a_k sum_i x_i cos(pi (2i + 1) k / (2B))`` with
    ``a_0 = sqrt(1/B)``, ``a_k = sqrt(2/B)``: O(B log B) operations per block against the
    product's O(B^2).  The forward transform computes ``conj(Z) = rfft(v') conj(a W)`` with
    ``v'`` = ``v`` circularly reversed, whose real and imaginary parts are ``X_k`` and
    ``X_{B-k}`` as they lie: a gather (``forward_in``), one FFT, one product, a gather
    (``coef_at``), no sign flip.  The inverse (the orthonormal DCT-III) computes
    ``w = irfft((X_k + i X_{B-k}) W_k / a_k)`` (``X_B = 0``), the conjugate spectrum of
    ``V_k = (X_k - i X_{B-k}) / (a_k W_k)``, so ``w`` is ``v`` circularly reversed and one
    gather (``inverse_out``) undoes both permutations.

    On the CPU the FFT is faster from :data:`FFT_FROM_BLOCK`-value blocks
    (benchmarks/results/dct_fft_cpu_2026-11-28.json)."""
    m, b = rows.shape
    if m == 0:                                            # (MKL's FFT refuses no rows)
        return rows.float().clone() if out is None else out
    forward_in, coef_at, _, _, twiddle, _ = _fft_tables(b, str(rows.device))
    v, spectrum = _workspaces(m, b)
    torch.index_select(rows, 1, forward_in, out=v)
    z = torch.view_as_complex(spectrum.view(m, b // 2 + 1, 2))
    torch.fft.rfft(v, dim=1, out=z)
    spectrum = torch.view_as_real(z.mul_(twiddle)).reshape(m, b + 2)
    return torch.index_select(spectrum, 1, coef_at, out=out)


def fft_idct_rows(coefs, out=None):
    """The inverse of :func:`fft_dct_rows` (the orthonormal DCT-III) through one inverse
    real FFT (into ``out`` if given)."""
    m, b = coefs.shape
    if m == 0:
        return coefs.float().clone() if out is None else out
    _, _, pair, inverse_out, _, twiddle = _fft_tables(b, str(coefs.device))
    w, spectrum = _workspaces(m, b)
    torch.index_select(coefs.float(), 1, pair, out=spectrum)
    u = spectrum.view(m, b // 2 + 1, 2)
    u[:, 0, 1] = 0.0                                      # X_B = 0
    torch.fft.irfft(torch.view_as_complex(u).mul_(twiddle), n=b, dim=1, out=w)
    return torch.index_select(w, 1, inverse_out, out=out)


def _torch_apply(rows, w, inverse, out=None):
    """The torch path of one transform of ``rows``: the FFT on the CPU from
    :data:`FFT_FROM_BLOCK`-value blocks, else the product (into ``out`` if given; no
    autograd: ``out=`` refuses inputs that require a gradient)."""
    rows = rows.detach()
    if rows.device.type == "cpu" and rows.shape[1] >= FFT_FROM_BLOCK:
        return fft_idct_rows(rows, out) if inverse else fft_dct_rows(rows, out)
    return torch.matmul(rows, w, out=out)


def _apply(rows, w, backend, inverse=False):
    if pick_backend(rows, backend) == "torch" or rows.numel() == 0:
        return _torch_apply(rows, w, inverse)
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
    return _apply(coefs.reshape(-1, block).float(), basis(block, coefs.device), backend,
                  inverse=True).reshape(-1)


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


def dct_blocks(x, block, inverse=False, backend=None):
    """The DCT-II (``inverse``: its inverse) of each block of flat ``x`` (whole blocks,
    float32) computed as a block of its own: the same bits whichever blocks lie beside
    it.  One launch (Triton, each row apart); else a batched product of one-row matrices
    (a product of many rows at once rounds differently with their number)."""
    check_block(block)
    if pick_backend(x, backend) != "torch" and x.numel():
        return _segment_apply(x, (block,) * (x.numel() // block), block, not inverse, backend)
    rows = x.detach().reshape(-1, 1, block).float()
    w = basis(block, x.device) if inverse else basis_t(block, x.device)
    return torch.bmm(rows, w.expand(rows.shape[0], block, block)).reshape(-1)


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


def _segments_torch(x, numels, block, forward):
    """:func:`dct_segments` / :func:`idct_segments` tensor by tensor, each transform
    written into its place in one output (no concatenation: 6.3M values in 8 tensors,
    a copy of the bucket and its page faults less per transform)."""
    numels = [int(n) for n in numels]
    padded = padded_numels(numels, block)
    w = basis_t(block, x.device) if forward else basis(block, x.device)
    x = x.detach().reshape(-1)
    out = torch.empty(sum(padded) if forward else sum(numels), dtype=torch.float32,
                      device=x.device)
    at_in = at_out = 0
    for n, whole in zip(numels, padded):
        if forward:
            _torch_apply(_pad(x[at_in:at_in + n], block), w, False,
                    out=out[at_out:at_out + whole].view(-1, block))
        else:
            rows = x[at_in:at_in + whole].float().view(-1, block)
            if n == whole:
                _torch_apply(rows, w, True, out=out[at_out:at_out + n].view(-1, block))
            else:
                out[at_out:at_out + n] = _torch_apply(rows, w, True).reshape(-1)[:n]
        at_in, at_out = at_in + (n if forward else whole), at_out + (whole if forward else n)
    return out


def dct_segments(flat, numels, block, backend=None):
    """Blocked DCT-II of every tensor of a bucket (``numels`` end to end in ``flat``),
    each zero-padded to whole blocks, coefficients end to end (float32): one launch
    (Triton), else :func:`dct` tensor by tensor."""
    check_block(block)
    if pick_backend(flat, backend) == "torch":
        return _segments_torch(flat, numels, block, True)
    return _segment_apply(flat, numels, block, True, backend)


def idct_segments(coefs, numels, block, backend=None):
    """Inverse of :func:`dct_segments`: the tensors of ``numels`` end to end (float32),
    padding dropped: one launch (Triton), else :func:`idct` tensor by tensor."""
    check_block(block)
    if pick_backend(coefs, backend) == "torch":
        return _segments_torch(coefs, numels, block, False)
    return _segment_apply(coefs, numels, block, False, backend)
