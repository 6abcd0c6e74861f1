"""randomk's draws: ``k`` distinct indices of each tensor of a bucket, a pure function of
``(seed, step)``, the same on every rank and on the CPU and CUDA (what ``core``'s
``random_indices`` and ``random_indices_segments`` return).

On the kernels' path (CUDA, or ``HVD_COMPRESS_BACKEND=triton``) a whole bucket is a
fixed number of int64 torch ops and at most one host synchronisation.  On the CPU the
same hash runs as uint32 numpy in cache-sized chunks (8x faster than the int64 torch
ops at 25M values here) and the selection loops over tensors, where a loop is cheap.

May import: torch, numpy, ``core``, :mod:`hvd_compress.kernels.uniform_draws` (the
hash in numpy); lazily, :mod:`hvd_compress.kernels` (which path).
"""
import math as _math

import numpy as _np
import torch as _torch

from ...kernels.uniform_draws import hash32_np as _np_hash32, key32 as _key32, keys53 as _keys53
from .core import (_cached, _constant, _host_list, _mix, _segment_table, _starts,
                   _word_pairs)

# A counter-based generator in int64 torch ops, so that the draws of a whole bucket are a
# fixed number of ops on any device and equal on the CPU and CUDA.  Draw j of a tensor
# whose (seed, step) mixes to the 64-bit word (hi, lo): the 53-bit key
#   key_j = (H(H(2j ^ lo) ^ hi) << 21) | (H(H(2j + 1 ^ lo) ^ hi) >> 11),
# H = lowbias32 (C. Wellons' 32-bit integer hash, a bijection), uniform index
# floor(key_j n / 2^53).  k <= n / 2: the first k distinct indices of draws 0, 1, 2, ...
# -- a uniformly random k-subset (draws are exchangeable), O(k log k); the prefix read is
# 1.1 n ln(n / (n - k)) + 64 draws (k distinct take n ln(n / (n - k)) on average), doubled
# (one host synchronisation a bucket says whether it held enough) until it holds k
# distinct, so the answer does not depend on the prefix.  Else the positions of the k
# smallest of the n distinct keys (key_j >> 21) << 31 | j (a 32-bit hash, ties by
# position), in ascending position order.

_M32 = 0xFFFFFFFF


_CHUNK = 1 << 16                      # uint32 entries a chunk: 256 KiB, in cache


def _host_keys(j, words, seg=None, full=True):
    """On the CPU, the keys of counters ``j`` (int64) of segments ``seg`` (None: all of
    segment 0) under one word a segment: :func:`_keys53` (``full``) or ``_key32(2j)``
    (the k-smallest path's key); int64, bit for bit what the torch ops give."""
    jn = j.numpy()
    sn = seg.numpy() if seg is not None else None
    los = _np.array([w & _M32 for w in words], dtype=_np.uint32)
    his = _np.array([w >> 32 for w in words], dtype=_np.uint32)
    out = _np.empty(len(jn), dtype=_np.int64)
    for s in range(0, len(jn), _CHUNK):
        e = min(len(jn), s + _CHUNK)
        lo, hi = (los[0], his[0]) if sn is None else (los[sn[s:e]], his[sn[s:e]])
        j2 = jn[s:e].astype(_np.uint32) * _np.uint32(2)           # 2j < 2^32
        a = _np_hash32(_np_hash32(j2 ^ lo) ^ hi).astype(_np.int64)
        if full:
            b = _np_hash32(_np_hash32((j2 + _np.uint32(1)) ^ lo) ^ hi)
            a = (a << 21) | (b >> _np.uint32(11)).astype(_np.int64)
        out[s:e] = a
    return _torch.from_numpy(out)


def _draw_keys(words, seg, j, device, full=True):
    """:func:`_host_keys` on the CPU path; the same keys on the kernels' path in one
    launch (:func:`hvd_compress.kernels.uniform_draws.hash_keys`), else in torch ops."""
    if _host_path(device):
        return _host_keys(j, words, seg, full)
    from ...kernels import pick_backend, uniform_draws
    if pick_backend(j) == "triton":
        return uniform_draws.hash_keys(j, seg, _word_pairs(words, device), full)
    lo, hi = _word_columns(words, seg, device)
    return _keys53(j, lo, hi) if full else _key32(2 * j, lo, hi)


def _host_path(device):
    """True where the draws run as the CPU's own code (numpy hashing, a loop over
    tensors), False on the kernels' path (CUDA, or HVD_COMPRESS_BACKEND=triton)."""
    from ...kernels import pick_backend
    return _torch.device(device).type == "cpu" and pick_backend(
        _torch.empty(0, device=device)) == "torch"


def draw_segments(numels, ks, seed, steps, like=None):
    """int32 indices into a bucket of tensors of ``numels`` (end to end): for tensor
    ``i``, ``min(ks[i], numels[i])`` distinct indices drawn with ``(seed, steps[i])``
    (offset to the bucket), tensor by tensor; what ``random_indices`` gives each tensor
    alone.  On the kernels' path a fixed number of ops for the whole bucket and one host
    synchronisation where some tensor has ``k <= n / 2``."""
    device = like.device if like is not None else _torch.device("cpu")
    offsets = _starts([int(n) for n in numels])
    ks = [min(int(k), int(n)) for k, n in zip(ks, numels)]
    words = [_mix(seed, int(s)) for s in steps]
    drawn = [i for i, (n, k) in enumerate(zip(numels, ks)) if k and 2 * k <= n]
    keyed = [i for i, (n, k) in enumerate(zip(numels, ks)) if k and 2 * k > n]
    out = _torch.empty(sum(ks) + 1, dtype=_torch.int64, device=device)   # + a spare slot
    starts = _starts(ks)
    for group, fill in ((drawn, _first_distinct), (keyed, _smallest_keys)):
        if group:
            fill(out, [int(numels[i]) for i in group], [ks[i] for i in group],
                 [offsets[i] for i in group], [starts[i] for i in group],
                 [words[i] for i in group], device)
    return out[:-1].to(_torch.int32)


def _word_columns(words, seg, device):
    """The (lo, hi) key words of each entry, from one word per segment."""
    w = _word_pairs(words, device)
    return w[:, 0][seg], w[:, 1][seg]


def _first_distinct(out, numels, ks, offsets, starts, words, device):
    """Tensors with ``k <= n / 2``: the first k distinct of their draws, into ``out``."""
    reads = [int(1.1 * n * _math.log(n / (n - k))) + 64 for n, k in zip(numels, ks)]
    keep = True                        # a layout's first prefix: its tables kept
    while True:
        ends = [s + r - 1 for s, r in zip(_starts(reads), reads)]
        if keep:
            seg, j = _cached("draws", reads, device, lambda: _segment_table(reads, device))
            ends = _constant(ends, device)
        else:                          # (rare: not kept)
            seg, j = _segment_table(reads, device)
            ends = _host_list(ends, device)
        n = _constant(numels, device)[seg]
        keys = _draw_keys(words, seg, j, device)
        idx = _torch.minimum((keys.double() * n / 2.0**53).long(), n - 1)
        idx = idx + _constant(offsets, device)[seg]             # disjoint ranges per tensor
        ordered, order = _torch.sort(idx, stable=True)           # equal draws: first first
        first = _torch.ones_like(ordered, dtype=_torch.bool)
        first[1:] = ordered[1:] != ordered[:-1]
        new = _torch.empty_like(first).scatter_(0, order, first)     # in draw order
        seen = _torch.cumsum(new.long(), 0)
        before = _torch.cat([seen.new_zeros(1), seen[ends][:-1]])
        k_t = _constant(ks, device)
        if bool(((seen[ends] - before) >= k_t).all()):                 # the one sync
            break
        reads, keep = [2 * r for r in reads], False             # a longer prefix, same answer
    rank = seen - before[seg] - 1
    _place(out, new & (rank < k_t[seg]), rank, seg, starts, idx, device)


def _smallest_keys(out, numels, ks, offsets, starts, words, device):
    """Tensors with ``k > n / 2``: the positions of the k smallest of n distinct keys
    ``(32-bit hash << 31) | position``, in ascending position order: one sort of the
    bucket's keys and no host synchronisation, or on the CPU a selection per tensor
    (``kthvalue``, O(n): sorting 25M keys took seconds here)."""
    if _host_path(device):
        for n, k, offset, start, word in zip(numels, ks, offsets, starts, words):
            j = _torch.arange(n)
            keys = (_host_keys(j, [word], full=False) << 31) | j
            take = keys <= _torch.kthvalue(keys, k).values
            out[start:start + k] = _torch.nonzero(take).squeeze(1) + offset
        return
    seg, j = _segment_table(numels, device)                 # n entries each: not kept
    keys = (_draw_keys(words, seg, j, device, full=False) << 31) | j
    first = _constant(_starts(numels), device)             # each tensor's first entry
    order = _torch.sort(keys).indices
    if len(numels) > 1:
        order = order[_torch.sort(seg[order], stable=True).indices]   # by tensor, then key
    seg_o = seg[order]
    rank = _torch.arange(order.numel(), device=device) - first[seg_o]
    take = _torch.empty_like(seg, dtype=_torch.bool).scatter_(
        0, order, rank < _constant(ks, device)[seg_o])
    seen = _torch.cumsum(take.long(), 0)                    # rank in position order
    before = _torch.cat([seen.new_zeros(1), seen])[first]
    _place(out, take, seen - before[seg] - 1, seg, starts, j + _constant(offsets, device)[seg], device)


def _place(out, take, rank, seg, starts, values, device):
    """``out[starts[seg] + rank] = values`` where ``take``, the rest into ``out``'s last
    (spare) slot; no host synchronisation."""
    slot = _constant(starts, device)[seg] + rank
    out.scatter_(0, _torch.where(take, slot, out.numel() - 1), values)
