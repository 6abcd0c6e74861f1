"""A stand-in for ``torch.cuda.graph`` with a CUDA graph's semantics on the CPU, for
the replay tests (``hvd_compress/compressors/replay.py``): tests/unit/test_replay.py,
and tests/gpu/test_gpu_replay.py's logic under HVD_COMPRESS_GPU_TESTS_ON_CPU=1.

- Capturing runs ``fn`` for what its Python does on the host (the compressor's store
  updated, checks deferred) and then puts back every tensor it wrote in place
  (``written``): a capture computes nothing.
- A replay runs ``fn`` again on the store as the capture saw it (put back after), into
  the capture's own tensors (:class:`GraphMemory`): what the capture returned holds
  each replay's values, as a graph's private memory does, and the host's state is what
  it was before the replay.

Not emulated: a replay here relaunches the kernels (so launch counts are not those of a
replay) and runs the Python again (so a deferred check list grows)."""
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten


class GraphMemory(TorchDispatchMode):
    """A CUDA graph's memory on the CPU: recording, every new tensor a framework op makes
    is kept in order; replaying, the same ops' results are written into those tensors,
    which are returned in their place (views and in-place results pass), so that what a
    capture returned, and what it handed out, holds each replay's values, as a graph's
    private memory does."""

    def __init__(self, kept=None):
        super().__init__()
        self.replaying, self.kept, self.at = kept is not None, kept if kept else [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(r.alias_info is not None for r in func._schema.returns):
            return out                               # a view, or an in-place op's input
        flat, spec = tree_flatten(out)
        if not self.replaying:
            self.kept.append(flat)
            return out
        mine = self.kept[self.at]
        self.at += 1
        got = []
        for m, o in zip(mine, flat):
            # (an empty tensor passes: Triton's interpreter resizes its own ones later)
            if isinstance(o, torch.Tensor) and o.numel():
                assert m.shape == o.shape and m.dtype == o.dtype, (func, m.shape, o.shape)
                m.copy_(o)
                o = m
            got.append(o)
        return tree_unflatten(got, spec)


class StandIn:
    """``capture(fn, written, store) -> (replay, fn())``, as ``replay.cuda_capture`` is
    called (see the module docstring); ``captures`` counts the calls."""

    def __init__(self):
        self.captures = 0

    def __call__(self, fn, written, store):
        self.captures += 1
        before = store.tables() if store is not None else None
        data = [t.clone() for t in written]
        memory = GraphMemory()
        with memory:
            out = fn()
        for t, d in zip(written, data):            # a capture computes nothing
            t.copy_(d)

        def replay_():
            now = store.tables() if store is not None else None
            if store is not None:
                store.set_tables(before)            # the state the capture saw
            with GraphMemory(memory.kept):
                fn()
            if store is not None:
                store.set_tables(now)               # a replay changes nothing on the host
        return replay_, out
