"""``auto`` on a real link (horovodrun -np 2): inside a namespace shaped to 100 Mbit/s
it chooses a sparsifier for the large bucket; on plain loopback none or fp16 for every
bucket.  The shaped case needs root (tc), like tests/integration/test_shaped_link.py."""
import json
import re
import os
import shutil
import subprocess
import sys

import pytest

from launch import HOROVODRUN, ROOT
from hvd_compress.tools import shaped_link as sl

WORKER = ROOT / "tests" / "workers" / "auto_link_worker.py"


def run_auto(tmp_path, prefix):
    argv = prefix + [str(HOROVODRUN), "-np", "2", "-H", "localhost:2", "--gloo",
                     sys.executable, str(WORKER), str(tmp_path)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert re.search(r"hvd_compress auto at step \d+ \(calibration\)", done.stdout)  # rank 0
    with open(tmp_path / "auto_link.json") as f:
        return json.load(f)


def test_plain_loopback_chooses_none_or_fp16_everywhere(tmp_path):
    """Decided from measured times, so a hiccup of this 2-core machine during the 20
    calibration steps can tip it (seen in 2 of about 6 full runs): a second, independent
    launch decides again, and one of the two must choose dense everywhere.  Both launches
    tipped once in CI, each keeping a compressor its trial measured 4% faster than dense;
    since then a tie (under ``trial_margin``, 5%) keeps dense."""
    runs = []
    for attempt in range(2):
        (tmp_path / str(attempt)).mkdir()
        got = run_auto(tmp_path / str(attempt), [])
        assert got["choices"], got
        runs.append(got)
        if all(spec.split(":")[0] in ("none", "fp16") for spec in got["choices"].values()):
            return
    raise AssertionError(f"auto chose a compressor on plain loopback in both launches: {runs}")


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("tc") is None,
                    reason="shaped links need root and tc (iproute2)")
def test_100mbit_chooses_a_sparsifier_for_the_large_bucket(tmp_path):
    with sl.shaped_link("100mbit") as prefix:
        got = run_auto(tmp_path, prefix)
    large = max(got["sizes"], key=got["sizes"].get)
    assert got["sizes"][large] >= 1_000_000
    assert got["choices"][large].startswith("laplace_topk"), got
