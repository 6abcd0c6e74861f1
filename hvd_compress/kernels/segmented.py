"""Segmented passes over a *bucket*: many tensors laid end to end in one flat buffer,
tensor ``s`` occupying ``lengths[s]`` consecutive entries (no empty segment).

Each pass reads the bucket once, whatever the number of tensors, and returns one result
per tensor, so per-tensor semantics (a threshold per tensor, k per tensor) cost no
Python loop over tensors:

- ``segment_abs_sum_max(x, lengths)``: ``sum|x|`` and ``max|x|`` per segment.  The
  kernel cuts every segment into blocks (a block never straddles two segments), each
  program reduces one block to a partial, and the partials are reduced per segment by
  ``torch.segment_reduce`` in a fixed order: deterministic, no float atomics.
- ``segment_count_above(a, segment_ids, thresholds)``: for ``thresholds`` of shape
  ``[T, G]``, the ``[T, G]`` counts ``#{i in segment s : a_i > thresholds[s, g]}``, with
  ``a`` non-negative (magnitudes) and ``segment_ids`` ascending (a bucket's, or a
  compaction of one in index order).  Integer atomics: exact, so deterministic.
- ``segment_ids(lengths)``: the segment of every entry (int32).
- ``block_table(lengths, device)``: the blocks that never straddle two segments, on the
  device once per bucket layout, which every bucket kernel of the package walks;
  ``word_table(lengths, per_word, ...)`` the same over packed codes (twobit, onebit).

Compaction with a threshold per segment is :func:`kernels.compact.compact_above` with
``segment_ids`` (the same two-pass kernel, the threshold read per entry).

Imports: the standard library, numpy, torch; on first use, Triton; and modules of its own
package.
"""
import functools
import math
from typing import NamedTuple

import numpy as np
import torch

from ._backend import count_launch, pick_backend
from ._held import used
from ._launch import cached


@functools.lru_cache(maxsize=None)
def _kernels():
    """Import Triton and define the kernels (once, on first launch)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _block_abs_sum_max_kernel(x_ptr, add_ptr, src_ptr, starts_ptr, stops_ptr,
                                  part_sum_ptr, part_max_ptr, BLOCK: tl.constexpr,
                                  ALIGN: tl.constexpr, ADD: tl.constexpr):
        # ALIGN: every start and stop is a multiple of it (Blocks.align), so the compiler
        # may load 16 bytes at a time.  ADD (float32 x): src + add written into x first
        # (error feedback's c = g + r; src is x itself, or a tensor alone's gradient, when
        # x is its spare buffer), then its sums; without ADD, src is x
        pid = tl.program_id(0)
        start = tl.multiple_of(tl.load(starts_ptr + pid), ALIGN)      # int64 offsets
        stop = tl.multiple_of(tl.load(stops_ptr + pid), ALIGN)
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(src_ptr + offs, mask=offs < stop, other=0.0).to(tl.float32)
        if ADD:
            x = x + tl.load(add_ptr + offs, mask=offs < stop, other=0.0)
            tl.store(x_ptr + offs, x, mask=offs < stop)
        a = tl.abs(x)
        tl.store(part_sum_ptr + pid, tl.sum(a, axis=0))
        tl.store(part_max_ptr + pid, tl.max(a, axis=0))

    @triton.jit
    def _segment_count_above_kernel(a_ptr, seg_ptr, thr_ptr, counts_ptr, n,
                                    G: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        valid = offs < n
        a = tl.load(a_ptr + offs, mask=valid, other=0.0).to(tl.float32)
        seg = tl.load(seg_ptr + offs, mask=valid, other=0).to(tl.int64)
        g = tl.arange(0, G)
        cell = seg[:, None] * G + g[None, :]                              # [BLOCK, G]
        t = tl.load(thr_ptr + cell, mask=valid[:, None], other=float("inf"))
        above = (a[:, None] > t) & valid[:, None]
        tl.atomic_add(counts_ptr + cell, above.to(tl.int32), mask=above, sem="relaxed")

    @triton.jit
    def _block_sign_sums_kernel(x_ptr, starts_ptr, stops_ptr, part_ptr, BLOCK: tl.constexpr,
                                ALIGN: tl.constexpr):
        # a block's [#(x >= 0), sum of those x, sum of x] (NaN counts in the last only)
        pid = tl.program_id(0)
        offs = tl.multiple_of(tl.load(starts_ptr + pid), ALIGN) + tl.arange(0, BLOCK)
        valid = offs < tl.multiple_of(tl.load(stops_ptr + pid), ALIGN)
        x = tl.load(x_ptr + offs, mask=valid, other=0.0).to(tl.float32)
        pos = (x >= 0) & valid
        tl.store(part_ptr + 3 * pid, tl.sum(pos.to(tl.float32), axis=0))
        tl.store(part_ptr + 3 * pid + 1, tl.sum(tl.where(pos, x, 0.0), axis=0))
        tl.store(part_ptr + 3 * pid + 2, tl.sum(x, axis=0))

    @triton.jit
    def _table_scan_kernel(counts_ptr, T, ends_ptr, bends_ptr, vstart_ptr, gstart_ptr,
                           groups_ptr, G: tl.constexpr, BLOCK: tl.constexpr, TB: tl.constexpr):
        # one program: the segments' exclusive and inclusive sums (values, blocks, groups)
        t = tl.arange(0, TB)
        live = t < T
        c = tl.load(counts_ptr + t, mask=live, other=0).to(tl.int64)
        ends = tl.cumsum(c, axis=0)
        groups = (c + (G - 1)) // G
        gends = tl.cumsum(groups, axis=0)
        tl.store(ends_ptr + t, ends, mask=live)
        tl.store(bends_ptr + t, tl.cumsum((c + (BLOCK - 1)) // BLOCK, axis=0), mask=live)
        tl.store(vstart_ptr + t, ends - c, mask=live)
        tl.store(gstart_ptr + t, gends - groups, mask=live)
        tl.store(groups_ptr, tl.sum(groups, axis=0))

    @triton.jit
    def _table_blocks_kernel(ends_ptr, bends_ptr, vstart_ptr, T, nb, starts_ptr, stops_ptr,
                             segs_ptr, BLOCK: tl.constexpr, BB: tl.constexpr,
                             STEPS: tl.constexpr):
        # block b's segment: the number of segments whose blocks end at or before b (a
        # binary search of STEPS = ceil(log2(T + 1)) halvings), then where it starts
        b = tl.program_id(0).to(tl.int64) * BB + tl.arange(0, BB)
        lo = tl.zeros([BB], dtype=tl.int64)
        hi = lo + T
        for _ in tl.static_range(STEPS):
            mid = (lo + hi) // 2
            below = tl.load(bends_ptr + mid, mask=mid < hi, other=0) <= b
            go_up = (mid < hi) & below
            lo = tl.where(go_up, mid + 1, lo)
            hi = tl.where(go_up | (mid >= hi), hi, mid)
        s = tl.minimum(lo, T - 1)
        be = tl.load(bends_ptr + s)
        first = tl.load(vstart_ptr + s)
        per = (tl.load(ends_ptr + s) - first + (BLOCK - 1)) // BLOCK
        starts = first + (b - (be - per)) * BLOCK
        stops = tl.where(b < tl.load(bends_ptr + T - 1), tl.load(ends_ptr + s), starts)
        m = b < nb
        tl.store(starts_ptr + b, starts, mask=m)
        tl.store(stops_ptr + b, stops, mask=m)
        tl.store(segs_ptr + b, s, mask=m)

    return (triton, *map(cached, (_block_abs_sum_max_kernel, _segment_count_above_kernel,
                                  _table_scan_kernel, _table_blocks_kernel,
                                  _block_sign_sums_kernel)))


def _lengths(lengths, device):
    return torch.as_tensor(lengths, dtype=torch.int64, device=device).reshape(-1)


def segment_ids(lengths, device=None):
    """int32 segment of every entry: ``[0]*lengths[0] + [1]*lengths[1] + ...``."""
    lengths = _lengths(lengths, device)
    return torch.repeat_interleave(torch.arange(lengths.numel(), dtype=torch.int32,
                                                device=lengths.device), lengths)


# -- sum and max of |x| per segment ------------------------------------------------------

def segment_abs_sum_max_reference(x, lengths, seg=None):
    """float32 ``(sum|x|, max|x|)`` per segment, in torch (``index_add_`` adds in index
    order on the CPU; ``torch.segment_reduce`` was 4x slower there, 2026-11-22; on CUDA
    its float atomics add in no fixed order, so two calls' sums may differ in the last
    bits).
    ``seg``: the segment ids, if the caller has them."""
    a = x.reshape(-1).float().abs()
    n_seg = len(lengths) if not torch.is_tensor(lengths) else lengths.numel()
    seg = (segment_ids(lengths, a.device) if seg is None else seg).long()
    total = torch.zeros(n_seg, dtype=torch.float32, device=a.device).index_add_(0, seg, a)
    peak = torch.zeros(n_seg, dtype=torch.float32, device=a.device).scatter_reduce_(
        0, seg, a, "amax", include_self=True)
    return total, peak


class Blocks(NamedTuple):
    """Blocks of a bucket that never straddle two tensors (int64, on the device)."""
    starts: torch.Tensor     #: first entry of each block
    stops: torch.Tensor      #: end of the block's tensor (the block stops there or earlier)
    segs: torch.Tensor       #: the tensor of each block
    first: torch.Tensor      #: index of each tensor's first block
    counts: torch.Tensor     #: blocks per tensor
    block: int               #: entries per block
    align: int = 1           #: a power of two (<= 16) dividing every start and stop


def alignment(lengths, block=16):
    """The largest power of two, at most 16, that divides ``block`` and every length: then
    every offset of a bucket of tensors of ``lengths``, and of its blocks, is a multiple
    of it.  Kernels pass it to ``tl.multiple_of``, which lets the compiler load 16 bytes
    at a time (4 float32) where it would load one value (offsets read from a table are
    otherwise of unknown alignment); a claim the host proves from the layout, so it
    holds."""
    g = math.gcd(int(block), *(int(n) for n in lengths))
    return min(16, g & -g) if g else 16


@functools.lru_cache(maxsize=256)
def _block_lists(lengths, block):
    starts, stops, segs, first, counts, offset = [], [], [], [], [], 0
    for s, length in enumerate(lengths):
        first.append(len(starts))
        count = max(1, -(-length // block))
        starts += [offset + i * block for i in range(count)]
        stops += [offset + length] * count
        segs += [s] * count
        counts.append(count)
        offset += length
    return starts, stops, segs, first, counts


_DEVICE_BLOCKS = {}


def block_table(lengths, device, block=4096):
    """:class:`Blocks` of tensors of ``lengths`` (an empty tensor gets one empty block),
    cached per lengths, block and device: a bucket's table is copied to the device once,
    not every step.  Every bucket kernel (here, :mod:`.histogram_select`, :mod:`.twobit`,
    :mod:`.rangefloat_segments`) walks such blocks."""
    key = (tuple(int(v) for v in lengths), int(block), str(device))
    table = _DEVICE_BLOCKS.get(key)
    if table is None:
        if len(_DEVICE_BLOCKS) > 256:
            _DEVICE_BLOCKS.clear()
        lists = _block_lists(key[0], key[1])
        table = Blocks(*(torch.tensor(v, dtype=torch.int64, device=device) for v in lists),
                       block=key[1], align=alignment(key[0], key[1]))
        _DEVICE_BLOCKS[key] = table
    return used(table)                  # (a CUDA graph that reads it keeps it: _held)


_WORD_TABLES = {}


def word_table(lengths, per_word, device, block_words):
    """``(word blocks, value offsets, word offsets, lengths, total words, value alignment)``
    of a bucket of tensors of ``lengths`` packed ``per_word`` codes a word, each tensor
    padded to whole words (2-bit codes: 16 an int32; signs: 8 a byte): :class:`Blocks` of
    the *words*, which the pack and decode kernels walk, int64 tensors on ``device``
    (cached per lengths, packing, block and device: copied there once), and
    :func:`alignment` of the value offsets and lengths."""
    key = (tuple(int(n) for n in lengths), int(per_word), int(block_words), str(device))
    table = _WORD_TABLES.get(key)
    if table is None:
        if len(_WORD_TABLES) > 256:
            _WORD_TABLES.clear()
        lengths = key[0]
        words = [-(-n // per_word) for n in lengths]
        xoff = np.cumsum([0, *lengths[:-1]])
        woff = np.cumsum([0, *words[:-1]])
        as_t = lambda v: torch.as_tensor(np.asarray(v, dtype=np.int64), device=device)  # noqa: E731
        table = _WORD_TABLES[key] = (block_table(words, device, block_words), as_t(xoff),
                                     as_t(woff), as_t(lengths), sum(words),
                                     alignment(lengths, per_word))
    return used(table)


def check_flat32(what, n, *tensors):
    """ValueError naming ``what`` unless every tensor is contiguous 1-D float32 of ``n``
    values: those that a kernel reads beside ``x`` or writes over in place (error
    feedback's ``add=``, ``source=`` and ``residual=``)."""
    if not all(t.dtype == torch.float32 and t.dim() == 1 and t.is_contiguous()
               and t.numel() == n for t in tensors):
        got = ", ".join(f"{t.dtype} of shape {tuple(t.shape)}" for t in tensors)
        raise ValueError(f"{what} needs contiguous 1-D float32 tensors of {n} values, got {got}")


def check_addends(what, x, add, source):
    """The checks of a first pass given error feedback's ``add`` (and ``source``):
    :func:`check_flat32` of all three, and ``source`` (read) apart from ``x`` (written)."""
    if source is None:
        return check_flat32(what + ": add=", x.numel(), x, add)
    if add is None:
        raise ValueError(f"{what}: source= is read in place of x only with add=")
    check_flat32(what + ": add= and source=", x.numel(), x, add, source)
    if source.data_ptr() == x.data_ptr():
        raise ValueError(f"{what}: source= must be another buffer than x (or None)")


def add_into(x, add, source):
    """The torch form of a first pass's error feedback: ``x + add`` over ``x``, or
    ``source + add`` into ``x``; ``x``."""
    return x.add_(add) if source is None else torch.add(source, add, out=x)


def segment_abs_sum_max(x, lengths, backend=None, block=4096, add=None, source=None):
    """float32 ``(sum|x|, max|x|)`` of each segment of flat ``x`` (kernel on CUDA).
    ``add``: float32 ``x + add`` is written over ``x`` first (both contiguous 1-D
    float32), in the same pass, and summed (error feedback's compensation); with
    ``source`` (contiguous 1-D float32, another buffer), ``source + add`` is written into
    ``x``, which is not read (a tensor alone: its gradient and residual, summed into the
    residual's spare buffer)."""
    lengths = tuple(int(v) for v in (lengths.tolist() if torch.is_tensor(lengths) else lengths))
    if min(lengths, default=1) < 1 or sum(lengths) != x.numel():
        raise ValueError(f"segment lengths {lengths[:8]}... must be >= 1 and sum to {x.numel()}")
    if add is not None or source is not None:
        check_addends("segment_abs_sum_max", x, add, source)
    if pick_backend(x, backend) == "torch":
        return segment_abs_sum_max_reference(x if add is None else add_into(x, add, source),
                                             lengths)
    triton, kernel = _kernels()[:2]
    x = x.reshape(-1).contiguous()
    blocks = block_table(lengths, x.device, block)
    programs = blocks.starts.numel()
    part_sum = torch.empty(programs, dtype=torch.float32, device=x.device)
    part_max = torch.empty(programs, dtype=torch.float32, device=x.device)
    count_launch("segment_abs_sum_max")
    kernel[(programs,)](x, x if add is None else add, x if source is None else source,
                        blocks.starts, blocks.stops, part_sum, part_max, BLOCK=block,
                        ALIGN=blocks.align, ADD=add is not None)
    return reduce_partials(part_sum, part_max, blocks)


def reduce_partials(part_sum, part_max, blocks):
    """Per tensor ``(sum, max)`` of its blocks' partial sums and maxima (one each per block
    of :class:`Blocks` ``blocks``), in a fixed order.  ``unsafe=True``: the lengths are
    the package's own block table (the default checks them with two host
    synchronisations per call)."""
    return (torch.segment_reduce(part_sum, "sum", lengths=blocks.counts, unsafe=True),
            torch.segment_reduce(part_max, "max", lengths=blocks.counts, unsafe=True))


# -- sums of the signs per segment (onebit's levels) -----------------------------------------

def segment_sign_sums_reference(x, lengths):
    """float32 ``[T, 3]``: per segment, the number of entries ``>= 0``, their sum, and the
    sum of all entries."""
    rows = []
    for p in torch.split(x.reshape(-1).float(), list(lengths)):
        pos = p >= 0
        rows.append(torch.stack([pos.float().sum(), torch.where(pos, p, 0.0).sum(), p.sum()]))
    return torch.stack(rows) if rows else torch.zeros(0, 3, device=x.device)


def segment_sign_sums(x, lengths, backend=None, block=4096):
    """:func:`segment_sign_sums_reference` in one pass (kernel on CUDA): a block's three
    sums per program, then the blocks' partials reduced per segment in a fixed order (a
    segmented reduction of the raw values gives one thread block per segment on CUDA)."""
    lengths = tuple(int(v) for v in lengths)
    if min(lengths, default=1) < 1 or sum(lengths) != x.numel():
        raise ValueError(f"segment lengths {lengths[:8]}... must be >= 1 and sum to {x.numel()}")
    if pick_backend(x, backend) == "torch":
        return segment_sign_sums_reference(x, lengths)
    kernel = _kernels()[5]
    x = x.reshape(-1).contiguous()
    blocks = block_table(lengths, x.device, block)
    part = torch.empty(blocks.starts.numel(), 3, dtype=torch.float32, device=x.device)
    count_launch("segment_sign_sums")
    kernel[(blocks.starts.numel(),)](x, blocks.starts, blocks.stops, part, BLOCK=block,
                                     ALIGN=blocks.align)
    return torch.segment_reduce(part, "sum", lengths=blocks.counts, axis=0, unsafe=True)


# -- counts above a grid of thresholds per segment ----------------------------------------

def segment_count_above_reference(a, seg, thresholds, chunk=1 << 16):
    """int64 ``[T, G]`` counts of ``a_i > thresholds[seg_i, g]``, in torch (vectorised:
    one compare of every entry with its segment's G thresholds, summed per segment)."""
    thresholds = thresholds.to(torch.float32)
    T, G = thresholds.shape
    counts = torch.zeros(T, G, dtype=torch.int64, device=a.device)
    a, seg = a.reshape(-1).float(), seg.reshape(-1).long()
    for start in range(0, a.numel(), chunk):      # bounded memory: chunk x G compares
        s = seg[start:start + chunk]
        above = a[start:start + chunk, None] > thresholds[s]
        counts.index_add_(0, s, above.to(torch.int64))
    return counts


def segment_count_above(a, seg, thresholds, backend=None, block=None):
    """int64 ``[T, G]``: ``#{i : seg_i = s, a_i > thresholds[s, g]}`` (kernel on CUDA)."""
    if thresholds.dim() != 2:
        raise ValueError(f"thresholds must be [segments, G], got shape {tuple(thresholds.shape)}")
    if pick_backend(a, backend) == "torch" or a.numel() == 0:
        return segment_count_above_reference(a, seg, thresholds)
    triton, kernel = _kernels()[0], _kernels()[2]
    T, G = thresholds.shape
    g_pad = max(2, triton.next_power_of_2(G))
    thr = torch.full((T, g_pad), float("inf"), dtype=torch.float32, device=a.device)
    thr[:, :G] = thresholds
    counts = torch.zeros(T, g_pad, dtype=torch.int32, device=a.device)
    block = block or max(64, 8192 // g_pad)
    a = a.reshape(-1).contiguous()
    count_launch("segment_count_above")
    kernel[(triton.cdiv(a.numel(), block),)](a, seg.reshape(-1).contiguous(), thr, counts,
                                             a.numel(), G=g_pad, BLOCK=block)
    return counts[:, :G].to(torch.int64)


# -- a block table from segment lengths known on the device only -------------------------

#: segments at most for :func:`device_blocks`' kernels (one program scans them all)
DEVICE_BLOCKS_MAX_SEGMENTS = 4096


def device_blocks_reference(counts, n, g, block):
    """:func:`device_blocks` in torch ops (a fixed number, no host synchronisation)."""
    counts = counts.to(torch.int64).reshape(-1)
    segments = counts.numel()
    ends = torch.cumsum(counts, 0)
    vstart = ends - counts
    groups = (counts + (g - 1)) // g
    gends = torch.cumsum(groups, 0)
    per = (counts + (block - 1)) // block                      # blocks per segment
    block_ends = torch.cumsum(per, 0)
    b = torch.arange(-(-n // block) + segments, dtype=torch.int64, device=counts.device)
    seg = torch.searchsorted(block_ends, b, right=True)        # the segment of block b
    s = seg.clamp_(max=segments - 1)
    starts = vstart[s] + (b - (block_ends[s] - per[s])) * block
    stops = torch.where(b < block_ends[-1], ends[s], starts)   # beyond the last: empty
    return starts, stops, s, vstart, gends - groups, gends[-1]


def device_blocks(counts, n, g, block, backend=None):
    """``(starts, stops, segs, vstart, gstart, groups)`` of segments of ``counts`` (int64
    on the device, ``>= 0``, summing to ``n``, a host int): blocks of ``block`` values
    that never straddle two segments, ``ceil(n / block) + len(counts)`` of them (the
    surplus empty, ``start == stop``), each segment's first value and first group of
    ``g`` values, and the groups in all (a 0-d device tensor).  Two launches (kernels on
    CUDA, up to :data:`DEVICE_BLOCKS_MAX_SEGMENTS` segments), no host synchronisation;
    the reference's torch ops elsewhere."""
    segments = counts.numel()
    if pick_backend(counts, backend) == "torch" or not 0 < segments <= DEVICE_BLOCKS_MAX_SEGMENTS:
        return device_blocks_reference(counts, n, g, block)
    triton, _, _, scan, blocks_kernel = _kernels()[:5]
    dev = counts.device
    ends, bends, vstart, gstart = torch.empty(4, segments, dtype=torch.int64, device=dev)
    groups = torch.empty((), dtype=torch.int64, device=dev)
    count_launch("segment_table_scan")
    scan[(1,)](counts.reshape(-1).contiguous(), segments, ends, bends, vstart, gstart, groups,
               G=g, BLOCK=block, TB=max(16, triton.next_power_of_2(segments)))
    nb = -(-n // block) + segments
    starts, stops, segs = torch.empty(3, nb, dtype=torch.int64, device=dev)
    count_launch("segment_table_blocks")
    bb = 256
    blocks_kernel[(triton.cdiv(nb, bb),)](ends, bends, vstart, segments, nb, starts, stops, segs,
                                          BLOCK=block, BB=bb, STEPS=segments.bit_length())
    return starts, stops, segs, vstart, gstart, groups
