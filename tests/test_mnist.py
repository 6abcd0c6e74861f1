"""MNIST-5k through real horovodrun -np 2 (the examples), same seed and steps:
top-k (1%, error feedback), Hylo's per-layer policy and DCT (>= 50x) within one point of uncompressed
training, and laplace_topk (1%) within one point of exact top-k; aggregation-aware selection
(agg=leader, agg=hint) within one point of agg=local; bytes saved are reported."""
import functools
import json

import pytest

from conftest import ROOT, horovodrun

EXAMPLES = {"pytorch": "examples/pytorch_mnist.py", "tensorflow": "examples/tensorflow2_mnist.py"}


@functools.lru_cache(maxsize=None)
def train(framework, spec):
    out_dir = ROOT / ".pytest_mnist"
    out_dir.mkdir(exist_ok=True)
    out = out_dir / f"{framework}_{spec.replace(':', '_').replace('=', '')}.json"
    rc, log = horovodrun([ROOT / EXAMPLES[framework], "--compression", spec, "--no-progress",
                          "--json", out], out_dir, timeout=900)
    assert rc == 0, log[-4000:]
    assert "final test accuracy" in log
    result = json.loads(out.read_text())
    out.unlink()
    return result


def final(run, key="test_accuracy"):
    return run["epochs_log"][-1][key]


@pytest.mark.parametrize("framework", ["pytorch", "tensorflow"])
def test_topk_within_one_point_of_uncompressed(framework):
    dense, topk = train(framework, "none"), train(framework, "topk:density=0.01")
    assert final(dense, "ratio") == pytest.approx(1.0)
    assert final(dense) > 0.9                                 # the baseline really learned
    assert final(topk) >= final(dense) - 0.01, (final(topk), final(dense))
    # 1% of the values, each sent as float32 value + int32 index: ~50x fewer bytes
    assert final(topk, "ratio") > 45


@pytest.mark.parametrize("framework", ["pytorch", "tensorflow"])
def test_laplace_topk_within_one_point_of_topk(framework):
    topk, laplace = train(framework, "topk:density=0.01"), train(framework, "laplace_topk:density=0.01")
    assert final(laplace) >= final(topk) - 0.01, (final(laplace), final(topk))
    assert final(laplace, "ratio") > 45


@pytest.mark.parametrize("framework", ["pytorch", "tensorflow"])
def test_hylo_within_one_point_of_uncompressed(framework):
    dense, hylo = train(framework, "none"), train(framework, "hylo")
    assert final(hylo) >= final(dense) - 0.01, (final(hylo), final(dense))
    assert final(hylo, "ratio") > 5                  # conv2 kernels + 2-bit fc1 on this net


@pytest.mark.parametrize("framework", ["pytorch", "tensorflow"])
def test_dct_at_50x_within_one_point_of_uncompressed(framework):
    dense, dct = train(framework, "none"), train(framework, "dct:density=0.01,block=64")
    assert final(dct, "ratio") >= 50
    assert final(dct) >= final(dense) - 0.01, (final(dct), final(dense))


@pytest.mark.parametrize("framework", ["pytorch", "tensorflow"])
@pytest.mark.parametrize("agg", ["leader", "hint"])
def test_aggregation_aware_within_one_point_of_local(framework, agg):
    local, run = train(framework, "topk:density=0.01"), train(framework, f"topk:density=0.01,agg={agg}")
    assert final(run) >= final(local) - 0.01, (final(run), final(local))
    assert final(run, "union_over_k") >= 1.0 if agg == "hint" else final(run, "union_over_k") == 1.0
