"""CUDA-graph replay of a bucket compress (``HVD_COMPRESS_CUDA_GRAPHS=1``; off by default).

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
``padded=1``.  Only CUDA tensors, only PyTorch.

How.  A graph reads and writes the addresses it was captured with, so each graph is
kept under the addresses a compress reads: the input buffer's and the residual
buffer's.  Error feedback makes the input of one step the residual of the next, and
PyTorch's caching allocator then hands the freed residual's block to the next
input, so a bucket's steps alternate between two graphs.

- A bucket's first compress, and any whose residuals are not one bucket buffer (the
  first step, a checkpoint just restored), run eagerly; after :data:`UNBUFFERED` such
  compresses in a row the bucket runs eagerly for good (logged once).
- A miss captures a graph (``torch.cuda.graph``, thread-local capture mode) and
  checks that the capture changed nothing on the host but the bucket's residuals,
  now views of the input, as the eager compress leaves them (:func:`host_effects`).
  Capturing runs nothing, so the inputs are intact: where the capture fails or the
  check does, the store is put back, the bucket runs eagerly from then on, and the
  reason is logged once.  Else the graph is replayed.
- A hit replays the graph, then makes the residuals views of the input
  (:meth:`~hvd_compress.memory.ResidualMemory.take_buffer`), as the eager compress
  would have.
- A bucket keeps at most :data:`MAX_GRAPHS` graphs (the least recently replayed goes:
  a restored checkpoint's residuals are at new addresses); one whose buffers are at new
  addresses :data:`MAX_GRAPHS` compresses in a row stops being captured (logged) and
  runs eagerly.

The payload returned is the graph's own memory: the next replay of the same graph
overwrites it, so it must have been sent (as every exchange does within its step)
before the bucket is compressed again.

Imports: the standard library, ``hvd_compress.memory``; torch lazily (CUDA tensors only).
"""
import logging
import os

from ..memory import ResidualMemory

logger = logging.getLogger("hvd_compress")

ENV_VAR = "HVD_COMPRESS_CUDA_GRAPHS"

#: graphs a bucket may keep, and captures in a row after which it gives up: the two the
#: swapping buffers need, and two more for an allocator that hands out another block now
#: and then
MAX_GRAPHS = 4

#: eager compresses in a row after which a bucket whose residuals are still not one
#: buffer stops trying (one makes them one: the first, and the first after a restore)
UNBUFFERED = 2

#: counts since the process started (tests and benchmarks read them): graphs
#: ``captured``, compresses ``replayed``, compresses run ``eager`` (first or unbuffered
#: steps, and buckets turned ``off``), buckets turned ``off``
STATS = {"captured": 0, "replayed": 0, "eager": 0, "off": 0}


def enabled():
    """Whether ``HVD_COMPRESS_CUDA_GRAPHS`` asks for replay (``1``; default ``0``)."""
    value = os.environ.get(ENV_VAR, "0")
    if value not in ("0", "1"):
        raise ValueError(f"{ENV_VAR} must be 0 or 1, got {value!r}")
    return value == "1"


def wanted(compressor, flat):
    """Whether ``compressor.compress_bucket(flat, ...)`` goes through :func:`compress_bucket`."""
    return compressor.replayable and getattr(flat, "is_cuda", False) and enabled()


class _Bucket:
    """What a compressor keeps for one bucket: its graphs by the addresses they read."""

    def __init__(self):
        self.graphs = {}      # (input address, residual address) -> (replay, payload, ctx),
        self.calls = 0        # least recently replayed first
        self.misses = 0       # captures since the last replay of a graph it had
        self.unbuffered = 0   # compresses in a row whose residuals were not one buffer
        self.off = None       # why the bucket runs eagerly for good, or None


def _parts(layout):
    return tuple(zip(layout.names, layout.numels))


def compress_bucket(c, flat, layout, capture=None):
    """``c.compress_bucket(flat, layout)``, replayed from a CUDA graph where it can be
    (see the module docstring).  ``capture(fn) -> (replay, result)``: records ``fn``'s
    launches, returning what ``fn`` returned (default :func:`cuda_capture`)."""
    buckets = c.__dict__.setdefault("_replay_buckets", {})
    b = buckets.setdefault((layout.key, layout.total, flat.dtype, flat.device, c.ef,
                            c.ef_decay), _Bucket())
    b.calls += 1
    if b.off is not None or b.calls == 1:
        STATS["eager"] += 1
        return c.compress_bucket_eager(flat, layout)
    parts = _parts(layout)
    memory = c.error_feedback(c._ops) if c.ef else None
    residual = memory.bucket_buffer(parts, flat) if memory is not None else None
    if memory is not None and residual is None:   # the residuals are not one buffer (yet)
        b.unbuffered += 1
        if b.unbuffered > UNBUFFERED:
            return _turn_off(c, b, layout, "its error feedback does not keep the residuals "
                             "in one bucket buffer", flat)
        STATS["eager"] += 1
        return c.compress_bucket_eager(flat, layout)
    b.unbuffered = 0
    key = (flat.data_ptr(), 0 if residual is None else residual.data_ptr())
    hit = b.graphs.pop(key, None)
    if hit is None:
        b.misses += 1
        if b.misses > MAX_GRAPHS:
            return _turn_off(c, b, layout, f"its buffers were at new addresses {MAX_GRAPHS} "
                             "times in a row", flat)
        hit = _capture(c, b, flat, layout, capture or _on_device(cuda_capture, flat.device))
        if hit is None:
            STATS["eager"] += 1
            return c.compress_bucket_eager(flat, layout)
        if len(b.graphs) >= MAX_GRAPHS:
            del b.graphs[next(iter(b.graphs))]    # the least recently replayed
        STATS["captured"] += 1
    else:
        b.misses = 0
        if memory is not None:
            memory.take_buffer(parts, flat)
    b.graphs[key] = hit                            # (last: the most recently replayed)
    replay, payload, ctx = hit
    replay()
    STATS["replayed"] += 1
    return payload, ctx


def _turn_off(c, b, layout, why, flat=None):
    b.off = why
    STATS["off"] += 1
    logger.warning("hvd_compress: %s: bucket %s is compressed eagerly from now on "
                   "(%s=1 replays it from CUDA graphs): %s", c.spec, layout.key, ENV_VAR, why)
    if flat is not None:
        STATS["eager"] += 1
        return c.compress_bucket_eager(flat, layout)
    return None


def _capture(c, b, flat, layout, capture):
    """``(replay, payload, ctx)`` of a graph of ``c``'s compress of ``flat``, or None (the
    bucket turned off, the store as it was)."""
    store = c._store
    saved = store.tables() if store is not None else None
    try:
        replay, (payload, ctx) = capture(lambda: c.compress_bucket_eager(flat, layout))
        why = host_effects(c, saved, layout, flat)
    except Exception as e:    # noqa: BLE001 - any failure to capture: eager from now on
        why = f"the capture failed: {type(e).__name__}: {e}"[:400]
    if why is not None:
        if store is not None:
            store.set_tables(saved)
        return _turn_off(c, b, layout, why)
    payload = tuple(payload) if isinstance(payload, (tuple, list)) else payload
    return replay, payload, ctx           # (a plain tuple: an OwnPayload holds the input)


def host_effects(c, before, layout, flat):
    """None if ``c``'s compress of ``flat`` (just run, or captured) changed nothing on the
    host that a replay would not redo: a compressor's store as it was (``before``: its
    ``tables()``, None without a store), but for the bucket's residuals, which must be
    views of ``flat`` end to end; else what changed, in words."""
    store = c._store
    if store is None:
        return None if before is None else "the store was dropped"
    tensors, spares, _ = before if before is not None else ({}, {}, {})
    residual_keys = {ResidualMemory.PREFIX + name for name in layout.names} if c.ef else set()
    now, now_spares, _ = store.tables()
    changed = sorted(k for k in set(now) | set(tensors)
                     if now.get(k) is not tensors.get(k) and k not in residual_keys)
    if changed or now_spares.keys() != spares.keys() or any(
            now_spares[k] is not spares[k] for k in spares):
        return ("the compress replaced state it keeps on the host "
                f"({', '.join(changed[:4]) or 'spares'})")
    if c.ef:
        buffer = c.error_feedback(c._ops).bucket_buffer(_parts(layout), flat)
        if buffer is None or buffer.data_ptr() != flat.data_ptr():
            return "its error feedback does not keep the residuals in the bucket's buffer"
    return None


def cuda_capture(fn):
    """``(graph.replay, fn())`` with ``fn``'s launches captured in a new CUDA graph
    (nothing runs); thread-local capture mode, so that other threads (Horovod's
    background thread) may go on using CUDA meanwhile."""
    import torch
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        out = fn()
    return graph.replay, out


def _on_device(capture, device):
    """``capture`` with ``device`` current (a process may hold tensors of several GPUs)."""
    def run(fn):
        import torch
        with torch.cuda.device(device):
            return capture(fn)
    return run
