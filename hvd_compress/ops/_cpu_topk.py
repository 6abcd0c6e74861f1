"""Top-k of CPU tensors in numpy: one introselect in a reused buffer, one compare pass.

Shared by both frameworks' primitives (``torch_ops`` and ``tf_ops`` hand it numpy views
of their CPU tensors).

``torch.topk`` on the CPU took 109-120 ms for k = 63K of 6.3M float32 values on one core
here (2026-11-25); ``np.partition`` finds the same k-th largest value in 8-11 ms.  This
module does the whole selection around it:

1. ``w = |s|`` (or ``s``) written into a float32 buffer kept per thread, so the pages of
   a tensor-sized allocation are not faulted in again every step (the cost: 5 bytes per
   value of the largest tensor seen, float32 work and bool mask, held per thread);
2. ``w.partition(n - k)`` in place: ``v = w[n - k]`` is the k-th largest and
   ``w[n - k:]`` the k largest.  numpy orders NaN after every number, so NaN or Inf
   anywhere in ``s`` is among those k (or fills them): their finiteness is the whole
   tensor's, read in O(k);
3. one pass of ``|s| >= v`` in 64K-value chunks (in cache) into a reused mask; its
   indices are the k largest plus any extra ties at ``v``, of which the lowest-index ones
   are kept.

Indices come in index order, ties broken by lowest index.  May import: numpy; lazily,
:mod:`hvd_compress.kernels.compact` (its chunked compare).  No framework.
"""
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


def largest(s, k, absolute):
    """``(indices, finite)`` of the ``k`` largest of 1-D float32 numpy ``s`` (of ``|s|``
    when ``absolute``), ``0 < k < len(s)``.

    ``indices`` (int64, index order, ties at the k-th value by lowest index) is None
    when the k largest hold NaN (the caller decides what NaN ranks as) and, with
    ``absolute``, when ``s`` is not finite; with ``absolute``, ``finite`` is False exactly
    when ``s`` holds NaN or +-Inf anywhere."""
    n = s.size
    work, mask = _scratch(n)
    if absolute:
        _np.abs(s, out=work)
    else:
        _np.copyto(work, s)
    work.partition(n - k)
    top = work[n - k:]
    if _np.isnan(top).any():
        return None, False
    finite = bool(_np.isfinite(top).all())
    if absolute and not finite:        # the caller sends every index
        return None, False
    v = work[n - k]
    if absolute:                       # (the partitioned values are not needed any more)
        from ..kernels.compact import NUMPY_CHUNK, abs_above_cpu
        abs_above_cpu(s, v, inclusive=True, out=mask, buf=work[:NUMPY_CHUNK])
    else:
        _np.greater_equal(s, v, out=mask)
    idx = _np.flatnonzero(mask)
    if len(idx) > k:                   # more ties at v than places left for them
        picked = _np.abs(s[idx]) if absolute else s[idx]
        keep = picked > v
        keep[_np.flatnonzero(~keep)[:k - int(keep.sum())]] = True
        idx = idx[keep]
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
