"""PyTorch primitives, core family: dtypes, shapes, index ranges and the seeded draws
(the same on every rank), gather / scatter, casts, control flow, error feedback's buffers
and small tensor helpers.

May import: torch; lazily, :mod:`hvd_compress.memory` (``new_store``).  Not the other
families of this package (they import this one).
"""
import torch as _torch


float32 = _torch.float32
float16 = _torch.float16
bfloat16 = _torch.bfloat16
int16 = _torch.int16
int8 = _torch.int8
uint8 = _torch.uint8
int32 = _torch.int32
int64 = _torch.int64


# -- shape and dtype ---------------------------------------------------------------------

def flatten(t):
    return t.reshape(-1)


def numel(t):
    return int(t.numel())


def shape(t):
    return tuple(t.shape)


def is_floating(t):
    return t.is_floating_point()


def all_finite(t):
    # min and max propagate NaN and are +-Inf when any entry is: 30x faster on the CPU
    # than isfinite(t).all(), which materialises a mask.
    if t.numel() == 0:
        return True
    lo, hi = _torch.aminmax(t.reshape(-1))
    return bool(_torch.isfinite(lo) & _torch.isfinite(hi))


def abs(t):  # noqa: A001 - mirrors the framework name
    return t.abs()


# -- index ranges and seeded draws (the same on every rank) ------------------------------

def arange(n, like=None):
    device = like.device if like is not None else None
    return _torch.arange(n, dtype=_torch.int32, device=device)


def _mix(seed, step):
    # SplitMix64-style mix of (seed, step) into a 63-bit generator seed.
    x = (int(seed) * 0x9E3779B97F4A7C15 + int(step) + 0x632BE59BD9B4E019) & (2**64 - 1)
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return (x ^ (x >> 31)) & (2**63 - 1)


def random_indices(n, k, seed, step, like=None):
    """``k`` distinct int32 indices of ``range(n)``, a uniformly random k-subset and a
    pure function of ``(seed, step)``, drawn on ``like``'s device by its generator (CPU
    and CUDA draws differ).  For ``k <= n / 16`` (randomk's densities): the first ``k``
    distinct values of i.i.d. uniform draws, O(k log k) and no permutation of all ``n``
    positions (``randperm(n)`` on the CPU took 0.8 s at 25M); else a permutation's first
    ``k``."""
    device = like.device if like is not None else _torch.device("cpu")
    gen = _torch.Generator(device=device)
    gen.manual_seed(_mix(seed, int(step)))
    k = int(k)
    if 16 * k > n:
        return _torch.randperm(n, generator=gen, device=device)[:k].to(_torch.int32)
    m = k + k // 8 + 64
    draws = _torch.randint(n, (m,), generator=gen, device=device)
    while True:
        uniq, inverse = _torch.unique(draws, return_inverse=True)
        if uniq.numel() >= k:
            break
        draws = _torch.cat([draws, _torch.randint(n, (m,), generator=gen, device=device)])
    first = _torch.full((uniq.numel(),), draws.numel(), dtype=_torch.int64, device=device)
    first.scatter_reduce_(0, inverse, _torch.arange(draws.numel(), device=device), "amin")
    return uniq[_torch.argsort(first)[:k]].to(_torch.int32)


def uniform(n, seed, step, like):
    """``n`` float32 draws from U[0, 1), a pure function of ``(seed, step)`` (on
    ``like``'s device, whose generator makes them: CPU and CUDA draws differ)."""
    gen = _torch.Generator(device=like.device)
    gen.manual_seed(_mix(seed, int(step)))
    return _torch.rand(n, generator=gen, device=like.device, dtype=_torch.float32)


# -- gather, scatter, casts --------------------------------------------------------------

def gather(t, idx):
    return t[idx.long()]


def scatter_sum(n, idx, values, dtype=float32):
    out = _torch.zeros(n, dtype=dtype, device=values.device)
    if idx.numel():
        out.index_add_(0, idx.long(), values.to(dtype))
    return out


class IndexCheck:
    """The range check of a payload's indices, ``[0, n)``: its ``(min, max)`` computed on
    the device at once (``stats``, int64 ``[2]``; None when there is no index); read back
    with another host readback where the decode makes one anyway (``verify``), else on
    its own, one host synchronisation (``finish``)."""

    def __init__(self, idx, n, what):
        self.n, self.what = n, what
        flat = idx.reshape(-1)
        self.stats = _torch.stack(_torch.aminmax(flat)).to(_torch.int64) if flat.numel() else None

    def verify(self, lo, hi):
        """Raise the ValueError unless ``lo >= 0`` and ``hi < n`` (host ints)."""
        self.stats = None
        if lo < 0 or hi >= self.n:
            raise ValueError(
                f"{self.what}: payload index out of range [0, {self.n}) (min {lo}, max {hi}); "
                "the payload is malformed or was produced for another tensor")

    def finish(self):
        """The check, if no readback has verified it yet."""
        if self.stats is not None:
            self.verify(*self.stats.tolist())                     # one host sync


def index_check(idx, n, what):
    return IndexCheck(idx, n, what)


def check_indices(idx, n, what):
    IndexCheck(idx, n, what).finish()


def cast(t, dtype):
    return t.to(dtype)


def bitcast(t, dtype):
    return t.view(dtype)


# -- control flow (graph-safe in TensorFlow) ---------------------------------------------

def cond(pred, f, g):
    return f() if bool(pred) else g()


def select(pred, a, b):
    return a if bool(pred) else b


# -- sizes -------------------------------------------------------------------------------

def size_bytes(t):
    return int(t.numel()) * t.element_size()


def count64(t):
    """Number of elements (a python int; an int64 tensor in TensorFlow)."""
    return int(t.numel())


def dtype_size(dtype):
    """Bytes per element of ``dtype``."""
    return _torch.empty((), dtype=dtype).element_size()


def zeros(n, dtype, like=None):
    return _torch.zeros(n, dtype=dtype, device=like.device if like is not None else None)


# -- error feedback's buffers ------------------------------------------------------------

def supports_inplace():
    """Error feedback may update its buffers in place (see memory.ResidualMemory)."""
    return True


def add_into(a, b, out):
    """``a + b`` written into ``out``."""
    return _torch.add(a, b, out=out)


def subtract(a, b, inplace=False):
    """``a - b``, in place on ``a`` when ``inplace``."""
    return a.sub_(b) if inplace else a - b


def subtract_at(a, idx, values, inplace=False):
    """``a - cast(scatter_sum(len(a), idx, values))`` for *distinct* ``idx``, touching only
    those entries (the same bits: ``0.0 + v`` is what the scatter into zeros holds)."""
    out = a if inplace else a.clone()
    if idx.numel():
        i = idx.long()
        out.index_put_((i,), a[i] - (0.0 + values.float()).to(a.dtype))
    return out


def new_store():
    from ...memory import TorchStore
    return TorchStore()


# -- small tensor helpers ----------------------------------------------------------------

def sum_rows(t, n):
    """Sum of the rows of ``t`` viewed as (len(t) // n, n)."""
    return t.reshape(-1, n).sum(0)


def length(t):
    return int(t.shape[0])


def reshape(t, shape):
    return t.reshape(shape)


def to_float32(t):
    return t.float()


def scalar(value, like):
    return _torch.as_tensor(value, device=like.device)


def where(cond, a, b):
    return _torch.where(cond, a, b)


def reduce_max(t):
    return t.max()


def reduce_min(t):
    return t.min()


def cumsum(t):
    return _torch.cumsum(t, 0)


def reduce_sum_int(mask):
    return mask.sum(dtype=_torch.int64)


def host_bool(t):
    """Python bool of a 0-d tensor (a host synchronisation on CUDA)."""
    return bool(t)


def ones_like(t, dtype):
    return _torch.ones(t.shape, dtype=dtype, device=t.device)


def head(t, n):
    return t[:n]


def stack_int32(values, like):
    return _torch.stack([v.to(_torch.int32) if hasattr(v, "to")
                         else _torch.tensor(v, dtype=_torch.int32, device=like.device)
                         for v in values]).to(like.device)


def repeat_interleave(values, repeats):
    return _torch.repeat_interleave(values, repeats.to(_torch.int64))


def constant(array, like):
    """A float32 tensor on ``like``'s device from a numpy array."""
    return _torch.as_tensor(array, dtype=_torch.float32).to(like.device)
