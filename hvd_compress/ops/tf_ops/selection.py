"""TensorFlow primitives, selection family: top-k and index sets, threshold selection
(sums, counts and compaction above thresholds, the bit-space search helpers and
laplace_topk's size cut-offs; TensorFlow references of the Triton kernels), random samples
and moments (dgc, gaussian_k, sidco_exp), convolution kernels as rows (kernel_select) and
the distinct indices of the aggregation-aware exchange.

May import: tensorflow, :mod:`.core`.  Never torch or :mod:`hvd_compress.kernels`.
"""
import tensorflow as _tf

from .core import gather, numel


# -- top-k and index sets ----------------------------------------------------------------

def topk_indices(scores, k):
    if scores.dtype in (_tf.float16, _tf.bfloat16):
        scores = _tf.cast(scores, _tf.float32)
    return _tf.math.top_k(scores, k=k, sorted=False).indices


def where_indices(mask):
    return _tf.cast(_tf.reshape(_tf.where(mask), [-1]), _tf.int32)


def mask_indices(mask):
    return _tf.reshape(_tf.where(mask), [-1])


# -- threshold selection and the bit-space search ----------------------------------------

def abs_sum_max(t):
    a = _tf.abs(_tf.cast(t, _tf.float32))
    if t.shape.num_elements() == 0:
        return _tf.constant(0.0), _tf.constant(0.0)
    # (a length known only at run time, e.g. sidco_exp's candidates in tf.function:
    # the max of magnitudes and 0, so an empty one gives 0)
    return _tf.reduce_sum(a), _tf.reduce_max(_tf.concat([_tf.reshape(a, [-1]), [0.0]], 0))


def count_above(t, thresholds):
    a = _tf.abs(_tf.cast(t, _tf.float32))
    thr = _tf.reshape(_tf.cast(thresholds, _tf.float32), [-1])
    # counts[j] = #{a > thr_j}, one comparison pass per threshold
    return _tf.map_fn(lambda x: _tf.math.count_nonzero(a > x, dtype=_tf.int64), thr,
                      fn_output_signature=_tf.int64)


def compact_above(t, threshold):
    a = _tf.abs(_tf.cast(t, _tf.float32))
    idx = _tf.cast(_tf.reshape(_tf.where(a > _tf.cast(threshold, _tf.float32)), [-1]), _tf.int32)
    return _tf.gather(t, idx), idx


def shrink_candidates(t):
    return True


def float_bits(t):
    return _tf.cast(_tf.bitcast(_tf.cast(t, _tf.float32), _tf.int32), _tf.int64)


def bits_float(b):
    return _tf.bitcast(_tf.cast(b, _tf.int32), _tf.float32)


def grid_fractions(g, like):
    return _tf.range(1, g + 1, dtype=_tf.int64)


# -- random samples and moments (dgc, gaussian_k, sidco_exp) -----------------------------

def random_sample(t, m, seed, step):
    """``m`` entries of 1-D ``t`` drawn uniformly *with replacement* (all of ``t`` when
    ``m >= numel(t)``), a pure function of ``(seed, step)``: O(m), no permutation of
    ``t``'s positions (the torch primitive's draws differ)."""
    n = numel(t)
    if m >= n:
        return t
    seed_t = _tf.stack([_tf.cast(seed % 2**63, _tf.int64), _tf.cast(step, _tf.int64)])
    dtype = _tf.int32 if n < 2**31 else _tf.int64
    idx = _tf.random.stateless_uniform([int(m)], seed=seed_t, minval=0, maxval=n, dtype=dtype)
    return gather(t, idx)


def moments(t):
    mean, var = _tf.nn.moments(_tf.cast(t, _tf.float32), axes=[0])
    return mean, _tf.sqrt(var)


# -- laplace_topk's cut-offs -------------------------------------------------------------

def small_topk_below(t):
    """Tensors smaller than this take tf.math.top_k in laplace_topk.  Measured on one CPU
    core inside tf.function (2026-11-22, density 0.01): top_k 1.1 / 3.4 ms against the
    search's 3.7 / 5.1 ms at 66k / 235k values; the search wins at 1M (10 vs 14 ms) and
    4M (25 vs 56 ms)."""
    return 1 << 18


def search_grid(t):
    return 8


# -- aggregation-aware exchange (compressors/aggregation.py) -----------------------------

def unique_sorted(idx):
    """The distinct values of 1-D int32 ``idx``, ascending."""
    return _tf.sort(_tf.unique(idx).y)


# -- convolution kernels as rows (kernel_select) -----------------------------------------

def kernel_matrix(flat, shape):
    """Keras convolution kernel (*kernel, in, out) as rows: (in * out, prod(kernel))."""
    ksize = 1
    for d in shape[:-2]:
        ksize *= int(d)
    return _tf.transpose(_tf.reshape(flat, [ksize, -1]))


def from_kernel_matrix(rows, shape):
    return _tf.reshape(_tf.transpose(rows), [-1])


def row_norms(rows):
    return _tf.norm(_tf.cast(rows, _tf.float32), axis=1)
