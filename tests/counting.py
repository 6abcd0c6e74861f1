"""Counting what a bucket exchange costs on the CUDA code path: Triton launches (the
launchers' own counter, ``hvd_compress.kernels.counting_launches``), framework (ATen)
ops (a ``TorchDispatchMode``), the calls that synchronise with the host on CUDA
(:class:`CountSyncs`) and the host's own Python calls (:func:`python_calls`).  Run with
``HVD_COMPRESS_BACKEND=triton``, so on CPU tensors the kernels run in Triton's
interpreter (``TRITON_INTERPRET=1``, conftest.py)."""
import collections
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hvd_compress
from hvd_compress import kernels as K
from hvd_compress.buckets import layout


class CountOps(TorchDispatchMode):
    """Framework (ATen) ops called inside the block (``.ops``: a Counter by op)."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


#: ATen ops whose output size or result the host must read on CUDA: each waits for the device
SYNC_OPS = frozenset({"aten.nonzero.default", "aten.masked_select.default",
                      "aten._unique2.default", "aten.unique_consecutive.default",
                      "aten.unique_dim.default", "aten.bincount.default",
                      "aten.equal.default", "aten.is_nonzero.default",
                      "aten._local_scalar_dense.default"})     # item(), int(), bool(), float()


class CountSyncs(TorchDispatchMode):
    """The calls inside the block that synchronise with the host on CUDA (``.syncs``: a
    Counter by call), counted on any device, so the CPU run of the CUDA code path checks
    them: the ops of :data:`SYNC_OPS`, ``repeat_interleave`` without ``output_size``,
    indexing with a boolean mask, and ``Tensor.tolist`` (which no dispatch mode sees on
    the CPU: patched for the block).  Not seen: host-to-device copies of Python values,
    ``.cpu()``/``.numpy()`` (nothing to copy on the CPU), and code that branches on
    ``is_cuda`` (the CPU's compaction and candidate pruning in laplace_topk's grid
    search, for example); so the GPU test against the same table is the real guard.
    ``host``: tensors that stay on the CPU on a GPU run too (the step counters of
    a compressor's state), whose reads wait for nothing (held here, so that no other
    tensor takes the id of one freed meanwhile).  On a GPU,
    ``torch.cuda.set_sync_debug_mode`` counts the real ones (tests/gpu/test_gpu_sync.py)."""

    def __init__(self, host=()):
        super().__init__()
        self.syncs = collections.Counter()
        self._tolist = None
        self._held = list(host)
        self._host = frozenset(id(t) for t in self._held)

    def __enter__(self):
        tolist, syncs = torch.Tensor.tolist, self.syncs

        def counted(t):
            syncs["Tensor.tolist"] += 1
            return tolist(t)
        self._tolist, torch.Tensor.tolist = tolist, counted
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name in SYNC_OPS:
            if not (args and id(args[0]) in self._host):
                self.syncs[name] += 1
        elif name == "aten.repeat_interleave.Tensor" and (kwargs or {}).get("output_size") is None:
            self.syncs[name] += 1
        elif name.startswith(("aten.index.Tensor", "aten.index_put")) and any(
                i is not None and i.dtype == torch.bool for i in args[1]):
            self.syncs[name + " (boolean mask)"] += 1
        return func(*args, **(kwargs or {}))


#: spec: (compress, decompress, settle) host synchronisations of one bucket exchange on
#: the CUDA code path, whatever its number of tensors: decompress of two ranks' payloads
#: as the exchange driver runs it (index checks deferred, ``ops.deferred_checks``), and
#: the driver's one readback of the step's deferred checks (``ops.settle_checks``)
BUCKET_SYNCS = {
    # the payload length with the NaN/Inf flag; the indices' range, deferred
    "laplace_topk:density=0.01,fused=1": (1, 0, 1),
    # ... the values' headers checked against the indices' number, deferred too
    "laplace_topk:density=0.01,fused=1,values=rangefloat8": (1, 0, 1),
    "laplace_topk:density=0.01,fused=1,exact=1": (1, 0, 1),
    "laplace_topk:density=0.01,warm=1": (1, 0, 1),       # (fused=1, started warm)
    # padded: every tensor's slots known before the search, NaN/Inf flagged on the
    # device: nothing read back in compress
    "laplace_topk:density=0.01,padded=1": (0, 0, 1),
    "laplace_topk:density=0.01,padded=1,values=rangefloat8": (0, 0, 1),
    "laplace_topk:density=0.01,padded=1,exact=1": (0, 0, 1),
    "laplace_topk:density=0.01,padded=1,warm=1": (0, 0, 1),
    # one sort of the bucket (ops.segment_abs_topk): its finiteness, read back with the
    # number of non-zeros among the picks (laplace_topk drops zeros)
    "laplace_topk:density=0.01": (1, 0, 1),
    "topk:density=0.01": (1, 0, 1),
    "topk:density=0.01,values=rangefloat8": (1, 0, 1),
    # dense codes: NaN/Inf flagged by their kernels, obeyed on the device (memory.NonFinite);
    # rangefloat's decompress checks the ranks' headers on the device, deferred
    "twobit": (0, 0, 0),
    "rangefloat:bits=8": (0, 0, 1),
    # the band count; the indices' range and the headers, deferred
    "dct:density=0.01": (1, 0, 1),
    "dct:density=0.01,padded=1": (0, 0, 1),       # its slots: nothing read back
    # the NaN/Inf check; whether the draws held k distinct indices for every tensor
    "randomk:density=0.01": (2, 0, 1),
    "randomk:density=0.6": (1, 0, 1),            # k > n / 2: the smallest keys, no check
    # the NaN/Inf check, then nonzero's size
    "threshold:threshold=2.5": (2, 0, 1),
    # NaN/Inf flagged per tensor on the device by a segmented pass (sum|x| NaN, max|x|
    # Inf), obeyed there; dense payloads: nothing to check in decompress
    "qsgd": (0, 0, 0),
    "terngrad": (0, 0, 0),
    "onebit": (0, 0, 0),
    "signsgd": (0, 0, 0),
}


def host_state(c):
    """Compressor ``c``'s step counters (CPU tensors whatever the gradients' device)."""
    store = c._store
    return () if store is None else [v for k, v in store._tensors.items()
                                     if k.startswith("step/")]


def exchange_syncs(T, spec, data, size=1000, counter=None, sizes=None):
    """``(compress, decompress, settle)`` host synchronisations of a bucket of ``T``
    tensors of ``size + 37 i`` values (or of ``sizes``; decompress: two ranks' payloads,
    as the exchange driver runs it: inside ``ops.deferred_checks``; settle: the
    driver's one readback of the deferred index checks, per step), after a warm-up:
    with :class:`CountSyncs` (three Counters), or ``counter(fn) -> (count, result)``
    (three ints; on a GPU, its sync-debug count)."""
    from hvd_compress.ops import torch_ops
    sizes = sizes or [size + 37 * i for i in range(T)]
    lay = layout([f"t{i}" for i in range(len(sizes))], [(n,) for n in sizes])
    c = hvd_compress.from_spec(spec)
    sink = []

    def decompress(payload, ctx):
        with torch_ops.deferred_checks(sink):
            return c.decompress_bucket(tuple(torch.cat([p, p]) for p in payload), ctx)

    for step in range(2):
        flat = data(lay.total, step)
        if counter is not None:
            comp, (payload, ctx) = counter(lambda: c.compress_bucket(flat, lay))
            dec, _ = counter(lambda: decompress(payload, ctx))
            settle, _ = counter(lambda: torch_ops.settle_checks(sink))
            continue
        with CountSyncs(host_state(c)) as comp:
            payload, ctx = c.compress_bucket(flat, lay)
        with CountSyncs(host_state(c)) as dec:
            decompress(payload, ctx)
        with CountSyncs(host_state(c)) as settle:
            torch_ops.settle_checks(sink)
        comp, dec, settle = comp.syncs, dec.syncs, settle.syncs
    return comp, dec, settle


def one_exchange(T, spec, data, size=1000):
    """``(Triton launches, ATen ops)``, two Counters, of compress + decompress (two
    ranks' payloads) of a bucket of ``T`` tensors of ``size + 37 i`` values, after a
    warm-up step; ``data(n, step)`` makes the flat gradient."""
    lay = layout([f"t{i}" for i in range(T)], [(size + 37 * i,) for i in range(T)])
    c = hvd_compress.from_spec(spec)
    for step in range(2):
        flat = data(lay.total, step)
        with CountOps() as ops, K.counting_launches() as launched:
            payload, ctx = c.compress_bucket(flat, lay)
            c.decompress_bucket(tuple(torch.cat([p, p]) for p in payload), ctx)
    return launched, ops.ops


def python_calls(T, spec, data, size=64):
    """Python and builtin function calls of compress + decompress (two ranks' payloads)
    of a bucket of ``T`` tensors of ``size`` values, after a warm-up step: the host's
    work that grows with the tensors even where launches and ops do not (each costs the
    host about as much on a GPU machine).  Generator resumes and the kernels' bodies in
    Triton's interpreter are left out."""
    lay = layout([f"t{i}" for i in range(T)], [(size,)] * T)
    c = hvd_compress.from_spec(spec)
    calls, inside = [0], []

    def count(frame, event, arg):
        code = frame.f_code
        if inside:
            if event == "return" and frame is inside[-1]:
                inside.pop()
        elif event == "call" and code.co_name == "run" and code.co_filename.endswith(
                "interpreter.py"):
            inside.append(frame)
        elif event == "c_call" or (event == "call" and code.co_name != "<genexpr>"):
            calls[0] += 1

    for step in range(2):
        flat = data(lay.total, step)
        if step:
            sys.setprofile(count)
        try:
            payload, ctx = c.compress_bucket(flat, lay)
            two = (tuple(torch.cat([p, p]) for p in payload) if isinstance(payload, tuple)
                   else payload * 2)
            c.decompress_bucket(two, ctx)
        finally:
            sys.setprofile(None)
    return calls[0]
