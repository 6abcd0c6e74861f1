"""CUDA-graph replay of a bucket's compress and decompress (on by default for CUDA
tensors since 2026-12-01; ``HVD_COMPRESS_CUDA_GRAPHS=0`` turns it off).

Why.  On a GPU a bucket compress is a handful of kernels of tens of microseconds each,
and the host takes 15-45 us to issue each one (``benchmarks/gpu_breakdown.py``, H200,
2026-11-29: 43 us through our launcher, 12 us for an ATen op), so the host's launches
are where the time goes.  Replayed from a CUDA graph captured once, GPT-2's block
compress took 0.22 ms against 1.0 ms eagerly with ``laplace_topk:padded=1``, 0.058
against 0.51 ms with ``twobit`` and 0.056 against 0.48 ms with ``rangefloat:bits=8``
(the same run).  A graph replays every launch of the capture with one host call
(``cudaGraphLaunch``).

What.  :meth:`~.base.Compressor.compress_bucket` of a compressor whose ``replayable`` is
true: its payload's shapes depend only on the layout (``fixed_size``), its compress
reads nothing back on the host (``tests/counting.py``'s ``BUCKET_SYNCS``: 0), it draws
nothing random on the host (no ``uses_step``), and its error feedback leaves each
residual in the bucket's own buffer (``c = g + r`` written over the input, then
``c - sent`` over ``c``; :class:`~hvd_compress.memory.ResidualMemory`'s ``reuse``):
``twobit``, ``onebit``, ``signsgd``, ``rangefloat`` and ``laplace_topk`` with
``padded=1``; and ``dct`` with ``padded=1``, whose residuals are coefficients, in a
buffer it names (:meth:`~.base.Compressor.residual_buffer`; below).  Only CUDA tensors,
only PyTorch.

How.  A graph reads and writes the addresses it was captured with, so a bucket's graphs
work on two buffers of its own, ``A`` and ``B``: error feedback writes ``c = g + r``
over the input, which then holds the residual, so the two swap roles every step, and a
bucket has two graphs, one per role.  (Waiting for the caching allocator to hand the
caller's next buffer out at the same address would save the copy below, but the
allocator need not, and small buckets share its pool with every other tensor.)

- A compressor that transforms first (``dct``: ``C = DCT(g) + R``) keeps its residuals
  in a buffer of another size: the two buffers that swap roles are that size, and the
  input has a third buffer of its own, the same every step, which the graphs read
  (``compress_bucket_eager(into=)`` writes ``C`` into the role's buffer).
- A bucket's first compress, and any whose residuals are not one bucket buffer (the
  first step, a checkpoint just restored), run eagerly; after :data:`UNBUFFERED` such
  compresses in a row the bucket runs eagerly for good (logged once).
- Then the residual is moved into ``A`` where it is in neither buffer (a copy, once),
  the input is copied into the other buffer (one copy a step, ``g`` read and written
  once), and that role's graph is replayed.
- A role without a graph captures one (``torch.cuda.graph``, thread-local capture
  mode) and checks that the capture changed nothing on the host but the bucket's
  residuals, now views of the input, as the eager compress leaves them
  (:func:`host_effects`).  Capturing runs nothing, so the buffers are intact: where the
  capture fails or the check does, the store is put back, the compress runs eagerly,
  and so does the bucket from then on (logged once).  Else the graph is replayed.
- A caller that asks (:func:`input_buffer`; the PyTorch glue does) writes the input
  into that buffer itself: no copy, and no bucket-sized buffer of its own each step.
- After a replay the residuals are made views of the input buffer
  (:meth:`~hvd_compress.memory.ResidualMemory.take_buffer`), as the eager compress
  would have made them.
- State that the compress writes *into* (``Compressor.in_place_state``:
  ``laplace_topk:warm=1``'s brackets) stays in the tensors the graph was captured with:
  before each replay, a value the store holds elsewhere (a checkpoint restored, a step
  rolled back) is copied into them (``TorchStore.pin``), and a journal, if any, keeps a
  copy of it first (``TorchStore.keep``).

The payload returned is the graph's own memory: the next replay of the same graph
overwrites it, so it must have been sent (as every exchange does within its step)
before the bucket is compressed again.  A graph holds the cached device tables its
capture read (:mod:`hvd_compress.kernels._held`), which their caches may drop.

Decompress (:func:`decompress_bucket`), of the same compressors, only inside the
exchange's deferred checks (``ops.deferred_checks``: a check read at once would read
back): the aggregate's tensors are new each step, so a bucket keeps a graph per shape
of the aggregate (per number of ranks) with its own input buffers, which the
aggregate is copied into before each replay.  The first aggregate of a shape is
decompressed eagerly (its kernels compiled), the second captured.  The checks the
capture deferred are handed to the exchange's list at every replay (their values are
the graph's memory, rewritten by each replay, read at the step's settle).  A capture
that fails on a malformed aggregate is followed by the eager decompress, whose
ValueError the caller gets; the bucket stays on.  The sum returned is the graph's
memory, as the payload is.

Imports: the standard library, ``hvd_compress.memory``; torch lazily (CUDA tensors only).
"""
import logging
import os

from ..memory import ResidualMemory

logger = logging.getLogger("hvd_compress")

ENV_VAR = "HVD_COMPRESS_CUDA_GRAPHS"

#: graphs a bucket's decompress keeps (one per shape of the aggregate: per number of
#: ranks), the least recently replayed dropped first
MAX_GRAPHS = 4

#: eager compresses in a row after which a bucket whose residuals are still not one
#: buffer stops trying (one makes them one: the first, and the first after a restore)
UNBUFFERED = 2

#: counts since the process started (tests and benchmarks read them): graphs
#: ``captured``, compresses and decompresses ``replayed`` and run ``eager`` (first or
#: unbuffered steps, and buckets turned ``off``), buckets turned ``off``
STATS = {"captured": 0, "replayed": 0, "eager": 0, "off": 0}


def enabled():
    """Whether ``HVD_COMPRESS_CUDA_GRAPHS`` asks for replay (``1``, the default since
    2026-12-01: on the H200 of 2026-11-30 every replayed row gave the eager bits, the DDP
    check passed, and GPT-2's codec took 31% of its backward against 88% eagerly;
    ``0``: every launch issued eagerly)."""
    value = os.environ.get(ENV_VAR, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{ENV_VAR} must be 0 or 1, got {value!r}")
    return value == "1"


def wanted(compressor, flat):
    """Whether ``compressor``'s bucket exchange of tensors like ``flat`` (its input, or an
    aggregate's first tensor) goes through this module: :func:`compress_bucket`,
    :func:`decompress_bucket`, :func:`input_buffer`."""
    return compressor.replayable and getattr(flat, "is_cuda", False) and enabled()


class _Bucket:
    """What a compressor keeps for one bucket: its graphs, and its compress's buffers."""

    def __init__(self):
        self.graphs = {}      # compress: role (0: input in A, 1: in B) -> (replay, payload,
        self.calls = 0        # ctx, in-place state, held); decompress: shapes -> (replay,
                              # inputs, sum, checks, held); held: the cached tables the
                              # graph reads; in-place state: {store key: the graph's tensor}
        self.buffers = None   # compress: A and B
        self.input = None     # ... and the input's own, where the residuals are not in it
        self.views = [None, None]   # ... the residuals' views of each, made once
        self.seen = set()     # decompress: the aggregates' shapes seen once (eagerly)
        self.unbuffered = 0   # compresses in a row whose residuals were not one buffer
        self.off = None       # why the bucket runs eagerly for good, or None


def _parts(layout):
    return tuple(zip(layout.names, layout.numels))


def _residual_parts(c, layout):
    """``(parts, numel, dtype)`` of the buffer ``c``'s error feedback keeps the residuals
    of ``layout`` in (:meth:`~.base.Compressor.residual_buffer`), or None: the input's."""
    return c.residual_buffer(layout, c._ops) if c.ef else None


def compress_bucket(c, flat, layout, capture=None):
    """``c.compress_bucket(flat, layout)``, replayed from a CUDA graph where it can be
    (see the module docstring).  ``capture(fn, written, store) -> (replay, fn())``:
    records ``fn``'s launches (default :func:`cuda_capture`)."""
    b = _bucket(c, _compress_key(c, layout, flat))
    eager = lambda: c.compress_bucket_eager(flat, layout, True)   # noqa: E731
    if b.off is not None or b.calls == 1:
        return _eager(eager)
    memory = c.error_feedback(c._ops) if c.ef else None
    domain = _residual_parts(c, layout)              # (dct: coefficients, not the input)
    parts = _parts(layout) if domain is None else domain[0]
    if b.buffers is None and domain is not None:
        import torch
        b.input = torch.empty_like(flat)
        b.buffers = tuple(torch.empty(domain[1], dtype=domain[2], device=flat.device)
                          for _ in range(2))
    residual = memory.bucket_buffer(parts, b.buffers[0] if domain else flat) \
        if memory is not None else None
    if memory is not None and residual is None:   # the residuals are not one buffer (yet)
        b.unbuffered += 1
        if b.unbuffered > UNBUFFERED:
            return _off(c, b, layout.key, "its error feedback does not keep the residuals "
                        "in one bucket buffer", eager)
        return _eager(eager)
    b.unbuffered = 0
    if b.buffers is None:
        import torch
        b.buffers = (torch.empty_like(flat), torch.empty_like(flat))
    first, second = b.buffers
    role = _input_role(b, residual)
    if residual is not None and residual.data_ptr() not in (first.data_ptr(),
                                                            second.data_ptr()):
        first.copy_(residual)                           # in neither: moved into A, once
        b.views[0] = memory.take_buffer(parts, first, b.views[0])
        residual = first
    target = b.buffers[role]                        # c = g + r written there (or T(g) + r)
    into = target if domain is None else b.input    # the input's buffer
    if flat.data_ptr() != into.data_ptr():          # (the caller wrote it there: input_buffer)
        into.copy_(flat)
    hit = b.graphs.get(role)
    store = c._store
    in_place = _in_place(c, layout, store)
    if None in in_place.values():                   # (rolled back to before its first step)
        return _eager(eager)
    if hit is None:
        saved = store.tables() if store is not None else None
        capture = capture or _on_device(cuda_capture, flat.device)
        written = ((into,) if domain is None else (into, target)) + (
            () if residual is None else (residual,)) + tuple(in_place.values())
        hit, why = _capture(capture, lambda: c.compress_bucket_eager(
            into, layout, True, None if domain is None else target), written,
            store, lambda: host_effects(c, saved, layout, target))
        if hit is None:
            if store is not None:
                store.set_tables(saved)
            return _off(c, b, layout.key, why, eager)
        replay, (payload, ctx), held = hit
        # (a plain tuple: an OwnPayload holds the input)
        b.graphs[role] = hit = (replay, (tuple(payload) if isinstance(payload, (tuple, list))
                                         else payload), ctx, in_place, held)
    elif memory is not None:                         # (the views made once a buffer)
        b.views[role] = memory.take_buffer(parts, target, b.views[role])
    replay, payload, ctx, pinned, _ = hit
    for key, tensor in pinned.items():               # the graph's own tensors hold the value
        store.pin(key, tensor)
    replay()
    STATS["replayed"] += 1
    return payload, ctx


def _in_place(c, layout, store):
    """``{key: tensor}`` of the state that ``c``'s compress of ``layout`` writes into
    (:meth:`~.base.Compressor.in_place_state`: ``laplace_topk:warm=1``'s brackets), each
    copied first for a journal, if any (:meth:`~hvd_compress.stores.TorchStore.keep`):
    a graph captured now reads and writes these tensors."""
    keys = c.in_place_state(layout) if store is not None else ()
    return {key: store.keep(key) for key in keys}


def input_buffer(c, layout, like):
    """The buffer :func:`compress_bucket` will copy the next input of ``layout`` (tensors
    like ``like``) into, for the caller to write that input there itself (the glue's
    ``torch.cat(..., out=)``: no copy, and no buffer of the caller's besides); None
    where there is none yet (the bucket's first steps) or the bucket runs eagerly."""
    b = c.__dict__.get("_replay_buckets", {}).get(_compress_key(c, layout, like))
    if b is None or b.off is not None or b.buffers is None:
        return None
    domain = _residual_parts(c, layout)
    residual = c.error_feedback(c._ops).bucket_buffer(
        _parts(layout) if domain is None else domain[0],
        like if domain is None else b.buffers[0]) if c.ef else None
    if c.ef and residual is None:
        return None                                # an eager step comes first
    return b.buffers[_input_role(b, residual)] if domain is None else b.input


def _input_role(b, residual):
    """Which of the bucket's buffers the next input goes into: A (0) without error
    feedback or where B holds the residual, else B (1; the residual in A, or in neither
    and about to be moved into A)."""
    return 0 if residual is None or residual.data_ptr() == b.buffers[1].data_ptr() else 1


def decompress_bucket(c, payload, ctx, capture=None):
    """``c.decompress_bucket(payload, ctx)`` (``payload``: the aggregate of every rank's),
    replayed from a CUDA graph where it can be: inside the exchange's deferred checks
    (a check read at once would read back), from the second aggregate of one shape on
    (the first compiles the kernels).  The aggregate is copied into the graph's own input
    buffers, the graph replayed, and the checks it makes join the exchange's
    (``deferred_checks``); the sum is the graph's memory."""
    from ..ops import torch_ops
    sink = torch_ops.deferral_sink()
    tensors = tuple(payload) if isinstance(payload, (tuple, list)) else (payload,)
    eager = lambda: c.decompress(payload, ctx)                  # noqa: E731
    b = _bucket(c, ("decompress", ctx.name, ctx.numel, ctx.dtype, tensors[0].device))
    if b.off is not None or sink is None:
        return _eager(eager)
    c.check_aggregate(payload, ctx)                # what the eager decompress checks first
    # (and whether the sum sorts: the exchange's ranks, torch_ops.summing_ranks)
    key = (tuple((tuple(t.shape), t.dtype) for t in tensors),
           torch_ops.sorted_sum(tensors[0].device))
    hit = b.graphs.pop(key, None)
    if hit is None:
        if key not in b.seen:
            b.seen.add(key)
            return _eager(eager)
        import torch
        inputs = tuple(torch.empty_like(t) for t in tensors)
        made = []                                  # the checks the decompress defers
        arg = inputs if isinstance(payload, (tuple, list)) else inputs[0]

        def fn():
            with torch_ops.deferred_checks(made):
                return c.decompress(arg, ctx)
        store = c._store
        saved = store.tables() if store is not None else None
        capture = capture or _on_device(cuda_capture, tensors[0].device)
        hit, why = _capture(capture, fn, (), store, lambda: _changed(store, saved))
        if hit is None:
            if store is not None:
                store.set_tables(saved)
            return _off(c, b, ctx.name, why, eager, "decompressed")
        hit = hit[0], inputs, hit[1], tuple(made), hit[2]
    _keep(b, key, hit)
    replay, inputs, out, deferred, _ = hit
    for mine, t in zip(inputs, tensors):
        mine.copy_(t)
    replay()
    sink.extend(deferred)
    STATS["replayed"] += 1
    return out


def _compress_key(c, layout, like):
    return "compress", layout.key, layout.total, like.dtype, like.device, c.ef, c.ef_decay


def _bucket(c, key):
    """``c``'s :class:`_Bucket` of ``key``, its calls counted."""
    b = c.__dict__.setdefault("_replay_buckets", {}).setdefault(key, _Bucket())
    b.calls += 1
    return b


def _keep(b, key, hit):
    """``hit`` kept as the most recently replayed graph of ``b`` (at most MAX_GRAPHS)."""
    while len(b.graphs) >= MAX_GRAPHS:
        del b.graphs[next(iter(b.graphs))]          # the least recently replayed
    b.graphs[key] = hit


def _eager(eager):
    STATS["eager"] += 1
    return eager()


def _capture(capture, fn, written, store, check):
    """``((replay, fn's result, held), None)``, or ``(None, why)`` when the capture failed
    or ``check()`` (after it) says why it cannot be replayed.  ``held``: the cached
    device tables the capture read, which the graph keeps alive (a cache may drop them:
    :mod:`hvd_compress.kernels._held`)."""
    from ..kernels import _held
    try:
        with _held.recording() as held:
            hit = capture(fn, written, store)
        hit = (*hit, held)
        why = check()
    except Exception as e:    # noqa: BLE001 - any failure to capture: eager from now on
        hit, why = None, f"the capture failed: {type(e).__name__}: {e}"[:400]
    if why is not None:
        return None, why
    STATS["captured"] += 1
    return hit, None


def _off(c, b, name, why, eager, what="compressed"):
    """``eager()``; unless it raises (then the input, not the capture, was at fault: a
    malformed aggregate), the bucket then runs eagerly for good, logged once."""
    out = _eager(eager)
    b.off = why
    STATS["off"] += 1
    logger.warning("hvd_compress: %s: bucket %s is %s eagerly from now on (%s=1 replays "
                   "it from CUDA graphs): %s", c.spec, name, what, ENV_VAR, why)
    return out


def _changed(store, before, allowed=frozenset()):
    """What the store holds other than ``before`` (its ``tables()``) in keys other than
    ``allowed``, in words; None if nothing."""
    if store is None:
        return None if before is None else "the store was dropped"
    tensors, spares, _ = before if before is not None else ({}, {}, {})
    now, now_spares, _ = store.tables()
    changed = sorted(k for k in set(now) | set(tensors)
                     if now.get(k) is not tensors.get(k) and k not in allowed)
    if changed or now_spares.keys() != spares.keys() or any(
            now_spares[k] is not spares[k] for k in spares):
        return ("it replaced state the compressor keeps on the host "
                f"({', '.join(changed[:4]) or 'spares'})")
    return None


def host_effects(c, before, layout, flat):
    """None if ``c``'s compress (just run, or captured) changed nothing on the host that
    a replay would not redo: a compressor's store as it was (``before``: its
    ``tables()``, None without a store), but for the bucket's residuals, which must be
    views of ``flat`` end to end (the input, or the buffer ``c.residual_buffer`` asks
    for); else what changed, in words."""
    residual_keys = {ResidualMemory.PREFIX + name
                     for name in c.residual_names(layout)} if c.ef else ()
    why = _changed(c._store, before, frozenset(residual_keys))
    if why is None and c.ef:
        domain = _residual_parts(c, layout)
        buffer = c.error_feedback(c._ops).bucket_buffer(
            _parts(layout) if domain is None else domain[0], flat)
        if buffer is None or buffer.data_ptr() != flat.data_ptr():
            return "its error feedback does not keep the residuals in the bucket's buffer"
    return why


def cuda_capture(fn, written=(), store=None):
    """``(graph.replay, fn())`` with ``fn``'s launches captured in a new CUDA graph.
    Nothing runs, so ``written`` (the tensors from before that ``fn`` writes in place)
    is left as it was, and ``store`` (the compressor's, which ``fn``'s Python updates) is
    what a replay leaves.  Thread-local capture mode, so that other threads (Horovod's
    background thread) may go on using CUDA meanwhile."""
    import torch
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        out = fn()
    return graph.replay, out


def _on_device(capture, device):
    """``capture`` with ``device`` current (a process may hold tensors of several GPUs)."""
    def run(fn, written, store):
        import torch
        with torch.cuda.device(device):
            return capture(fn, written, store)
    return run
