"""TensorFlow primitives, segments family: buckets, tensors end to end with one result
per tensor (segment): concat / split, segment ids, per-segment sums, maxima, counts above
thresholds and compaction, and the choice of the segmented search.

May import: numpy, tensorflow, :mod:`.core`, :mod:`hvd_compress.ops._cpu_topk`.  Never
torch or :mod:`hvd_compress.kernels`.
"""
import numpy as _np
import tensorflow as _tf

from .. import _cpu_topk
from .core import _eager_on_cpu


def concat(ts):
    # (no reshape of what is already flat: a Reshape and a Const a part, in a bucket's
    # graph some 16 ops a tensor)
    ts = [t if t.shape.rank == 1 else _tf.reshape(t, [-1]) for t in ts]
    return ts[0] if len(ts) == 1 else _tf.concat(ts, 0)


def split(flat, lengths):
    return _tf.split(flat, list(lengths))


def split_cols(t, widths):
    """``t`` (rows, sum(widths)) cut into column blocks of ``widths``: one op, not a
    strided slice (and its three constants) a block."""
    return _tf.split(t, list(widths), axis=1)


def segment_ids(layout, like):
    lengths = _tf.constant(layout.numels, dtype=_tf.int32)
    return _tf.repeat(_tf.range(len(layout.numels), dtype=_tf.int32), lengths)


def layout_constant(what, layout, values, dtype, like):
    """A small per-tensor constant of a bucket (k, n, ...): the list ``values()`` returns
    (a graph constant inside tf.function; nothing to cache)."""
    return _tf.constant(list(values()), dtype=dtype)


def segment_abs_sum_max(flat, layout, add=None, source=None):
    if add is not None or source is not None:   # (error feedback defers it on PyTorch only)
        raise NotImplementedError("segment_abs_sum_max(add=) writes in place: PyTorch only")
    # each tensor reduced on its own (one op each, as a tensor alone is, so the same
    # sums): a segment sum took 4-7x as long on the CPU, 2026-12-01
    parts = _tf.split(_tf.abs(_tf.cast(_tf.reshape(flat, [-1]), _tf.float32)),
                      list(layout.numels))
    zero = _tf.constant(0.0)
    return (_tf.stack([_tf.reduce_sum(p) if n else zero for p, n in zip(parts, layout.numels)]),
            _tf.stack([_tf.reduce_max(p) if n else zero for p, n in zip(parts, layout.numels)]))


def segment_count_above(a, seg, thresholds):
    above = _tf.cast(a, _tf.float32)[:, None] > _tf.gather(_tf.cast(thresholds, _tf.float32), seg)
    return _tf.math.unsorted_segment_sum(_tf.cast(above, _tf.int64), seg, _tf.shape(thresholds)[0])


def segment_compact_above(flat, thresholds, seg, layout):
    a = _tf.abs(_tf.cast(flat, _tf.float32))
    idx = _tf.cast(_tf.reshape(_tf.where(a > _tf.gather(_tf.cast(thresholds, _tf.float32), seg)),
                               [-1]), _tf.int32)
    return _tf.gather(flat, idx), idx


def segment_sum_int(values, seg, segments):
    return _tf.math.unsorted_segment_sum(_tf.cast(values, _tf.int64), seg, segments)


def rows_max(t):
    return _tf.reduce_max(t, axis=1)


def rows_min(t):
    return _tf.reduce_min(t, axis=1)


def host_all(t):
    """Python bool when executing eagerly; False (unknown) inside tf.function."""
    return bool(_tf.reduce_all(t)) if _tf.executing_eagerly() else False


def segment_counts(seg, segments):
    return _tf.math.bincount(seg, minlength=segments, maxlength=segments, dtype=_tf.int64)


def stack_cols(ts):
    return _tf.stack(ts, 1)


def split_sizes(t, sizes, n):
    return _tf.split(t, _tf.cast(sizes, _tf.int64), num=n)


def segmented_search(t, exact):
    """One search for a bucket's tensors (as in PyTorch: exact=1 on the CPU; always
    inside tf.function, where a Python loop per tensor only adds graph nodes)."""
    return bool(exact or not _tf.executing_eagerly())


def segment_abs_topk(flat, numels, ks, drop_zeros=False):
    """``(int32 indices, finite)``: the ``ks[i]`` largest ``|x|`` of each tensor ``i`` of
    ``flat`` (without zeros with ``drop_zeros``) and whether ``flat`` holds no NaN/Inf (a
    Python bool), from one numpy partition per tensor
    (:func:`hvd_compress.ops._cpu_topk.segment_abs_largest`; every index when not
    finite), as in PyTorch.  Eager CPU tensors only (see ``core._eager_on_cpu``); None
    elsewhere, and the caller checks, then selects."""
    if not (flat.dtype.is_floating and _eager_on_cpu(flat)):
        return None
    x = _np.asarray(flat.numpy(), dtype=_np.float32).reshape(-1)
    idx, finite = _cpu_topk.segment_abs_largest(x, numels, ks, drop_zeros)
    return _tf.constant(idx.astype(_np.int32)), finite


# -- laplace_topk's fused search: PyTorch only (its kernels are Triton's) -----------------

def histogram_search_supported():
    """Can this framework run the fused histogram search?  Not TensorFlow."""
    return False


def _torch_only(*_args, **_kw):
    raise NotImplementedError("laplace_topk's fused search (fused=1) runs on PyTorch tensors only")


bucket_blocks = search_start = _torch_only
histogram_step = band_select = padded_slots = _torch_only
warm_brackets = keep_brackets = warm_search_start = _torch_only
