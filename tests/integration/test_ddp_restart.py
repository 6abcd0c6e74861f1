"""hvd_compress.ddp under ``torchrun --max-restarts``: a worker killed (SIGKILL) after step
6 of 8, torchrun restarting both, which go on from the checkpoint of step 4
(tests/workers/ddp_restart_worker.py: four runs in one launch; Gloo, CPU; no Horovod).
About 40 s on 2 cores: the launch, and three restarts."""
from pathlib import Path

import numpy as np
import pytest

from launch import ROOT, torchrun


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp_restart")
    # (torch 2.13: without it the second restart's workers read the first one's Gloo
    # addresses from the rendezvous store and fail to connect: PyTorch issue 135712)
    rc, log = torchrun(["--max-restarts", "3", ROOT / "tests/workers/ddp_restart_worker.py"],
                       out, timeout=240, env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    assert rc == 0, log[-6000:]
    return out, log


def finals(out, run):
    return [dict(np.load(Path(out) / f"{run}_rank{r}.npz")) for r in range(2)]


def params(result):
    return {k: v for k, v in result.items() if k not in ("attempt", "start", "saved_norm")}


def test_a_restart_from_each_ranks_own_checkpoint_ends_where_the_run_without_a_fault_ends(runs):
    """Each rank restores its own model, optimizer and hook state (residuals): the final
    parameters of both ranks are those of the run without a fault, bit for bit; the
    checkpoint held residuals (their norm > 0) and the run really was restarted."""
    out, log = runs
    straight, restarted = finals(out, "straight"), finals(out, "restart")
    for s, r in zip(straight, restarted):
        assert int(r["attempt"]) >= 1 and int(r["start"]) == 4 and float(r["saved_norm"]) > 0
        assert int(s["attempt"]) == 0 and int(s["start"]) == 0
        for k, v in params(s).items():
            assert np.array_equal(v, r[k]), k


def test_residuals_left_out_of_the_checkpoint_change_the_result(runs):
    """The same restart without the hook's state (the residuals start afresh): the final
    parameters differ from the run without a fault, so the test above could fail."""
    out, _ = runs
    straight, lost = finals(out, "straight"), finals(out, "lost")
    assert int(lost[0]["attempt"]) >= 1 and int(lost[0]["start"]) == 4
    assert any(not np.array_equal(v, lost[0][k]) for k, v in params(straight[0]).items())


def test_rank_zeros_checkpoint_given_to_rank_one_is_refused_by_name(runs):
    """Only rank 0 saved, and both ranks load its file (the usual idiom for a model): rank
    1's hook refuses rank 0's residuals with a ValueError that says what to do; rank 0's
    loads; neither waits for the other."""
    out, _ = runs
    assert not (out / "rank0_error_rank0.txt").exists()
    text = (out / "rank0_error_rank1.txt").read_text()
    assert "error feedback of rank 0, but this is rank 1" in text
    assert "save state_dict() on every rank" in text
