"""Compressors whose payload's shapes never depend on the values (``fixed_size``): the
same shapes for any data, NaN/Inf, zeros and subnormals included, alone and in a bucket,
on both backends.  The exchange then gathers them with ``Transport.allgather_fixed``,
which the DDP transport makes one collective with no lengths gathered first and nothing
read back (checked on a real one-process Gloo group; tests/integration/test_ddp.py runs
them across two processes)."""
import numpy as np
import pytest
import torch
import torch.distributed as dist

import hvd_compress
from hvd_compress.buckets import layout
from hvd_compress.compressors.base import REGISTRY
from hvd_compress.exchange.protocol import Wait

FIXED = ["bf16", "twobit", "twobit:threshold=0.5", "rangefloat:bits=8", "rangefloat:bits=4",
         "qsgd", "terngrad", "onebit", "signsgd", "laplace_topk:density=0.02,padded=1",
         "laplace_topk:density=0.02,exact=1,padded=1",
         "laplace_topk:density=0.02,padded=1,values=rangefloat8",
         "dct:density=0.02,block=32,padded=1"]
SIZES = [300, 17, 1000]


def data(kind, n, seed=0):
    g = torch.from_numpy(np.random.default_rng(seed).laplace(size=n).astype(np.float32))
    if kind == "zeros":
        return torch.zeros(n)
    if kind == "sparse":
        return torch.zeros(n).index_fill_(0, torch.tensor([3, n - 2]), 2.0)
    if kind == "nan":
        return g.index_fill_(0, torch.tensor([7]), float("nan"))
    if kind == "inf":
        return g.index_fill_(0, torch.tensor([n - 1]), float("-inf"))
    if kind == "huge":
        return g * 1e37
    if kind == "subnormal":
        return g * 1e-40
    return g


def test_exactly_the_compressors_whose_payload_cannot_vary_say_so():
    """Defaults of every registered compressor: fixed_size only where the payload is per
    tensor a count of codes (or the padded search's slots); a selection's size varies."""
    fixed = {name for name in REGISTRY if name not in ("kernel_select",)
             and hvd_compress.from_spec(name).fixed_size}
    assert fixed == {"bf16", "twobit", "rangefloat", "qsgd", "terngrad", "onebit", "signsgd"}
    assert not hvd_compress.from_spec("kernel_select").fixed_size
    for spec in ("laplace_topk:density=0.02,fused=1", "topk", "dct", "randomk"):
        assert not hvd_compress.from_spec(spec).fixed_size
    assert all(hvd_compress.from_spec(s).fixed_size for s in FIXED)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("spec", FIXED)
def test_a_fixed_size_payload_has_the_same_shapes_for_any_values(monkeypatch, backend, spec):
    monkeypatch.setenv("HVD_COMPRESS_BACKEND", backend)
    lay = layout(["a", "b", "c"], [(n,) for n in SIZES])
    kinds = ["laplace", "zeros", "sparse", "nan", "inf", "huge", "subnormal"]
    for dtype in (torch.float32, torch.float16):
        if dtype == torch.float16 and spec == "bf16":
            continue
        bucket, alone = set(), set()
        for seed, kind in enumerate(kinds):
            c = hvd_compress.from_spec(spec)          # a fresh one: no residual to carry
            g = data(kind, lay.total, seed).to(dtype)
            payload, _ = c.compress_bucket(g.clone(), lay)
            bucket.add(tuple((tuple(t.shape), t.dtype) for t in payload))
            payload, _ = c.compress(g[:SIZES[0]].reshape(20, 15).clone(), "a")
            alone.add(tuple((tuple(t.shape), t.dtype) for t in payload))
        assert len(bucket) == 1 and len(alone) == 1, (dtype, bucket, alone)


def drive(gen):
    """Run a transport's collective generator to its end: ``(result, collectives)``."""
    waits, got = 0, None
    try:
        while True:
            w = gen.send(got)
            assert isinstance(w, Wait)
            waits += 1
            got = w.wait()
    except StopIteration as stop:
        return stop.value, waits


def test_the_ddp_transport_gathers_a_fixed_payload_in_one_collective(tmp_path):
    """``TorchDistributed.allgather_fixed``: one all_gather of the bytes, no lengths (one
    collective and 16 bytes fewer than ``allgather`` for two tensors), the same tensors
    back, bfloat16 included."""
    from hvd_compress.torch.ddp_bucket import TorchDistributed
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0,
                            world_size=1)
    try:
        t = TorchDistributed(dist.group.WORLD)
        payload = (torch.arange(5, dtype=torch.int32).reshape(5), torch.randn(3).bfloat16())
        (fixed, sent_fixed, _), n_fixed = drive(t.allgather_fixed(payload, "x"))
        (plain, sent_plain, _), n_plain = drive(t.allgather(payload, "x"))
        assert (n_fixed, n_plain) == (1, 2) and sent_plain - sent_fixed == 16
        for a, b, p in zip(fixed, plain, payload):
            assert a.dtype == p.dtype and torch.equal(a, p) and torch.equal(b, p)
    finally:
        dist.destroy_process_group()
