"""The shaped-link helper (hvd_compress/shaped_link.py): a network namespace whose
loopback runs through tc's token bucket, always removed; a real 2-worker horovodrun job
inside it completes, and is slowed to the rate; and the step-time benchmark's worker
reports a split that adds up."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import HOROVODRUN, ROOT
from hvd_compress import shaped_link as sl

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
def test_refuses_clearly_without_root():
    cmd = [sys.executable, "-m", "hvd_compress.shaped_link", "--rate", "1gbit", "--", "true"]
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
