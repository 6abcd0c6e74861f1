"""The shaped-link helper (hvd_compress/tools/shaped_link.py): a network namespace whose
loopback runs through tc's token bucket, always removed; a real 2-worker horovodrun job
inside it completes, and is slowed to the rate; two hosts (a namespace each, a
full-duplex shaped veth link) are set up and always removed, and a real Horovod job
launched across them by the module's launcher computes the right sums at the full rate
each way; the step-time benchmark's worker reports a split that adds up, and its link
that changes mid-run changes."""
import importlib.util
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

from launch import HOROVODRUN, ROOT
from hvd_compress.tools import shaped_link as sl

needs_root = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("tc") is None,
                                reason="shaped links need root and tc (iproute2)")


def test_rate_is_checked():
    for bad in ("fast", "10", "1 gbit", "-1mbit", 100):
        with pytest.raises(ValueError, match="rate must be a tc rate"):
            with sl.shaped_link(bad):
                pass
    assert sl.check_rate("100Mbit") == "100mbit"


def test_plain_loopback_needs_nothing():
    with sl.shaped_link(None) as prefix:
        assert prefix == []


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv to drop root")
@pytest.mark.parametrize("mode", [[], ["--hosts", "2"]], ids=["loopback", "two_hosts"])
def test_refuses_clearly_without_root(mode):
    cmd = [sys.executable, "-m", "hvd_compress.tools.shaped_link", "--rate", "1gbit", *mode,
           "--", "true"]
    if os.geteuid() == 0:
        cmd = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] + cmd
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert done.returncode == 2
    assert "needs root" in done.stderr


@needs_root
def test_namespace_is_removed_when_the_command_fails():
    name = f"hvdc-test-{os.getpid()}"
    rc = sl.main(["--rate", "100mbit", "--name", name, "--",
                  "sh", "-c", "tc qdisc show dev lo | grep -q 'tbf' && exit 7"])
    assert rc == 7                                   # the command ran, shaped, and failed
    assert name not in sl.namespaces()
    with pytest.raises(RuntimeError, match="boom"):
        with sl.shaped_link("1gbit", name=name):
            assert name in sl.namespaces()
            raise RuntimeError("boom")
    assert name not in sl.namespaces()


@needs_root
def test_horovodrun_job_completes_inside_and_is_slowed_to_the_rate(tmp_path):
    cmd = [str(HOROVODRUN), "-np", "2", "-H", "localhost:2", "--gloo", sys.executable,
           str(ROOT / "tests/workers/shaped_worker.py"), str(tmp_path)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = sl.run(cmd, "100mbit", capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    result = json.loads((tmp_path / "shaped.json").read_text())
    # a 2-worker ring moves every byte once each way through the one shared bucket:
    # 7.5 MB reduced -> >= 15 MB through 100 Mbit/s (12.5 MB/s) -> >= 1.2 s; plain
    # loopback takes a few ms.  Allow a generous margin below the ideal.
    assert result["seconds"] > 0.6, result


def qdisc(ns, dev="hvd0"):
    return subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "show", "dev", dev],
                          capture_output=True, text=True).stdout


def test_two_hosts_checks_its_arguments():
    for bad in ("fast", "10", 100):
        with pytest.raises(ValueError, match="rate must be a tc rate"):
            with sl.two_hosts(bad):
                pass
    with pytest.raises(ValueError, match="needs a rate"):
        with sl.two_hosts(None):
            pass
    with pytest.raises(ValueError, match="n >= 2"):
        with sl.two_hosts("1gbit", n=1):
            pass
    with pytest.raises(ValueError, match="rate must be a tc rate"):
        sl.run_two_hosts(["true"], "1 gbit")


@needs_root
def test_two_hosts_are_set_up_and_always_removed():
    name = f"hvdc-test2h-{os.getpid()}"
    hosts_files = [os.path.join(sl.NETNS_ETC, f"{name}-h{i}") for i in range(3)]
    with pytest.raises(RuntimeError, match="boom"):
        with sl.two_hosts("100mbit", name=name) as h:
            assert h.namespaces == [f"{name}-h0", f"{name}-h1"]
            assert set(h.namespaces) <= set(sl.namespaces())
            assert h.addresses == ["10.77.0.1", "10.77.0.2"] and h.iface == "hvd0"
            for ns, addr in zip(h.namespaces, h.addresses):
                assert "tbf" in qdisc(ns) and "rate 100Mbit" in qdisc(ns)
                # the machine's hostname resolves to this host's own address inside it
                got = subprocess.run(h.prefix(h.namespaces.index(ns)) + [
                    "getent", "hosts", socket.gethostname()], capture_output=True, text=True)
                assert got.stdout.split()[0] == addr, got
            h.set_rate("1gbit")                               # what --change-link does
            assert all("rate 1Gbit" in qdisc(ns) for ns in h.namespaces)
            raise RuntimeError("boom")
    assert not [ns for ns in sl.namespaces() if ns.startswith(name)]
    assert not any(os.path.exists(d) for d in hosts_files)
    with sl.two_hosts("1gbit", n=3, name=name) as h:          # n > 2: through a bridge
        assert {f"{name}-h0", f"{name}-h1", f"{name}-h2", f"{name}-sw"} <= set(sl.namespaces())
        assert "tbf" in qdisc(f"{name}-sw", "p2") and "tbf" in qdisc(f"{name}-h2")
        assert all(os.path.exists(os.path.join(d, "hosts")) for d in hosts_files)
    assert not [ns for ns in sl.namespaces() if ns.startswith(name)]
    assert not any(os.path.exists(d) for d in hosts_files)


@needs_root
@pytest.mark.parametrize("n", [2, 3])
def test_horovod_job_across_two_hosts_sums_right(tmp_path, n):
    """n=2: a veth pair; n=3: through a bridge, and a process set of ranks 0 and 1."""
    out, err = io.StringIO(), io.StringIO()
    rc = sl.run_two_hosts([sys.executable, ROOT / "tests/workers/two_host_worker.py", tmp_path],
                          "1gbit", np=n, timeout=120, cwd=ROOT, stdout=out, stderr=err,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert rc == 0, (out.getvalue() + err.getvalue())[-4000:]
    for r in range(n):
        assert f"[{r}]<stdout>:rank {r} done" in out.getvalue()
    ranks = [json.loads((tmp_path / f"two_host_rank{r}.json").read_text()) for r in range(n)]
    total = n * (n + 1) / 2                                         # sum of rank + 1
    for r, got in enumerate(ranks):
        assert got["rank"] == r and got["size"] == n and got["gloo_iface"] == "hvd0"
        assert (got["local_rank"], got["local_size"]) == (0, 1)     # one worker per host
        assert (got["cross_rank"], got["cross_size"]) == (r, n)
        assert got["summed"] == [total, total]
        assert got["averaged"] == [total / n, total / n]
        assert got["broadcast"] == [0.0, 2.0, 4.0, 6.0, 8.0]        # from rank 1
        assert got["gathered"] == [[q, 10 * q] for q in range(n)]
        assert got["hostname_resolves_to"] == f"10.77.0.{r + 1}"    # each on its own host
        assert got["objects"] == [{"rank": q, "host": f"10.77.0.{q + 1}"} for q in range(n)]
        assert got["pair_sum"] == (3.0 if n > 2 and r < 2 else None)
    assert not [ns for ns in sl.namespaces() if ns.startswith(f"hvdc{os.getpid()}-")]


@needs_root
def test_two_hosts_have_the_rate_each_way(tmp_path):
    """The same 7.5 MB of allreduce as the loopback test: a 2-worker ring sends every byte
    once each way, at once; each direction has its own 100 Mbit/s bucket, so ~0.6 s (the
    shared loopback bucket: ~1.2 s)."""
    rc = sl.run_two_hosts([sys.executable, ROOT / "tests/workers/shaped_worker.py", tmp_path],
                          "100mbit", timeout=120, stdout=io.StringIO(), stderr=io.StringIO())
    assert rc == 0
    seconds = json.loads((tmp_path / "shaped.json").read_text())["seconds"]
    assert 0.45 < seconds < 1.0, seconds


@needs_root
def test_launcher_stops_the_others_when_one_fails_and_on_timeout():
    with sl.two_hosts("1gbit") as h:
        start = time.monotonic()
        rc = sl.run_on_hosts(h, ["sh", "-c", "[ $HOROVOD_RANK = 1 ] && exit 5; sleep 60"],
                             stdout=io.StringIO(), stderr=io.StringIO())
        assert rc == 5 and time.monotonic() - start < 30
        with pytest.raises(subprocess.TimeoutExpired):
            sl.run_on_hosts(h, ["sleep", "60"], timeout=2, stdout=io.StringIO(),
                            stderr=io.StringIO())
        assert time.monotonic() - start < 40
        out = io.StringIO()
        assert sl.run_on_hosts(h, ["sh", "-c", "echo $HOROVOD_HOSTNAME $HOROVOD_GLOO_IFACE"],
                               stdout=out) == 0
        assert sorted(out.getvalue().splitlines()) == ["[0]<stdout>:10.77.0.1 hvd0",
                                                       "[1]<stdout>:10.77.0.2 hvd0"]


@needs_root
def test_step_time_link_that_changes_mid_run():
    spec = importlib.util.spec_from_file_location("step_time", ROOT / "benchmarks/step_time.py")
    st = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(st)
    assert st.parse_change("1gbit:100mbit@8") == ("1gbit", "100mbit", 8)
    for bad in ("1gbit:100mbit", "1gbit@3", "fast:slow@2", "1gbit:100mbit@0"):
        with pytest.raises(ValueError):
            st.parse_change(bad)
    with sl.two_hosts("1gbit") as h:
        rows = st.run_pair(st.hosts_launch(h), "1gbit-then-100mbit-2host", "mnist_cnn",
                           ["none", "topk:density=0.01"], 2 + 1 + 2, 1, 300,
                           (h, "1gbit", "100mbit", 2, 1))
        assert "rate 100Mbit" in qdisc(h.namespaces[0])             # left at the 2nd rate
    assert [(r["spec"], r["phase"], r["phase_rate"]) for r in rows] == [
        ("none", 1, "1gbit"), ("none", 2, "100mbit"),
        ("topk:density=0.01", 1, "1gbit"), ("topk:density=0.01", 2, "100mbit")]
    for r in rows:
        assert r["steps"] == 2 and len(r["step_totals"]) == 2 and r["total"] > 0
        # each compressor starts on the first rate and is moved to the second once
        assert [c["rate"] for c in r["link_changes"]] == ["1gbit", "100mbit"]
    assert "phase 2 (100mbit)" in st.table(rows, "1gbit-then-100mbit-2host")


def test_step_time_worker_reports_a_split_that_adds_up(tmp_path):
    out = tmp_path / "st.json"
    cmd = [str(HOROVODRUN), "-np", "2", "-H", "localhost:2", "--gloo", sys.executable,
           str(ROOT / "benchmarks/step_time_worker.py"), "--model", "mnist_cnn",
           "--specs", "horovod;none;topk:density=0.01;twobit", "--steps", "1",
           "--warmup", "1", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    rows = {r["spec"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"horovod", "none", "topk:density=0.01", "twobit"}
    for r in rows.values():
        parts = [r[k] for k in ("compute", "compress", "communicate", "decompress", "other")]
        assert all(p >= 0 for p in parts)
        assert sum(parts) == pytest.approx(r["total"], rel=1e-6, abs=1e-6)   # one step
        assert r["n_params"] == 80_202 and r["n_tensors"] == 8
    assert rows["none"]["sent"] == rows["horovod"]["sent"] == 4 * 80_202
    assert rows["topk:density=0.01"]["sent"] < rows["none"]["sent"] / 40
    assert rows["topk:density=0.01"]["compress"] > 0 and rows["twobit"]["decompress"] > 0
