"""hvd_compress.ddp under Hugging Face Accelerate: one ``torchrun --nproc_per_node 2``
launch (CPU, Gloo) of tests/workers/accelerate_worker.py, which registers the hook on the
model ``accelerator.prepare`` returned.  Both ranks end equal; every step went through the
hook and sent fewer bytes than dense.  No Horovod."""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from launch import ROOT

TORCHRUN = Path(sys.executable).parent / "torchrun"
STEPS = 5
DENSE = 4 * (4 * 25 + 4 + 10 * 256 + 10)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("accelerate")
    env = dict(os.environ, OUT_DIR=str(out), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    proc = subprocess.Popen([str(TORCHRUN), "--nproc_per_node", "2", "--standalone",
                             str(ROOT / "tests/workers/accelerate_worker.py")], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        pytest.fail(f"torchrun hung:\n{log[-6000:]}")
    assert proc.returncode == 0, log[-6000:]
    return ([json.load(open(out / f"accelerate_rank{r}.json")) for r in range(2)],
            [dict(np.load(out / f"accelerate_rank{r}.npz")) for r in range(2)])


def test_accelerate_prepare_then_register(job):
    info, params = job
    assert sorted(i["rank"] for i in info) == [0, 1] and info[0]["world"] == 2
    for i in info:
        assert i["names"] == ["0.bias", "0.weight", "3.bias", "3.weight"]
        s = i["stats"]
        assert s["steps"] == STEPS and s["total_dense"] == STEPS * DENSE
        assert 0 < s["total_sent"] < s["total_dense"] / 5, s
    for n in params[0]:
        np.testing.assert_array_equal(params[0][n], params[1][n], err_msg=n)
