"""TensorFlow primitives, core family: dtypes, shapes, index ranges and the seeded draws
(the same on every rank), gather / scatter, casts, control flow, error feedback's buffers
and small tensor helpers.

May import: tensorflow; lazily, :mod:`hvd_compress.memory` (``new_store``).  Not the
other families of this package (they import this one).
"""
import contextlib as _contextlib

import tensorflow as _tf


float32 = _tf.float32
float16 = _tf.float16
bfloat16 = _tf.bfloat16
int16 = _tf.int16
int8 = _tf.int8
uint8 = _tf.uint8
int32 = _tf.int32
int64 = _tf.int64


# -- shape and dtype ---------------------------------------------------------------------

def flatten(t):
    return _tf.reshape(t, [-1])


def numel(t):
    n = t.shape.num_elements()
    if n is None:
        raise ValueError("hvd_compress needs tensors of static shape in TensorFlow, "
                         f"got shape {t.shape}")
    return int(n)


def shape(t):
    return tuple(t.shape.as_list())


def is_floating(t):
    return t.dtype.is_floating


def all_finite(t):
    if numel(t) == 0:
        return _tf.constant(True)
    return _tf.reduce_all(_tf.math.is_finite(t))


def abs(t):  # noqa: A001
    return _tf.abs(t)


# -- index ranges and seeded draws (the same on every rank) ------------------------------

def arange(n, like=None):
    return _tf.range(n, dtype=_tf.int32)


def random_indices(n, k, seed, step, like=None):
    seed_t = _tf.stack([_tf.cast(seed, _tf.int64), _tf.cast(step, _tf.int64)])
    keys = _tf.random.stateless_uniform([n], seed=seed_t)
    return _tf.math.top_k(keys, k=k, sorted=False).indices


def random_indices_segments(numels, ks, seed, steps, like=None):
    """Each tensor's :func:`random_indices` (offset into the bucket), tensor by tensor."""
    parts, offset = [], 0
    for n, k, step in zip(numels, ks, steps):
        k = min(int(k), int(n))
        if k:
            parts.append(random_indices(n, k, seed, step, like) + offset)
        offset += int(n)
    return _tf.concat(parts, 0) if parts else _tf.zeros([0], _tf.int32)


def uniform(n, seed, step, like):
    """``n`` float32 draws from U[0, 1), a pure function of ``(seed, step)``."""
    seed_t = _tf.stack([_tf.cast(seed % 2**63, _tf.int64), _tf.cast(step, _tf.int64)])
    return _tf.random.stateless_uniform([n], seed=seed_t, dtype=_tf.float32)


# -- gather, scatter, casts --------------------------------------------------------------

def gather(t, idx):
    return _tf.gather(t, idx)


def _eager_on_cpu(t):
    """Executing eagerly, with ``t`` on the CPU?  (The numpy fast paths run only then:
    inside ``tf.function`` they would go through ``tf.numpy_function``, and under
    ``horovodrun`` with 2 workers on 2 cores that made a 6.3M-parameter model's step
    take 350-440 ms in about half the launches, against 90-100 ms in the others and
    140-150 ms with ``tf.math.top_k``, 2026-11-25.)"""
    return _tf.executing_eagerly() and "CPU" in t.device


def summing_ranks(ranks, rows=None, equal=False):
    """PyTorch's bound on the values meeting at an index (:func:`scatter_sum` takes none
    here)."""
    return _contextlib.nullcontext()


def rank_rows(part, n):
    """None: :func:`scatter_sum` adds every value at once here (PyTorch's, on CUDA)."""
    return None


def sorted_sum(device, ordered=True, meeting=None):
    """False: :func:`scatter_sum` never sorts here (PyTorch's choice on CUDA)."""
    return False


def scatter_sum(n, idx, values, dtype=float32, ordered=True, meeting=None, segments=None):
    """``values`` summed into ``n`` zeros at ``idx`` (``ordered``, ``meeting``,
    ``segments``: PyTorch's choice on CUDA; TensorFlow's segment sum on a GPU is not
    ordered, see docs/gpu.md)."""
    return _tf.math.unsorted_segment_sum(_tf.cast(values, dtype), idx, n)


def cast(t, dtype):
    return _tf.cast(t, dtype)


def bitcast(t, dtype):
    return _tf.bitcast(t, dtype)


# -- control flow (graph-safe in TensorFlow) ---------------------------------------------

def cond(pred, f, g):
    if isinstance(pred, bool):
        return f() if pred else g()
    return _tf.cond(pred, f, g)


def select(pred, a, b):
    if isinstance(pred, bool):
        return a if pred else b
    return _tf.where(pred, a, b)


# -- sizes -------------------------------------------------------------------------------

def size_bytes(t):
    return _tf.cast(_tf.size(t), _tf.int64) * t.dtype.size


def count64(t):
    """Number of elements as an int64 tensor (a python int in PyTorch)."""
    return _tf.size(t, out_type=_tf.int64)


def dtype_size(dtype):
    """Bytes per element of ``dtype``."""
    return _tf.as_dtype(dtype).size


def zeros(n, dtype, like=None):
    return _tf.zeros([n], dtype=dtype)


# -- error feedback's buffers ------------------------------------------------------------

def supports_inplace():
    """No in-place buffers: state lives in tf.Variables, updated by assign."""
    return False


def add_into(a, b, out):
    """``a + b``; ``out`` is not written (no in-place buffers here: error feedback calls
    this only where :func:`supports_inplace` is true, i.e. in PyTorch)."""
    return a + b


def subtract(a, b, inplace=False):
    return a - b


def scale(a, factor, inplace=False):
    return a * factor


def restore_flagged(new, old, flags):
    """``old`` where any of ``flags`` is non-zero, else ``new`` (a new tensor)."""
    return _tf.where(_tf.reduce_any(_tf.not_equal(flags, 0)), old, new)


def subtract_at(a, idx, values, inplace=False):
    """``a - cast(scatter_sum(len(a), idx, values))`` (``idx`` distinct)."""
    return a - cast(scatter_sum(numel(a), idx, values, float32), a.dtype)


def new_store():
    from ...stores import TFStore
    return TFStore()


# -- small tensor helpers ----------------------------------------------------------------

def sum_rows(t, n):
    """Sum of the rows of ``t`` viewed as (len(t) // n, n) (no rows of nothing: empty)."""
    if isinstance(n, int) and n == 0:
        return _tf.zeros([0], dtype=t.dtype)
    return _tf.reduce_sum(_tf.reshape(t, [-1, n]), axis=0)


def length(t):
    """Static length of 1-D ``t`` when known, else a scalar tensor."""
    n = t.shape[0]
    return int(n) if n is not None else _tf.shape(t)[0]


def reshape(t, shape):
    return _tf.reshape(t, shape)


def to_float32(t):
    return _tf.cast(t, _tf.float32)


def scalar(value, like):
    return _tf.convert_to_tensor(value)


def divide(a, b):
    """``a / b`` (IEEE division; see the torch family's)."""
    return a / b


def where(cond, a, b):
    return _tf.where(cond, a, b)


def reduce_max(t):
    return _tf.reduce_max(t)


def reduce_min(t):
    return _tf.reduce_min(t)


def cumsum(t):
    return _tf.cumsum(t)


def reduce_sum_int(mask):
    return _tf.reduce_sum(_tf.cast(mask, _tf.int64))


def host_bool(t):
    """Python bool when executing eagerly; False (unknown) inside tf.function."""
    return bool(t) if _tf.executing_eagerly() else False


def ones_like(t, dtype):
    return _tf.ones(_tf.shape(t), dtype=dtype)


def head(t, n):
    return t[:n]


def stack_int32(values, like):
    return _tf.stack([_tf.cast(v, _tf.int32) for v in values])


def repeat_interleave(values, repeats, total=None):
    """``values[i]`` repeated ``repeats[i]`` times (``total``, their sum, is not needed)."""
    return _tf.repeat(values, _tf.cast(repeats, _tf.int64))


def constant(array, like):
    """A float32 tensor from a numpy array."""
    return _tf.constant(array, dtype=_tf.float32)
