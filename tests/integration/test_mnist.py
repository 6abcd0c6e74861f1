"""MNIST-5k through real horovodrun -np 2 (the examples), same seed and steps:
top-k (1%, error feedback), Hylo's per-layer policy and DCT (>= 50x) within one point of uncompressed
training (test accuracy averaged over the last 5 of 15 epochs), and laplace_topk (1%, every tensor searched) within one point of exact top-k; aggregation-aware selection
(agg=leader, agg=hint) within one point of agg=local; the hierarchical exchange on 2
hosts x 2 workers within one point of the flat one; bytes saved are reported; no
progress bar under horovodrun, a line per epoch instead.

TensorFlow trains top-k and laplace_topk here; Hylo, DCT and the aggregation-aware runs
train on PyTorch only (each run costs 22-31 s of `make test`).  Their TensorFlow parts are
checked through real horovodrun at the aggregate level instead: the policy's
kernel_select and twobit, dct in buckets, and every agg= mode on 2 and 3 ranks against a
numpy reference (test_horovod_tensorflow.py), and the TF codecs against torch bit for bit
(tests/unit/test_dct*.py, test_hylo.py)."""
import functools
import io
import json
import sys

import pytest

from launch import ROOT, horovodrun

sys.path.insert(0, str(ROOT / "examples"))
from mnist_common import show_progress  # noqa: E402

EXAMPLES = {"pytorch": "examples/pytorch_mnist.py", "tensorflow": "examples/tensorflow2_mnist.py"}


@functools.lru_cache(maxsize=None)
def train(framework, spec, hosts=None, epochs=None):
    """One run of the example; ``hosts``: horovodrun's ``-H`` (default one host, 2
    workers); ``epochs``: default the example's (15)."""
    out_dir = ROOT / ".pytest_mnist"
    out_dir.mkdir(exist_ok=True)
    name = f"{framework}_{spec.replace(':', '_').replace('=', '')}_{hosts}_{epochs}"
    out = out_dir / f"{name}.json"
    np_ = sum(int(h.split(":")[1]) for h in hosts.split(",")) if hosts else 2
    # no --no-progress: as `make demo` runs them (test_no_progress_bar_under_horovodrun)
    more = ["--epochs", str(epochs)] if epochs else []
    rc, log = horovodrun([ROOT / EXAMPLES[framework], "--compression", spec,
                          "--json", out, *more], out_dir, timeout=900, np_=np_, hosts=hosts,
                         env={"HOROVOD_DYNAMIC_PROCESS_SETS": "1"} if hosts else None)
    assert rc == 0, log[-4000:]
    assert "final test accuracy" in log
    result = json.loads(out.read_text())
    out.unlink()
    return dict(result, log=log)


def final(run, key="test_accuracy"):
    return run["epochs_log"][-1][key]


def late(run, epochs=5):
    """Test accuracy averaged over the last ``epochs`` epochs: what "within one point"
    compares.  The last epoch alone moves by about a point from epoch to epoch on 1,000
    test digits (dense PyTorch, epochs 7-15 on one machine: 94.6-96.6%), and its value
    differs between CPUs (the same code gave Hylo 94.9% against dense 96.0% on one
    machine and passed on another)."""
    accs = [e["test_accuracy"] for e in run["epochs_log"][-epochs:]]
    return sum(accs) / len(accs)


@pytest.mark.parametrize("framework", ["pytorch", "tensorflow"])
def test_topk_within_one_point_of_uncompressed(framework):
    dense, topk = train(framework, "none"), train(framework, "topk:density=0.01")
    assert final(dense, "ratio") == pytest.approx(1.0)
    assert final(dense) > 0.9                                 # the baseline really learned
    assert late(topk) >= late(dense) - 0.01, (late(topk), late(dense))
    # 1% of the values, each sent as float32 value + int32 index: ~50x fewer bytes
    assert final(topk, "ratio") > 45


@pytest.mark.parametrize("framework", ["pytorch", "tensorflow"])
def test_laplace_topk_within_one_point_of_topk(framework):
    # small=0: every tensor through the seed-000 search.  By default tensors below the
    # framework's crossover take its exact top-k (PyTorch on the CPU: 2^27 values, every
    # tensor of this net), and the run would be topk's, bit for bit.
    topk = train(framework, "topk:density=0.01")
    laplace = train(framework, "laplace_topk:density=0.01,small=0")
    losses = [[e["loss"] for e in run["epochs_log"]] for run in (topk, laplace)]
    assert losses[0] != losses[1], "laplace_topk trained exactly as topk: no search ran"
    assert late(laplace) >= late(topk) - 0.01, (late(laplace), late(topk))
    assert final(laplace, "ratio") > 45


@pytest.mark.parametrize("framework", ["pytorch"])
def test_hylo_within_one_point_of_uncompressed(framework):
    dense, hylo = train(framework, "none"), train(framework, "hylo")
    assert late(hylo) >= late(dense) - 0.01, (late(hylo), late(dense))
    assert final(hylo, "ratio") > 5                  # conv2 kernels + 2-bit fc1 on this net


@pytest.mark.parametrize("framework", ["pytorch"])
def test_dct_at_50x_within_one_point_of_uncompressed(framework):
    dense, dct = train(framework, "none"), train(framework, "dct:density=0.01,block=64")
    assert final(dct, "ratio") >= 50
    assert late(dct) >= late(dense) - 0.01, (late(dct), late(dense))


@pytest.mark.parametrize("framework", ["pytorch"])
@pytest.mark.parametrize("agg", ["leader", "hint"])
def test_aggregation_aware_within_one_point_of_local(framework, agg):
    local, run = train(framework, "topk:density=0.01"), train(framework, f"topk:density=0.01,agg={agg}")
    assert late(run) >= late(local) - 0.01, (late(run), late(local))
    assert final(run, "union_over_k") >= 1.0 if agg == "hint" else final(run, "union_over_k") == 1.0


@pytest.mark.parametrize("framework", ["pytorch", "tensorflow"])
def test_no_progress_bar_under_horovodrun(framework):
    """`make demo` (-tf): horovodrun relays each worker's output line by line, prefixed,
    so a bar's every refresh would be a line of its own: no bar at all, one report line
    per epoch on rank 0 (the run is the one the accuracy tests use)."""
    run = train(framework, "topk:density=0.01")
    log, epochs = run["log"], len(run["epochs_log"])
    assert "\r" not in log and "it/s]" not in log and "%|" not in log, log[-2000:]
    lines = [line for line in log.splitlines() if "epoch " in line]
    assert len(lines) == epochs, lines
    assert all(line.startswith("[0]<stdout>:epoch ") for line in lines), lines


class _Stream(io.StringIO):
    def __init__(self, tty):
        super().__init__()
        self.tty = tty

    def isatty(self):
        return self.tty


def test_show_progress_only_on_a_terminal_outside_horovodrun(monkeypatch):
    for name in ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert show_progress(True, _Stream(True))
    assert not show_progress(False, _Stream(True))               # --no-progress, or rank > 0
    assert not show_progress(True, _Stream(False))               # piped or redirected
    assert not show_progress(True, object())                     # no isatty
    monkeypatch.setenv("HOROVOD_RANK", "0")                      # a horovodrun worker
    assert not show_progress(True, _Stream(True))


TWO_BY_TWO = "localhost:2,127.0.0.1:2"        # 2 hosts x 2 workers, both this machine


@pytest.mark.parametrize("framework", ["pytorch"])
def test_hierarchical_laplace_topk_within_one_point_of_flat_on_two_hosts_of_two(framework):
    """Issue 28: the same 4 workers, flat vs hier: (host sums, shards across hosts).  10
    epochs, not 15: four workers on CI's two cores made this the suite's longest test
    (173 s); the last 5 of 10 epochs are past 90% already."""
    flat = train(framework, "laplace_topk:density=0.01", TWO_BY_TWO, epochs=10)
    hier = train(framework, "hier:laplace_topk:density=0.01", TWO_BY_TWO, epochs=10)
    assert "hierarchical exchange: 2 hosts x 2 workers" in hier["log"]
    assert late(hier) >= late(flat) - 0.01, (late(hier), late(flat))
    assert final(flat) > 0.9
