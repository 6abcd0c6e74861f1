"""2-bit threshold quantization, 16 values per 32-bit word (MXNet's ``2bit``).

Code of value ``x`` with threshold ``t``: ``1`` (means ``+t``) if ``x >= t``, ``2``
(``-t``) if ``x <= -t``, else ``0``; value ``i`` of a word sits in bits ``2i..2i+1``.
Packing is bit-exact between the kernel and the reference; words are int32 (the top
code may set the sign bit).  ``t > 0`` is assumed (the compressor sends nothing
quantized for an all-zero tensor).
"""
import functools

import torch

from ._backend import pick_backend

PER_WORD = 16


@functools.lru_cache(maxsize=None)
def _kernels():
    """Import Triton and define the kernels (once, on first launch)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _pack_kernel(x_ptr, t_ptr, words_ptr, n, n_words, BLOCK_W: tl.constexpr):
        pid = tl.program_id(0)
        w = pid.to(tl.int64) * BLOCK_W + tl.arange(0, BLOCK_W)               # word ids
        lane = tl.arange(0, 16)
        idx = w[:, None] * 16 + lane[None, :]
        x = tl.load(x_ptr + idx, mask=idx < n, other=0.0).to(tl.float32)
        t = tl.load(t_ptr)
        code = tl.where(x >= t, 1, tl.where(x <= -t, 2, 0))
        word = tl.sum(code << (2 * lane[None, :]), axis=1)                     # disjoint bits
        tl.store(words_ptr + w, word.to(tl.int32), mask=w < n_words)

    @triton.jit
    def _unpack_kernel(words_ptr, out_ptr, n_words, BLOCK_W: tl.constexpr):
        pid = tl.program_id(0)
        w = pid.to(tl.int64) * BLOCK_W + tl.arange(0, BLOCK_W)
        lane = tl.arange(0, 16)
        word = tl.load(words_ptr + w, mask=w < n_words, other=0)
        code = (word[:, None] >> (2 * lane[None, :])) & 3
        sign = tl.where(code == 1, 1.0, tl.where(code == 2, -1.0, 0.0))
        idx = w[:, None] * 16 + lane[None, :]
        tl.store(out_ptr + idx, sign, mask=(w < n_words)[:, None])

    return triton, _pack_kernel, _unpack_kernel


def _shifts(device):
    return 2 * torch.arange(PER_WORD, dtype=torch.int64, device=device)


def pack_reference(x, t):
    """int32 words (``ceil(n/16)``) of the codes of flat ``x`` against threshold ``t``."""
    xf = x.reshape(-1).float()
    n_words = -(-xf.numel() // PER_WORD)
    t = torch.as_tensor(t, dtype=torch.float32, device=x.device)
    code = torch.where(xf >= t, 1, torch.where(xf <= -t, 2, 0)).to(torch.int64)
    code = torch.nn.functional.pad(code, (0, n_words * PER_WORD - xf.numel()))
    words = (code.view(-1, PER_WORD) << _shifts(x.device)).sum(1)           # < 2^32
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # wrap to int32


def unpack_reference(words):
    """float32 signs (+1, -1, 0), 16 per word."""
    code = (words.to(torch.int64)[:, None] >> _shifts(words.device)) & 3
    return torch.where(code == 1, 1.0, torch.where(code == 2, -1.0, 0.0)).reshape(-1)


def pack(x, t, backend=None, block_words=256):
    """Quantize flat ``x`` with threshold ``t`` and pack 16 codes per int32 word."""
    if pick_backend(x, backend) == "torch" or x.numel() == 0:
        return pack_reference(x, t)
    triton, pack_kernel, _ = _kernels()
    x = x.reshape(-1).contiguous()
    n = x.numel()
    n_words = -(-n // PER_WORD)
    t = torch.as_tensor(t, dtype=torch.float32, device=x.device).reshape(1)
    words = torch.empty(n_words, dtype=torch.int32, device=x.device)
    pack_kernel[(triton.cdiv(n_words, block_words),)](x, t, words, n, n_words, BLOCK_W=block_words)
    return words


def unpack(words, backend=None, block_words=256):
    """float32 signs of every code in ``words`` (``16 * len(words)`` values)."""
    if pick_backend(words, backend) == "torch" or words.numel() == 0:
        return unpack_reference(words)
    triton, _, unpack_kernel = _kernels()
    words = words.contiguous()
    out = torch.empty(words.numel() * PER_WORD, dtype=torch.float32, device=words.device)
    unpack_kernel[(triton.cdiv(words.numel(), block_words),)](words, out, words.numel(),
                                                              BLOCK_W=block_words)
    return out
