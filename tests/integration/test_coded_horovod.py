"""Coded synchronous SGD (seed 003) through real ``horovodrun -np 3`` and ``-np 4`` jobs in
both frameworks (tests/workers/coded_worker.py); in one process: tests/unit/test_coded.py."""
from math import ceil, comb

import numpy as np
import pytest

from launch import ROOT, horovodrun, load_ranks
from hvd_compress.coded.exchange import HEADER
from reference import MAX, fixed_reference


# -- real horovodrun jobs -----------------------------------------------------------------

JOBS = [("torch", 3, {"HOROVOD_DYNAMIC_PROCESS_SETS": "1"}), ("torch", 4, {"STATIC_SETS": "1"}),
        ("tf", 3, {"HOROVOD_DYNAMIC_PROCESS_SETS": "1"}), ("tf", 4, {"STATIC_SETS": "1"})]


@pytest.fixture(scope="module")
def coded_jobs(tmp_path_factory):
    out = tmp_path_factory.mktemp("coded_jobs")
    for framework, n, env in JOBS:
        rc, log = horovodrun([ROOT / "tests/workers/coded_worker.py", framework], out,
                             np_=n, env=env)
        assert rc == 0, log[-6000:]
    return {(f, n): load_ranks(out, f"coded_{f}_{n}", n) for f, n, _ in JOBS}


def cases(n):
    return [(r, ex) for r in range(1, n)
            for ex in ("multicast", "multicast_alltoall", "reduce_scatter")] + \
        [(1, "allreduce"), (n, "multicast")]


@pytest.mark.parametrize("framework,n", [(f, n) for f, n, _ in JOBS])
def test_every_rank_gets_the_fixed_point_sum_bit_for_bit(coded_jobs, framework, n):
    ranks = coded_jobs[(framework, n)]
    for r, ex in cases(n):
        key = f"{r}|{ex}"
        got = ranks[0][f"{key}|got"]
        for other in ranks[1:]:
            assert np.array_equal(other[f"{key}|got"].view(np.int32), got.view(np.int32)), key
        parts, full = ranks[0][f"{key}|parts"], ranks[0][f"{key}|full"]
        assert len(parts) == comb(n, r)
        if ex == "allreduce":
            np.testing.assert_allclose(got, parts.sum(0), rtol=1e-5, atol=1e-7)
            continue
        want = fixed_reference(parts)
        assert np.array_equal(got.view(np.int32), want.view(np.int32)), key
        # and the plain full-batch gradient, within the fixed point's resolution
        tol = len(parts) * 10.0 / MAX + 1e-6 * np.abs(full).max()
        assert np.abs(got - full).max() <= tol, (key, np.abs(got - full).max(), tol)


@pytest.mark.parametrize("framework,n", [(f, n) for f, n, _ in JOBS])
def test_bytes_sent_per_worker_equal_the_formula(coded_jobs, framework, n):
    for rank in coded_jobs[(framework, n)]:
        for r, ex in cases(n):
            sent, received, handed, clipped = rank[f"{r}|{ex}|bytes"]
            D = len(rank[f"{r}|{ex}|got"])
            assert clipped == 0
            if ex.startswith("multicast") and r < n:
                seg = ceil((D + HEADER) / r)   # + the sender's NaN flag, r part checksums
                assert sent == comb(n - 1, r) * (seg + 1 + r) * 4
                # a process-set allgather gets each packet once; alltoall one per receiver
                assert handed == sent * (1 if ex == "multicast" else r)
                assert received == r * sent
                # the paper's load (1/r)(1 - r/n) of all C(n, r) parts, up to the padding
                load = sent / (comb(n, r) * (D + HEADER) * 4)
                assert load == pytest.approx((1 / r) * (1 - r / n),
                                             rel=r * (seg + 1 + r) / (D + HEADER) - 1 + 1e-9)
            elif ex == "reduce_scatter":
                s = ceil((D + HEADER) / n)
                assert sent == (n - r) * (s + 1) * 4 + (n - 1) * (s + 2) * 4
                assert received == sent
                assert handed == (n - r) * (s + 1) * 4 + (s + 2) * 4
            elif ex == "allreduce":
                assert sent == 2 * (n - 1) * D * 4 // n and handed == D * 4
            else:                                # r == n: nothing to exchange
                assert sent == received == 0


@pytest.mark.parametrize("framework,n", [(f, n) for f, n, _ in JOBS])
def test_clipping_is_counted_reported_and_exact(coded_jobs, framework, n):
    ranks = coded_jobs[(framework, n)]
    parts = ranks[0]["clip|multicast|parts"]
    expected = int((np.abs(parts) > 0.5).sum())
    assert expected > 0
    for rank in ranks:
        for ex in ("multicast", "reduce_scatter"):
            clipped, saturated, warned = rank[f"clip|{ex}|counts"]
            assert clipped == expected and warned == 1, (ex, rank[f"clip|{ex}|counts"])
            assert np.array_equal(rank[f"clip|{ex}|got"], ranks[0][f"clip|{ex}|got"])
        assert np.array_equal(rank["clip|multicast|got"].view(np.int32),
                              fixed_reference(parts, 0.5).view(np.int32))


@pytest.mark.parametrize("framework,n", [(f, n) for f, n, _ in JOBS])
def test_disagreeing_ranks_and_nan_fail_on_every_rank(coded_jobs, framework, n):
    for rank in coded_jobs[(framework, n)]:
        assert "redundancy per rank" in str(rank["fail|redundancy"])
        assert "batch_size per rank" in str(rank["fail|batch"])
        assert "exchange per rank" in str(rank["fail|exchange"])
        for ex in ("multicast", "reduce_scatter", "allreduce"):
            assert "NaN/Inf" in str(rank[f"nan|{ex}"]), (ex, rank[f"nan|{ex}"])
        for r, ex in ((2, "multicast"), (2, "multicast_alltoall"), (n, "multicast")):
            assert "not computed alike" in str(rank[f"differ|{r}|{ex}"]), (r, ex)


def test_torch_dropout_is_seeded_per_part_so_replicas_agree(coded_jobs):
    for n in (3, 4):
        ranks = coded_jobs[("torch", n)]
        for rank in ranks[1:]:
            assert np.array_equal(rank["dropout|got"], ranks[0]["dropout|got"])


def test_a_killed_worker_fails_the_job_instead_of_hanging(tmp_path):
    import time
    start = time.monotonic()
    rc, log = horovodrun([ROOT / "tests/workers/coded_worker.py", "torch", "die"], tmp_path,
                         np_=3, env={"HOROVOD_DYNAMIC_PROCESS_SETS": "1"}, timeout=300,
                         gloo_timeout=30)
    assert rc != 0 and "unexpected" not in log
    assert "HorovodInternalError" in log or "Connection reset" in log, log[-3000:]
    assert time.monotonic() - start < 120


def test_mnist_dnn_cssgd_within_one_point_of_ssgd(tmp_path):
    """examples/cssgd_mnist.py on -np 3: CSSGD with r = 2 (the fastest r in
    benchmarks/cssgd.py) and SSGD, same seed and samples per step, 5 epochs."""
    import json
    acc = {}
    for name, args in (("ssgd", ["--exchange", "ssgd", "-r", "1"]),
                       ("cssgd", ["--exchange", "multicast", "-r", "2"])):
        out = tmp_path / f"{name}.json"
        rc, log = horovodrun([ROOT / "examples/cssgd_mnist.py", *args, "--epochs", "5",
                              "--no-progress", "--json", out], tmp_path, np_=3,
                             env={"HOROVOD_DYNAMIC_PROCESS_SETS": "1"})
        assert rc == 0, log[-4000:]
        rows = json.loads(out.read_text())["epochs_log"]
        acc[name] = rows[-1]["test_accuracy"]
        assert rows[-1]["clipped"] == 0
    assert acc["ssgd"] > 0.85, acc
    assert abs(acc["cssgd"] - acc["ssgd"]) <= 0.01, acc
