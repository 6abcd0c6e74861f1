"""PyTorch primitives, core family: dtypes, shapes, index ranges and the seeded draws
(the same on every rank), gather / scatter, casts, control flow, error feedback's buffers
and small tensor helpers.

May import: torch; lazily, :mod:`hvd_compress.memory` (``new_store``).  Not the other
families of this package (they import this one).
"""
import itertools as _itertools
import math as _math

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
    """``min(k, n)`` distinct int32 indices of ``range(n)``, a uniformly random subset in
    a random order, a pure function of ``(seed, step)``: the same on every rank and every
    device (:func:`random_indices_segments` with one tensor)."""
    return random_indices_segments((n,), (k,), seed, [step], like)


# A counter-based generator in int64 torch ops, so that the draws of a whole bucket are a
# fixed number of ops on any device and equal on the CPU and CUDA.  Draw j of a tensor
# whose (seed, step) mixes to the 64-bit word (hi, lo): the 53-bit key
#   key_j = (H(H(2j ^ lo) ^ hi) << 21) | (H(H(2j + 1 ^ lo) ^ hi) >> 11),
# H = lowbias32 (C. Wellons' 32-bit integer hash, a bijection), uniform index
# floor(key_j n / 2^53).  k <= n / 2: the first k distinct indices of draws 0, 1, 2, ...
# -- a uniformly random k-subset (draws are exchangeable), O(k log k); the prefix read is
# 1.1 n ln(n / (n - k)) + 64 draws (k distinct take n ln(n / (n - k)) on average), doubled
# (one host synchronisation a bucket says whether it held enough) until it holds k
# distinct, so the answer does not depend on the prefix.  Else the positions of the k
# smallest of the n distinct keys (key_j >> 21) << 31 | j (a 32-bit hash, ties by position).

_M32 = 0xFFFFFFFF


def _mul32(x, c):
    """``x * c mod 2^32`` for int64 ``x`` in [0, 2^32) and a 32-bit constant ``c``, with
    no int64 overflow (``c`` in two 16-bit halves)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _hash32(x):
    """lowbias32: a bijection of [0, 2^32) that mixes every bit (int64 in, int64 out)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _keys53(j, lo, hi):
    """53-bit keys (int64) of counters ``j`` (< 2^31) under key words ``lo``, ``hi``."""
    a = _hash32(_hash32((2 * j) ^ lo) ^ hi)
    b = _hash32(_hash32((2 * j + 1) ^ lo) ^ hi)
    return (a << 21) | (b >> 11)


def _segment_table(sizes, device):
    """``(segment of each entry, its counter within the segment)`` for host ``sizes``,
    made on ``device`` (no blocking copy)."""
    sizes_t = _host_list(sizes, device)
    seg = _torch.repeat_interleave(_torch.arange(len(sizes), device=device), sizes_t,
                                   output_size=sum(sizes))
    start = _torch.cumsum(sizes_t, 0) - sizes_t
    return seg, _torch.arange(seg.numel(), device=device) - start[seg]


_CACHE = {}


def _cached(what, values, device, make):
    """``make()`` once per (what, values, device), kept in a bounded cache: the constants
    of a model's bucket layouts (the other families use it too)."""
    key = (what, tuple(values), str(device))
    got = _CACHE.get(key)
    if got is None:
        if len(_CACHE) > 1024:
            _CACHE.clear()
        got = _CACHE[key] = make()
    return got


def _host_list(values, device, dtype=_torch.int64):
    """A small host list on ``device`` without a blocking copy (pinned where CUDA)."""
    t = _torch.tensor(values, dtype=dtype)
    if _torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _constant(values, device):
    """:func:`_host_list` of a layout's constant (offsets, sizes, k), copied once."""
    return _cached("list", values, device, lambda: _host_list(values, device))


def _starts(sizes):
    """Where each of ``sizes`` starts when they are laid end to end (exclusive sums)."""
    return [0, *_itertools.accumulate(sizes)][:len(sizes)]


def random_indices_segments(numels, ks, seed, steps, like=None):
    """int32 indices into a bucket of tensors of ``numels`` (end to end): for tensor
    ``i``, ``min(ks[i], numels[i])`` distinct indices drawn with ``(seed, steps[i])``
    (offset to the bucket), tensor by tensor; what :func:`random_indices` gives each
    tensor alone.  A fixed number of ops for the whole bucket; one host synchronisation
    where some tensor has ``k <= n / 2``."""
    device = like.device if like is not None else _torch.device("cpu")
    offsets = _starts([int(n) for n in numels])
    ks = [min(int(k), int(n)) for k, n in zip(ks, numels)]
    words = [_mix(seed, int(s)) for s in steps]
    drawn = [i for i, (n, k) in enumerate(zip(numels, ks)) if k and 2 * k <= n]
    keyed = [i for i, (n, k) in enumerate(zip(numels, ks)) if k and 2 * k > n]
    out = _torch.empty(sum(ks) + 1, dtype=_torch.int64, device=device)   # + a spare slot
    starts = _starts(ks)
    for group, fill in ((drawn, _first_distinct), (keyed, _smallest_keys)):
        if group:
            fill(out, [int(numels[i]) for i in group], [ks[i] for i in group],
                 [offsets[i] for i in group], [starts[i] for i in group],
                 [words[i] for i in group], device)
    return out[:-1].to(_torch.int32)


def _word_columns(words, seg, device):
    """The (lo, hi) key words of each entry, from one word per segment."""
    w = _host_list([[x & _M32, x >> 32] for x in words], device)
    return w[:, 0][seg], w[:, 1][seg]


def _first_distinct(out, numels, ks, offsets, starts, words, device):
    """Tensors with ``k <= n / 2``: the first k distinct of their draws, into ``out``."""
    reads = [int(1.1 * n * _math.log(n / (n - k))) + 64 for n, k in zip(numels, ks)]
    keep = True                        # a layout's first prefix: its tables kept
    while True:
        ends = [s + r - 1 for s, r in zip(_starts(reads), reads)]
        if keep:
            seg, j = _cached("draws", reads, device, lambda: _segment_table(reads, device))
            ends = _constant(ends, device)
        else:                          # (rare: not kept)
            seg, j = _segment_table(reads, device)
            ends = _host_list(ends, device)
        lo, hi = _word_columns(words, seg, device)
        n = _constant(numels, device)[seg]
        idx = _torch.minimum((_keys53(j, lo, hi).double() * n / 2.0**53).long(), n - 1)
        idx = idx + _constant(offsets, device)[seg]             # disjoint ranges per tensor
        ordered, order = _torch.sort(idx, stable=True)           # equal draws: first first
        first = _torch.ones_like(ordered, dtype=_torch.bool)
        first[1:] = ordered[1:] != ordered[:-1]
        new = _torch.empty_like(first).scatter_(0, order, first)     # in draw order
        seen = _torch.cumsum(new.long(), 0)
        before = _torch.cat([seen.new_zeros(1), seen[ends][:-1]])
        k_t = _constant(ks, device)
        if bool(((seen[ends] - before) >= k_t).all()):                 # the one sync
            break
        reads, keep = [2 * r for r in reads], False             # a longer prefix, same answer
    rank = seen - before[seg] - 1
    _place(out, new & (rank < k_t[seg]), rank, seg, starts, idx, device)


def _smallest_keys(out, numels, ks, offsets, starts, words, device):
    """Tensors with ``k > n / 2``: the positions of the k smallest of n distinct keys
    ``(32-bit hash << 31) | position``, in key order."""
    seg, j = _segment_table(numels, device)                 # n entries each: not kept
    lo, hi = _word_columns(words, seg, device)
    keys = ((_keys53(j, lo, hi) >> 21) << 31) | j
    if len(numels) == 1:
        _place(out, _torch.ones(ks[0], dtype=_torch.bool, device=device),
               _torch.arange(ks[0], device=device), seg[:ks[0]], starts,
               _torch.topk(keys, ks[0], largest=False, sorted=True).indices + offsets[0], device)
        return
    order = _torch.sort(keys).indices
    order = order[_torch.sort(seg[order], stable=True).indices]   # by tensor, then key
    seg_o = seg[order]
    rank = _torch.arange(order.numel(), device=device) - _constant(_starts(numels), device)[seg_o]
    idx = j[order] + _constant(offsets, device)[seg_o]
    _place(out, rank < _constant(ks, device)[seg_o], rank, seg_o, starts, idx, device)


def _place(out, take, rank, seg, starts, values, device):
    """``out[starts[seg] + rank] = values`` where ``take``, the rest into ``out``'s last
    (spare) slot; no host synchronisation."""
    slot = _constant(starts, device)[seg] + rank
    out.scatter_(0, _torch.where(take, slot, out.numel() - 1), values)


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
    the device at once (``stats``, int64 ``[2]``; None when there is no index), read back
    with another host readback where the decode makes one anyway (``read``), else on its
    own, one host synchronisation; ``finish`` raises the ValueError, after the decoder's
    own checks."""

    def __init__(self, idx, n, what):
        self.n, self.what, self.bounds = n, what, None
        flat = idx.reshape(-1)
        self.stats = _torch.stack(_torch.aminmax(flat)).to(_torch.int64) if flat.numel() else None

    def read(self, lo, hi):
        """The host's ``(min, max)``, read back with something else."""
        self.bounds = (lo, hi)

    def finish(self):
        """Raise the ValueError unless every index is in ``[0, n)``."""
        if self.stats is None:
            return
        lo, hi = self.bounds if self.bounds is not None else self.stats.tolist()   # one sync
        if lo < 0 or hi >= self.n:
            raise ValueError(
                f"{self.what}: payload index out of range [0, {self.n}) (min {lo}, max {hi}); "
                "the payload is malformed or was produced for another tensor")


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
