"""Launch real ``horovodrun -np 2 --gloo`` and ``torchrun`` jobs and load what each rank
wrote."""
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
HOROVODRUN = Path(sys.executable).parent / "horovodrun"
TORCHRUN = Path(sys.executable).parent / "torchrun"


#: Gloo's timeout for one collective (Horovod's default is 30 s): on CI's two cores,
#: four TensorFlow workers once left a rank more than 30 s behind the others
GLOO_TIMEOUT_S = 300


def horovodrun(args, out_dir, timeout=600, env=None, np_=2, hosts=None,
               gloo_timeout=GLOO_TIMEOUT_S):
    """Run ``horovodrun -np 2 -H localhost:2 --gloo python <args>``; return (rc, output).
    ``hosts``: another ``-H`` (``"localhost:2,127.0.0.1:2"`` is two hosts of two workers,
    both this machine: Horovod sets local and cross ranks as for two machines).
    ``gloo_timeout``: seconds a rank waits in one collective (a job meant to fail by
    timing out passes Horovod's own 30)."""
    full_env = dict(os.environ, OUT_DIR=str(out_dir), PYTHONUNBUFFERED="1",
                    OMP_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="2", **(env or {}))
    cmd = [str(HOROVODRUN), "-np", str(np_), "-H", hosts or f"localhost:{np_}", "--gloo",
           "--gloo-timeout-seconds", str(gloo_timeout), sys.executable, *map(str, args)]
    proc = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True,
                          timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


def load_ranks(out_dir, prefix, n=2):
    return [dict(np.load(Path(out_dir) / f"{prefix}_rank{r}.npz", allow_pickle=False))
            for r in range(n)]


def run_job(cmd, timeout, env, cwd=ROOT, what=None):
    """Run ``cmd`` in its own process group, stdout and stderr merged; returns (rc,
    output).  On a timeout the group (a launcher and its workers) is killed and the test
    fails with ``what`` (default the command) and the end of the output, so a hang
    fails the test instead of leaving processes behind."""
    proc = subprocess.Popen([str(c) for c in cmd], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        pytest.fail(f"{what or cmd} hung for {timeout} s:\n{log[-6000:]}")
    return proc.returncode, log


def torchrun(args, out_dir, timeout=300, env=None):
    """``torchrun --nproc_per_node 2 --standalone <args>`` (a free port for the
    rendezvous) through :func:`run_job`; returns (rc, output).  Workers get ``OUT_DIR``
    and ``DDP_WORKER_TIMEOUT`` (15 s less than ``timeout``), and ``env``."""
    launcher = [str(TORCHRUN)] if TORCHRUN.exists() else [sys.executable, "-m",
                                                          "torch.distributed.run"]
    env = dict(os.environ, OUT_DIR=str(out_dir), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               DDP_WORKER_TIMEOUT=str(timeout - 15), **(env or {}))
    return run_job(launcher + ["--nproc_per_node", "2", "--standalone", *map(str, args)],
                   timeout, env, what=f"torchrun {list(map(str, args))}")
