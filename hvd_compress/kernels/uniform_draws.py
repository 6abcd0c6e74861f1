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
    return triton, _uniform_kernel


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
    triton, kernel = _kernels()
    blocks = block_table(lengths, device, block)
    vstart = blocks.starts[blocks.first]                       # each tensor's first entry
    out = torch.empty(sum(lengths), dtype=torch.float32, device=device)
    count_launch("uniform_segments")
    kernel[(blocks.starts.numel(),)](out, blocks.starts, blocks.stops, blocks.segs, vstart,
                                     words.reshape(-1).to(torch.int64).contiguous(), BLOCK=block)
    return out
