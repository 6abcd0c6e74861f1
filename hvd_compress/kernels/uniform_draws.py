"""Uniform random draws for every entry of a *bucket*, each tensor with its own stream:
the stochastic quantizers' (QSGD, TernGrad) draws where the kernels run, one launch per
bucket whatever its number of tensors.

Counter-based, so a pure function of its inputs: entry ``j`` (its index within its
tensor) of tensor ``s``, whose 64-bit word (a mix of its seed, rank, name and step, made
on the host) splits into ``(lo, hi)``, draws::

    x = H(H(j ^ lo) ^ hi),   u = (x >> 8) * 2^-24   in [0, 1), a multiple of 2^-24

with ``H`` = lowbias32 (C. Wellons' 32-bit integer hash, a bijection that mixes every
bit: ``x ^= x >> 16; x *= 0x7FEB352D; x ^= x >> 15; x *= 0x846CA68B; x ^= x >> 16``,
mod 2^32) -- the hash that randomk's draws use.  A tensor's draws do not depend on the
bucket around it: alone or in any bucket, the same words give the same draws.

The same hash gives randomk's draw keys (``hash_keys``; the ops layer's
``_draws`` module: their meaning), in one launch instead of some 80 int64 torch ops.

``uniform_segments(lengths, words, device)``: float32 draws of every entry, end to end;
``words`` int64 ``[T, 2]`` on the device, ``(lo, hi)`` of each tensor, each < 2^32.
The kernel walks the bucket's blocks (:func:`.segmented.block_table`); its reference
runs the same hash in uint32 numpy.

Imports: the standard library, numpy, torch; on first use, Triton; and modules of its
own package.
"""
import functools

import numpy as np
import torch

from ._backend import count_launch, pick_backend
from ._launch import cached
from .segmented import block_table

BLOCK = 4096
SCALE = 1.0 / (1 << 24)         #: 2^-24 (5.9604644775390625e-08 in the kernel): exact


@functools.lru_cache(maxsize=None)
def _kernels():
    """Import Triton and define the kernel (once, on first launch)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _uniform_kernel(out_ptr, starts_ptr, stops_ptr, segs_ptr, vstart_ptr, words_ptr,
                        BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        start = tl.load(starts_ptr + pid)
        s = tl.load(segs_ptr + pid)
        offs = start + tl.arange(0, BLOCK)
        valid = offs < tl.load(stops_ptr + pid)
        x = (offs - tl.load(vstart_ptr + s)).to(tl.uint32)          # j, within its tensor
        for r in tl.static_range(2):                               # H(H(j ^ lo) ^ hi)
            x = x ^ tl.load(words_ptr + 2 * s + r).to(tl.uint32)
            x = x ^ (x >> 16)
            x = x * 0x7FEB352D
            x = x ^ (x >> 15)
            x = x * 0x846CA68B
            x = x ^ (x >> 16)
        tl.store(out_ptr + offs, (x >> 8).to(tl.float32) * 5.9604644775390625e-08, mask=valid)

    @triton.jit
    def _keys_kernel(j_ptr, seg_ptr, words_ptr, out_ptr, n, FULL: tl.constexpr,
                     BLOCK: tl.constexpr):
        # randomk's keys: key32(2j); with FULL, key32(2j) << 21 | key32(2j + 1) >> 11
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        j = tl.load(j_ptr + offs, mask=m, other=0)
        s = tl.load(seg_ptr + offs, mask=m, other=0)
        key = tl.zeros([BLOCK], dtype=tl.int64)
        for half in tl.static_range(2 if FULL else 1):
            x = (2 * j + half).to(tl.uint32)
            for r in tl.static_range(2):                           # H(H(c ^ lo) ^ hi)
                x = x ^ tl.load(words_ptr + 2 * s + r, mask=m, other=0).to(tl.uint32)
                x = x ^ (x >> 16)
                x = x * 0x7FEB352D
                x = x ^ (x >> 15)
                x = x * 0x846CA68B
                x = x ^ (x >> 16)
            if half == 0:
                key = x.to(tl.int64) << (21 if FULL else 0)
            else:
                key = key | (x >> 11).to(tl.int64)
        tl.store(out_ptr + offs, key, mask=m)

    return triton, cached(_uniform_kernel), cached(_keys_kernel)


_M32 = 0xFFFFFFFF


def mul32(x, c):
    """``x * c mod 2^32`` for int64 ``x`` in [0, 2^32) and a 32-bit constant ``c``, with
    no int64 overflow (``c`` in two 16-bit halves)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def hash32(x):
    """lowbias32 in int64 torch ops: a bijection of [0, 2^32) (int64 in, int64 out)."""
    x = x ^ (x >> 16)
    x = mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def key32(c, lo, hi):
    """``H(H(c ^ lo) ^ hi)``: the 32-bit key of counter ``c`` (int64, < 2^32)."""
    return hash32(hash32(c ^ lo) ^ hi)


def keys53(j, lo, hi):
    """53-bit keys (int64) of counters ``j`` (< 2^31) under key words ``lo``, ``hi``."""
    return (key32(2 * j, lo, hi) << 21) | (key32(2 * j + 1, lo, hi) >> 11)


def hash_keys_reference(j, seg, words, full=True):
    """:func:`hash_keys` in int64 torch ops."""
    w = words.reshape(-1, 2).to(torch.int64)
    lo, hi = w[:, 0][seg], w[:, 1][seg]
    return keys53(j, lo, hi) if full else key32(2 * j, lo, hi)


def hash_keys(j, seg, words, full=True, backend=None, block=BLOCK):
    """randomk's draw keys (int64): for counter ``j[i]`` (< 2^31) of segment ``seg[i]``
    under that segment's ``words`` pair ``(lo, hi)`` (int64 ``[T, 2]``, each < 2^32),
    ``key32(2j)`` and, with ``full``, the 53-bit ``key32(2j) << 21 | key32(2j + 1) >> 11``
    -- one launch (kernel on CUDA) where some 80 int64 torch ops computed them."""
    if pick_backend(j, backend) == "torch":
        return hash_keys_reference(j, seg, words, full)
    triton, _, kernel = _kernels()
    j = j.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty_like(j)
    if j.numel():
        count_launch("hash_keys")
        kernel[(triton.cdiv(j.numel(), block),)](j, seg.reshape(-1).to(torch.int64).contiguous(),
                                                 words.reshape(-1).to(torch.int64).contiguous(),
                                                 out, j.numel(), FULL=bool(full), BLOCK=block)
    return out


def hash32_np(x):
    """lowbias32 of a uint32 numpy array, in place (uint32 products wrap mod 2^32)."""
    x ^= x >> np.uint32(16)
    x *= np.uint32(0x7FEB352D)
    x ^= x >> np.uint32(15)
    x *= np.uint32(0x846CA68B)
    x ^= x >> np.uint32(16)
    return x


def uniform_segments_reference(lengths, words, device=None):
    """:func:`uniform_segments` in numpy (then on ``device``)."""
    lengths = np.asarray([int(n) for n in lengths], dtype=np.int64)
    w = words.reshape(-1, 2).cpu().numpy().astype(np.uint32)
    seg = np.repeat(np.arange(lengths.size), lengths)
    starts = np.cumsum(lengths) - lengths
    x = (np.arange(int(lengths.sum()), dtype=np.int64) - starts[seg]).astype(np.uint32)
    x = hash32_np(hash32_np(x ^ w[seg, 0]) ^ w[seg, 1])
    u = (x >> np.uint32(8)).astype(np.float32) * np.float32(SCALE)
    return torch.from_numpy(u).to(device if device is not None else words.device)


def uniform_segments(lengths, words, device=None, backend=None, block=BLOCK):
    """float32 draws in [0, 1) of every entry of a bucket of tensors of host ``lengths``
    (each >= 1), tensor ``s`` drawing with ``words[s] = (lo, hi)`` (int64 ``[T, 2]``,
    each < 2^32): one launch (kernel on CUDA); see the module docstring."""
    device = torch.device(device) if device is not None else words.device
    lengths = tuple(int(n) for n in lengths)
    if len(lengths) != words.reshape(-1, 2).shape[0] or min(lengths, default=1) < 1:
        raise ValueError(f"uniform_segments: {len(lengths)} lengths (each >= 1) for "
                         f"{words.reshape(-1, 2).shape[0]} word pairs")
    if pick_backend(torch.empty(0, device=device), backend) == "torch":
        return uniform_segments_reference(lengths, words, device)
    triton, kernel = _kernels()[:2]
    blocks = block_table(lengths, device, block)
    vstart = blocks.starts[blocks.first]                       # each tensor's first entry
    out = torch.empty(sum(lengths), dtype=torch.float32, device=device)
    count_launch("uniform_segments")
    kernel[(blocks.starts.numel(),)](out, blocks.starts, blocks.stops, blocks.segs, vstart,
                                     words.reshape(-1).to(torch.int64).contiguous(), BLOCK=block)
    return out
