"""MNIST-5k through real horovodrun -np 2: top-k (1%, error feedback) ends within one
point of uncompressed training with the same seed and steps, and reports bytes saved."""
import json

import pytest

from conftest import ROOT, horovodrun

EXAMPLES = {"pytorch": "examples/pytorch_mnist.py", "tensorflow": "examples/tensorflow2_mnist.py"}


def train(framework, spec, out_dir):
    out = out_dir / f"{framework}_{spec.replace(':', '_')}.json"
    rc, log = horovodrun([ROOT / EXAMPLES[framework], "--compression", spec, "--no-progress",
                          "--json", out], out_dir, timeout=900)
    assert rc == 0, log[-4000:]
    assert "final test accuracy" in log
    return json.loads(out.read_text())


@pytest.mark.parametrize("framework", ["pytorch", "tensorflow"])
def test_topk_within_one_point_of_uncompressed(framework, tmp_path):
    dense = train(framework, "none", tmp_path)
    topk = train(framework, "topk:density=0.01", tmp_path)
    assert dense["epochs_log"][-1]["ratio"] == pytest.approx(1.0)
    acc_dense = dense["epochs_log"][-1]["test_accuracy"]
    acc_topk = topk["epochs_log"][-1]["test_accuracy"]
    assert acc_dense > 0.9                                   # the baseline really learned
    assert acc_topk >= acc_dense - 0.01, (acc_topk, acc_dense)
    # 1% of the values, each sent as float32 value + int32 index: ~50x fewer bytes
    assert topk["epochs_log"][-1]["ratio"] > 45
