"""Malformed aggregated payloads for every compressor (no test here: the generator and
the check that tests/unit/test_malformed_payloads.py runs under hypothesis, and
benchmarks/fuzz_payloads.py runs longer, printing counts)."""
import collections
import random

import numpy as np

import hvd_compress

SPECS = ["none", "fp16", "bf16", "topk:density=0.1", "randomk:density=0.1",
         "threshold:threshold=0.5", "laplace_topk:density=0.1", "dgc:density=0.1",
         "gaussian_k:density=0.1", "sidco_exp:density=0.1", "twobit", "rangefloat:bits=8",
         "dct:density=0.1,block=32", "topk:density=0.1,values=rangefloat8",
         "kernel_select:fraction=0.5", "qsgd", "terngrad", "signsgd", "onebit"]
MUTATIONS = ["drop", "extra", "truncate", "extend", "empty", "dtype", "index"]
DTYPES = ["float64", "int64", "uint8", "float16", "int32"]


def mutate(fw, tensors, how, which, amount, dtype):
    """This rank's payload (as an aggregate would hold it) changed by ``how`` at tensor
    ``which``; None when the change does not apply.  ``fw``: a :class:`Torch` or
    :class:`TF` adapter."""
    tensors = list(tensors)
    i = which % len(tensors)
    t = tensors[i]
    n = fw.size(t)
    if how == "drop":
        return tensors[:-1] if len(tensors) > 1 else []
    if how == "extra":
        return tensors + [t]
    if how == "truncate":
        if n == 0:
            return None
        tensors[i] = t[:n - min(n, amount)]
    elif how == "extend":
        tensors[i] = fw.extend(t, amount)
    elif how == "empty":
        tensors[i] = t[:0]
    elif how == "dtype":
        if fw.dtype_name(t) == dtype:
            return None
        tensors[i] = fw.cast(t, dtype)
    elif how == "index":          # int32 indices far out of range
        if fw.dtype_name(t) != "int32" or n == 0:
            return None
        tensors[i] = t + 10 ** 6 * amount
    return tensors


class Torch:
    def __init__(self):
        import torch
        self.t = torch

    def tensor(self, a):
        return self.t.from_numpy(a)

    def size(self, t):
        return int(t.numel())

    def extend(self, t, n):
        return self.t.cat([t, self.t.zeros(n, dtype=t.dtype)])

    def dtype_name(self, t):
        return str(t.dtype).replace("torch.", "")

    def cast(self, t, name):
        return t.to(getattr(self.t, name))


class TF:
    def __init__(self):
        import tensorflow as tf
        self.t = tf

    def tensor(self, a):
        return self.t.constant(a)

    def size(self, t):
        return int(t.shape.num_elements())

    def extend(self, t, n):
        return self.t.concat([t, self.t.zeros([n], t.dtype)], 0)

    def dtype_name(self, t):
        return t.dtype.name

    def cast(self, t, name):
        return self.t.cast(t, getattr(self.t, name))


def check(fw, spec, how, which, amount, dtype, seed=0):
    """Decompress a malformed aggregate: it either raises ValueError/TypeError naming the
    compressor, or (a change that leaves it well formed) returns the tensor's shape.
    Returns "error", "ok" or "skip" (the change does not apply); anything else raises."""
    rng = np.random.default_rng(seed)
    shape = (4, 8, 3, 3) if spec.startswith("kernel_select") else (30, 7)
    c = hvd_compress.from_spec(spec)
    payload, ctx = c.compress(fw.tensor(rng.standard_normal(shape).astype(np.float32)), "g")
    several = isinstance(payload, (tuple, list))
    changed = mutate(fw, list(payload) if several else [payload], how, which, amount, dtype)
    if changed is None:
        return "skip"
    bad = tuple(changed) if several or len(changed) != 1 else changed[0]
    try:
        out = c.decompress(bad, ctx)
    except (ValueError, TypeError) as e:
        name = spec.split(":")[0]
        assert name in str(e), f"{spec} {how}: the error does not name {name}: {e}"
        return "error"
    except Exception as e:         # noqa: BLE001 - the point: nothing else may escape
        raise AssertionError(f"{spec} {how} {which} {amount} {dtype}: raw "
                             f"{type(e).__name__}: {e}") from None
    assert tuple(out.shape) == shape, f"{spec} {how}: shape {tuple(out.shape)}"
    return "ok"


#: compressors whose payload holds free bit patterns (codes, headers) that a change may
#: leave well formed, e.g. an extra empty [E, 0] rangefloat header, shifted 2-bit codes
FREE_BITS = {"twobit", "rangefloat:bits=8", "dct:density=0.1,block=32",
             "topk:density=0.1,values=rangefloat8", "qsgd", "terngrad", "signsgd", "onebit"}


def fuzz(fw, cases, seed=0):
    """``cases`` random (compressor, mutation) cases: {spec: Counter(error/ok/skip)}."""
    rng = random.Random(seed)
    counts = collections.defaultdict(collections.Counter)
    for i in range(cases):
        spec = rng.choice(SPECS)
        outcome = check(fw, spec, rng.choice(MUTATIONS), rng.randrange(4),
                        rng.randrange(1, 10), rng.choice(DTYPES), seed=i)
        counts[spec][outcome] += 1
    return counts
