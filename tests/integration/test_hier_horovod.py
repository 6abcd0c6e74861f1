"""The hierarchical exchange (``hier:``, issue 28) through real ``horovodrun`` on 2 hosts
x 2 workers (``-H localhost:2,127.0.0.1:2``: both "hosts" are this machine, Horovod's
local and cross ranks are set as for two machines; tests/workers/hier_worker.py; PyTorch
with dynamic process sets, TensorFlow with the sets given to hvd.init), on
uneven hosts (2 + 1), and (as root) through the two-host harness with two workers per
host (hvd_compress.tools.shaped_link.run_two_hosts(per_host=2): two network namespaces
joined by a 100 Mbit/s link, the workers of a host on its own loopback).  The aggregates are checked against the numpy reference of the
scheme in tests/reference.py; in one process: tests/unit/test_hierarchical.py."""
import io
import os
import shutil
import sys

import numpy as np
import pytest

from launch import ROOT, horovodrun, load_ranks
from reference import hier_pieces, hier_reference, topk_mask

WORKER = ROOT / "tests/workers/hier_worker.py"
SHAPES = {"a.weight": (40, 30), "b.weight": (30, 20), "c.bias": (7,)}
HOSTS, L = 2, 2


def grad(rank, step, name):          # as the worker makes them
    seed = 1000 * step + 10 * rank + list(SHAPES).index(name)
    return np.random.RandomState(seed).standard_normal(SHAPES[name]).astype(np.float32)


def topk(c):
    return np.where(topk_mask(c, 0.05), c, 0).astype(np.float32)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    out = tmp_path_factory.mktemp("hier_jobs")
    rc, log = horovodrun([WORKER, "torch"], out, np_=4, hosts="localhost:2,127.0.0.1:2",
                         env={"HOROVOD_DYNAMIC_PROCESS_SETS": "1"})
    assert rc == 0, log[-6000:]
    rc, log = horovodrun([WORKER, "torch"], out, np_=3, hosts="localhost:2,127.0.0.1:1",
                         env={"MODE": "uneven"})
    assert rc == 0, log[-6000:]
    rc, log = horovodrun([WORKER, "tf"], out, np_=4, hosts="localhost:2,127.0.0.1:2")
    assert rc == 0, log[-6000:]
    jobs = {"torch": load_ranks(out, "hier_torch_main", 4),
            "tf": load_ranks(out, "hier_tf_main", 4),
            "uneven": load_ranks(out, "hier_torch_uneven", 3)}
    if os.geteuid() == 0 and shutil.which("tc"):
        from hvd_compress.tools import shaped_link as sl
        log = io.StringIO()
        rc = sl.run_two_hosts([sys.executable, WORKER, "torch"], "100mbit", np=4, per_host=2,
                              timeout=300, cwd=ROOT, stdout=log, stderr=log,
                              env=dict(os.environ, OMP_NUM_THREADS="1", OUT_DIR=str(out),
                                       MODE="harness", HOROVOD_DYNAMIC_PROCESS_SETS="1"))
        assert rc == 0, log.getvalue()[-6000:]
        jobs["harness"] = load_ranks(out, "hier_torch_harness", 4)
    return jobs


VIA = ["torch", "tf", "harness"]


def _ranks(jobs, via):
    if via not in jobs:
        pytest.skip("the two-host harness needs root and tc (iproute2)")
    return jobs[via]


def _layout(names):
    numels = [int(np.prod(SHAPES[n])) for n in names]
    offsets = list(np.cumsum([0] + numels[:-1]))
    return numels, offsets, sum(numels)


@pytest.mark.parametrize("via", VIA)
def test_horovod_gives_two_hosts_of_two_workers(jobs, via):
    places = [tuple(r["places"]) for r in _ranks(jobs, via)]
    # (rank, local_rank, local_size, cross_rank, cross_size), host by host
    assert places == [(0, 0, 2, 0, 2), (1, 1, 2, 0, 2), (2, 0, 2, 1, 2), (3, 1, 2, 1, 2)]


@pytest.mark.parametrize("via", VIA)
def test_a_bucket_every_rank_ends_with_the_reference_aggregate(jobs, via):
    ranks = _ranks(jobs, via)
    names = [str(n) for n in ranks[0]["bucket_order"]]
    numels, offsets, total = _layout(names)
    pieces = hier_pieces(names, offsets, numels, total, L)
    residual = {}
    for s in range(3):
        flat = [np.concatenate([grad(r, s, n).reshape(-1) for n in names]) for r in range(4)]
        want = hier_reference(flat, HOSTS, pieces, topk, residual)
        for r, rank in enumerate(ranks):
            got = np.concatenate([rank[f"bucket|{s}|{n}"].reshape(-1) for n in names])
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5,
                                       err_msg=f"rank {r} step {s}")
            np.testing.assert_array_equal(got, np.concatenate(
                [ranks[0][f"bucket|{s}|{n}"].reshape(-1) for n in names]))
    # error feedback: each piece's residual lives on the worker that compresses it
    for r, rank in enumerate(ranks):
        h, lr = divmod(r, L)
        mine = {name for shard, name, _, _ in pieces if shard == lr}
        kept = {k.split("|", 2)[2] for k in rank if k.startswith("bucket|residual|")}
        assert kept == mine, (r, kept, mine)
        for name in mine:
            np.testing.assert_allclose(rank[f"bucket|residual|{name}"], residual[(h, name)],
                                       rtol=1e-5, atol=1e-5, err_msg=f"rank {r} {name}")


def test_only_the_compressed_shard_crosses_hosts(jobs):
    for rank in jobs["torch"]:
        sent, dense, host_sent = rank["bucket|2|stats"]
        assert dense == 4 * 1807
        # about half the bucket's top 5% (this worker's shard), values and indices
        assert 0 < sent < dense / 8, (sent, dense)
        assert host_sent >= 4 * 1807 // 2, host_sent      # the dense traffic inside the host


@pytest.mark.parametrize("via", VIA)
def test_a_checkpoint_restores_bit_for_bit(jobs, via):
    for r, rank in enumerate(_ranks(jobs, via)):
        for n in SHAPES:
            np.testing.assert_array_equal(rank[f"restored|2|{n}"], rank[f"bucket|2|{n}"],
                                          err_msg=f"rank {r} {n}")


@pytest.mark.parametrize("via", ["torch", "tf"])
def test_tensor_by_tensor_and_the_mean(jobs, via):
    ranks = jobs[via]
    residual = {}
    for s in range(2):
        for n in SHAPES:
            numel = int(np.prod(SHAPES[n]))
            pieces = hier_pieces([n], [0], [numel], numel, L)
            g = [grad(r, s, n).reshape(-1) for r in range(4)]
            want = hier_reference(g, HOSTS, pieces, topk, residual.setdefault(n, {})) / 4
            for r, rank in enumerate(ranks):
                np.testing.assert_allclose(rank[f"tensor|{s}|{n}"].reshape(-1), want,
                                           rtol=1e-5, atol=1e-6, err_msg=f"rank {r} {n} {s}")


@pytest.mark.parametrize("via", ["torch", "tf"])
def test_ranks_configured_differently_fail_on_every_rank(jobs, via):
    for rank in jobs[via]:
        msg = str(rank["mismatch_error"])
        assert "configured differently" in msg and "density=0.1" in msg, msg


def test_uneven_hosts_are_a_clear_error_on_every_rank(jobs):
    for rank in jobs["uneven"]:
        msg = str(rank["uneven_error"])
        assert "uneven hosts" in msg and "rank 2: 1" in msg, msg


@pytest.mark.parametrize("via", VIA)
def test_auto_switches_flat_to_hier_to_dense_and_leaves_no_residual_behind(jobs, via):
    """auto (topk | hier:topk | none, one calibration step each): step 0 is the flat
    top-k sum; after the dense step 2 the three aggregates add up to every worker's
    gradients, so the residuals moved between the flat and the hierarchical scheme (flat
    residuals outside a worker's shard, then the shard pieces) were all sent."""
    ranks = _ranks(jobs, via)
    for n in SHAPES:
        for s in range(3):
            for r, rank in enumerate(ranks):
                np.testing.assert_array_equal(rank[f"auto|{s}|{n}"], ranks[0][f"auto|{s}|{n}"],
                                              err_msg=f"rank {r} {n} step {s}")
        flat0 = sum(topk(grad(r, 0, n).reshape(-1)) for r in range(4))
        np.testing.assert_allclose(ranks[0][f"auto|0|{n}"].reshape(-1), flat0, rtol=1e-5,
                                   atol=1e-5)
        total = sum(grad(r, s, n).astype(np.float64) for r in range(4) for s in range(3))
        got = sum(ranks[0][f"auto|{s}|{n}"].astype(np.float64) for s in range(3))
        np.testing.assert_allclose(got, total, rtol=1e-5, atol=1e-4, err_msg=n)
    if via != "tf":                 # the host's dense bytes: only the hier: step has them
        for rank in ranks:
            host = [rank[f"auto|{s}|stats"][2] for s in range(3)]
            assert host[0] == 0 and host[1] > 0 and host[2] == 0, host


@pytest.mark.parametrize("via", VIA)
def test_the_workers_of_a_host_use_shared_memory(jobs, via):
    """The aggregates above came through the shared-memory transport inside each host
    (hvd_compress/exchange/shared_host.py): PyTorch, and TensorFlow's eager tape (its
    tf.function steps, the tensor-by-tensor case, go through Horovod's collectives)."""
    for rank in _ranks(jobs, via):
        assert str(rank["host_transport"]) == "SharedHost"
