"""Counting what a bucket exchange costs on the CUDA code path: Triton launches (the
launchers' own counter, ``hvd_compress.kernels.counting_launches``) and framework (ATen)
ops (a ``TorchDispatchMode``).  Run with ``HVD_COMPRESS_BACKEND=triton``, so on CPU
tensors the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, conftest.py)."""
import collections

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
