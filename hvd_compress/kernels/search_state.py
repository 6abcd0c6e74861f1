"""How laplace_topk's fused search starts (``fused=1``; the algorithm in
:func:`hvd_compress.compressors.fused_search.select_histogram`, the passes in
:mod:`.histogram_select`): its state, every tensor's first bracket, and a warm search's
first pass folded into the pass that every search makes anyway.

The state is int64 ``[7, T]``, rows ``LO, HI, C_LO, C_HI, ACTIVE, QUOTA, FINITE``: tensor
``s``'s bracket ``(lo, hi]`` of magnitudes as float32 *bit patterns*, the counts above its
ends, whether it is still searched, how many band entries to take, and whether the
bucket is finite.  The kernels:

``search_from_fit(abs_sum, abs_max, n, factor, warm, spread)``
    one program: every tensor at its Laplace fit's bracket ``(bits(sum|x| / n * factor),
    bits(max|x|)]``, or around a previous search's (``warm``), or every entry selected
    after a NaN/Inf (:func:`search_start`'s rule).
``warm_first_pass(x, blocks, warm, spread, bins, hist)``
    a warm search's first pass and the sums pass in one read of the bucket: error
    feedback's ``c = g + r`` written (``add``, ``source``: as
    :func:`.segmented.segment_abs_sum_max`), each block's ``sum|c|`` and ``max|c|`` (the
    partials reduced per tensor in a fixed order), and the histogram of every tensor:
    with a warm bracket (``warm[0, s] >= 0``), :func:`.histogram_select.segment_histogram`'s
    over the window ``(max(lo - spread, 0), min(hi + spread, +Inf)]``; without (the
    first step, or after a NaN/Inf), over ``(0, +Inf]`` in ``COLD_BINS`` parts, counted
    per block as the cold search's coarse pass is.  The previous search's brackets bound
    the window, so it is known before the pass; the unfolded start caps it at
    ``bits(max|c|)`` instead, known only after.
``warm_start(hist, abs_sum, abs_max, n, factor, warm, spread, k, slack, bins)``
    one program per tensor: its column of the state (the window counted), then, in a
    finite bucket, the step of the search from its counted row
    (:func:`.histogram_select.histogram_pick`'s); with a warm bracket, a miss above (k
    or more entries past the window: ``(hi, +Inf]``) narrowed to ``(hi,
    bits(max|c|)]``, which holds the same entries (the next pass's 2046 parts of
    ``(hi, +Inf]`` put them in a few: per-entry atomics queued on those, 478 us for a
    25M-value tensor whose threshold grew 1.5x, H200 2026-11-30); a bucket that is not
    finite has its rows zeroed.

Every tensor is so stepped once by the first pass, and three passes of 2046 parts
collapse whatever bracket it leaves (at most 2^31 bit patterns wide after a miss, 2^31 /
62 for a cold tensor's part; 2046^3 > 2^31): a folded warm search makes three histogram
passes after its start, where the unfolded one and the cold one make four.  A warm
search so reads the bucket once fewer than the sums pass and then a first
histogram pass.  In its steady state (87% of a GPT-2's tensor-steps stayed within the
window, ``benchmarks/threshold_drift.py``) and in tolerance mode, that one read and the
selection's passes (``band_compact``); ``exact=1`` usually needs another pass.

Imports: the standard library, torch; on first use, Triton; and modules of its own
package (:mod:`.histogram_select` inside functions: it imports this module).
"""
import functools
import types

import torch

from ._backend import count_launch, pick_backend, program_chunk
from ._launch import cached
from .segmented import (add_into, check_addends, reduce_partials,
                        segment_abs_sum_max_reference)


@functools.lru_cache(maxsize=None)
def _kernels():
    """Import Triton and define the kernels (once, on first launch)."""
    # helpers of several kernels (histogram_select.py's too), and tl: Triton's
    # interpreter looks them up here
    global _pick, _window, _column, _count_fine, _add_outside, _count_local, _add_local
    global _bucket_finite, _start_columns, tl
    import triton
    import triton.language as tl

    from . import histogram_select as H
    H._kernels()
    _pick, _window, _column = H._pick, H._window, H._column
    _count_fine, _add_outside = H._count_fine, H._add_outside
    _count_local, _add_local = H._count_local, H._add_local

    @triton.jit
    def _bucket_finite(sum_ptr, max_ptr, T, TB: tl.constexpr, CHUNKS: tl.constexpr):
        # 1 where no tensor's sum|x| is NaN nor its max|x| Inf or NaN (CHUNKS = cdiv(T,
        # TB), a constexpr: Triton 3.6's interpreter takes no loop over a runtime count)
        bad = tl.zeros([TB], dtype=tl.int32)
        for c in range(CHUNKS):
            t = c * TB + tl.arange(0, TB)
            m = t < T
            a_sum = tl.load(sum_ptr + t, mask=m, other=0.0)
            a_max = tl.load(max_ptr + t, mask=m, other=0.0)
            bad |= ((a_sum != a_sum) | (tl.abs(a_max) == float("inf"))
                    | (a_max != a_max)).to(tl.int32)
        return (tl.max(bad, axis=0) == 0).to(tl.int64)

    @triton.jit
    def _start_columns(t, m, sum_ptr, max_ptr, n_ptr, state_ptr, T, factor, warm_ptr, spread,
                       finite, WARM: tl.constexpr, FOLDED: tl.constexpr):
        # the state of tensors t (where m): the Laplace fit's bracket, or (-1, -1] when not
        # finite; WARM: (lo - spread, min(hi + spread, cap)] where the warm [2, T] bracket's
        # lo >= 0, cap bits(max|x|), or +Inf where FOLDED (the window the first pass
        # counted), and where FOLDED a tensor without one at (0, +Inf], as counted too
        a_sum = tl.load(sum_ptr + t, mask=m, other=0.0)
        a_max = tl.load(max_ptr + t, mask=m, other=0.0)
        fit = tl.math.div_rn(a_sum, tl.load(n_ptr + t, mask=m, other=1.0)) * factor
        lo = fit.to(tl.int32, bitcast=True).to(tl.int64)
        hi = a_max.to(tl.int32, bitcast=True).to(tl.int64)
        if WARM:
            w_lo = tl.load(warm_ptr + t, mask=m, other=-1)
            if FOLDED:
                cap = tl.zeros_like(hi) + 0x7F800000
                lo = tl.where(w_lo >= 0, lo, 0)
                hi = tl.where(w_lo >= 0, hi, cap)
            else:
                cap = hi
            lo = tl.where(w_lo >= 0, tl.maximum(w_lo - spread, 0), lo)
            hi = tl.where(w_lo >= 0, tl.minimum(tl.load(warm_ptr + T + t, mask=m, other=0)
                                                + spread, cap), hi)
        zero = tl.zeros_like(lo)
        tl.store(state_ptr + t, tl.where(finite != 0, lo, zero - 1), mask=m)
        tl.store(state_ptr + T + t, tl.where(finite != 0, hi, zero - 1), mask=m)
        tl.store(state_ptr + 2 * T + t, zero, mask=m)
        tl.store(state_ptr + 3 * T + t, zero, mask=m)
        tl.store(state_ptr + 4 * T + t, zero + finite, mask=m)
        tl.store(state_ptr + 5 * T + t, zero, mask=m)
        tl.store(state_ptr + 6 * T + t, zero + finite, mask=m)

    @triton.jit
    def _start_kernel(sum_ptr, max_ptr, n_ptr, state_ptr, T, factor, warm_ptr, spread,
                      TB: tl.constexpr, CHUNKS: tl.constexpr, WARM: tl.constexpr):
        # one program: the bucket's finiteness, then every tensor's bracket
        finite = _bucket_finite(sum_ptr, max_ptr, T, TB, CHUNKS)
        for c in range(CHUNKS):
            t = c * TB + tl.arange(0, TB)
            _start_columns(t, t < T, sum_ptr, max_ptr, n_ptr, state_ptr, T, factor, warm_ptr,
                           spread, finite, WARM, False)

    @triton.jit
    def _first_pass_kernel(x_ptr, add_ptr, src_ptr, starts_ptr, stops_ptr, segs_ptr,
                           warm_ptr, T, spread, hist_ptr, part_sum_ptr, part_max_ptr,
                           BINS: tl.constexpr, COLD: tl.constexpr, BLOCK: tl.constexpr,
                           ALIGN: tl.constexpr, ADD: tl.constexpr, CHUNK: tl.constexpr):
        # segmented.py's sums pass (ADD: src + add written into x first) and the count of
        # the block's tensor: with a warm bracket, histogram_select.py's fine count over
        # the window around it (its helpers); without, (0, +Inf] in COLD parts, counted
        # in the block's own histogram (as the cold search's coarse pass: per-entry
        # atomics would queue on the few parts that hold a tensor's entries), into the
        # first COLD + 2 columns of its row.  CHUNK entries at a time
        pid = tl.program_id(0)
        start = tl.multiple_of(tl.load(starts_ptr + pid), ALIGN)
        count = (tl.multiple_of(tl.load(stops_ptr + pid), ALIGN) - start).to(tl.int32)
        s = tl.load(segs_ptr + pid)
        w_lo = tl.load(warm_ptr + s)
        cold = w_lo < 0
        lo, hi, scale = _window(tl.maximum(w_lo - spread, 0),
                                tl.minimum(tl.load(warm_ptr + T + s) + spread, 0x7F800000),
                                BINS)
        c_lo, c_hi, c_scale = _window(w_lo * 0, w_lo * 0 + 0x7F800000, COLD)
        lo = tl.where(cold, c_lo, lo)
        hi = tl.where(cold, c_hi, hi)
        scale = tl.where(cold, c_scale, scale)
        row = hist_ptr + s * (BINS + 2)
        total = tl.zeros([CHUNK], dtype=tl.float32)
        top = tl.zeros([CHUNK], dtype=tl.float32)
        below = tl.zeros([CHUNK], dtype=tl.int32)
        above = tl.zeros([CHUNK], dtype=tl.int32)
        h = tl.zeros([COLD + 2], dtype=tl.int32)
        for c0 in range(0, BLOCK, CHUNK):
            local = tl.multiple_of(c0, CHUNK) + tl.arange(0, CHUNK)
            valid = local < count
            x = tl.load(src_ptr + start + local, mask=valid, other=0.0).to(tl.float32)
            if ADD:
                x = x + tl.load(add_ptr + start + local, mask=valid, other=0.0)
                tl.store(x_ptr + start + local, x, mask=valid)
            a = tl.abs(x)
            total += a
            top = tl.maximum(top, a)
            b = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF        # bits of |x|
            j = _column(b, lo, scale, BINS)
            if cold:                             # (0, +Inf]: lo = 0, no entry below it
                h = _count_local(h, b, j, valid, lo, hi, COLD)
            else:
                below, above = _count_fine(row, b, j, valid, lo, hi, below, above)
        tl.store(part_sum_ptr + pid, tl.sum(total, axis=0))
        tl.store(part_max_ptr + pid, tl.max(top, axis=0))
        if cold:
            _add_local(row, h, COLD)
        else:
            _add_outside(row, below, above, BINS)

    @triton.jit
    def _warm_start_kernel(hist_ptr, sum_ptr, max_ptr, n_ptr, state_ptr, warm_ptr, k_ptr,
                           slack_ptr, T, factor, spread, BINS: tl.constexpr,
                           ROW: tl.constexpr, COLD: tl.constexpr, TB: tl.constexpr,
                           CHUNKS: tl.constexpr):
        # tensor s's column of the state (every program reads the T sums for the bucket's
        # finiteness: T^2 small reads, from L2), then its step from its counted row
        s = tl.program_id(0)
        finite = _bucket_finite(sum_ptr, max_ptr, T, TB, CHUNKS)
        lane = tl.arange(0, 16)
        _start_columns(s + lane, lane < 1, sum_ptr, max_ptr, n_ptr, state_ptr, T, factor,
                       warm_ptr, spread, finite, True, True)
        if finite != 0:
            tl.debug_barrier()              # the column stored, then read by the pick
            if tl.load(warm_ptr + s) >= 0:
                _pick(hist_ptr, state_ptr, k_ptr, slack_ptr, T, s, BINS, ROW)
                # a miss above, (hi, +Inf]: (hi, bits(max|c|)], the same entries (module
                # docstring)
                tl.debug_barrier()
                lo = tl.load(state_ptr + s)
                hi = tl.load(state_ptr + T + s)
                top = tl.load(max_ptr + s).to(tl.int32, bitcast=True).to(tl.int64)
                tl.store(state_ptr + T + s,
                         tl.where((hi == 0x7F800000) & (top > lo), top, hi))
            else:
                # (0, +Inf] in COLD parts: the first COLD + 2 columns of its row, read as a
                # row of that width (_pick's rows are ROW apart: its base moved back)
                _pick(hist_ptr + s * (ROW - COLD - 2), state_ptr, k_ptr, slack_ptr, T, s,
                      COLD, COLD + 2)
        else:
            cols = tl.arange(0, ROW)
            tl.store(hist_ptr + s * ROW + cols, tl.zeros([ROW], dtype=tl.int64))

    return types.SimpleNamespace(start=cached(_start_kernel), first=cached(_first_pass_kernel),
                                 warm=cached(_warm_start_kernel))


# -- the search's state ----------------------------------------------------------------

#: rows of the search state (int64 ``[7, T]``)
LO, HI, C_LO, C_HI, ACTIVE, QUOTA, FINITE = range(7)
INF_BITS = 0x7F800000      #: bits of +Inf: the top of a bracket above a warm start's
#: parts of ``(0, +Inf]`` in which a warm search's first pass counts a tensor without a
#: warm bracket (the cold search's coarse pass's 62: a part spans 2^31 / 62 bit patterns,
#: about 4 octaves, and three passes of 2046 parts collapse it)
COLD_BINS = 62


def search_start(lo, hi, abs_sum, abs_max):
    """The state of a search with brackets ``(lo, hi]`` (bits, int64 ``[T]``): every
    tensor active, counts unknown.  A NaN or Inf in the bucket (``sum|x|`` NaN -- a sum of
    magnitudes is NaN only with a NaN in it -- or ``max|x|`` infinite; a finite sum past
    float32's range is not one): no tensor is searched and every entry is selected
    (``lo = hi = -1``); ``FINITE`` records it."""
    finite = ~torch.isnan(abs_sum).any() & torch.isfinite(abs_max).all()
    state = torch.zeros(7, lo.numel(), dtype=torch.int64, device=lo.device)
    state[LO] = torch.where(finite, lo, -1)
    state[HI] = torch.where(finite, hi, -1)
    state[ACTIVE] = finite.long()
    state[FINITE] = finite.long()
    return state


def search_from_fit_reference(abs_sum, abs_max, n, factor, warm=None, spread=0,
                              folded=False):
    """:func:`search_from_fit` in torch; ``folded=True`` (:func:`warm_start`'s): a warm
    bracket's top is ``hi + spread`` at most ``+Inf``, not ``bits(max|x|)``, and a tensor
    without one starts at ``(0, +Inf]`` (what the folded first pass counted)."""
    fit = abs_sum.float() / n.float() * torch.tensor(factor, dtype=torch.float32)
    lo = fit.view(torch.int32).to(torch.int64)
    hi = abs_max.float().view(torch.int32).to(torch.int64)
    if warm is not None:
        use = warm[0] >= 0
        if folded:            # the windows the first pass counted: a cold one (0, +Inf]
            lo, hi = torch.zeros_like(lo), torch.full_like(hi, INF_BITS)
        lo = torch.where(use, torch.clamp(warm[0] - spread, min=0), lo)
        hi = torch.where(use, torch.clamp(warm[1] + spread, max=hi), hi)
    return search_start(lo, hi, abs_sum, abs_max)


def check_warm(warm, T):
    """A ValueError unless ``warm`` is None or a contiguous int64 ``[2, T]`` tensor."""
    if warm is not None and (warm.dtype != torch.int64 or warm.shape != (2, T)
                             or not warm.is_contiguous()):
        raise ValueError(f"warm must be a contiguous int64 [2, {T}] tensor, "
                         f"got {warm.dtype} {tuple(warm.shape)}")


def _programs_of(T):
    """``(TB, CHUNKS)``: tensors a program reads at once, and how many times."""
    tb = max(16, min(1024, 1 << max(T - 1, 1).bit_length()))
    return tb, -(-T // tb)


def search_from_fit(abs_sum, abs_max, n, factor, warm=None, spread=0, backend=None):
    """The state of a search that starts every tensor at ``(bits(sum|x| / n * factor),
    bits(max|x|)]`` (float32 ``[T]`` each; ``factor`` a float, rounded to float32; an
    IEEE division), with :func:`search_start`'s NaN/Inf rule: one launch of one program
    where the kernels run, instead of some 35 framework ops.  ``warm``: int64 ``[2, T]``,
    brackets ``(lo, hi]`` in bits (a previous search's final ones); a tensor whose ``lo``
    is not negative starts at ``(lo - spread, min(hi + spread, bits(max|x|))]`` instead
    (``lo - spread`` at least 0; :func:`warm_start` leaves ``hi + spread`` uncapped)."""
    check_warm(warm, abs_sum.numel())
    if pick_backend(abs_sum, backend) == "torch":
        return search_from_fit_reference(abs_sum, abs_max, n, factor, warm, spread)
    T = abs_sum.numel()
    state = torch.empty(7, T, dtype=torch.int64, device=abs_sum.device)
    count_launch("search_from_fit")
    tb, chunks = _programs_of(T)
    _kernels().start[(1,)](abs_sum.float().contiguous(), abs_max.float().contiguous(),
                           n.float().contiguous(), state, T, float(factor),
                           state if warm is None else warm, int(spread), TB=tb,
                           CHUNKS=chunks, WARM=warm is not None)
    return state


# -- a warm search's first pass, folded into the sums ------------------------------------

def warm_first_pass_reference(x, blocks, warm, spread, bins, hist, add=None, source=None):
    """:func:`warm_first_pass` in torch (``hist`` added to in place)."""
    from . import histogram_select as H
    if add is not None:
        add_into(x, add, source)
    seg = H._entry_segments(blocks, x.numel())
    abs_sum, abs_max = segment_abs_sum_max_reference(x, blocks.counts, seg)
    ones = torch.ones_like(abs_sum)
    use = warm[0] >= 0
    window = search_start(torch.clamp(warm[0] - spread, min=0),
                          torch.clamp(warm[1] + spread, max=INF_BITS), ones, ones)
    window[ACTIVE] = use.long()
    hist += H.segment_histogram_reference(x, blocks, window, bins)
    whole = search_start(torch.zeros_like(warm[0]), torch.full_like(warm[1], INF_BITS), ones,
                         ones)
    whole[ACTIVE] = (~use).long()
    hist[:, :COLD_BINS + 2] += H.segment_histogram_reference(x, blocks, whole, COLD_BINS)
    return abs_sum, abs_max


def warm_first_pass(x, blocks, warm, spread, bins, hist, add=None, source=None, backend=None):
    """float32 ``(sum|c|, max|c|)`` per tensor of the bucket ``x`` (:class:`.Blocks`
    ``blocks``) and, counted into ``hist`` (int64 ``[T, bins + 2]``, zeroed), the
    histogram of every tensor with a warm bracket (``warm``, int64 ``[2, T]``; ``lo >=
    0``) over ``(max(lo - spread, 0), min(hi + spread, +Inf)]``, and of every other
    tensor over ``(0, +Inf]`` in ``COLD_BINS`` parts (the first ``COLD_BINS + 2``
    columns of its row): one read of the bucket (module docstring).  ``add``/``source``:
    error feedback's ``c`` written first, as :func:`.segmented.segment_abs_sum_max`'s."""
    T = blocks.first.numel()
    check_warm(warm, T)
    if add is not None or source is not None:
        check_addends("warm_first_pass", x, add, source)
    if pick_backend(x, backend) == "torch" or x.numel() == 0:
        return warm_first_pass_reference(x, blocks, warm, spread, bins, hist, add, source)
    from . import histogram_select as H
    x = x.reshape(-1)
    programs = blocks.starts.numel()
    part_sum = torch.empty(programs, dtype=torch.float32, device=x.device)
    part_max = torch.empty(programs, dtype=torch.float32, device=x.device)
    count_launch("warm_first_pass")
    _kernels().first[(programs,)](
        x, x if add is None else add, x if source is None else source, blocks.starts,
        blocks.stops, blocks.segs, warm, T, int(spread), hist, part_sum, part_max, BINS=bins,
        COLD=COLD_BINS, BLOCK=blocks.block, ALIGN=blocks.align, ADD=add is not None,
        CHUNK=program_chunk(H.HISTOGRAM_CHUNK, blocks.block, x), num_warps=H.HISTOGRAM_WARPS)
    return reduce_partials(part_sum, part_max, blocks)


def warm_start_reference(hist, abs_sum, abs_max, n, factor, warm, spread, k, slack, bins):
    """:func:`warm_start` in torch (``hist`` zeroed)."""
    from . import histogram_select as H
    state = search_from_fit_reference(abs_sum, abs_max, n, factor, warm, spread, folded=True)
    finite = state[ACTIVE] != 0
    counted, whole = (warm[0] >= 0) & finite, (warm[0] < 0) & finite
    coarse = hist[:, :COLD_BINS + 2].clone()             # a cold tensor's row
    stepped, cold = state.clone(), state.clone()
    stepped[ACTIVE], cold[ACTIVE] = counted.long(), whole.long()
    H.histogram_pick_reference(hist, stepped, k, slack, bins)
    H.histogram_pick_reference(coarse, cold, k, slack, COLD_BINS)
    top = abs_max.float().view(torch.int32).to(torch.int64)
    capped = (stepped[HI] == INF_BITS) & (top > stepped[LO])
    stepped[HI] = torch.where(capped, top, stepped[HI])
    return torch.where(counted[None, :], stepped, torch.where(whole[None, :], cold, state))


def warm_start(hist, abs_sum, abs_max, n, factor, warm, spread, k, slack, bins, backend=None):
    """The state of a warm search after :func:`warm_first_pass` counted ``hist``: every
    tensor's start at the window that pass counted (:func:`search_from_fit_reference`
    with ``folded=True``), then in a finite bucket every tensor's step
    (:func:`.histogram_select.histogram_pick`'s): from its row's 2046 parts where it has
    a warm bracket, from the ``COLD_BINS`` parts of ``(0, +Inf]`` where not.  One launch,
    a program per tensor; ``hist`` is left zero."""
    T = abs_sum.numel()
    check_warm(warm, T)
    if pick_backend(abs_sum, backend) == "torch":
        return warm_start_reference(hist, abs_sum, abs_max, n, factor, warm, spread, k,
                                    slack, bins)
    state = torch.empty(7, T, dtype=torch.int64, device=abs_sum.device)
    count_launch("warm_start")
    tb, chunks = _programs_of(T)
    _kernels().warm[(T,)](hist, abs_sum.float().contiguous(), abs_max.float().contiguous(),
                          n.float().contiguous(), state, warm, k, slack, T, float(factor),
                          int(spread), BINS=bins, ROW=bins + 2, COLD=COLD_BINS, TB=tb,
                          CHUNKS=chunks)
    return state


def warm_search(x, blocks, warm, k, slack, n, factor, spread, bins, buffers=None, add=None,
                source=None, backend=None):
    """The state of a warm search once its first pass is made: :func:`warm_first_pass`,
    then :func:`warm_start` (two launches), the counts in ``buffers``' shared zeroed buffer
    (:func:`.histogram_select.histogram_step`'s)."""
    from . import histogram_select as H
    T = blocks.first.numel()
    if pick_backend(x, backend) == "torch" or x.numel() == 0:
        hist = torch.zeros(T, bins + 2, dtype=torch.int64, device=x.device)
        backend = "torch"
    else:
        hist = H._zeroed_counts({} if buffers is None else buffers, T, bins, x.device)
    abs_sum, abs_max = warm_first_pass(x, blocks, warm, spread, bins, hist, add, source,
                                       backend)
    return warm_start(hist, abs_sum, abs_max, n, factor, warm, spread, k, slack, bins,
                      backend)
