"""Peers of laplace_topk: sparsifiers that estimate the top-k threshold other ways.

``dgc``        Lin et al., "Deep Gradient Compression", ICLR 2018 (the "hierarchical
               selection" that seed 000 compares with): top-k of a 1% random sample
               (drawn with replacement, on the tensor's device) gives a threshold,
               adapted x1.3 / x0.7 up to 10 times while the count is outside
               [0.7k, 1.3k]; when more than k survive, an exact top-k over those
               candidates.
``gaussian_k`` Shi et al., "Understanding Top-k Sparsification in Distributed Deep
               Learning", 2019: ``t = |mu| + sigma * Phi^-1(1 - rho/2)``, corrected x0.5
               (fewer than 2k/3) / x1.5 (more than 4k/3) up to 3 times.
``sidco_exp``  Abdelmoniem et al., "An Efficient Statistical-based Gradient Compression
               Technique for Distributed Training Systems" (SIDCo), MLSys 2021, the
               exponential fit: ``S`` stages each keep a fraction ``rho^(1/S)`` of what the
               previous kept, with the exceedances over the last threshold fitted by an
               exponential: ``t_i = t_{i-1} + mean(|g| - t_{i-1} | |g| > t_{i-1}) ln(1/r)``.

Data-dependent loops stop early in eager mode (one host synchronisation per step, as
the original implementations do); inside tf.function they run their full length.  dgc
takes its first count from the compaction at the sampled threshold, so when that
threshold is in range (the usual case) its compress synchronises once: the compaction's
output size.

Imports: the standard library; and modules of its own package.
"""
import math
from statistics import NormalDist

from .base import register
from .sparse import DensitySparsifier


@register
class DGC(DensitySparsifier):
    """Sampled threshold (DGC's hierarchical selection); ``sample`` is the sample fraction."""

    name = "dgc"
    uses_step = True

    def __init__(self, density=0.01, ef=None, sample=0.01, seed=0, values=None, **kw):
        super().__init__(density=density, ef=ef, values=values, **kw)
        if not 0.0 < float(sample) <= 1.0:
            raise ValueError(f"sample must be in (0, 1], got {sample!r}")
        self.sample, self.seed = float(sample), int(seed)

    def select(self, flat, ctx, ops, step):
        n, k = ctx.numel, self.k(ctx.numel)
        m = max(1, min(n, math.ceil(self.sample * n)))
        # O(m) with replacement on flat's device (ops.random_sample), not a permutation
        s = ops.abs(ops.to_float32(ops.random_sample(flat, m, self.seed, step)))
        ks = max(1, min(m, math.ceil(self.density * m)))
        t = ops.reduce_min(ops.gather(s, ops.topk_indices(s, ks)))
        lo, hi = int(0.7 * k), int(1.3 * k)
        # The first count is the length of the compaction at the sample's threshold: with
        # a 1% sample it is nearly always in range, and then that compaction is the
        # answer (one host synchronisation, its output size, instead of a count read back
        # and then the compaction's).  Otherwise one count pass and one read-back per
        # adaptation, and a compaction at the final threshold, as before.
        values, idx = ops.compact_above(flat, t)
        c, moved = ops.length(idx), False
        for i in range(10):
            done, t_next = _dgc_step(ops, t, c, lo, hi)
            if done is True or (done is not False and ops.host_bool(done)):
                break
            t, moved = t_next, True
            if i < 9:
                c = ops.count_above(flat, t)[0]
        if moved:
            values, idx = ops.compact_above(flat, t)
        return ops.cond(ops.length(idx) > k,
                        lambda: ops.gather(idx, ops.topk_indices(ops.abs(ops.to_float32(values)), k)),
                        lambda: idx)


def _dgc_step(ops, t, c, lo, hi):
    """DGC's rule for count ``c`` at threshold ``t``: ``(in [lo, hi]?, next threshold)``,
    x1.3 above ``hi``, x0.7 below ``lo``.  Python bools for a count known on the host (a
    compaction's length in eager mode), tensors for a count on the device."""
    high, low = c > hi, c < lo
    if isinstance(high, bool):
        return not (high or low), (t * 1.3 if high else t * 0.7 if low else t)
    return ~(high | low), ops.where(high, t * 1.3, ops.where(low, t * 0.7, t))


@register
class GaussianK(DensitySparsifier):
    """Threshold from a Gaussian fit (mean, standard deviation), corrected up to 3 times."""

    name = "gaussian_k"

    def select(self, flat, ctx, ops, step):
        k = self.k(ctx.numel)
        mean, std = ops.moments(flat)
        t = ops.abs(mean) + std * NormalDist().inv_cdf(1.0 - self.density / 2.0)
        for _ in range(3):
            c = ops.count_above(flat, t)[0]
            few, many = 3 * c < 2 * k, 3 * c > 4 * k
            if ops.host_bool(~(few | many)):
                break
            t = ops.where(few, t * 0.5, ops.where(many, t * 1.5, t))
        return ops.compact_above(flat, t)[1]


@register
class SIDCoExp(DensitySparsifier):
    """SIDCo-E: multi-stage exponential fit of the magnitudes' tail (``stages`` stages)."""

    name = "sidco_exp"

    def __init__(self, density=0.01, ef=None, stages=2, values=None, **kw):
        super().__init__(density=density, ef=ef, values=values, **kw)
        if int(stages) < 1:
            raise ValueError(f"stages must be >= 1, got {stages!r}")
        self.stages = int(stages)

    def select(self, flat, ctx, ops, step):
        per_stage = math.log(1.0 / self.density) / self.stages      # ln(1/r), r = rho^(1/S)
        abs_sum, _ = ops.abs_sum_max(flat)
        t = abs_sum / ctx.numel * per_stage                           # stage 1 on all of |g|
        values, idx = ops.compact_above(flat, t)
        for _ in range(self.stages - 1):
            a = ops.abs(ops.to_float32(values))
            count = ops.cast(ops.reduce_sum_int(a >= 0), ops.float32)
            mean_excess = (ops.abs_sum_max(a)[0] - t * count) / ops.where(count > 0, count,
                                                                           0 * count + 1)
            t = t + mean_excess * per_stage
            values, pos = ops.compact_above(a, t)
            idx = ops.gather(idx, pos)
        return idx
