"""TensorFlow primitives, selection family: top-k and index sets, threshold selection
(sums, counts and compaction above thresholds, the bit-space search helpers and
laplace_topk's size cut-offs; TensorFlow references of the Triton kernels), random samples
and moments (dgc, gaussian_k, sidco_exp), convolution kernels as rows (kernel_select) and
the distinct indices of the aggregation-aware exchange.

May import: tensorflow, :mod:`.core`, :mod:`hvd_compress.ops._cpu_topk` (numpy).  Never
torch or :mod:`hvd_compress.kernels`.
"""
import functools as _functools

import tensorflow as _tf

from .. import _cpu_topk
from .core import _eager_on_cpu, gather, numel


# -- top-k and index sets ----------------------------------------------------------------

def topk_indices(scores, k):
    """int32 indices of the ``k`` largest of 1-D ``scores`` (in no particular order).

    Eager CPU tensors: numpy's introselect in a reused buffer, then one compare pass
    (:func:`hvd_compress.ops._cpu_topk.indices`; ties by lowest index, as
    ``tf.math.top_k``'s): 21-23 ms for k = 63K of 6.3M float32 values here (2026-11-25),
    against 73-75 ms for ``tf.math.top_k``; from 1M to 25M values the compressor
    ``topk`` was 2.8-3.8x faster at density 0.01 and 0.88-1.8x at 0.001
    (``benchmarks/results/select_tf_cpu_2026-11-25.json``).  Inside ``tf.function`` and
    on GPUs ``tf.math.top_k`` (see ``core._eager_on_cpu`` for why not numpy there);
    inside ``tf.function`` on a machine without a GPU, from ``_cpu_topk.PREFILTER_MIN``
    values up, :func:`_sampled_topk` first."""
    if scores.dtype in (_tf.float16, _tf.bfloat16):
        scores = _tf.cast(scores, _tf.float32)
    n = scores.shape.num_elements()
    if scores.dtype == _tf.float32 and n is not None and 0 < k < n and _eager_on_cpu(scores):
        return _tf.constant(_cpu_topk.indices(scores.numpy().reshape(-1), k))
    if n is not None and _cpu_topk.prefilter(n, k) and _graph_on_cpu(scores):
        return _sampled_topk(_tf.reshape(scores, [-1]), k)
    return _tf.math.top_k(scores, k=k, sorted=False).indices


def _graph_on_cpu(t):
    """Tracing a ``tf.function`` for the CPU: no GPU that TensorFlow sees, ``t`` not
    placed on one."""
    return not _tf.executing_eagerly() and "GPU" not in t.device and not _gpus()


@_functools.lru_cache(maxsize=None)
def _gpus():
    return bool(_tf.config.list_logical_devices("GPU"))


def _sampled_topk(s, k):
    """``tf.math.top_k(s, k).indices`` of 1-D float32 ``s`` (the same set: ties by
    lowest index), in TensorFlow ops: step 0 of :mod:`hvd_compress.ops._cpu_topk` with its
    sample and rank.  ``t`` = the ``r``-th largest of 1 value in 61; when at least ``k``
    values are at or above it and none is NaN, the top-k of those candidates (in index
    order), else of all of ``s``.  Inside ``tf.function`` on one core here (2026-11-28,
    Gaussian magnitudes): 6.3M values at k = 1%, 85.4 -> 14.3 ms against
    ``tf.math.top_k``; at 0.1%, 26.0 -> 8.9 ms; 1.31M at 1%, 13.7 -> 3.1 ms."""
    n = s.shape.num_elements()
    m = -(-n // _cpu_topk.SAMPLE_STRIDE)
    r = _cpu_topk.sample_rank(m, n, k)
    t = _tf.reduce_min(_tf.math.top_k(s[::_cpu_topk.SAMPLE_STRIDE], k=r, sorted=False).values)
    above = s >= t
    enough = (_tf.math.count_nonzero(above, dtype=_tf.int64) >= k) & \
        ~_tf.reduce_any(_tf.math.is_nan(s))

    def candidates():
        idx = _tf.cast(_tf.reshape(_tf.where(above), [-1]), _tf.int32)
        return _tf.gather(idx, _tf.math.top_k(_tf.gather(s, idx), k=k, sorted=False).indices)

    return _tf.cond(enough, candidates, lambda: _tf.math.top_k(s, k=k, sorted=False).indices)


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
    """Tensors smaller than this take the framework's top-k in laplace_topk
    (:func:`topk_indices`: the sampled threshold and numpy's partition on eager CPU
    tensors, the same in TensorFlow ops inside ``tf.function`` on the CPU, else
    ``tf.math.top_k``).

    Inside ``tf.function`` on the CPU: 2^25.  2 threads, TensorFlow 2.21, 2026-11-28
    (the same three inputs and two densities, 256K to 25M values; ``benchmarks/select.py
    --framework tensorflow --graph``, ``select_tf_graph_sampled_2026-11-28.json``): the
    sampled top-k was faster than the search in 23 of 24 cases (1.03-3.7x); the search
    was 1.08x faster at 6.3M, density 0.001, Gaussian data; ``tf.math.top_k`` was
    1.2-8.7x slower than the sampled top-k.

    Eager on the CPU: 2^25.  2 threads, TensorFlow 2.21, 2026-11-25 (Laplace, Gaussian
    and Student-t(2) data, densities 0.001 and 0.01, 1M to 25M values;
    ``benchmarks/select.py --framework tensorflow``,
    ``benchmarks/results/select_tf_cpu_2026-11-25.json``): the partition was faster than
    the search in all 36 cases (1.1-15x).

    On GPUs: 2^18, as inside ``tf.function`` on the CPU before the sampled threshold (one
    CPU core, 2026-11-22, density 0.01: ``tf.math.top_k`` 1.1 / 3.4 ms against the
    search's 3.7 / 5.1 ms at 66k / 235k values; the search won at 1M (10 vs 14 ms) and
    4M (25 vs 56 ms)); not measured on a GPU."""
    return 1 << 25 if _eager_on_cpu(t) or _graph_on_cpu(t) else 1 << 18


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
