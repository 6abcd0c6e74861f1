"""CUDA-graph replay of a bucket's compress and decompress
(``HVD_COMPRESS_CUDA_GRAPHS=1``, ``hvd_compress/compressors/replay.py``) on CUDA.

Every replayable compressor, six steps (one with a NaN), its input made each step as
the glue makes it (``torch.cat`` of the gradients, so the caching allocator picks the
addresses) and two ranks' aggregate a new tensor each step: the eager payload bits,
decompressed sum and residuals; the later steps replayed (no kernel launched through
a launcher); no bucket turned off.  A malformed index in a replayed decompress still
raises at the settle.  On CPU tensors (HVD_COMPRESS_GPU_TESTS_ON_CPU=1) the same
steps run through tests/replay_standin.py's stand-in for ``torch.cuda.graph`` (no
launch counts: the stand-in relaunches), with two specs; tests/unit/test_replay.py
checks the replay logic itself on the CPU.  A tensor alone, which the glue sends as a
bucket of one where its exchanges are replayed (its own path otherwise), gives its own
path's bits replayed."""
import pytest
import torch

import hvd_compress
from hvd_compress.buckets import layout
from hvd_compress.compressors import replay
from hvd_compress.kernels import counting_launches
from hvd_compress.ops import torch_ops
from gpu_helpers import DEV, GPU, assert_same_steps, laplace

pytestmark = GPU

SIZES = [1000, 4096, 50_000, 3, 130_000, 768 * 64]
SPECS = ["twobit", "twobit:ef=0", "twobit:threshold=0.5", "onebit", "signsgd",
         "rangefloat:bits=8", "rangefloat:bits=6",
         "laplace_topk:density=0.01,padded=1",
         "laplace_topk:density=0.01,padded=1,values=rangefloat8",
         "laplace_topk:density=0.01,padded=1,exact=1",
         "laplace_topk:density=0.01,padded=1,ef_decay=0.9",
         "laplace_topk:density=0.01,padded=1,warm=1",
         "dct:density=0.01,padded=1", "dct:density=0.01,padded=1,block=64,bits=12"]
STEPS = 6
if DEV == "cpu":        # the interpreter: the test's own logic, on three kernel families
    SPECS = ["twobit", "laplace_topk:density=0.01,padded=1", "dct:density=0.01,padded=1"]


@pytest.fixture(autouse=True)
def graphs_on_cpu(monkeypatch):
    """On CPU tensors: replay taken for them, through the stand-in for CUDA graphs, and
    the kernels of the CUDA code path (in Triton's interpreter): the torch references
    branch on what they read back (``all_finite``, ``nonzero``'s size), so their ops
    differ between a capture and a replay, which the stand-in cannot follow (and a real
    capture would not take: those reads synchronise)."""
    if DEV == "cpu":
        from replay_standin import StandIn          # tests/replay_standin.py
        monkeypatch.setenv("HVD_COMPRESS_BACKEND", "triton")
        monkeypatch.setattr(replay, "wanted", lambda c, t: c.replayable and replay.enabled())
        monkeypatch.setattr(replay, "cuda_capture", StandIn())
        monkeypatch.setattr(replay, "_on_device", lambda capture, device: capture)


#: a bucket of one tensor, which the glue sends as a bucket where replayed (its own path
#: otherwise: the eager steps here), and the specs it is checked with
ALONE = [300_000]
ALONE_SPECS = ["twobit", "rangefloat:bits=8", "laplace_topk:density=0.01,padded=1",
               "dct:density=0.01,padded=1"]


def steps(spec, graphs, monkeypatch, sizes=SIZES):
    """Each step's (payload, decompressed sum, residuals, launches), copied out; a bucket
    of one tensor sent as the glue sends it (``sends_alone``)."""
    monkeypatch.setenv(replay.ENV_VAR, "1" if graphs else "0")
    lay = layout([f"t{i}" for i in range(len(sizes))], [(n,) for n in sizes])
    c = hvd_compress.from_spec(spec)
    out = []
    for step in range(STEPS):
        grads = [laplace(n, seed=10 * step + i, device=DEV) for i, n in enumerate(sizes)]
        if step == 3:
            grads[-1][17] = float("nan")
        alone = len(sizes) == 1 and c.sends_alone(grads[0])
        flat = grads[0] if alone else torch.cat([g.reshape(-1) for g in grads],
                                                out=c.bucket_input(lay, grads[0]))
        del grads
        with counting_launches() as launched:
            payload, ctx = c.compress(flat, lay.key) if alone else c.compress_bucket(flat, lay)
        # copies: a replayed payload is the graph's memory, residuals are live buffers
        copied = tuple(t.clone() for t in (payload if isinstance(payload, tuple) else (payload,)))
        residuals = [c.residual(n) for n in lay.names]
        sink = []
        with counting_launches() as decoded, torch_ops.deferred_checks(sink):
            agg = aggregate(copied, c.collective)
            total = (c.decompress(agg, ctx) if alone else c.decompress_bucket(agg, ctx)).clone()
        torch_ops.settle_checks(sink)
        out.append((copied, total, [None if r is None else r.clone() for r in residuals],
                    sum(launched.values()), sum(decoded.values())))
        del flat, payload, residuals
    if DEV == "cuda":
        torch.cuda.synchronize()
    return out


def aggregate(payload, collective):
    """Two ranks' aggregate of ``payload`` (this rank's, sent twice), as the collective
    makes it: a new tensor each step."""
    if collective == "allreduce":
        return payload[0] * 2
    return tuple(torch.cat([t, t]) for t in payload)


@pytest.mark.parametrize("spec,sizes", [(s, SIZES) for s in SPECS] + [
    (s, ALONE) for s in ALONE_SPECS if s in SPECS])
def test_a_replayed_compress_gives_the_eager_bits(spec, sizes, monkeypatch):
    """Every replayable spec on a bucket of six tensors; three on a tensor alone, whose
    eager steps take its own path (``compress``) and replayed ones a bucket of one."""
    eager = steps(spec, False, monkeypatch, sizes)
    before = dict(replay.STATS)
    replayed = steps(spec, True, monkeypatch, sizes)
    got = {k: replay.STATS[k] - before[k] for k in before}
    assert_same_steps(spec, sizes, eager, replayed)
    assert got["off"] == 0, f"{spec}: replay turned off ({got}); see the log"
    # compress: the first step eager, a graph per role of the bucket's two buffers (one
    # without error feedback); decompress: the first aggregate eager, one graph
    assert got == {"eager": 2, "replayed": 2 * (STEPS - 1), "off": 0,
                   "captured": 2 if "ef=0" in spec else 3}, (spec, got)
    for what, at in (("compress", 3), ("decompress", 4)) if DEV == "cuda" else ():
        launches = [r[at] for r in replayed[2:]]
        assert min(launches) == 0, (
            f"{spec}: every later {what} launched kernels ({launches}): not replayed")


def test_a_replayed_decompress_finds_a_malformed_index(monkeypatch):
    """An index past the bucket's end in an aggregate of the shape the graph was
    captured for: the check the graph makes again raises at the settle."""
    monkeypatch.setenv(replay.ENV_VAR, "1")
    lay = layout([f"t{i}" for i in range(len(SIZES))], [(n,) for n in SIZES])
    c = hvd_compress.from_spec("laplace_topk:density=0.01,padded=1")
    for step in range(4):
        payload, ctx = c.compress_bucket(laplace(lay.total, seed=step, device=DEV), lay)
        agg = aggregate(payload, c.collective)
        if step == 3:
            agg[-1][5] = lay.total + 7
        sink = []
        with torch_ops.deferred_checks(sink):
            c.decompress_bucket(agg, ctx)
        if step < 3:
            torch_ops.settle_checks(sink)
    with pytest.raises(ValueError, match="out of range"):
        torch_ops.settle_checks(sink)
