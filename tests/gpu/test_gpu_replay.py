"""CUDA-graph replay of a bucket compress (``HVD_COMPRESS_CUDA_GRAPHS=1``,
``hvd_compress/compressors/replay.py``) on CUDA: every replayable compressor, six steps
(one with a NaN), its input made each step as the glue makes it (``torch.cat`` of the
gradients, so the caching allocator picks the addresses), gives the eager compress's
payload bits, decompressed sum and residuals; the later steps are replayed (no kernel
launched through a launcher) and no bucket is turned off.  Needs CUDA itself (graphs
cannot be captured elsewhere): tests/unit/test_replay.py checks the logic on the CPU."""
import pytest
import torch

import hvd_compress
from hvd_compress.buckets import layout
from hvd_compress.compressors import replay
from hvd_compress.kernels import counting_launches
from gpu_helpers import CUDA_ONLY, GPU, assert_same_steps, laplace

pytestmark = GPU + [CUDA_ONLY]

SIZES = [1000, 4096, 50_000, 3, 130_000, 768 * 64]
SPECS = ["twobit", "twobit:ef=0", "twobit:threshold=0.5", "onebit", "signsgd",
         "rangefloat:bits=8", "rangefloat:bits=6",
         "laplace_topk:density=0.01,padded=1",
         "laplace_topk:density=0.01,padded=1,values=rangefloat8",
         "laplace_topk:density=0.01,padded=1,exact=1",
         "laplace_topk:density=0.01,padded=1,ef_decay=0.9"]
STEPS = 6


def steps(spec, graphs, monkeypatch):
    """Each step's (payload, decompressed sum, residuals, launches), copied out."""
    monkeypatch.setenv(replay.ENV_VAR, "1" if graphs else "0")
    lay = layout([f"t{i}" for i in range(len(SIZES))], [(n,) for n in SIZES])
    c = hvd_compress.from_spec(spec)
    out = []
    for step in range(STEPS):
        grads = [laplace(n, seed=10 * step + i, device="cuda") for i, n in enumerate(SIZES)]
        if step == 3:
            grads[2][17] = float("nan")
        flat = torch.cat([g.reshape(-1) for g in grads])       # as the glue makes it
        del grads
        with counting_launches() as launched:
            payload, ctx = c.compress_bucket(flat, lay)
        # copies: a replayed payload is the graph's memory, residuals are live buffers
        copied = tuple(t.clone() for t in (payload if isinstance(payload, tuple) else (payload,)))
        residuals = [c.residual(n) for n in lay.names]
        out.append((copied, c.decompress_bucket(payload, ctx).clone(),
                    [None if r is None else r.clone() for r in residuals],
                    sum(launched.values())))
        del flat, payload, residuals
    torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("spec", SPECS)
def test_a_replayed_compress_gives_the_eager_bits(spec, monkeypatch):
    eager = steps(spec, False, monkeypatch)
    before = dict(replay.STATS)
    replayed = steps(spec, True, monkeypatch)
    got = {k: replay.STATS[k] - before[k] for k in before}
    assert_same_steps(spec, SIZES, eager, replayed)
    assert got["off"] == 0, f"{spec}: replay turned off ({got}); see the log"
    assert got["replayed"] >= STEPS - 2, f"{spec}: too few compresses replayed ({got})"
    assert got["captured"] <= replay.MAX_GRAPHS, got
    replayed_launches = [r[3] for r in replayed[2:]]
    assert min(replayed_launches) == 0, (
        f"{spec}: every later step launched kernels ({replayed_launches}): not replayed")
