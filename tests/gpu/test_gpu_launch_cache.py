"""The launch cache (``HVD_COMPRESS_LAUNCH_CACHE=1``, ``hvd_compress/kernels/_launch.py``)
on CUDA: every kernel family's bucket compress, decompress and error feedback, three
steps, give the same bits through the cache as through Triton's own dispatch, and the
cache is used (hits).  On CPU tensors (HVD_COMPRESS_GPU_TESTS_ON_CPU=1) the cache passes
every launch through: the same comparison, no hits.  A spec whose CUDA path launches no
Triton kernel at these sizes (plain ``laplace_topk``: torch.topk below 2^27 values) needs
no hit; the H200 run of 2026-11-30 found that this test had asked it for one."""
import pytest
import torch

import hvd_compress
from hvd_compress.buckets import layout
from hvd_compress.kernels import _launch
from hvd_compress.kernels._backend import counting_launches
from gpu_helpers import DEV, GPU, assert_same_steps, laplace

pytestmark = GPU

SIZES = [1000, 4097, 50_000, 3, 130_000]          # no multiple of any block, one tiny
SPECS = ["laplace_topk:density=0.01", "laplace_topk:density=0.01,fused=1",
         "laplace_topk:density=0.01,padded=1",
         "laplace_topk:density=0.01,fused=1,values=rangefloat8",
         "topk:density=0.01,values=rangefloat8", "twobit", "twobit:threshold=0.5",
         "rangefloat:bits=8", "rangefloat:bits=6", "dct:density=0.01",
         "dct:density=0.01,padded=1", "qsgd", "terngrad", "onebit", "signsgd"]
if DEV == "cpu":            # the interpreter: the test's own logic, on one kernel family
    SPECS = ["twobit"]      # (every spec here: 115 s on 2 cores)


def steps(spec, cache, monkeypatch):
    """Three steps of one rank's bucket exchange: payload, decompressed sum, residuals."""
    monkeypatch.setenv("HVD_COMPRESS_LAUNCH_CACHE", "1" if cache else "0")
    torch.manual_seed(0)
    lay = layout([f"t{i}" for i in range(len(SIZES))], [(n,) for n in SIZES])
    c = hvd_compress.from_spec(spec)
    out = []
    for step in range(3):
        g = laplace(lay.total, seed=step, device=DEV)
        payload, ctx = c.compress_bucket(g, lay)
        total = c.decompress_bucket(payload, ctx)
        payload = tuple(payload) if isinstance(payload, (tuple, list)) else (payload,)
        residuals = [c.residual(n) for n in lay.names]
        out.append((payload, total, residuals))
    return out


@pytest.mark.parametrize("spec", SPECS)
def test_the_launch_cache_gives_the_bits_of_tritons_dispatch(spec, monkeypatch):
    plain = steps(spec, False, monkeypatch)
    before = dict(_launch.STATS)
    with counting_launches() as launched:
        through = steps(spec, True, monkeypatch)
    assert_same_steps(spec, SIZES, plain, through)
    hits = _launch.STATS["hits"] - before["hits"]
    if DEV == "cuda" and sum(launched.values()):
        assert hits > 0, f"{spec}: no launch went through the cache ({_launch.STATS})"
    else:
        assert hits == 0 and _launch.STATS["misses"] == before["misses"]
