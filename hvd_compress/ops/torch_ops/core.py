"""PyTorch primitives, core family: dtypes, shapes, index ranges and the seeded draws
(the same on every rank), gather / scatter, casts, control flow, error feedback's buffers
and small tensor helpers.

May import: torch; lazily, its private ``_draws`` (randomk's draws, which use the
layout helpers here) and :mod:`hvd_compress.memory` (``new_store``).  Not the other
families of this package (they import this one).
"""
import contextlib as _contextlib
import itertools as _itertools
import threading as _threading

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


def random_indices(n, k, seed, step, like=None):
    """``min(k, n)`` distinct int32 indices of ``range(n)``, a uniformly random subset, a
    pure function of ``(seed, step)``: the same on every rank and every device
    (:func:`random_indices_segments` with one tensor)."""
    return random_indices_segments((n,), (k,), seed, [step], like)


def random_indices_segments(numels, ks, seed, steps, like=None):
    """int32 indices into a bucket of tensors of ``numels`` (end to end): for tensor
    ``i``, ``min(ks[i], numels[i])`` distinct indices drawn with ``(seed, steps[i])``
    (offset to the bucket); what :func:`random_indices` gives each tensor alone.  The
    generator and its two paths are in ``_draws``."""
    from ._draws import draw_segments
    return draw_segments(numels, ks, seed, steps, like)


def _mix(seed, step):
    # SplitMix64-style mix of (seed, step) into a 63-bit generator seed.
    x = (int(seed) * 0x9E3779B97F4A7C15 + int(step) + 0x632BE59BD9B4E019) & (2**64 - 1)
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return (x ^ (x >> 31)) & (2**63 - 1)


def _word_pairs(words, device):
    """int64 ``[T, 2]`` on ``device``: each 64-bit host word as its ``(lo, hi)`` 32-bit
    halves (the counter-based draws' keys)."""
    return _host_list([[w & 0xFFFFFFFF, (w >> 32) & 0xFFFFFFFF] for w in words], device)


# -- bucket layouts: tables and constants made once (segments and the draws use them) ----

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
    from ...kernels._held import used
    return used(got)                    # (a CUDA graph that reads it keeps it: _held)


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


def uniform(n, seed, step, like):
    """``n`` float32 draws from U[0, 1), a pure function of ``(seed, step)`` (on
    ``like``'s device, whose generator makes them: CPU and CUDA draws differ)."""
    gen = _torch.Generator(device=like.device)
    gen.manual_seed(_mix(seed, int(step)))
    return _torch.rand(n, generator=gen, device=like.device, dtype=_torch.float32)


# -- gather, scatter, casts --------------------------------------------------------------

def _index_vector(idx):
    """``idx`` as ``index_select`` and ``index_add_`` take it: 1-D, int32 or int64 as it is
    (no int64 copy), other integer dtypes cast to int64."""
    idx = idx if idx.dim() == 1 else idx.reshape(-1)
    return idx if idx.dtype in (_torch.int32, _torch.int64) else idx.long()


def gather(t, idx):
    """``t[idx]`` along dimension 0; a 1-D ``idx`` in one op (:func:`_index_vector`)."""
    if idx.dim() == 1:
        return t.index_select(0, _index_vector(idx))
    return t[idx.long()]


class _Summing(_threading.local):
    ranks = None                       #: :func:`summing_ranks`' bound, or None
    rows = None                        #: each payload tensor's rows from each rank, or None
    equal = False                      #: every rank's payload tensors of the same shapes


_SUMMING = _Summing()


@_contextlib.contextmanager
def summing_ranks(ranks, rows=None, equal=False):
    """Decompresses inside sum an aggregate of ``ranks`` ranks' payloads, each rank
    sending an index at most once (the exchange's, :mod:`hvd_compress.exchange.protocol`):
    at most ``ranks`` values meet at an index, the bound :func:`scatter_sum` takes when
    it is given none.  ``rows``: where the transport knows them, ``rows[i][r]`` of the
    aggregate's tensor ``i`` came from rank ``r``; ``equal``: every rank sent tensors of
    the same shapes (a fixed-size payload).  :func:`rank_rows` reads them."""
    before = _SUMMING.ranks, _SUMMING.rows, _SUMMING.equal
    _SUMMING.ranks, _SUMMING.rows, _SUMMING.equal = ranks, rows, bool(equal)
    try:
        yield
    finally:
        _SUMMING.ranks, _SUMMING.rows, _SUMMING.equal = before


def rank_rows(part, n):
    """How many of the ``n`` rows of tensor ``part`` of the aggregate being decompressed
    came from each rank, in rank order (:func:`summing_ranks`); None where that is not
    known, or the counts do not add up to ``n`` (what :func:`scatter_sum` takes as
    ``segments``)."""
    ranks, rows = _SUMMING.ranks, _SUMMING.rows
    if not isinstance(n, int) or not ranks:
        return None
    if rows is not None:
        got = list(rows[part]) if -len(rows) <= part < len(rows) else None
        return got if got is not None and len(got) == ranks and sum(got) == n else None
    if _SUMMING.equal and n % ranks == 0:
        return [n // ranks] * ranks
    return None


#: :func:`scatter_sum` adds rank by rank (a launch each) up to this many ranks, and sorts
#: beyond: 16 ``index_add_`` launches cost the host about as much as the sort's host
#: work (11 us a launch against 0.3-0.4 ms, the H200's host, 2026-11-29/30)
_BY_RANK_MAX = 16


def sorted_sum(device, ordered=True, meeting=None):
    """Does :func:`scatter_sum` sort on ``device``?  Where ``ordered`` and on CUDA, unless
    at most two values can meet at an index (``meeting``, else :func:`summing_ranks`'):
    ``0 + a + b`` and ``0 + b + a`` are the same float, so ``index_add_``'s atomics give
    the ordered sum's bits there."""
    bound = _SUMMING.ranks if meeting is None else meeting
    return bool(ordered) and device.type == "cuda" and (bound is None or bound > 2)


def scatter_sum(n, idx, values, dtype=float32, ordered=True, meeting=None, segments=None):
    """``values`` added into ``n`` zeros at ``idx`` (:func:`_index_vector`; indices checked
    or clamped by the caller), an index's values in a fixed order: the same bits on
    every rank and every run.  On the CPU ``index_add_`` adds them in index order.  On
    CUDA ``index_add_`` adds with atomics in no fixed order, so where three or more
    values meet at an index (an allgathered aggregate of 3+ ranks) two ranks could round
    its sum differently and their replicas drift apart; there the values are sorted by
    index (a stable radix sort) and each index's added in their order (``index_put_``'s
    accumulation, without its range check: no host read-back), the CPU's bits for fewer
    than 32 values at an index, a fixed tree beyond.  ``meeting``: the most values that
    can meet at an index (1 for distinct indices; default: the exchange's
    :func:`summing_ranks`, else unknown); at most 2, ``index_add_`` is ordered enough
    (:func:`sorted_sum`), and the sort's host work (0.3-0.4 ms a call on the H200's host,
    2026-11-30) is saved.  ``ordered=False``: ``index_add_`` on CUDA whatever meets (a
    rank's own statistics, many values at an index: the sorted sum adds those one
    after another).

    ``segments``: the lengths (host ints) of consecutive parts of ``idx`` that each hold
    an index at most once but for zeros (the ranks' payloads, :func:`rank_rows`; a
    padded one repeats an index with 0.0, which adds nothing in any order).  Where the
    sum would sort, up to ``_BY_RANK_MAX`` parts are added one ``index_add_`` after
    another instead: atomics that never meet within a part, so the bits of the CPU's
    sequential sum at any number of values an index, and no sort."""
    out = _torch.zeros(n, dtype=dtype, device=values.device)
    if idx.numel():
        idx, values = _index_vector(idx), values.reshape(-1).to(dtype)
        if sorted_sum(out.device, ordered, meeting):
            if segments is not None and len(segments) <= _BY_RANK_MAX:
                for i, v in zip(idx.split(list(segments)), values.split(list(segments))):
                    out.index_add_(0, i, v)
                return out
            _torch.ops.aten._index_put_impl_(out, [idx], values, True, True)
        else:
            out.index_add_(0, idx, values)
    return out


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


def _flat32(t):
    """Is ``t`` contiguous 1-D float32 (what a kernel may write over in place)?"""
    return t.dtype == _torch.float32 and t.dim() == 1 and t.is_contiguous()


def _add_unless(kernel_adds, flat, add, source=None):
    """``(flat, add, source)`` for a pass that adds error feedback's residuals ``add`` to
    ``flat`` itself (or to ``source``, into ``flat``: a tensor alone's spare buffer) where
    ``kernel_adds`` and all are contiguous 1-D float32; elsewhere ``flat + add`` (or
    ``source + add``) is written into ``flat`` at once (the same ``c``, a pass apart) and
    ``add`` and ``source`` become None."""
    if add is not None and not (kernel_adds and _flat32(flat) and _flat32(add) and (
            source is None or _flat32(source))):
        from ...kernels.segmented import add_into
        return add_into(flat, add.to(flat.dtype), source), None, None
    return flat, add, source


def subtract(a, b, inplace=False):
    """``a - b``, in place on ``a`` when ``inplace``."""
    return a.sub_(b) if inplace else a - b


def scale(a, factor, inplace=False):
    """``factor * a`` (a Python float), in place on ``a`` when ``inplace``."""
    return a.mul_(factor) if inplace else a * factor


def subtract_at(a, idx, values, inplace=False):
    """``a - cast(scatter_sum(len(a), idx, values))`` for *distinct* ``idx`` (int32 or
    int64; or repeats whose values are 0.0, a padded payload's padding, which adds -0.0),
    touching only those entries: the same bits, as ``0.0 + v`` is what the
    scatter into zeros holds and ``x - w`` is ``x + (-1) w`` in IEEE arithmetic (signed
    zeros and rounding included), so it is one ``index_add_`` of ``0.0 + v`` with
    ``alpha=-1`` (two ops).  On CUDA a
    float32 add is an atomic, which flushes subnormal inputs and results to zero (PTX
    ``atom.add.f32``; :func:`scatter_sum` adds without atomics there): a sent entry's
    float32 residual below 1.2e-38 in magnitude becomes 0, and so does a padded tensor's
    unsent first entry's."""
    out = a if inplace else a.clone()
    if idx.numel():
        out.index_add_(0, _index_vector(idx), (0.0 + values.float()).to(a.dtype), alpha=-1)
    return out


def restore_flagged(new, old, flags):
    """``new`` (returned), overwritten in place with ``old`` where any of the device
    ``flags`` is non-zero, without reading them on the host: one kernel launch that moves
    no data when no flag is set where the kernels run (CUDA), ``torch.where`` elsewhere
    (:func:`hvd_compress.kernels.flagged_copy.copy_if_flagged`)."""
    from ...kernels import flagged_copy
    return flagged_copy.copy_if_flagged(new, old, flags)


def new_store():
    from ...stores import TorchStore
    return TorchStore()


# -- small tensor helpers ----------------------------------------------------------------

def sum_rows(t, n):
    """Sum of the rows of ``t`` viewed as (len(t) // n, n) (no rows of nothing: empty)."""
    return t.reshape(-1, n).sum(0) if n else t.new_zeros(0)


def length(t):
    return int(t.shape[0])


def reshape(t, shape):
    return t.reshape(shape)


def to_float32(t):
    return t.float()


def scalar(value, like):
    """A 0-d tensor of the Python number ``value`` on ``like``'s device, filled there
    (``torch.full``): a tensor copied from the host would make the host wait for a CUDA
    device (one synchronisation per call, seen on an H200 on 2026-11-26)."""
    return _torch.full((), value, device=like.device)


def divide(a, b):
    """``a / b`` rounded as IEEE division on every device.  CUDA divides a tensor by a
    Python number as a multiplication by its reciprocal, which can differ in the last bit
    (seen on an H200 on 2026-11-26), so a Python ``b`` becomes a tensor first."""
    return a / (b if isinstance(b, _torch.Tensor) else scalar(float(b), a))


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


def repeat_interleave(values, repeats, total=None):
    """``values[i]`` repeated ``repeats[i]`` times; ``total`` (their sum, when the host
    knows it) spares CUDA the synchronisation that sizes the output."""
    return _torch.repeat_interleave(values, repeats.to(_torch.int64), output_size=total)


def constant(array, like):
    """A float32 tensor on ``like``'s device from a numpy array."""
    return _torch.as_tensor(array, dtype=_torch.float32).to(like.device)
