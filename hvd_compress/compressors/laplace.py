"""Laplace-fit top-k threshold with binary-search refinement (seed 000).

Chen, Liu & Han, "A low-complexity top-k threshold for residual gradient compression
in distributed training", Journal of Zhejiang University (Engineering Science), 2021,
55(2):386-394.

Gradients of a layer are close to Laplace(0, b).  For Laplace,
``P(|g| > t) = exp(-t / b)`` and the maximum-likelihood estimate of ``b`` is
``mean|g|``, so the threshold that keeps a fraction ``rho = k / n`` is::

    t0 = mean|g| * ln(1 / rho)                                   (Laplace fit)

The estimate is then corrected by a search on ``t`` that counts ``|g| > t`` until the
count lies within ``tol * k`` of ``k`` -- no sort, no sampling.  Here:

1. one pass: ``sum|g|`` and ``max|g|`` (kernel ``abs_stats``);
2. candidates: stream-compact ``|g| > t0 / 2`` (kernel ``compact``); for Laplace that
   keeps ``sqrt(rho) * n`` entries, and the lighter-tailed Gaussian still >= k.  If
   fewer than ``k`` survive (data far from Laplace), all nonzero entries are candidates;
3. search: the bracket ``[lo, hi]`` (``count(>lo) >= k > count(>hi)``, starting at
   ``[t0/2, max|g|]``) is cut into ``G + 1`` parts *in float32 bit space* (bit patterns
   of non-negative floats order like the floats, so the cut is scale-free) and all ``G``
   thresholds are counted in one pass over the candidates (kernel ``threshold_count``).
   Each pass shrinks the bracket ``G + 1``-fold; ``ceil(31 ln 2 / ln(G + 1))`` passes
   reach adjacent floats from any start (G = 16 on CUDA, one kernel pass for all
   thresholds: 8 passes; G = 8 on the CPU, where each threshold costs a compare: 10);
4. selection: the threshold whose count is within tolerance (the closer of lo and hi),
   else -- ties, or ``exact=1`` -- everything above ``hi`` plus the first entries (in
   index order) of the band ``(lo, hi]`` up to exactly ``k``.  After those passes the
   band holds a single float value, so this is exactly the k largest magnitudes, ties broken
   by lowest index, without sorting anything.

A nonzero tensor always yields between 1 and n entries; an all-zero tensor none.

Small tensors: fitting and searching cost a fixed few passes and host decisions (about
1 ms on the CPU) that an exact top-k of a small tensor does not.  Below ``small`` values
(default: the framework's crossover, ``ops.small_topk_below``: with PyTorch on the CPU,
whose top-k there is a sampled threshold and numpy's partition of the candidates,
2^27 = 134,217,728 values (it was 1.3-4.3x faster than the search at every size measured,
2M to 128M, on one thread and two); with TensorFlow on the CPU 2^25, eagerly and inside
``tf.function``, and 262,144 on GPUs; 2^27 on CUDA, where torch.topk was faster than the
search up to 25M values and even at 100M on an H100), the k largest come from
the framework's top-k instead, zeros dropped, so the contract above holds (exactly k, or
every nonzero entry when there are fewer; ties broken by the framework, not by index; on
the CPU with PyTorch by lowest index).  ``exact=1``
always searches (ties by lowest index).

Imports: the standard library; and modules of its own package.
"""
import math

from .base import OwnPayload, register
from .fused_search import (WARM_KEY, bucket_constants, fused_payload, select_histogram,
                           torch_only)
from .sparse import DensitySparsifier, per_segment, top_k_checked



def exact_passes(grid):
    """Passes that collapse any float32 bracket (< 2^31 bit patterns) to adjacent floats."""
    return math.ceil(31 * math.log(2) / math.log(grid + 1))


@register
class LaplaceTopK(DensitySparsifier):
    """Top-k by magnitude from a Laplace-fit threshold refined by a counting search.

    ``density``: fraction k/n to send; ``tol``: accepted relative error of the count
    (default 0.01, i.e. within ±1% of k); ``passes``: counting passes over the
    candidates before the search checks the tolerance (it then goes on while the count
    is off, up to the passes that collapse the bracket); ``exact=1``: exactly k entries (the k largest, ties
    by lowest index).  Error feedback is on by default (``ef=0`` turns it off).

    ``fused=1`` (PyTorch): the fused search of :func:`~.fused_search.select_histogram`
    instead -- every tensor of a bucket at once in a fixed number of passes, decided on
    the device, one host synchronisation per compress (the payload's length, with the NaN/Inf check;
    ``values=rangefloat*`` adds the codec's).  ``passes`` and ``small`` do not apply to
    it.  Not the default until a GPU measurement says it is faster than torch.topk there.

    ``padded=1`` (implies ``fused=1``): no host synchronisation at all in compress.
    Each tensor sends a fixed number of pairs, ``min(n, k + floor(tol * k))`` (the most
    the search's count may reach): its selection, then padding (its first index, value
    0.0, which adds nothing where decompress and error feedback sum it).  The payload's
    size is then known before the search, so the collective needs no read-back, and
    the compress is the same launches every step (what a CUDA graph can capture).  A
    tensor sends at most ``tol * k`` pairs more than k (1% by default, none with
    ``exact=1``); one with fewer than k nonzero entries pads its slots, where
    ``fused=1`` sends only those.  A bucket holding NaN/Inf sends NaN as every value
    (each tensor's first slots), so the aggregate is non-finite wherever any rank's
    bucket was, and the residuals stay as they were (flagged on the device,
    ``memory.NonFinite``).  Not with ``agg=``, ``momentum=`` or ``warmup_steps=``.

    ``warm=1`` (implies ``fused=1``; with ``padded=1`` too): each bucket's search starts
    at the bracket its previous search ended with, widened by a factor 1.13, instead of
    at the Laplace fit (``fused_search.histogram_search(warm=)``): on a GPT-2 with AdamW
    a third fewer entries read by the histogram passes, the same launches
    (``benchmarks/threshold_drift.py``).  The brackets (int64, two per tensor) are state,
    as the residuals are: in ``state_dict()``, and put back by a journal's rollback; the
    first step, and the one after a bucket with NaN/Inf, start cold.  Not with ``agg=``.
    Not the default until a GPU measurement says it pays.
    """

    name = "laplace_topk"
    segmented = True

    def __init__(self, density=0.01, ef=None, tol=0.01, passes=4, exact=False, values=None,
                 small=None, fused=None, padded=None, warm=None, **kw):
        super().__init__(density=density, ef=ef, values=values, **kw)
        if not 0.0 <= float(tol) < 1.0:
            raise ValueError(f"tol must be in [0, 1), got {tol!r}")
        if int(passes) < 1:
            raise ValueError(f"passes must be >= 1, got {passes!r}")
        if small is not None and int(small) < 0:
            raise ValueError(f"small must be >= 0 (values), got {small!r}")
        self.tol, self.passes, self.exact = float(tol), int(passes), bool(exact)
        self.small = None if small is None else int(small)
        self.fused = None if fused is None else bool(int(fused))
        self.padded = None if padded is None else bool(int(padded))
        if self.padded:
            if self.fused is False:
                raise ValueError("padded=1 is a payload of the fused search; it cannot "
                                 "take fused=0")
            if self.agg is not None:
                raise ValueError(f"padded=1 sends each rank's own pairs (agg=local); got "
                                 f"agg={self.agg}")
            if self.momentum or self.warmup_steps:
                raise ValueError("padded=1 keeps its payload's size fixed: it cannot take "
                                 "momentum= (DGC's momentum masking reads the sent indices, "
                                 "padding repeats one) or warmup_steps= (k changes each step)")
            self.fused = True
        self.warm = None if warm is None else bool(int(warm))
        if self.warm:
            if self.fused is False:
                raise ValueError("warm=1 starts the fused search warm; it cannot take fused=0")
            if self.agg is not None:
                raise ValueError(f"warm=1 keeps each rank's own search brackets; it cannot "
                                 f"take agg={self.agg}")
            self.fused = True
        self.fixed_size = self.replayable = bool(self.padded)   # (replay: compressors/replay.py)

    def in_place_state(self, lay):
        # warm=1: the bucket's brackets, written into the tensor a CUDA graph reads
        return (WARM_KEY + lay.key,) if self.warm else ()

    #: select_checked finds NaN/Inf itself where it can: the fused search in its first
    #: pass; CPU tensors below ``small`` among their k largest ``|g|``
    finds_nonfinite = True

    def select_checked(self, flat, ctx, ops, step):
        """``(indices, finite)``; a bucket holding NaN/Inf sends every index.  The fused
        search (``fused=1``); tensors all below ``small`` on the CPU: one numpy
        partition each (``segment_abs_topk``), zeros dropped; else a finiteness check,
        then :meth:`select`."""
        if not self.fused:
            found = None
            if not self.exact and max(ctx.numels) < self.small_below(flat, ops):
                found = top_k_checked(self, flat, ctx, ops, drop_zeros=True)
            # not finite: every index; else without zeros (on CUDA read back together)
            return found if found is not None else super().select_checked(flat, ctx, ops, step)
        torch_only(self, ops)
        return select_histogram(self, flat, ctx.layout, ops, add=ctx.add, source=ctx.source)

    def adds_residual(self, flat, ctx, ops):
        # the fused search's first pass (sum|c| and max|c| per tensor) adds r itself, a
        # bucket's or a tensor alone's
        return bool(self.fused) and self.payload_is_copy and ctx.numel > 0

    #: the fused search's write pass gathers the sent values and counts them per tensor
    #: (for ``values=rangefloat*``), and with error feedback writes its residual over the
    #: sent entries (float values, float32 buckets); False: the values gathered, and the
    #: residual subtracted, after the search
    writes_residual = True

    def encode(self, flat, ctx, ops, step):
        # (no error feedback, or one that does not come through encode_checked: flat is
        # left as it is)
        return self._encode_fused(flat, ctx, ops, step, own=False)[0]

    def encode_checked(self, flat, ctx, ops, step):
        # called by error feedback (Compressor._compress_flat), whose residuals are
        # updated in place in flat where payload_is_copy
        return self._encode_fused(flat, ctx, ops, step, own=self.payload_is_copy)

    def _encode_fused(self, flat, ctx, ops, step, own):
        """``(payload, finite)`` with the values that the fused search's write pass
        gathered and counted per tensor; ``own`` (float values): that pass also writes
        ``c - sent`` over the sent entries of ``flat`` (+0.0), so error feedback scatters
        nothing.  Elsewhere: the sparsifiers' :meth:`encode_checked`."""
        if not (self.fused and self.writes_residual and ops.histogram_search_supported()):
            return super().encode_checked(flat, ctx, ops, step)
        coded = self.codec is not None         # (per-tensor counts for its exponent ranges)
        payload, finite, written = fused_payload(self, self, flat, ctx, ops, add=ctx.add,
                                                 source=ctx.source,
                                                 own=own and not coded, count=coded)
        return (payload if written is None else OwnPayload(payload, residual=written)), finite

    def slots(self, lay, ops, like):
        """``padded=1``'s slots of the bucket ``lay`` (``ops.padded_slots``): ``min(n, k +
        floor(tol * k))`` per tensor, ``k`` with ``exact=1``."""
        tol = 0.0 if self.exact else self.tol
        return ops.padded_slots(("laplace", self.density, tol), lay, lambda: [
            min(n, self.k(n) + int(math.floor(tol * self.k(n)))) for n in lay.numels], like)

    def small_below(self, flat, ops):
        """Tensors of fewer values take the framework's top-k (``small``, else the
        framework's crossover)."""
        return ops.small_topk_below(flat) if self.small is None else self.small

    def threshold_estimate(self, abs_sum, n):
        """``t0 = mean|g| * ln(1/density)``."""
        return abs_sum / n * math.log(1.0 / self.density)

    def select(self, flat, ctx, ops, step):
        lay = ctx.bucket
        if self.fused:                       # (called directly by agg=union/leader/hint)
            return self.select_checked(flat, ctx, ops, step)[0]
        if lay is not None:
            if ops.segmented_search(flat, self.exact):
                return self.select_segmented(flat, lay, ops)
            return self.select_each(flat, ctx, ops)
        n, k = ctx.numel, self.k(ctx.numel)
        if n < self.small_below(flat, ops) and not self.exact:
            mags = ops.abs(flat)
            idx = ops.topk_indices(mags, k)
            return ops.gather(idx, ops.mask_indices(ops.gather(mags, idx) > 0))
        abs_sum, abs_max = ops.abs_sum_max(flat)
        t_cand = 0.5 * self.threshold_estimate(abs_sum, n)
        values, idx = ops.compact_above(flat, t_cand)
        enough = ops.length(values) >= k
        t_cand = ops.select(enough, t_cand, 0.0 * abs_max)   # (not 0 * t_cand: inf when sum|g| overflows)
        values, idx = ops.cond(enough, lambda: (values, idx),
                               lambda: ops.compact_above(flat, 0.0))
        grid = ops.search_grid(flat)
        return search_exact_k(ops, ops.abs(ops.to_float32(values)), idx, k, t_cand, abs_max,
                              passes=exact_passes(grid) if self.exact else self.passes,
                              tol=0.0 if self.exact else self.tol, grid=grid)


    def select_each(self, flat, ctx, ops):
        """A bucket, each tensor selected as on its own: the framework's top-k below
        ``small``, the search above; zeros are dropped once for the whole bucket (one
        host synchronisation, not one per tensor).  The same indices as tensor by
        tensor (a search never selects a zero)."""
        small = self.small_below(flat, ops)

        def one(seg, n, _):
            if n < small:
                return ops.topk_indices(ops.abs(seg), self.k(n))
            return self.select(seg, ctx._replace(shape=(n,), numel=n, segments=None), ops, None)

        idx = per_segment(one, flat, ctx, ops, None)
        return ops.gather(idx, ops.mask_indices(ops.gather(flat, idx) != 0))

    def select_segmented(self, flat, lay, ops):
        """The same search for every tensor of a bucket at once (``lay``: its Layout):
        one pass for ``sum|g|`` and ``max|g|`` per tensor, one compaction with a
        candidate threshold per tensor, then counting passes that count ``G`` thresholds
        *per tensor* in one pass over all candidates.  Every tensor keeps its own ``k``,
        fit, bracket and tolerance; the final band is ranked within each tensor.  No
        framework top-k for small tensors here: one search serves the whole bucket."""
        T = len(lay.numels)
        tol = 0.0 if self.exact else self.tol
        k_t, slack, n_t = bucket_constants(self, lay, tol, ops, flat)
        seg = ops.segment_ids(lay, flat)
        abs_sum, abs_max = ops.segment_abs_sum_max(flat, lay)
        t_cand = 0.5 * (abs_sum / n_t) * math.log(1.0 / self.density)
        values, idx = ops.segment_compact_above(flat, t_cand, seg, lay)
        cseg = ops.gather(seg, idx)
        enough = ops.segment_counts(cseg, T) >= k_t
        if not ops.host_all(enough):          # data far from Laplace: all nonzero entries
            t_cand = ops.where(enough, t_cand, 0.0 * abs_max)   # (0 * t_cand: NaN if it is inf)
            values, idx = ops.segment_compact_above(flat, t_cand, seg, lay)
            cseg = ops.gather(seg, idx)
        grid = ops.search_grid(flat)
        return search_segments(ops, ops.abs(ops.to_float32(values)), idx, cseg, T, k_t, slack,
                               t_cand, abs_max,
                               passes=exact_passes(grid) if self.exact else self.passes,
                               tol=tol, grid=grid)


def search_segments(ops, a, idx, seg, T, k_t, slack, lo, hi, passes, tol, grid):
    """:func:`search_exact_k` for ``T`` tensors at once: ``a`` (magnitudes of candidates
    at bucket indices ``idx``, tensor ``seg`` ascending), ``k_t`` and ``slack`` (the
    count's allowed miss) per tensor, brackets ``lo``/``hi`` per tensor.  Returns the
    bucket indices to send."""
    lo_b, hi_b = ops.float_bits(lo), ops.float_bits(hi)
    ends = ops.segment_count_above(a, seg, ops.bits_float(ops.stack_cols([lo_b, hi_b])))
    c_lo, c_hi = ends[:, 0], ends[:, 1]
    fractions = ops.grid_fractions(grid, a)
    kk = k_t[:, None]
    for p in range(exact_passes(grid)):
        if p >= passes:
            done = ops.host_all(((c_lo - k_t) <= slack) | ((k_t - c_hi) <= slack)) if tol else False
            if done:
                break
        thr_b = lo_b[:, None] + ((hi_b - lo_b)[:, None] * fractions[None, :]) // (grid + 1)
        counts = ops.segment_count_above(a, seg, ops.bits_float(thr_b))         # [T, G]
        ge = counts >= kk
        lo_b = ops.rows_max(ops.where(ge, thr_b, lo_b[:, None] + 0 * thr_b))
        c_lo = ops.rows_min(ops.where(ge, counts, c_lo[:, None] + 0 * counts))
        hi_b = ops.rows_min(ops.where(ge, hi_b[:, None] + 0 * thr_b, thr_b))
        c_hi = ops.rows_max(ops.where(ge, c_hi[:, None] + 0 * counts, counts))
        if ops.shrink_candidates(a):     # CPU: keep only candidates above their tensor's lo
            keep = ops.mask_indices(a > ops.gather(ops.bits_float(lo_b), seg))
            a, idx, seg = ops.gather(a, keep), ops.gather(idx, keep), ops.gather(seg, keep)
    lo_e, hi_e = ops.gather(ops.bits_float(lo_b), seg), ops.gather(ops.bits_float(hi_b), seg)
    above_lo, above_hi = a > lo_e, a > hi_e
    lo_ok = (c_lo - k_t) <= slack
    hi_ok = (k_t - c_hi) <= slack
    target = ops.where(lo_ok & (~hi_ok | ((c_lo - k_t) <= (k_t - c_hi))), c_lo,
                       ops.where(hi_ok, c_hi, k_t))
    band = above_lo & ~above_hi
    band_i = ops.cast(band, ops.int64)
    per_seg = ops.segment_sum_int(band_i, seg, T)
    before = ops.cumsum(per_seg) - per_seg                   # band entries of earlier tensors
    band_rank = ops.cumsum(band_i) - ops.gather(before, seg)  # 1-based rank inside its tensor
    take = above_hi | (band & (band_rank <= ops.gather(target - c_hi, seg)))
    return ops.gather(idx, ops.mask_indices(take))


def search_exact_k(ops, a, idx, k, lo, hi, passes, tol, grid):
    """Indices (from ``idx``) of about ``k`` largest of the magnitudes ``a``.

    Invariant: ``count(a > lo) >= k`` (or every candidate, if there are fewer than k)
    and ``count(a > hi) < k``.  ``tol == 0`` returns exactly ``min(k, len(a))``.
    """
    slack = int(math.floor(tol * k))
    lo_b, hi_b = ops.float_bits(lo), ops.float_bits(hi)
    c_lo, c_hi = ops.reduce_sum_int(a > lo), ops.reduce_sum_int(a > hi)
    fractions = ops.grid_fractions(grid, a)
    for p in range(exact_passes(grid)):
        if p >= passes:
            # Past the first `passes` passes (which reach the tolerance on Laplace-,
            # Gaussian- and Student-t-like data: benchmarks/select.py), go on only while
            # the count is off.  Asking costs one host synchronisation per extra pass, and
            # only data far from Laplace (bimodal, heavy ties) gets here.  Inside
            # tf.function the answer is unknown and the search runs to the end.
            done = ops.host_bool((c_lo - k <= slack) | (k - c_hi <= slack)) if tol else False
            if done:
                break
        thr_b = lo_b + ((hi_b - lo_b) * fractions) // (grid + 1)
        counts = ops.count_above(a, ops.bits_float(thr_b))
        ge = counts >= k
        lo_b = ops.reduce_max(ops.where(ge, thr_b, lo_b))
        c_lo = ops.reduce_min(ops.where(ge, counts, c_lo))
        hi_b = ops.reduce_min(ops.where(ge, hi_b, thr_b))
        c_hi = ops.reduce_max(ops.where(ge, c_hi, counts))
        if ops.shrink_candidates(a):
            kept, pos = ops.compact_above(a, ops.bits_float(lo_b))
            a, idx = kept, ops.gather(idx, pos)
    above_lo = a > ops.bits_float(lo_b)
    above_hi = a > ops.bits_float(hi_b)
    # target count: the closer in-tolerance end of the bracket, else exactly k
    lo_ok = (c_lo - k) <= slack
    hi_ok = (k - c_hi) <= slack
    k_t = 0 * c_lo + k                                      # k as a tensor like c_lo
    target = ops.where(lo_ok & (~hi_ok | ((c_lo - k) <= (k - c_hi))), c_lo,
                       ops.where(hi_ok, c_hi, k_t))
    band = above_lo & ~above_hi
    band_rank = ops.cumsum(ops.cast(band, c_lo.dtype))
    take = above_hi | (band & (band_rank <= target - c_hi))
    return ops.gather(idx, ops.mask_indices(take))
