"""Per-tensor top-k selection over a whole *bucket* in a fixed number of passes: the
kernels of laplace_topk's fused search (``laplace_topk:fused=1``, the algorithm in
:func:`hvd_compress.compressors.fused_search.select_histogram`).

A bucket holds ``T`` tensors end to end.  The search keeps a *state* on the device, int64
``[7, T]`` (rows ``LO, HI, C_LO, C_HI, ACTIVE, QUOTA, FINITE``): tensor ``s``'s bracket
``(lo, hi]`` of magnitudes as float32 *bit patterns* (for non-negative floats the bit
patterns order like the values, so cutting a bracket into equal parts in bit space is
scale-free), the counts above its ends, whether it is still searched, how many band
entries to take, and whether the bucket is finite.  Its kernels read it through one
pointer (no host-side row views per launch).  The kernels:

``search_from_fit`` (in :mod:`.search_state`, with the state's rows and a warm
    search's first pass folded into the sums pass) starts every tensor's bracket.
``segment_histogram(x, blocks, state, bins)``
    int64 ``[T, bins + 2]`` counts of ``b = bits(|x_i|)`` per active tensor: column 0
    counts ``0 < b <= lo`` (nonzero, below the bracket), column ``bins + 1`` counts
    ``b > hi`` (above it), and column ``1 + j`` the window bin
    ``j = ((b - lo - 1) * bins) // W`` of ``lo < b <= hi`` (``W = max(hi - lo, 1)``;
    ``hi`` is read as ``lo + W``, so an empty bracket is one bit wide).  Suffix sums of a
    row are then the counts above the edges ``E_0 = 0``,
    ``E_j = lo + ceil((j - 1) W / bins)`` (``j = 1 .. bins + 1``; the last is ``hi``):
    ``bins + 2`` thresholds counted in one read.  Integer atomics: exact and
    deterministic.  Entries of inactive tensors are not read.  ``local=True`` (for a
    few columns: a coarse pass) counts each block in its own histogram
    (``tl.histogram``) and adds the non-empty columns, an atomic each.
``histogram_pick(hist, state, k, slack, bins)``
    one program per tensor: the search's step from its row, on the device (no host round
    trip): the new bracket and counts, ``ACTIVE`` and ``QUOTA``; ``hist`` zeroed.
``histogram_step``: the two as one pass (one launch with ``FOLD_PICK``); then
:func:`.band_compact.band_select` writes the selection out (the one host sync).

All walk ``blocks`` (:func:`.segmented.block_table`): blocks that never straddle two
tensors, so a program reads one tensor's bracket once and the number of launches does
not depend on ``T``.  Bit patterns are compared as integers, so a NaN (bits above +Inf)
counts as above any finite bracket: ``lo = hi = -1`` selects every entry.

Imports: the standard library, torch; on first use, Triton; and modules of its own
package.
"""
import functools
import types

import torch

from ._backend import count_launch, pick_backend, program_chunk
from ._launch import cached
from .search_state import (ACTIVE, C_HI, C_LO, FINITE, HI, INF_BITS, LO,  # noqa: F401
                           QUOTA, check_warm, search_from_fit, search_from_fit_reference,
                           search_start)  # (the search's state and start, re-exported)
from .segmented import Blocks, block_table  # noqa: F401  (the bucket's blocks)


@functools.lru_cache(maxsize=None)
def _kernels():
    """Import Triton and define the kernels (once, on first launch)."""
    # helpers of this module's kernels and search_state.py's (_pick, and the fine and
    # local counts), and tl, which they use: Triton's interpreter looks them up in this
    # module, whichever kernel calls first
    global _pick, _window, _column, _count_fine, _add_outside, _count_local, _add_local, tl
    import triton
    import triton.language as tl

    @triton.jit
    def _window(lo64, top64, BINS: tl.constexpr):
        # the bracket (lo64, top64] as the histogram counts it: int32 ends (-1 <= lo <
        # 2^31), the top read as lo + W, W = max(top - lo, 1) (an empty bracket is one bit
        # wide; no |x| lies above 2^31 - 1), and BINS / W in float64
        width = tl.maximum(top64 - lo64, 1)
        return (lo64.to(tl.int32), tl.minimum(lo64 + width, 0x7FFFFFFF).to(tl.int32),
                BINS / width.to(tl.float64))

    @triton.jit
    def _column(b, lo, scale, BINS: tl.constexpr):
        # the window bin floor((b - lo - 1) * BINS / W) of an entry inside the bracket,
        # plus 1: b - lo - 1 < 2^31 is exact in float64, its product with BINS / W is
        # within 2^-41 of the quotient q < 2^11, whose fractional part is 0 or at least
        # 1 / W >= 2^-31, so adding 2^-36 (the literal) and truncating gives floor(q);
        # entries outside get 0 (below) or BINS (above), so the conversion is in range.
        # Per entry only int32 and one float64 multiply, no 64-bit integer division
        # (sm_90 has no divider)
        off = b - lo - 1
        q = tl.where(off >= 0, off, 0).to(tl.float64) * scale
        return 1 + tl.minimum(q + 1.4551915228366852e-11, BINS).to(tl.int32)

    @triton.jit
    def _count_fine(row, b, j, seen, lo, hi, below, above):
        # a fine pass's count of the entries seen: an atomic per entry inside the bracket
        # (column j), those below (nonzero) and above it added to the block's tallies
        inside = seen & (b > lo) & (b <= hi)
        tl.atomic_add(row + tl.where(inside, j, 0), inside.to(tl.int64), mask=inside,
                      sem="relaxed")
        return (below + (seen & (b > 0) & (b <= lo)).to(tl.int32),
                above + (seen & (b > hi)).to(tl.int32))

    @triton.jit
    def _add_outside(row, below, above, BINS: tl.constexpr):
        # the block's tallies into its tensor's columns 0 and BINS + 1: every block of a
        # tensor adds to these two counters, so no atomic that adds 0 (an inactive
        # tensor's blocks, or nothing above hi), as they queue on one address
        below_n = tl.sum(below, axis=0).to(tl.int64)
        above_n = tl.sum(above, axis=0).to(tl.int64)
        tl.atomic_add(row, below_n, mask=below_n > 0, sem="relaxed")
        tl.atomic_add(row + BINS + 1, above_n, mask=above_n > 0, sem="relaxed")

    @triton.jit
    def _count_local(h, b, j, valid, lo, hi, BINS: tl.constexpr):
        # a local count of the entries valid: their columns (0 below the bracket, nonzero;
        # BINS + 1 above it) in the block's own histogram h (tl.histogram: BINS + 2
        # columns, few), which _add_local adds with one atomic per non-empty column: where
        # most entries of a block fall in a few columns, per-entry atomics would queue
        col = tl.where(b > hi, BINS + 1, tl.where(b > lo, j, 0))
        return h + tl.histogram(col, BINS + 2, mask=valid & ((b > 0) | (b > lo)))

    @triton.jit
    def _add_local(row, h, BINS: tl.constexpr):
        cols = tl.arange(0, BINS + 2)
        tl.atomic_add(row + cols, h.to(tl.int64), mask=h > 0, sem="relaxed")

    @triton.jit
    def _pick(hist_ptr, state_ptr, k_ptr, slack_ptr, T, s, BINS: tl.constexpr,
              ROW: tl.constexpr):
        # tensor s's step of the search from its histogram row (.cg: read from L2, where
        # the histogram's atomics were made, also by a block of the same launch)
        cols = tl.arange(0, ROW)
        active = tl.load(state_ptr + 4 * T + s) != 0
        live = cols < tl.where(active, ROW, 0)          # an inactive tensor's row is zero
        h = tl.load(hist_ptr + s * ROW + cols, mask=live, other=0, cache_modifier=".cg")
        tl.store(hist_ptr + s * ROW + cols, tl.zeros_like(h), mask=live)   # for the next pass
        above = tl.sum(h, axis=0) - tl.cumsum(h, axis=0) + h      # count(> E_j): suffix sums
        k = tl.load(k_ptr + s)
        slack = tl.load(slack_ptr + s)
        lo = tl.load(state_ptr + s)
        hi = tl.load(state_ptr + T + s)
        c_lo = tl.load(state_ptr + 2 * T + s)
        c_hi = tl.load(state_ptr + 3 * T + s)
        # j = BINS + 1: k or more above the bracket (a warm start's), next (hi, +Inf]
        j = tl.minimum(tl.maximum(tl.sum((above >= k).to(tl.int64), axis=0) - 1, 0), BINS + 1)
        width = tl.maximum(hi - lo, 1)
        new_lo = tl.where(j == 0, 0, lo + ((j - 1) * width + BINS - 1) // BINS)
        new_hi = tl.where(j > BINS, 0x7F800000, lo + (j * width + BINS - 1) // BINS)
        lo = tl.where(active, new_lo, lo)
        hi = tl.where(active, new_hi, hi)
        c_lo = tl.where(active, tl.sum(tl.where(cols == j, above, 0), axis=0), c_lo)
        c_hi = tl.where(active, tl.sum(tl.where(cols == j + 1, above, 0), axis=0), c_hi)
        lo_ok = (c_lo - k) <= slack
        hi_ok = (k - c_hi) <= slack
        hi_off = (k - c_hi) > slack
        target = tl.where(lo_ok & (hi_off | ((c_lo - k) <= (k - c_hi))), c_lo,
                          tl.where(hi_ok, c_hi, k))
        tl.store(state_ptr + s, lo)
        tl.store(state_ptr + T + s, hi)
        tl.store(state_ptr + 2 * T + s, c_lo)
        tl.store(state_ptr + 3 * T + s, c_hi)
        off = (hi - lo > 1) & ((c_lo - k) > slack) & hi_off
        tl.store(state_ptr + 4 * T + s, off.to(tl.int64))
        tl.store(state_ptr + 5 * T + s, target - c_hi)

    @triton.jit
    def _histogram_kernel(x_ptr, starts_ptr, stops_ptr, segs_ptr, state_ptr, T, hist_ptr,
                          counts_ptr, done_ptr, k_ptr, slack_ptr,
                          BINS: tl.constexpr, BLOCK: tl.constexpr, LOCAL: tl.constexpr,
                          ALIGN: tl.constexpr, PICK: tl.constexpr, CHUNK: tl.constexpr):
        # the state's rows read here: LO = 0, HI = 1, ACTIVE = 4.  ALIGN divides every
        # start and stop (16-byte loads).  The block is read CHUNK entries at a time:
        # fewer registers a thread
        pid = tl.program_id(0)
        start = tl.multiple_of(tl.load(starts_ptr + pid), ALIGN)
        s = tl.load(segs_ptr + pid)
        count = tl.where(tl.load(state_ptr + 4 * T + s) != 0,
                         tl.multiple_of(tl.load(stops_ptr + pid), ALIGN) - start, 0).to(tl.int32)
        lo, hi, scale = _window(tl.load(state_ptr + s), tl.load(state_ptr + T + s), BINS)
        row = hist_ptr + s * (BINS + 2)
        if LOCAL:
            h = tl.zeros([BINS + 2], dtype=tl.int32)
        else:
            below = tl.zeros([CHUNK], dtype=tl.int32)
            above = tl.zeros([CHUNK], dtype=tl.int32)
        # an inactive tensor's program skips the loop: nothing read, and none of its
        # masked work (a warm search's later passes, where every tensor has stopped, took
        # 15.5 us each on GPT-2's block without this, H200 2026-11-30)
        if count > 0:
            for c0 in range(0, BLOCK, CHUNK):
                local = tl.multiple_of(c0, CHUNK) + tl.arange(0, CHUNK)
                valid = local < count
                x = tl.load(x_ptr + start + local, mask=valid, other=0.0).to(tl.float32)
                b = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF        # bits of |x|
                j = _column(b, lo, scale, BINS)
                if LOCAL:                                    # a coarse pass
                    h = _count_local(h, b, j, valid, lo, hi, BINS)
                else:
                    below, above = _count_fine(row, b, j, valid, lo, hi, below, above)
        if LOCAL:
            _add_local(row, h, BINS)
        else:
            _add_outside(row, below, above, BINS)
        if PICK:
            # the tensor's last block to finish counting makes its step: every thread's
            # atomics before the block's count (the barrier, then a release), the row read
            # after it (acquire); the count is left zero for the next pass
            tl.debug_barrier()
            finished = tl.atomic_add(done_ptr + s, 1, sem="acq_rel")
            if finished == tl.load(counts_ptr + s) - 1:
                tl.store(done_ptr + s, 0)
                _pick(hist_ptr, state_ptr, k_ptr, slack_ptr, T, s, BINS, BINS + 2)

    @triton.jit
    def _pick_kernel(hist_ptr, state_ptr, k_ptr, slack_ptr, T, BINS: tl.constexpr,
                     ROW: tl.constexpr):
        _pick(hist_ptr, state_ptr, k_ptr, slack_ptr, T, tl.program_id(0), BINS, ROW)

    return types.SimpleNamespace(histogram=cached(_histogram_kernel), pick=cached(_pick_kernel))


def _magnitude_bits(x):
    """Bits of |x| as float32 (the sign bit cleared: no float abs, so no denormal is
    flushed and a NaN's sign does not matter), int64."""
    return (x.reshape(-1).float().view(torch.int32) & 0x7FFFFFFF).to(torch.int64)


def _entry_segments(blocks, n):
    """The tensor of every entry (int64), from the block table."""
    lengths = torch.diff(torch.cat([blocks.starts[blocks.first],
                                    torch.tensor([n], device=blocks.starts.device)]))
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)


# -- histogram ------------------------------------------------------------------------

def segment_histogram_reference(x, blocks, state, bins):
    """The histogram of :func:`segment_histogram`, in torch."""
    b = _magnitude_bits(x)
    T = blocks.first.numel()
    seg = _entry_segments(blocks, b.numel())
    keep = state[ACTIVE][seg] != 0
    b, seg = b[keep], seg[keep]
    lo_e = state[LO][seg]
    width = torch.clamp(state[HI][seg] - lo_e, min=1)
    hi_e = lo_e + width
    col = torch.where(b > hi_e, bins + 1, 1 + torch.div((b - lo_e - 1) * bins, width,
                                                        rounding_mode="floor"))
    col = torch.where(b <= lo_e, 0, col)
    counted = (b > lo_e) | (b > 0)
    hist = torch.zeros(T * (bins + 2), dtype=torch.int64, device=x.device)
    hist.index_add_(0, (seg * (bins + 2) + col)[counted], torch.ones_like(col[counted]))
    return hist.reshape(T, bins + 2)


#: warps of a histogram program, from the compiled register counts (sm_90, Triton 3.6),
#: not timed yet: ``benchmarks/gpu_breakdown.py``'s ``warps`` rows time 4 and 8
HISTOGRAM_WARPS = 4

#: entries a histogram program reads at once on CUDA (its block in a loop of ``block //
#: CHUNK``; :func:`._backend.program_chunk`): 512, 4 a thread, from the compiled register
#: counts (sm_90, Triton 3.6): read whole (4096), the coarse pass held 145 registers a
#: thread and the fine one 185 (3 and 2 programs an SM, too few to hide latency: the
#: H200's passes ran at a sixth of the bandwidth of the one before, 2026-11-29); now 39
#: and 48.  Not timed yet: ``benchmarks/gpu_breakdown.py``'s ``passes`` rows time both
HISTOGRAM_CHUNK = 512


def segment_histogram(x, blocks, state, bins=2046, out=None, backend=None, local=False):
    """int64 ``[T, bins + 2]`` (see the module docstring) of the tensors active in
    ``state`` (the others' rows stay zero and their entries are not read); ``bins + 2``
    must be a power of two.  ``out``: a zeroed buffer to count into (the kernel of
    :func:`histogram_pick` zeroes it again after reading it).  ``local``: the kernel
    counts each block in a histogram of its own (``tl.histogram``) and adds its
    non-empty columns with one atomic each, instead of one atomic per entry in the
    bracket (for a few columns, where per-entry atomics queue on the same counters).
    The same counts either way."""
    if pick_backend(x, backend) == "torch" or x.numel() == 0:
        return segment_histogram_reference(x, blocks, state, bins)
    T = blocks.first.numel()
    hist = torch.zeros(T, bins + 2, dtype=torch.int64, device=x.device) if out is None else out
    count_launch("segment_histogram")
    _launch_histogram(x, blocks, state, bins, hist, local)
    return hist


def _launch_histogram(x, blocks, state, bins, hist, local, pick=None):
    """The histogram kernel; ``pick = (k, slack, done)``: with the search's step."""
    k, slack, done = pick or (hist, hist, hist)       # not read without a pick
    _kernels().histogram[(blocks.starts.numel(),)](
        x.reshape(-1), blocks.starts, blocks.stops, blocks.segs, _whole(state),
        blocks.first.numel(), hist, blocks.counts, done, k, slack, BINS=bins,
        BLOCK=blocks.block, LOCAL=bool(local), ALIGN=blocks.align, PICK=pick is not None,
        CHUNK=program_chunk(HISTOGRAM_CHUNK, blocks.block, x), num_warps=HISTOGRAM_WARPS)


def _whole(state):
    """The state as the kernels read it: one contiguous int64 ``[7, T]``."""
    if state.dim() != 2 or state.shape[0] != 7 or not state.is_contiguous():
        raise ValueError(f"the search state must be a contiguous [7, T] tensor, got shape "
                         f"{tuple(state.shape)}")
    return state


def histogram_edges(lo, hi, bins):
    """int64 ``[T, bins + 2]`` edges ``E_j`` of :func:`segment_histogram`'s columns: the
    suffix sum of a row from column ``j`` counts the entries above ``E_j``."""
    width = torch.clamp(hi - lo, min=1)[:, None]
    j = torch.arange(bins + 1, dtype=torch.int64, device=lo.device)[None, :]
    inner = lo[:, None] + torch.div(j * width + bins - 1, bins, rounding_mode="floor")
    return torch.cat([torch.zeros_like(lo)[:, None], inner], 1)


# -- one step of the search, on the device ------------------------------------------------

def histogram_pick_reference(hist, state, k, slack, bins):
    """:func:`histogram_pick` in torch (``state`` updated in place, ``hist`` zeroed)."""
    above = torch.flip(torch.cumsum(torch.flip(hist, [1]), 1), [1])       # count(> E_j)
    edges = histogram_edges(state[LO], state[HI], bins)
    above = torch.cat([above, torch.zeros_like(above[:, :1])], 1)      # E_(bins+2) = +Inf
    edges = torch.cat([edges, torch.full_like(edges[:, :1], INF_BITS)], 1)
    j = torch.clamp((above >= k[:, None]).sum(1) - 1, 0, bins + 1)[:, None]
    active = state[ACTIVE] != 0
    for row, new in ((LO, edges.gather(1, j)), (C_LO, above.gather(1, j)),
                     (HI, edges.gather(1, j + 1)), (C_HI, above.gather(1, j + 1))):
        state[row] = torch.where(active, new[:, 0], state[row])
    c_lo, c_hi = state[C_LO], state[C_HI]
    lo_ok, hi_ok = (c_lo - k) <= slack, (k - c_hi) <= slack
    target = torch.where(lo_ok & (~hi_ok | ((c_lo - k) <= (k - c_hi))), c_lo,
                         torch.where(hi_ok, c_hi, k))
    state[ACTIVE] = ((state[HI] - state[LO] > 1) & ~lo_ok & ~hi_ok).long()
    state[QUOTA] = target - c_hi
    hist.zero_()
    return state


def histogram_pick(hist, state, k, slack, bins, backend=None):
    """One step of the search for every active tensor, on the device: the last edge
    whose count reaches ``k`` (``count(> E_j) >= k > count(> E_{j+1})``; edge 0 when
    none does: fewer nonzero entries than k; ``(hi, +Inf]`` when k or more lie above
    ``hi``, as a warm start's may) becomes the bracket ``(E_j, E_{j+1}]`` with its two
    counts; a tensor stays active while its bracket is wider than one float and neither
    count is within ``slack`` of ``k``.  ``QUOTA``: how many band entries to take for
    the count that the selection will send (the closer end within ``slack``, else
    exactly ``k``).  ``state`` is updated in place; ``hist`` is zeroed."""
    if pick_backend(hist, backend) == "torch":
        return histogram_pick_reference(hist, state, k, slack, bins)
    T = state.shape[1]
    count_launch("histogram_pick")
    _kernels().pick[(T,)](hist, _whole(state), k, slack, T, BINS=bins, ROW=bins + 2)
    return state


# -- one pass: the histogram and the step ------------------------------------------------

#: each pass's step in the histogram's launch (each tensor's last block to finish picks:
#: a launch fewer a pass, 4 a cold compress, 3 a warm one).  On since 2026-12-01: the
#: H200's ``gpu_breakdown`` ``warps`` rows, in both calls after the histogram read its
#: block in chunks (2026-11-30 and 12-01), timed the whole selection at 0.83 and 0.72 ms
#: against 1.17 and 0.89 (GPT-2's block), 0.86 and 0.78 against 1.35 and 1.55 (25M
#: values), the same indices; before the chunks (2026-11-29) it had been slower
FOLD_PICK = True


def histogram_step(x, blocks, state, bins, k, slack, buffers=None, local=False, backend=None):
    """One pass of the search: :func:`segment_histogram`, then :func:`histogram_pick`
    (``state`` updated in place and returned), in one launch where the kernels run and
    ``FOLD_PICK`` is set.  ``buffers``: a dict that keeps the zeroed counts
    (``"counts"``, one buffer for every pass) and the per-tensor counters (``"done"``,
    its tail, left zero) for the next passes."""
    buffers = {} if buffers is None else buffers
    if pick_backend(x, backend) == "torch" or x.numel() == 0:
        hist = segment_histogram(x, blocks, state, bins, None, backend, local)
        return histogram_pick(hist, state, k, slack, bins, backend)
    hist = _zeroed_counts(buffers, blocks.first.numel(), bins, x.device)
    if not FOLD_PICK:
        segment_histogram(x, blocks, state, bins, hist, backend, local)
        return histogram_pick(hist, state, k, slack, bins, backend)
    count_launch("segment_histogram_pick")
    _launch_histogram(x, blocks, state, bins, hist, local, (k, slack, buffers["done"]))
    return state


def _zeroed_counts(buffers, T, bins, device):
    """The passes' one zeroed int64 counts buffer (``buffers["counts"]``, flat, 2048
    columns a tensor), indexed as ``[T, bins + 2]`` rows from its start: each pick zeroes
    the rows it counted into, so every later pass finds its rows zero (one allocation).
    Its last ``T`` entries, past every row, are ``FOLD_PICK``'s per-tensor counters of
    the blocks that finished (``buffers["done"]``), which the last block zeroes again."""
    need = T * (bins + 2)
    whole = buffers.get("counts")
    if whole is None or whole.numel() < need:
        whole = buffers["counts"] = torch.zeros(max(need, T * 2048) + T, dtype=torch.int64,
                                                device=device)
        buffers["done"] = whole[whole.numel() - T:]
    return whole