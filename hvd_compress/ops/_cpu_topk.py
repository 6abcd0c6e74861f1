"""Top-k of CPU tensors in numpy: a sampled threshold, one compare pass and an exact
top-k of the few values above it; else one introselect in a reused buffer.

Shared by both frameworks' primitives (``torch_ops`` and ``tf_ops`` hand it numpy views
of their CPU tensors).

``torch.topk`` on the CPU took 109-120 ms for k = 63K of 6.3M float32 values on one core
here (2026-11-25); ``np.partition`` finds the same k-th largest value in 8-11 ms.  This
module does the whole selection around it.

0. **A sampled threshold first** (tensors of at least ``PREFILTER_MIN`` values, ``k`` at
   most a quarter of them): ``t`` = the ``r``-th largest of a strided sample (1 value in
   61), ``r`` a few standard deviations above the sample's expected share of the k
   (:func:`sample_rank`).  One pass of ``|s| >= t`` gives the candidates (about
   ``1.1 k``), and steps 2-3 run on them alone.  Exact: when at least ``k`` values are at
   or above ``t``, the k largest are among them; when fewer are (an unlucky sample) or
   ``t`` is 0 (mostly zeros), the steps below run on the whole tensor.  NaN is never a
   candidate, so one ``max`` looks for it (NaN propagates).  This is the hierarchical
   selection of DGC (Lin et al., "Deep Gradient Compression", ICLR 2018), made exact.
   Measured here (2026-11-28, one thread, median of 7): 6.3M Gaussian values at k = 1%,
   42.8 -> 7.5 ms; at 0.1%, 40.5 -> 5.3 ms; 1.31M at 1%, 7.8 -> 1.0 ms; 262K at 1%,
   1.7 -> 0.22 ms; an embedding's gradient (2/3 of its rows zero), 6.3M at 1%,
   35.8 -> 7.3 ms.  TensorFlow's graph path does the same in TensorFlow ops
   (``tf_ops.selection``), with this module's sample and rank;
1. ``w = |s|`` (or ``s``) written into a float32 buffer kept per thread, so the pages of
   a tensor-sized allocation are not faulted in again every step (the cost: 5 bytes per
   value of the largest tensor seen, float32 work and bool mask, held per thread);
2. ``w.partition(n - k)`` in place: ``v = w[n - k]`` is the k-th largest and
   ``w[n - k:]`` the k largest.  numpy orders NaN after every number, so NaN or Inf
   anywhere in ``s`` is among those k (or fills them): their finiteness is the whole
   tensor's, read in O(k).
   **Many zeros** (at least 1/16 of a strided sample): numpy's introselect slows down
   about 18x when a large share of the values tie at the *bottom* of the order, which is
   where the zeros of ``|s|`` lie: an embedding's gradient (the rows of tokens not in
   the batch), dead ReLU units, masked weights.  Measured here (2026-11-27, k = 1%,
   ``benchmarks/select.py --inputs gaussian,embedding``): 161 ms for 1.28M values with
   2/3 of the 256-wide rows zero, 871 ms for 6.4M, against 9 and 49 ms for Gaussian
   values; erratically from about 40% zeros up.  Then ``w = -|s|`` (the sign bit set,
   one pass; ``-s`` for scores with no negative value in the sample: where scores are
   signed the zeros are not at the bottom) and ``w.partition(k - 1)``: the zeros tie at
   the top, ``v = -w[k - 1]`` and ``w[:k]`` are the k largest (7 and 43 ms); NaN, which
   numpy orders last either way, is found by one ``max`` (NaN propagates).  Not always:
   with no zeros that order was 0-30% slower, varying between runs;
3. one pass of ``|s| >= v`` in 64K-value chunks (in cache) into a reused mask; its
   indices are the k largest plus any extra ties at ``v``, of which the lowest-index ones
   are kept.

Indices come in index order, ties broken by lowest index.  May import: numpy; lazily,
:mod:`hvd_compress.kernels.compact` (its chunked compare).  No framework.
"""
import math
import threading

import numpy as _np

_local = threading.local()


def _scratch(n):
    """A float32 work buffer and a bool mask of ``n`` values, grown as needed and kept
    for the thread (one of each, the size of the largest tensor seen)."""
    have = getattr(_local, "buffers", None)
    if have is None or have[0].size < n:
        have = (_np.empty(n, dtype=_np.float32), _np.empty(n, dtype=bool))
        _local.buffers = have
    return have[0][:n], have[1][:n]


_SIGN = _np.uint32(0x80000000)
#: every how many values :func:`_many_zeros` looks at (a prime: the zero rows of an
#: embedding's gradient are whole multiples of its width)
SAMPLE_STRIDE = 61


#: tensors of at least this many values take the sampled threshold first (step 0)
PREFILTER_MIN = 1 << 14


def prefilter(n, k):
    """Does a top-k of ``k`` of ``n`` values take the sampled threshold first?"""
    return n >= PREFILTER_MIN and 0 < k and 4 * k <= n


def sample_rank(m, n, k):
    """The rank ``r`` (1 = the largest) in a sample of ``m`` of ``n`` values whose value is
    the threshold of step 0: the sample's expected count above the k-th largest,
    ``mu = k m / n``, plus ``4 sqrt(mu) + 8``, so that fewer than ``k`` values are at or
    above it only for a sample far from its expectation."""
    mu = k * m / n
    return max(1, min(m, math.ceil(mu + 4.0 * math.sqrt(mu) + 8)))


def _sampled(s, k, absolute, work, mask):
    """Step 0: ``(indices, finite)`` as :func:`largest`, or None when the whole tensor
    must be partitioned (fewer than ``k`` at or above the sample's threshold, or that
    threshold 0 or NaN)."""
    sample = _np.abs(s[::SAMPLE_STRIDE]) if absolute else s[::SAMPLE_STRIDE].copy()
    m = sample.size
    r = sample_rank(m, s.size, k)
    sample.partition(m - r)
    t = sample[m - r]
    if not (t > 0 if absolute else _np.isfinite(t)):
        return None
    idx = _at_least(s, t, absolute, work, mask)
    if idx.size < k:
        return None
    if _np.isnan(s.max()):             # NaN ranks above every number (step 2)
        return None, False
    picked = _scores(s, idx, absolute)
    w = _np.negative(picked)           # the candidates' ties at t on top (step 2)
    w.partition(k - 1)
    v = -w[k - 1]
    finite = bool(_np.isfinite(w[:k]).all())
    if absolute and not finite:
        return None, False
    at_least = picked >= v
    return _keep_k(idx[at_least], picked[at_least], v, k), finite


def _at_least(s, t, absolute, work, mask):
    """Indices (index order) of ``|s| >= t`` (``s >= t`` unless ``absolute``): one pass,
    into the reused ``mask``; ``work`` holds ``|s|`` chunk by chunk (its values are
    overwritten)."""
    if absolute:
        from ..kernels.compact import NUMPY_CHUNK, abs_above_cpu
        abs_above_cpu(s, t, inclusive=True, out=mask, buf=work[:NUMPY_CHUNK])
    else:
        _np.greater_equal(s, t, out=mask)
    return _np.flatnonzero(mask)


def _scores(s, idx, absolute):
    """The scores at ``idx``: ``|s[idx]|``, or ``s[idx]`` unless ``absolute``."""
    return _np.abs(s[idx]) if absolute else s[idx]


def _keep_k(idx, picked, v, k):
    """``idx`` (index order; ``picked``: their values, all ``>= v``) less its
    highest-index ties at ``v`` beyond ``k`` in all."""
    if len(idx) <= k:
        return idx
    keep = picked > v
    keep[_np.flatnonzero(~keep)[:k - int(keep.sum())]] = True
    return idx[keep]


def _many_zeros(s, absolute=True):
    """Whether at least 1/16 of a strided sample of ``s`` (1 value in 61, at least the
    first) is zero, and, unless ``absolute``, none of it negative: then :func:`largest`
    partitions ``-|s|`` or ``-s`` (see the module's step 2)."""
    sample = s[::SAMPLE_STRIDE]
    if not absolute and not sample.min() >= 0:          # (NaN: False as well)
        return False
    return (sample.size - _np.count_nonzero(sample)) * 16 >= sample.size


def largest(s, k, absolute):
    """``(indices, finite)`` of the ``k`` largest of 1-D float32 numpy ``s`` (of ``|s|``
    when ``absolute``), ``0 < k < len(s)``.

    ``indices`` (int64, index order, ties at the k-th value by lowest index) is None
    when the k largest hold NaN (the caller decides what NaN ranks as) and, with
    ``absolute``, when ``s`` is not finite; with ``absolute``, ``finite`` is False exactly
    when ``s`` holds NaN or +-Inf anywhere."""
    n = s.size
    work, mask = _scratch(n)
    if prefilter(n, k):
        got = _sampled(s, k, absolute, work, mask)
        if got is not None:
            return got
    if _many_zeros(s, absolute):       # the k smallest of -|s| (-s): the zeros on top
        if absolute:
            _np.bitwise_or(s.view(_np.uint32), _SIGN, out=work.view(_np.uint32))
        else:
            _np.negative(s, out=work)
        if _np.isnan(work.max()):
            return None, False
        work.partition(k - 1)
        top, v = work[:k], -work[k - 1]
    else:
        if absolute:
            _np.abs(s, out=work)
        else:
            _np.copyto(work, s)
        work.partition(n - k)
        top, v = work[n - k:], work[n - k]
        if _np.isnan(top).any():
            return None, False
    finite = bool(_np.isfinite(top).all())
    if absolute and not finite:        # the caller sends every index
        return None, False
    idx = _at_least(s, v, absolute, work, mask)    # (the partitioned values are done with)
    if len(idx) > k:                   # more ties at v than places left for them
        idx = _keep_k(idx, _scores(s, idx, absolute), v, k)
    return idx, finite


def segment_abs_largest(x, numels, ks, drop_zeros=False):
    """``(indices, finite)``: the ``ks[i]`` largest ``|x|`` of each tensor ``i`` of 1-D
    float32 numpy ``x`` (``numels`` end to end; int64 indices into ``x``, in index order,
    ties by lowest index) and whether ``x`` holds no NaN/Inf; every index of ``x`` when it
    does (a non-finite bucket is sent whole).  ``drop_zeros``: without the indices of
    zeros (when finite)."""
    idx, finite = _segment_abs_largest(x, numels, ks)
    if drop_zeros and finite:
        idx = idx[x[idx] != 0]
    return idx, finite


def _segment_abs_largest(x, numels, ks):
    parts, off = [], 0
    for n, k in zip(numels, ks):
        s = x[off:off + n]
        if n and k < n:
            idx, finite = largest(s, k, absolute=True)
        elif n:                                           # every entry
            idx, finite = _np.arange(n), bool(_np.isfinite(s).all())
        else:
            idx, finite = _np.arange(0), True
        if not finite:
            return _np.arange(x.size), False
        parts.append(idx + off if off else idx)
        off += n
    return (parts[0] if len(parts) == 1 else _np.concatenate(parts)), True


def indices(scores, k):
    """int32 indices of the ``k`` largest of 1-D numpy ``scores``, ``0 < k < len(scores)``
    (index order, ties by lowest index; NaN ranks above every number, as in
    ``torch.topk``)."""
    n = scores.size
    s = _np.ascontiguousarray(scores, dtype=_np.float32)
    idx, _ = largest(s, k, False)
    if idx is None:                    # NaN among the k largest: numpy orders NaN last
        idx = _np.sort(_np.argpartition(s, n - k)[n - k:])
    return idx.astype(_np.int32)
