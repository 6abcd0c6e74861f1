"""The last step of laplace_topk's fused search (``laplace_topk:fused=1``): every tensor's
selection written out at once, by *band* (the search itself, which leaves each tensor's
bracket and quota in the search state, is :mod:`.histogram_select`).

``band_select(x, blocks, state)``
    int32 bucket indices, in index order, of every entry with ``b > hi[s]`` plus the
    first ``quota[s]`` entries (in index order) of the band ``lo[s] < b <= hi[s]``
    (``b``: the bits of ``|x|`` as float32; ``lo``, ``hi``, ``quota``: the state's rows
    ``LO``, ``HI``, ``QUOTA`` of the entry's tensor ``s``).  As in :mod:`.compact`: a
    per-block count of both sets (``_band_kernel`` with ``WRITE=False``), one program for
    the offsets (``_offsets_kernel``: their cumulative sums; the band's ranks restart at
    each tensor), then the write (``_band_kernel`` with ``WRITE=True``).  The output
    length and the state's ``FINITE`` are read back together: the one host
    synchronisation of the fused search.  ``gather=True``: the write also copies the
    taken values, and the offsets program counts them per tensor (what a per-tensor
    value codec needs); ``zero=True``: the write puts +0.0 over them in ``x`` (error
    feedback's residual).  ``slots=``: *padded* (``laplace_topk:padded=1``), every
    tensor's entries in a fixed number of slots of its own (:func:`slot_table`), so the
    output's size is known before the search and nothing is read back.

Every program walks one block of ``blocks`` (:func:`.segmented.block_table`): blocks never
straddle two tensors, so the number of launches does not depend on the number of
tensors.  Bit patterns are compared as integers, so a NaN counts as above any finite
bracket (a bucket with one has ``lo = hi = -1``: every entry is taken).

Imports: the standard library, torch; on first use, Triton; and modules of its own
package.
"""
import functools
import types
from typing import Any, NamedTuple

import torch

from ._backend import count_launch, pick_backend, program_chunk
from ._launch import cached
from .histogram_select import FINITE, HI, LO, QUOTA, _entry_segments, _magnitude_bits, _whole
from .segmented import check_flat32


@functools.lru_cache(maxsize=None)
def _kernels():
    """Import Triton and define the kernels (once, on first launch)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _band_kernel(x_ptr, starts_ptr, stops_ptr, segs_ptr, state_ptr, T,
                     above_ptr, band_ptr, out_offset_ptr, idx_ptr, val_ptr,
                     first_ptr, slots_ptr,
                     WRITE: tl.constexpr, BLOCK: tl.constexpr, ALIGN: tl.constexpr,
                     CHUNK: tl.constexpr, GATHER: tl.constexpr = False,
                     ZERO: tl.constexpr = False, PADDED: tl.constexpr = False):
        # WRITE=False: count the block's entries above hi and in the band (lo, hi];
        # WRITE=True: write the taken entries' indices (band_ptr: band entries before it),
        # with GATHER their values too (val_ptr, x's dtype), with ZERO +0.0 over them in x
        # (error feedback's c - sent for the sent entries, x float32: each program writes
        # only entries of its own block, after reading them).  PADDED: tensor s's taken
        # entries go to its own slots, from slots_ptr[s] on, the first slots_ptr[T + s] of
        # them only (first_ptr: each tensor's first block); with GATHER, NaN for every
        # value of a bucket that is not finite.
        # Per entry only int32 (a block's counts and ranks are below BLOCK); the state's
        # rows read here: LO = 0, HI = 1, QUOTA = 5, FINITE = 6
        pid = tl.program_id(0)
        start = tl.multiple_of(tl.load(starts_ptr + pid), ALIGN)
        count = (tl.multiple_of(tl.load(stops_ptr + pid), ALIGN) - start).to(tl.int32)
        s = tl.load(segs_ptr + pid)
        lo = tl.load(state_ptr + s).to(tl.int32)                 # -1 <= lo, hi < 2^31
        hi = tl.load(state_ptr + T + s).to(tl.int32)
        if WRITE:
            # the band entries this block may still take: QUOTA less those before it,
            # clamped to [0, BLOCK] so that the compare stays in int32
            room = tl.minimum(tl.maximum(tl.load(state_ptr + 5 * T + s) - tl.load(band_ptr + pid),
                                         0), BLOCK).to(tl.int32)
            at = tl.load(out_offset_ptr + pid)
            if PADDED:
                # the taken entries of its tensor before this block, then the tensor's slots
                # (limit: the tensor's slots this block may still fill)
                at -= tl.load(out_offset_ptr + tl.load(first_ptr + s))
                limit = tl.load(slots_ptr + T + s) - at
                at += tl.load(slots_ptr + s)
            if GATHER and PADDED:
                finite = tl.load(state_ptr + 6 * T + s) != 0
            tl.static_assert(BLOCK <= 16384)      # (the packed counts below: 15 bits)
            # both counts of the block's entries before the chunk, packed as below
            carry = tl.sum(tl.zeros([CHUNK], dtype=tl.int32), axis=0)
        else:
            n_above = tl.zeros([CHUNK], dtype=tl.int32)
            n_band = tl.zeros([CHUNK], dtype=tl.int32)
        for c0 in range(0, BLOCK, CHUNK):      # CHUNK entries at a time: fewer registers
            local = tl.multiple_of(c0, CHUNK) + tl.arange(0, CHUNK)
            valid = local < count
            raw = tl.load(x_ptr + start + local, mask=valid, other=0.0)
            x = raw.to(tl.float32)
            b = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF        # bits of |x|
            above = valid & (b > hi)
            band = (valid & (b > lo) & (b <= hi)).to(tl.int32)
            if WRITE:
                # one scan for both counts before each entry: band entries in the low 16
                # bits, entries above hi in the high ones (a block's counts are below
                # 2^15), from the chunks before on.  The band entries taken are its first
                # `room`, so the taken entries before an entry are those above hi plus
                # min(band entries before it, room)
                code = band + (above.to(tl.int32) << 16)
                before = carry + tl.cumsum(code, axis=0) - code
                carry += tl.sum(code, axis=0)
                band_before = before & 0xFFFF
                take = above | ((band > 0) & (band_before < room))
                pos = (before >> 16) + tl.minimum(band_before, room)
                if PADDED:
                    take = take & (pos < limit)
                tl.store(idx_ptr + at + pos, (start + local).to(tl.int32), mask=take)
                if GATHER:
                    if PADDED:
                        raw = tl.where(finite, raw, float("nan")).to(raw.dtype)
                    tl.store(val_ptr + at + pos, raw, mask=take)
                if ZERO:
                    tl.store(x_ptr + start + local, tl.zeros_like(x), mask=take)
            else:
                n_above += above.to(tl.int32)
                n_band += band
        if not WRITE:
            tl.store(above_ptr + pid, tl.sum(n_above, axis=0).to(tl.int64))
            tl.store(band_ptr + pid, tl.sum(n_band, axis=0).to(tl.int64))

    @triton.jit
    def _offsets_kernel(above_ptr, band_ptr, segs_ptr, first_ptr, state_ptr, T, P,
                        ex_ptr, band_before_ptr, out_start_ptr, result_ptr, taken_ptr,
                        CB: tl.constexpr, CHUNKS: tl.constexpr, COUNTS: tl.constexpr = 0,
                        BAD: tl.constexpr = False):
        # one program, after the count pass: for every block, the band entries before it
        # within its tensor and where its taken entries go; then [total, FINITE] (BAD:
        # [total, 1 - FINITE], the flag of a bucket that is not finite); with
        # COUNTS (= cdiv(T, CB), a constexpr loop count) the taken entries of every tensor
        # (taken_ptr, int64 [T]): from its first block's start to the next tensor's
        carry = tl.sum(tl.zeros([CB], dtype=tl.int64), axis=0)     # an int64 scalar, 0
        for c in range(CHUNKS):                  # the band's exclusive sums, bucket-wide
            p = c * CB + tl.arange(0, CB)
            m = p < P
            band = tl.load(band_ptr + p, mask=m, other=0)
            tl.store(ex_ptr + p, carry + tl.cumsum(band, axis=0) - band, mask=m)
            carry += tl.sum(band, axis=0)
        tl.debug_barrier()                       # ex written before any program reads it
        carry = tl.sum(tl.zeros([CB], dtype=tl.int64), axis=0)
        for c in range(CHUNKS):
            p = c * CB + tl.arange(0, CB)
            m = p < P
            seg = tl.load(segs_ptr + p, mask=m, other=0)
            band = tl.load(band_ptr + p, mask=m, other=0)
            before = tl.load(ex_ptr + p, mask=m, other=0) - tl.load(
                ex_ptr + tl.load(first_ptr + seg, mask=m, other=0), mask=m, other=0)
            quota = tl.load(state_ptr + 5 * T + seg, mask=m, other=0)
            taken = tl.load(above_ptr + p, mask=m, other=0) + tl.maximum(
                tl.minimum(quota - before, band), 0)
            tl.store(band_before_ptr + p, before, mask=m)
            tl.store(out_start_ptr + p, carry + tl.cumsum(taken, axis=0) - taken, mask=m)
            carry += tl.sum(taken, axis=0)
        if COUNTS:
            tl.debug_barrier()                   # out_start written before it is read
            for c in range(COUNTS):
                t = c * CB + tl.arange(0, CB)
                m, more = t < T, t + 1 < T       # (every tensor has a block, maybe empty)
                here = tl.load(out_start_ptr + tl.load(first_ptr + t, mask=m, other=0),
                               mask=m, other=0)
                after = tl.load(out_start_ptr + tl.load(first_ptr + t + 1, mask=more, other=0),
                                mask=more, other=0)
                tl.store(taken_ptr + t, tl.where(more, after, carry) - here, mask=m)
        two = tl.arange(0, 2)
        finite = tl.load(state_ptr + 6 * T)
        tl.store(result_ptr + two, tl.where(two == 0, carry, 1 - finite if BAD else finite))

    return types.SimpleNamespace(band=cached(_band_kernel), offsets=cached(_offsets_kernel))


class Slots(NamedTuple):
    """Where a padded selection puts each tensor's entries (:func:`slot_table`)."""
    table: Any      #: int64 ``[2, T]`` on the device: each tensor's first slot, its slots
    fill: Any       #: int32 ``[total]``: the bucket index of each slot's tensor's start
    sizes: tuple    #: the slots of each tensor, on the host
    total: int      #: every slot


def slot_table(numels, sizes, device):
    """:class:`Slots` of tensors of ``numels`` values with ``sizes`` slots each (at most
    their values): a padded selection's payload holds ``sum(sizes)`` entries, tensor
    ``t``'s in its own slots, the slots it leaves free holding the index of its first
    value (0.0 as their value: adding it changes no sum, so decompress and error
    feedback's subtraction read padding as they read a sent entry)."""
    sizes = tuple(int(c) for c in sizes)
    if len(sizes) != len(numels) or any(not 0 <= c <= n for c, n in zip(sizes, numels)):
        raise ValueError(f"slot_table: slots {sizes} for tensors of {tuple(numels)} values")
    starts = [0]
    for c in sizes[:-1]:
        starts.append(starts[-1] + c)
    offsets = [0]
    for n in numels[:-1]:
        offsets.append(offsets[-1] + n)
    table = torch.tensor([starts, sizes], dtype=torch.int64)
    fill = torch.repeat_interleave(torch.tensor(offsets, dtype=torch.int32),
                                   torch.tensor(sizes, dtype=torch.int64))
    if torch.device(device).type == "cuda":          # (copied without blocking the host)
        table, fill = (t.pin_memory().to(device, non_blocking=True) for t in (table, fill))
    return Slots(table.to(device), fill.to(device), sizes, sum(sizes))


def band_select_reference(x, blocks, state, gather=False, zero=False, count=True, slots=None):
    """:func:`band_select`, in torch."""
    b = _magnitude_bits(x)
    T = blocks.first.numel()
    seg = _entry_segments(blocks, b.numel())
    lo_e, hi_e = state[LO][seg], state[HI][seg]
    band = (b > lo_e) & (b <= hi_e)
    per = torch.zeros(T, dtype=torch.int64, device=x.device).index_add_(0, seg, band.long())
    before = torch.cumsum(per, 0) - per
    rank = torch.cumsum(band.long(), 0) - band.long() - before[seg]        # 0-based
    take = (b > hi_e) | (band & (rank < state[QUOTA][seg]))
    idx = torch.nonzero(take).reshape(-1)
    if slots is not None:
        return _padded_reference(x, idx, seg, state, zero, slots)
    finite = bool(state[FINITE, 0])
    if not gather:
        return idx.to(torch.int32), finite
    values = x.reshape(-1)[idx]
    counts = torch.zeros(T, dtype=torch.int64, device=x.device).index_add_(
        0, seg[idx], torch.ones_like(idx)) if count else None
    if zero:
        x.reshape(-1).index_fill_(0, idx, 0.0)
    return idx.to(torch.int32), finite, values, counts


def _padded_reference(x, idx, seg, state, zero, slots):
    """The padded selection from the taken bucket indices ``idx`` (index order)."""
    T = slots.table.shape[1]
    s = seg[idx]
    per = torch.zeros(T, dtype=torch.int64, device=x.device).index_add_(0, s, torch.ones_like(s))
    rank = torch.arange(idx.numel(), device=x.device) - (torch.cumsum(per, 0) - per)[s]
    keep = rank < slots.table[1][s]
    idx, at = idx[keep], slots.table[0][s[keep]] + rank[keep]
    bad = 1 - state[FINITE, :1]
    out = slots.fill.clone()
    out[at] = idx.to(torch.int32)
    values = torch.zeros(slots.total, dtype=x.dtype, device=x.device)
    values[at] = torch.where(bad[0] == 0, x.reshape(-1)[idx], float("nan")).to(x.dtype)
    if zero:
        x.reshape(-1).index_fill_(0, idx, 0.0)
    return out, bad, values, slots.table[1]


#: warps of a band-write program (chunks of ``BAND_CHUNK`` entries: 4 a thread): chosen
#: from the compiled register counts (sm_90, Triton 3.6), not timed yet;
#: ``benchmarks/gpu_breakdown.py``'s ``warps`` rows time 4 and 8, with
#: ``histogram_select.HISTOGRAM_WARPS``
BAND_WRITE_WARPS = 8

#: entries a band program reads at once on CUDA (its block in a loop of ``block // CHUNK``,
#: the write's scan carried from chunk to chunk), as ``histogram_select.HISTOGRAM_CHUNK``:
#: compiled for sm_90 (Triton 3.6, 2026-11-30), the write at 8 warps held 122 registers a
#: thread reading its block whole, 64 in chunks of 1024 (16 -> 32 warps on an SM); the
#: count 47 -> 40 at 4 warps.  Not timed yet (``gpu_breakdown.py``'s ``passes`` rows)
BAND_CHUNK = 1024

#: blocks the offsets program takes at once (its loop count, ``cdiv(blocks,
#: OFFSETS_BLOCK)``, is a compile-time constant: one compile per such count, 1 up to 33M
#: values in blocks of 4096), and its warps: 16 entries a thread, as 2048 at 4 warps
#: were, but a 25M-value bucket's 6,104 blocks in one iteration of each of its two
#: loops instead of three (the H200 took 42 us for this one program there, 11 us for
#: GPT-2's 1,731 blocks, 2026-11-29).  Compiled for sm_90 (Triton 3.6): 128 registers, no
#: spill (8192 at 4 warps spills).  Not timed yet (``gpu_breakdown.py``'s ``passes``)
OFFSETS_BLOCK = 8192
OFFSETS_WARPS = 16


def band_select(x, blocks, state, backend=None, gather=False, zero=False, count=True,
                slots=None):
    """``(int32 indices, finite)``: per tensor, the entries with ``b > HI`` and the first
    ``QUOTA`` of ``LO < b <= HI``; ``finite`` is the state's ``FINITE`` as a Python bool,
    read back with the output's length (one host synchronisation for both).

    ``gather=True``: ``(indices, finite, values, counts)``, the values ``x[indices]``
    written by the same launch as the indices, and how many of them each tensor has
    (int64 ``[T]``, from the offsets program; None with ``count=False``).  ``zero=True``
    (with ``gather``; ``x`` contiguous 1-D float32): that launch also writes +0.0 over the
    taken entries of ``x`` (error feedback's ``c - sent`` there: ``c - (0.0 + c)`` is +0.0
    for every finite nonzero ``c``, and only nonzero entries are taken from a finite
    bucket).

    ``slots`` (a :class:`Slots`, with ``gather``): *padded*, with no host
    synchronisation at all: tensor ``t``'s entries go to its own ``slots.sizes[t]`` slots
    (the first of them in index order where it takes more; padding where it takes fewer:
    :func:`slot_table`), and a bucket that is not finite sends NaN in every slot it
    fills.  ``(indices, bad, values, counts)`` then holds ``slots.total`` entries;
    ``bad`` is a flag on the device (int64 ``[1]``), 1 where the bucket is *not* finite,
    and ``counts`` the slots' sizes (int64 ``[T]``)."""
    if (zero or slots is not None) and not gather:
        raise ValueError(f"band_select: {'zero' if zero else 'slots'}= needs gather=True")
    if zero:
        check_flat32("band_select: zero=", x.numel(), x)
    if pick_backend(x, backend) == "torch":
        return band_select_reference(x, blocks, state, gather, zero, count, slots)
    x = x.reshape(-1)
    programs = blocks.starts.numel()
    above = torch.empty(programs, dtype=torch.int64, device=x.device)
    band = torch.empty(programs, dtype=torch.int64, device=x.device)
    T = blocks.first.numel()
    count_launch("band_count")
    kernels, chunk = _kernels(), program_chunk(BAND_CHUNK, blocks.block, x)
    kernels.band[(programs,)](x, blocks.starts, blocks.stops, blocks.segs, _whole(state), T, above,
                              band, above, above, above, above, above, WRITE=False,
                              BLOCK=blocks.block, ALIGN=blocks.align, CHUNK=chunk)
    band_before, out_start, scratch, result = (
        torch.empty(n, dtype=torch.int64, device=x.device) for n in (programs,) * 3 + (2,))
    count = gather and count and slots is None
    counts = torch.empty(T, dtype=torch.int64, device=x.device) if count else None
    count_launch("band_offsets")
    kernels.offsets[(1,)](above, band, blocks.segs, blocks.first, state, T, programs, scratch,
                          band_before, out_start, result, result if counts is None else counts,
                          CB=OFFSETS_BLOCK, CHUNKS=-(-programs // OFFSETS_BLOCK),
                          COUNTS=-(-T // OFFSETS_BLOCK) if count else 0, BAD=slots is not None,
                          num_warps=OFFSETS_WARPS)
    if slots is not None:                # the slots: no size to read back, the flag stays
        total, finite, counts = slots.total, result[1:], slots.table[1]
        idx = slots.fill.clone()
        values = torch.zeros(total, dtype=x.dtype, device=x.device)
    else:
        # the one host synchronisation: the size of the output allocation (and the flag)
        total, finite = result.tolist()
        finite = bool(finite)
        idx = torch.empty(total, dtype=torch.int32, device=x.device)
        values = torch.empty(total, dtype=x.dtype, device=x.device) if gather else idx
    if total:
        count_launch("band_write")
        # 8 warps (BAND_WRITE_WARPS): in chunks of 1024, 64 registers a thread and 32
        # warps on an SM (sm_90, Triton 3.6, 2026-11-30); with 4, 96 and 20
        kernels.band[(programs,)](x, blocks.starts, blocks.stops, blocks.segs, state, T, above,
                                  band_before, out_start, idx, values, blocks.first,
                                  above if slots is None else slots.table, WRITE=True,
                                  BLOCK=blocks.block, ALIGN=blocks.align, GATHER=gather,
                                  ZERO=zero, PADDED=slots is not None, CHUNK=chunk,
                                  num_warps=BAND_WRITE_WARPS)
    return (idx, finite, values, counts) if gather else (idx, finite)
