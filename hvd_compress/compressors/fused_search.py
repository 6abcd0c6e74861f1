"""The fused search of seed 000's threshold (laplace_topk ``fused=1`` and ``padded=1``;
``dct:padded=1`` selects its coefficients with it): every tensor of a bucket at once, in
a fixed number of passes decided on the device.

Chen, Liu & Han, "A low-complexity top-k threshold for residual gradient compression
in distributed training", Journal of Zhejiang University (Engineering Science), 2021,
55(2):386-394 -- the Laplace fit ``t0 = mean|g| ln(1/rho)`` of :mod:`.laplace`, here
corrected by histogram passes in float32 bit space instead of a grid search with host
decisions (:func:`select_histogram` states the algorithm).  The kernels are
``kernels/histogram_select.py`` (the passes) and ``kernels/band_compact.py`` (the write
pass), reached through the framework's ops.

Imports: the standard library; and modules of its own package.
"""
import math

from ..memory import NonFinite


def torch_only(sparsifier, ops):
    """ValueError naming ``sparsifier``'s spec where ``ops`` cannot run the fused search
    (TensorFlow)."""
    if not ops.histogram_search_supported():
        raise ValueError(f"{sparsifier.spec}: fused=1 (the fused histogram search, which "
                         "padded=1 and warm=1 imply) runs on PyTorch tensors only; leave "
                         "fused, padded and warm unset for TensorFlow")


def fused_payload(sparsifier, selector, flat, ctx, ops, **kw):
    """``(payload, finite, written)``: ``sparsifier``'s payload of the entries that the
    fused search of ``selector`` (a LaplaceTopK; its ``padded`` decides) selects in
    ``flat`` (``ctx``: its Ctx), values and counts from the write pass
    (:func:`select_histogram` with ``gather``; ``kw``: ``add``, ``source``, ``own``,
    ``count``).
    ``padded=1``: in ``selector``'s slots, ``finite`` a device flag
    (:class:`~hvd_compress.memory.NonFinite`) and the codec's counts the host's."""
    torch_only(sparsifier, ops)
    slots = selector.slots(ctx.layout, ops, flat) if selector.padded else None
    idx, finite, values, counts, written = select_histogram(
        selector, flat, ctx.layout, ops, gather=True, slots=slots, **kw)
    if slots is not None:                      # (finite: the device's flag, 1 where not)
        finite, counts = NonFinite(finite), None
    payload = sparsifier._payload(flat, idx, ctx, ops, values, counts,
                                  lengths=None if slots is None else slots.sizes)
    return payload, finite, written


def bucket_constants(self, lay, tol, ops, like):
    """Per-tensor ``k``, ``slack = floor(tol * k)`` (int64) and ``n`` (float32) of the
    bucket ``lay`` on ``like``'s device, made once per (density, tol, layout, device)."""
    k_t = ops.layout_constant(("k", self.density), lay,
                              lambda: [self.k(n) for n in lay.numels], ops.int64, like)
    slack = ops.layout_constant(("slack", self.density, tol), lay,
                                lambda: [int(math.floor(tol * self.k(n))) for n in lay.numels],
                                ops.int64, like)
    n_t = ops.layout_constant("numels", lay, lambda: lay.numels, ops.float32, like)
    return k_t, slack, n_t


HISTOGRAM_BINS = 2046   #: window bins per tensor and pass (a row of 2048 counters)
#: the fused search's passes, the bins of each: a coarse first one (62 bins, counted per
#: block, so no atomic per entry), then fine ones over its narrow bracket; 62 x 2046^3
#: parts collapse any float32 bracket (< 2^31 bit patterns) to one value
HISTOGRAM_PASSES = (62, HISTOGRAM_BINS, HISTOGRAM_BINS, HISTOGRAM_BINS)
COARSE_BINS = 62        #: passes with at most this many bins count per block (``local``)

#: a warm start (``histogram_search(warm=)``) brackets each tensor within a factor 1 + w
#: of the previous search's bracket, w = 0.13: 87% of tensor-steps of a GPT-2 with AdamW
#: stayed within it (``benchmarks/threshold_drift.py``, 2026-11-30); a float32's bits
#: grow by 2^23 an octave, so the factor is ``log2(1.13) * 2^23`` bits (normal floats)
WARM_SPREAD = 0.13
WARM_SPREAD_BITS = round(math.log2(1 + WARM_SPREAD) * 2 ** 23)
#: its passes: fine from the first (a part of the warm bracket spans a factor 1.0001,
#: finer than the gap between entries near a top-1% threshold for k up to some 2,000, so
#: a tensor with ``floor(tol * k) = 0`` lands on k too; 62 parts span 1.004, about 2% of
#: k on Laplace data); after a miss, ``(0, lo]`` or ``(hi, +Inf]``, 3 collapse either;
#: unfolded (``fold=False``), a tensor without a warm bracket starts at its Laplace fit,
#: whose first pass may miss: 4
WARM_PASSES = (HISTOGRAM_BINS,) * 4
#: the folded start's (``fold=True``, the compressors'): its first pass steps every
#: tensor, a cold one from ``(0, +Inf]`` in 62 parts (``search_state.COLD_BINS``), so 3
#: passes collapse any bracket left: a pass fewer (a launch with ``FOLD_PICK``, 2 without)
WARM_FOLDED_PASSES = (HISTOGRAM_BINS,) * 3


#: where ``warm=1`` keeps a bucket's brackets in its compressor's state (int64 ``[2, T]``:
#: checkpointed, and restored by a journal's rollback, with the residuals), + the key
WARM_KEY = "warm/"


def reads(reading, numels):
    """``(passes that read the bucket, the bucket's entries read over its size)`` of a
    search's ``reading`` (:func:`histogram_search`): a pass reads only the tensors still
    searched."""
    total = max(sum(numels), 1)
    return (sum(any(r) for r in reading),
            sum(n for r in reading for n, a in zip(numels, r) if a) / total)


def warm_brackets(state):
    """A search's final brackets ``(lo, hi]`` (int64 ``[2, T]``, a copy) for the next
    search's warm start; a bucket that held NaN/Inf has ``lo = -1``: its tensors start
    cold (at their Laplace fit) next time."""
    return state[:2].clone()


def select_histogram(self, flat, lay, ops, passes=None, add=None, gather=False,
                     own=False, count=True, slots=None, source=None, warm=None, fold=True):
    """The fused search (``fused=1``): every tensor of the bucket ``lay`` at once, in a
    fixed number of passes, with no host synchronisation but the output's length.

    1. one pass: ``sum|g|`` and ``max|g|`` per tensor (with error feedback, ``g`` is
       ``c = g + r``, written by this same pass: ``add``, and ``source`` where ``g`` is
       not ``flat`` itself but a tensor alone's gradient); the bracket starts at
       ``(t0 / 2, max|g|]``, ``t0 = mean|g| ln(1/density)`` (the Laplace fit), set on
       the device by one launch;
    2. histogram passes (kernel ``histogram_select.segment_histogram``) count, per
       tensor, the entries above ``bins + 2`` thresholds: 0, and the bracket cut into
       ``bins`` equal parts in float32 bit space.  The new bracket is the part where the
       count crosses k (``count(> lo) >= k > count(> hi)``), chosen on the device; when
       fewer than k entries lie above ``t0 / 2`` (data far from Laplace) it is
       ``(0, t0 / 2]``.  ``passes`` gives each pass's bins: by default a coarse pass of
       62 bins, counted per block (about 10% of a Laplace tensor lies above ``t0 / 2``:
       one atomic per such entry queued on the counters), then three passes of 2046
       bins, which collapse any float32 bracket to one value, even after a miss of the
       fit, while their atomics are only for the entries of the narrowed bracket.  A
       pass counts only the tensors still off (count outside ``tol * k`` and a bracket
       wider than one float); the others' entries are not read, so on Laplace-like
       data, where the second pass lands within about 1% of k, the later ones cost a
       launch each and no reads;
    3. the count: the closer end of the bracket within ``tol * k`` of ``k``, else exactly
       ``k`` (``exact=1`` always): everything above ``hi`` plus the first entries (in index
       order) of the band ``(lo, hi]`` (kernel ``band_compact.band_select``: a count
       pass, one program for the offsets, the read-back, a write pass).

    ``exact=1`` gives the same indices as the grid search (the k largest, ties by lowest
    index); in tolerance mode no unsent magnitude exceeds a sent one either.  A tensor
    with fewer than k nonzero entries sends them all.

    ``gather=True``: the write pass also gathers the values, counted per tensor by the
    offsets program (``count``), and with ``own=True`` (error feedback, residuals updated
    in place in ``flat``) writes +0.0 over the sent entries of ``flat``: ``(indices,
    finite, values, counts, written)`` (``ops.band_select``); ``slots`` (with
    ``gather``): padded (``padded=1``), no synchronisation at all.
    ``warm``: start at a previous search's brackets (:func:`histogram_search`, its first
    pass folded into step 1 unless ``fold=False``); where ``self.warm`` (``warm=1``) and
    none is given, at the brackets this bucket's last search ended with, kept in
    ``self``'s state (:data:`WARM_KEY`).
    """
    held = None
    if warm is None and self.warm:
        store, key = self._state(ops), WARM_KEY + lay.key
        warm = held = ops.warm_brackets(store, key, len(lay.numels), flat)
    blocks, state = histogram_search(self, flat, lay, ops, passes, add, source, warm,
                                     fold=fold)
    if held is not None:
        ops.keep_brackets(store, key, held, state)
    return ops.band_select(flat, blocks, state, gather=gather, own=own, count=count,
                           slots=slots)


def histogram_search(self, flat, lay, ops, passes=None, add=None, source=None, warm=None,
                     reading=None, fold=True):
    """Steps 1 and 2 of :func:`select_histogram`: ``(blocks, search state)``, every
    launch on the device and no host synchronisation, shapes fixed by the layout (so
    the whole of it could be replayed from a CUDA graph; ``benchmarks/gpu_breakdown.py``
    times that).  ``add``: error feedback's residuals, added to ``flat`` by the first
    pass (:meth:`LaplaceTopK.adds_residual`), or to ``source`` into ``flat``.  ``warm``:
    a previous search's final brackets (:func:`warm_brackets`): a tensor starts within a
    factor ``1 + WARM_SPREAD`` of its own instead of at its Laplace fit; ``fold``: its
    first pass is counted by the sums pass (``ops.warm_search_start``: a read of the
    bucket fewer, a tensor without a warm bracket counted over ``(0, +Inf]``), then
    ``WARM_FOLDED_PASSES``.  ``passes``: default ``HISTOGRAM_PASSES``, from ``warm``
    ``WARM_FOLDED_PASSES`` (``WARM_PASSES`` unfolded).  ``reading``: a list that gets,
    per histogram pass, which tensors it reads (a list of bools: those still searched; a
    host read each, for benchmarks: :func:`reads`)."""
    if passes is None:
        passes = (HISTOGRAM_PASSES if warm is None else WARM_FOLDED_PASSES if fold
                  else WARM_PASSES)
    k_t, slack, n_t = bucket_constants(self, lay, 0.0 if self.exact else self.tol, ops, flat)
    blocks = ops.bucket_blocks(lay, flat)
    factor, buffers = 0.5 * math.log(1.0 / self.density), {}
    if warm is not None and fold:
        state = ops.warm_search_start(flat, lay, blocks, warm, k_t, slack, n_t, factor,
                                      WARM_SPREAD_BITS, HISTOGRAM_BINS, buffers, add, source)
    else:
        abs_sum, abs_max = ops.segment_abs_sum_max(flat, lay, add=add, source=source)
        state = ops.search_start(abs_sum, abs_max, n_t, factor, warm,
                                 WARM_SPREAD_BITS if warm is not None else 0)
    for bins in passes:
        if reading is not None:
            from ..kernels.histogram_select import ACTIVE
            reading.append([bool(a) for a in state[ACTIVE].tolist()])
        state = ops.histogram_step(flat, blocks, state, bins, k_t, slack, buffers,
                                   local=bins <= COARSE_BINS)
    return blocks, state
