"""``auto`` on a real link (horovodrun -np 2): inside a namespace shaped to 100 Mbit/s
it chooses a sparsifier for the large bucket; on plain loopback it compresses only where
it measured a win over dense.  The shaped case needs root (tc), like
tests/integration/test_shaped_link.py."""
import json
import re
import os
import shutil
import subprocess
import sys

import pytest

from launch import HOROVODRUN, ROOT
from hvd_compress import Auto
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


def test_plain_loopback_compresses_only_where_measured_faster(tmp_path):
    """On plain loopback auto sees a fast link, and keeps a compressor for a bucket only
    where the combination it chose was measured ``trial_margin`` (5%) faster than dense
    everywhere, both timed for real in this launch.

    This test used to assert that loopback chooses ``none`` or ``fp16`` everywhere.  Since
    the CPU codecs got cheaper (bucket residuals), laplace_topk at 1% on the 1M-value
    tensor ties with a 4 MB loopback allreduce on this 2-core machine, and in CI both of
    two launches measured a compressed mix 7-15% faster than dense and kept it: a real
    measurement, not a wrong decision.  What must hold on a fast link is that compressing
    was paid for by a measured win."""
    got = run_auto(tmp_path, [])
    assert got["choices"], got
    # the link fit: loopback moves gigabytes per second (100 Mbit/s is 1.25e7 B/s)
    assert got["decision"]["beta_Bps"] > 2e8, got["decision"]
    if all(spec.split(":")[0] in ("none", "fp16") for spec in got["choices"].values()):
        return
    trials, measured, choice = got["trials"], got["measured"], got["choice"]
    dense = {key: 0 for key in choice}
    assert dense in trials, f"auto compressed on plain loopback without timing dense: {got}"
    base, chosen = measured[trials.index(dense)], measured[trials.index(choice)]
    assert chosen < base * (1 - Auto.trial_margin), \
        f"auto compressed without a measured {Auto.trial_margin:.0%} win: {got}"


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("tc") is None,
                    reason="shaped links need root and tc (iproute2)")
def test_100mbit_chooses_a_sparsifier_for_the_large_bucket(tmp_path):
    with sl.shaped_link("100mbit") as prefix:
        got = run_auto(tmp_path, prefix)
    large = max(got["sizes"], key=got["sizes"].get)
    assert got["sizes"][large] >= 1_000_000
    assert got["choices"][large].startswith("laplace_topk"), got
