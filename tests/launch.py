"""Launch real ``horovodrun -np 2 --gloo`` jobs and load what each rank wrote."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
HOROVODRUN = Path(sys.executable).parent / "horovodrun"


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
