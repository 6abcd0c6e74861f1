"""hvd_compress.ddp under Hugging Face Accelerate: one ``torchrun --nproc_per_node 2``
launch (CPU, Gloo) of tests/workers/accelerate_worker.py, which registers the hook on the
model ``accelerator.prepare`` returned.  Both ranks end equal; every step went through the
hook and sent fewer bytes than dense.  No Horovod."""
import json

import numpy as np
import pytest

from launch import ROOT, torchrun

STEPS = 5
DENSE = 4 * (4 * 25 + 4 + 10 * 256 + 10)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("accelerate")
    rc, log = torchrun([ROOT / "tests/workers/accelerate_worker.py"], out, timeout=240)
    assert rc == 0, log[-6000:]
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
