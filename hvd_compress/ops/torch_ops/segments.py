"""PyTorch primitives, segments family: buckets, tensors end to end with one result per
tensor (segment): concat / split, segment ids, per-segment sums, maxima, counts above
thresholds and compaction, and the choice of the segmented search.

On CUDA tensors the per-segment passes dispatch to the Triton kernels of
:mod:`hvd_compress.kernels.segmented`.

May import: torch, :mod:`.core`, :mod:`hvd_compress.ops._cpu_topk` (numpy); lazily,
:mod:`hvd_compress.kernels` and :mod:`hvd_compress.log`.
"""
import numpy as _np
import torch as _torch

from .. import _cpu_topk
from .core import _add_unless, _cached, _constant, _flat32, _host_list, _index_vector


def concat(ts):
    return _torch.cat([t.reshape(-1) for t in ts])


def split(flat, lengths):
    """Views of ``flat``, one per length."""
    return list(_torch.split(flat, list(lengths)))


def split_cols(t, widths):
    """Views of ``t`` (rows, sum(widths)), column blocks of ``widths``."""
    return list(_torch.split(t, list(widths), dim=1))


def _per_layout(what, layout, device, make):
    """``make()``, computed once per (what, bucket layout, device) and kept (a bounded
    cache: the constants of a model's buckets)."""
    return _cached(what, (layout.key, layout.numels), device, make)


def segment_ids(layout, like):
    """int32 tensor index of every entry of a bucket (cached per layout and device)."""
    from ...kernels import segmented
    return _per_layout("ids", layout, like.device,
                       lambda: segmented.segment_ids(layout.numels, like.device))


def segment_abs_sum_max(flat, layout, add=None, source=None):
    """float32 ``(sum|x|, max|x|)`` per tensor of a bucket (one pass; Triton on CUDA).
    ``add`` (float32, as ``flat``): ``flat + add`` written over ``flat`` first, in the
    same pass where the kernels run (error feedback's ``c = g + r``), and summed;
    ``source``: ``source + add`` written into ``flat`` instead (a tensor alone)."""
    from ...kernels import pick_backend, segmented
    flat, add, source = _add_unless(pick_backend(flat) == "triton", flat, add, source)
    if pick_backend(flat) == "triton":
        return segmented.segment_abs_sum_max(flat, layout.numels, backend="triton", add=add,
                                             source=source)
    return segmented.segment_abs_sum_max_reference(flat, layout.numels, segment_ids(layout, flat))


def segment_count_above(a, seg, thresholds):
    """int64 ``[T, G]`` counts of ``a > thresholds[seg, g]`` (one pass; Triton on CUDA)."""
    from ...kernels import segmented
    return segmented.segment_count_above(a, seg, thresholds)


def segment_compact_above(flat, thresholds, seg, layout):
    """``(flat[sel], int32 indices)``, ``sel = |flat| > thresholds[seg]``, index order."""
    from ...kernels import compact_above as launch
    from ...kernels.compact import compact_above_reference
    if flat.is_cuda:
        return launch(flat, thresholds, segment_ids=seg)
    # CPU: the thresholds repeated per tensor (one write) instead of a gather per entry
    lengths = _per_layout("lengths", layout, "cpu",
                          lambda: _torch.tensor(layout.numels, dtype=_torch.int64))
    return compact_above_reference(flat, _torch.repeat_interleave(thresholds.float(), lengths))


def segment_sum_int(values, seg, segments):
    """int64 per-segment sums of the integers (or booleans) ``values``."""
    out = _torch.zeros(segments, dtype=_torch.int64, device=values.device)
    return out.index_add_(0, _index_vector(seg), values.reshape(-1).to(_torch.int64))


def rows_max(t):
    return t.max(dim=1).values


def rows_min(t):
    return t.min(dim=1).values


def host_all(t):
    """Python bool: are all entries true (a host synchronisation on CUDA)."""
    return bool(t.all())


def segment_counts(seg, segments):
    """int64 number of entries of each segment (an ``index_add_`` of ones: ``bincount``
    would synchronise with the host on CUDA to size its output).  The ones are a cached
    1 expanded (a view), so it is two framework ops: the zeros and the add."""
    out = _torch.zeros(segments, dtype=_torch.int64, device=seg.device)
    if seg.numel():
        out.index_add_(0, _index_vector(seg), _constant((1,), seg.device).expand(seg.numel()))
    return out


def stack_cols(ts):
    return _torch.stack(ts, 1)


def split_sizes(t, sizes, n):
    """``t`` cut into ``n`` pieces of the (tensor) ``sizes`` (a host synchronisation)."""
    return list(_torch.split(t, sizes.tolist()))


def segmented_search(t, exact):
    """laplace_topk on a bucket: one search for all its tensors (True) or each tensor's
    own selection in turn (False)?  Measured 2026-11-22 on the VGG-like (28 tensors,
    815k values) and ResNet-like (47, 697k) models' gradients:

    - CPU, one thread: tolerance mode 18 / 17 ms segmented against 6 / 6 ms tensor by
      tensor (small tensors take torch.topk); ``exact=1`` 22-25 ms against 56 / 89 ms.
    - H100: tolerance mode 5.6 / 6.4 ms segmented against 1.9 / 4.7 ms for per-tensor
      torch.topk in a bucket; ``exact=1`` 5.1 / 6.6 ms against 80 / 168 ms tensor by
      tensor (each tensor's own search: launches and host syncs per tensor).

    So: the segmented search for ``exact=1``, each tensor's own selection otherwise."""
    return bool(exact)


def segment_abs_topk(flat, numels, ks, drop_zeros=False):
    """``(int32 indices, finite)``: the ``ks[i]`` largest ``|x|`` of each tensor ``i`` of
    ``flat`` (``numels`` end to end; indices into ``flat``, in index order, ties by lowest
    index) and whether ``flat`` holds no NaN/Inf, learnt from the same selection (every
    index when it does not); None where a framework top-k per tensor is the better way.
    ``drop_zeros``: without the indices of zeros (when finite); on CUDA read back with
    the finiteness, one host synchronisation for both.

    - CPU tensors: one numpy partition per tensor in a reused buffer
      (:func:`hvd_compress.ops._cpu_topk.segment_abs_largest`): 21.5-22.5 ms for k = 63K
      of 6.3M values on one core here (2026-11-25), against 42-43 ms for ``all_finite``
      and ``topk_indices(abs(x))`` before.
    - CUDA (and the kernel path, ``HVD_COMPRESS_BACKEND=triton``, which runs CUDA's code
      on the CPU): one stable sort of the whole bucket (:func:`_sorted_segment_topk`)
      when it holds more tensors than millions of values, else None.  H200, torch 2.11,
      2026-11-26 (``benchmarks/results/gpu_2026-11-26/gpu_breakdown_*``): a torch.topk
      per tensor costs about 80 us a tensor, launches mostly, the sort about 0.12-0.16 ms
      per million values; the top-k of ResNet-50's 72-tensor bucket (8.9M values) took
      5.2-5.8 ms tensor by tensor and 1.1-1.4 ms by the sort, GPT-2's 12-tensor block
      (7.1M) 0.89-1.06 and 0.94-1.19 ms (even; two runs), one 25M-value tensor 0.65
      and 2.83 ms."""
    from ...kernels import pick_backend
    if flat.device.type == "cpu" and pick_backend(flat) == "torch":
        idx, finite = _cpu_topk.segment_abs_largest(flat.detach().reshape(-1).float().numpy(),
                                                    numels, ks, drop_zeros)
        return _torch.from_numpy(idx.astype(_np.int32)), finite
    if len(numels) < 2 or len(numels) * 1_000_000 < flat.numel():
        return None
    return _sorted_segment_topk(flat, numels, ks, drop_zeros)


def _sorted_segment_topk(flat, numels, ks, drop_zeros=False):
    """:func:`segment_abs_topk` by one sort: int64 keys ``(tensor << 31) | (2^31 - 1 -
    bits(|x|))`` (a float's bits order like its value for ``|x|``), sorted stably, put
    each tensor's entries together, largest first, ties in index order; each tensor's
    first ``k`` are taken at positions known from the layout.  One host
    synchronisation: the finiteness, read from each tensor's largest key (with
    ``drop_zeros``, and the number of non-zeros taken: then compacted without another)."""
    from ...kernels import segmented
    device, numels = flat.device, tuple(int(n) for n in numels)
    ids = _cached("segment ids", numels, device, lambda: segmented.segment_ids(numels, device))
    starts = [0]
    for n in numels[:-1]:
        starts.append(starts[-1] + n)
    take = _cached("top-k positions", numels + tuple(ks), device, lambda: _torch.cat(
        [_torch.arange(a, a + min(k, n)) for a, n, k in zip(starts, numels, ks)]).to(device))
    first = _constant(starts, device)
    x = flat.detach().reshape(-1)
    bits = (x if x.dtype == _torch.float32 else x.float()).view(_torch.int32) & 0x7FFFFFFF
    keys, order = _torch.sort((ids.long() << 31) | (0x7FFFFFFF - bits).long(), stable=True)
    largest = 0x7FFFFFFF - (keys[first] & 0x7FFFFFFF)               # bits of each max|x|
    finite = (largest < 0x7F800000).all()
    picked = order[take]
    if drop_zeros:
        nonzero = (keys[take] & 0x7FFFFFFF) != 0x7FFFFFFF          # |x|'s bits not 0
        finite, count = _torch.stack([finite.long(), nonzero.sum()]).tolist()  # one sync
        if finite:
            picked = picked[_torch.nonzero_static(nonzero, size=count).reshape(-1)]
    if not bool(finite):                      # the one host sync (above with drop_zeros)
        return _torch.arange(x.numel(), dtype=_torch.int32, device=device), False
    return _torch.sort(picked).values.to(_torch.int32), True


# -- laplace_topk's fused search (laplace_topk:fused=1): hvd_compress.kernels.histogram_select
#    and band_compact

def histogram_search_supported():
    """Can this framework run the fused histogram search?"""
    return True


def layout_constant(what, layout, values, dtype, like):
    """A small per-tensor constant of a bucket (k, n, ...) on ``like``'s device: the
    list ``values()`` returns, made and copied there once per (what, dtype, layout,
    device)."""
    return _per_layout((what, str(dtype)), layout, like.device,
                       lambda: _host_list(list(values()), like.device, dtype))


def bucket_blocks(layout, like):
    """The bucket's blocks that never straddle two tensors (on ``like``'s device)."""
    from ...kernels import segmented
    return segmented.block_table(layout.numels, like.device)


#: whether this process has said that the fused search runs its torch references
_SAID_REFERENCE = []


def search_start(abs_sum, abs_max, n, factor, warm=None, spread=0):
    """The fused search's state, every tensor's bracket ``(bits(sum|x| / n * factor),
    bits(max|x|)]`` (one launch on CUDA), or around a previous one (``warm``, widened by
    ``spread`` bits: ``histogram_select.search_from_fit``); every entry selected when the
    bucket holds a NaN or Inf (from its ``sum|x|`` and ``max|x|``).  Where the kernels do
    not run (CPU tensors), a warning once per process: the search is then its torch
    references."""
    from ...kernels import search_state
    _say_reference(abs_sum)
    return search_state.search_from_fit(abs_sum, abs_max, n, factor, warm, spread)


def _say_reference(like):
    """A warning, once per process, where the fused search runs its torch references."""
    from ...kernels import pick_backend
    if not _SAID_REFERENCE and pick_backend(like) == "torch":
        from ...log import logger
        _SAID_REFERENCE.append(True)
        logger.warning("hvd_compress: fused=1/padded=1 on %s tensors runs the fused search's "
                       "torch references, many times slower than the default search there "
                       "(55-1,400 ms against 1.9-14 ms at 1M-4M values on 2 CPU cores); it "
                       "is for CUDA's kernels: leave fused and padded unset where they do "
                       "not run (CPU tensors, HVD_COMPRESS_BACKEND=torch)", like.device.type)


def warm_search_start(flat, layout, blocks, warm, k, slack, n, factor, spread, bins, buffers,
                      add=None, source=None):
    """A warm fused search's state after its first pass (``laplace_topk:warm=1``): the
    sums pass (``flat + add`` written over ``flat``, or ``source + add`` into it, as
    :func:`segment_abs_sum_max`'s) also counts the histogram of every tensor with a warm
    bracket (``warm``) over a window around it, then one launch starts every tensor and
    makes those tensors' step: one read of the bucket fewer than :func:`search_start` and
    a first :func:`histogram_step` (``kernels.search_state.warm_search``)."""
    from ...kernels import pick_backend, search_state
    flat, add, source = _add_unless(pick_backend(flat) == "triton", flat, add, source)
    _say_reference(flat)
    return search_state.warm_search(flat, blocks, warm, k, slack, n, factor, spread, bins,
                                    buffers, add, source)


def warm_brackets(store, key, T, like):
    """The fused search's warm brackets of a bucket of ``T`` tensors, int64 ``[2, T]`` held
    in ``store`` under ``key`` on ``like``'s device: all -1 (a cold start) the first time,
    or where what it holds is of another shape (a checkpoint of another layout)."""
    held = store.get(key, lambda: _torch.full((2, T), -1, dtype=_torch.int64,
                                              device=like.device))
    if tuple(held.shape) != (2, T) or held.dtype != _torch.int64 or not held.is_contiguous():
        held = _torch.full((2, T), -1, dtype=_torch.int64, device=like.device)
        store.set(key, held)
    elif held.device != like.device:                 # (a checkpoint loaded elsewhere)
        held = held.to(like.device)
        store.set(key, held)
    return held


def keep_brackets(store, key, held, state):
    """A finished search's brackets (rows ``LO, HI`` of ``state``) written *into* ``held``,
    the tensor :func:`warm_brackets` returned (in place: a CUDA graph holds its address;
    the store's journal, if any, keeps a copy first)."""
    store.keep(key)
    held.copy_(state[:2])


def histogram_step(flat, blocks, state, bins, k, slack, buffers, local=False):
    """One pass of the fused search on the device (Triton on CUDA): the int64
    ``[T, bins + 2]`` magnitude histogram of the tensors active in ``state``, then its
    step (``state`` updated and returned); ``buffers``: a dict of zeroed buffers that the
    passes reuse; ``local``: a histogram per block, then an atomic per non-empty column
    (for a few columns)."""
    from ...kernels import histogram_select
    return histogram_select.histogram_step(flat, blocks, state, bins, k, slack, buffers,
                                           local=local)


def padded_slots(what, layout, sizes, like):
    """The slots of a padded selection (``band_compact.slot_table``): the list
    ``sizes()`` of them per tensor of ``layout``, on ``like``'s device, made once per
    (what, layout, device)."""
    from ...kernels import band_compact
    return _per_layout(("slots", what), layout, like.device,
                       lambda: band_compact.slot_table(layout.numels, sizes(), like.device))


def band_select(flat, blocks, state, gather=False, own=False, count=True, slots=None):
    """``(int32 indices, finite)``: above ``HI`` and the first ``QUOTA`` of the band,
    per tensor; ``finite`` a Python bool (one host synchronisation for both).
    ``gather=True``: ``(indices, finite, values, counts, written)``, the values gathered
    by the launch that writes the indices, and their number per tensor (int64; None
    with ``count=False``); with
    ``own=True`` (error feedback's residuals updated in place in ``flat``) that launch
    also writes ``flat - sent`` over ``flat`` (+0.0 at the sent entries) where ``flat``
    is contiguous 1-D float32: ``written`` is ``flat`` then, else None (``flat`` left as
    it was).  ``slots`` (:func:`padded_slots`, with ``gather``): padded, no host
    synchronisation; ``finite`` is then a flag on the device, int64 ``[1]``, non-zero
    where the bucket is *not* finite, and ``counts`` the slots' sizes."""
    from ...kernels import band_compact
    if not gather:
        return band_compact.band_select(flat, blocks, state, slots=slots)
    zero = own and _flat32(flat)
    return (*band_compact.band_select(flat, blocks, state, gather=True, zero=zero, count=count,
                                      slots=slots), flat if zero else None)
