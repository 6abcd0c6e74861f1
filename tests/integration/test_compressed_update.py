"""Compressed updates (``compressed_update=True``) through real jobs: one ``horovodrun -np
2 --gloo`` launch of tests/workers/compressed_update_worker.py (the Horovod optimizer)
and one ``torchrun --nproc_per_node 2`` launch of tests/workers/ddp_update_worker.py
(the DDP hook, no Horovod).  Both run the scenarios of tests/workers/update_scenarios.py
(the tests taking ``ranks`` run for each); the others are one glue's own.  Last,
examples/ddp_gpt2.py shrunk to a few steps.

Each step is checked against a numpy reference of the rule written here
(:func:`reference_rule`) from the update a plain ``torch.optim.AdamW`` makes of each
rank's own gradient (recorded by the worker).
"""
import json

import numpy as np
import pytest

from launch import ROOT, horovodrun, load_ranks, torchrun
from reference import compressed_update_rule

WORKERS = {"horovodrun": ROOT / "tests/workers/compressed_update_worker.py",
           "torchrun": ROOT / "tests/workers/ddp_update_worker.py"}
STEPS, DENSITY = 6, 0.3
#: the MLP's tensors in parameter order, and their sizes
SIZES = {"fc1.weight": 96, "fc1.bias": 16, "fc2.weight": 48, "fc2.bias": 3}
_JOBS, _LOGS = {}, {}


def job(tmp_path_factory, launcher):
    """Each glue's job, launched once for the session."""
    if launcher not in _JOBS:
        out = tmp_path_factory.mktemp(f"compressed_update_{launcher}")
        if launcher == "horovodrun":
            rc, log = horovodrun([WORKERS[launcher]], out)
        else:
            rc, log = torchrun([WORKERS[launcher]], out, timeout=300)
        assert rc == 0, log[-3000:]
        _LOGS[launcher] = log
        _JOBS[launcher] = load_ranks(out, "update" if launcher == "horovodrun" else "ddp_update")
    return _JOBS[launcher]


@pytest.fixture(scope="module", params=["horovodrun", "torchrun"])
def ranks(request, tmp_path_factory):
    """Both glues' ranks: the tests of the shared scenarios run for each."""
    return job(tmp_path_factory, request.param)


@pytest.fixture(scope="module")
def hvd_ranks(tmp_path_factory):
    return job(tmp_path_factory, "horovodrun")


@pytest.fixture(scope="module")
def ddp_ranks(tmp_path_factory):
    return job(tmp_path_factory, "torchrun")


def reference_rule(ranks):
    """Top-k at DENSITY of each rank's AdamW update, error feedback, the mean applied
    (tests/reference.py); the residuals as the compressor keeps them, by name."""
    return compressed_update_rule(ranks, STEPS, SIZES, DENSITY, sorted(SIZES))


def test_every_step_matches_the_numpy_reference(ranks):
    for t, (param, residuals) in reference_rule(ranks).items():
        for r, e in zip(ranks, residuals):
            np.testing.assert_allclose(r[f"trace/{t}/param"], param, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(r[f"trace/{t}/residual"], e, rtol=1e-5, atol=1e-6)


def test_min_size_sends_small_tensors_whole_and_the_rest_as_before(ranks):
    """``topk:density=0.3,min_size=20``: the biases (16, 3 values) whole, the weights by
    top-k with error feedback, every step as the rule says."""
    expected = compressed_update_rule(ranks, STEPS, SIZES, DENSITY, sorted(SIZES), min_size=20,
                                      key="min_size")
    for t, (param, residuals) in expected.items():
        for r, e in zip(ranks, residuals):
            np.testing.assert_allclose(r[f"min_size/{t}/param"], param, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(r[f"min_size/{t}/residual"], e, rtol=1e-5, atol=1e-6)
    assert not np.allclose(ranks[0][f"min_size/{STEPS}/param"],
                           ranks[0][f"trace/{STEPS}/param"])


def test_ef_decay_keeps_beta_times_what_was_not_sent(ranks):
    """``topk:density=0.3,ef_decay=0.5``: each rank keeps half its unsent update, every
    step as the rule says (and not as plain error feedback's)."""
    expected = compressed_update_rule(ranks, STEPS, SIZES, DENSITY, sorted(SIZES),
                                      key="decay", decay=0.5)
    for t, (param, residuals) in expected.items():
        for r, e in zip(ranks, residuals):
            np.testing.assert_allclose(r[f"decay/{t}/param"], param, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(r[f"decay/{t}/residual"], e, rtol=1e-5, atol=1e-6)
    assert not np.allclose(ranks[0][f"decay/{STEPS}/param"], ranks[0][f"trace/{STEPS}/param"])


def test_parameters_agree_and_each_rank_keeps_its_own_optimizer_state(ranks):
    for t in range(1, STEPS + 1):
        assert np.array_equal(ranks[0][f"trace/{t}/param"], ranks[1][f"trace/{t}/param"])
        # the wrapped AdamW stepped on this rank's gradient, as the plain one did
        for r in ranks:
            assert np.array_equal(r[f"trace/{t}/exp_avg"], r[f"trace/{t}/ref_exp_avg"])
        assert not np.array_equal(ranks[0][f"trace/{t}/exp_avg"], ranks[1][f"trace/{t}/exp_avg"])
        for r in ranks:          # after step(), p.grad is this rank's own gradient again
            assert np.array_equal(r[f"trace/{t}/grad"], r[f"trace/{t}/ref_grad"])
    for t in range(2, STEPS + 1):
        assert not np.array_equal(ranks[0][f"trace/{t}/param"], ranks[0][f"trace/{t-1}/param"])
    for r in ranks:     # torch's step hooks ran once a step, the post hook after the exchange
        for t in range(1, STEPS + 1):
            assert list(r[f"trace/{t}/hooks"]) == ["pre", "post"]
            assert np.array_equal(r[f"trace/{t}/hook_param"], r[f"trace/{t}/param"])
    # top-k at 30% of the updates: values and indices, well under the dense bytes
    assert 0 < int(ranks[0]["trace/sent"]) < 0.7 * int(ranks[0]["trace/dense"])


def test_checkpoint_resumes_bit_for_bit(ranks):
    for r in ranks:
        assert np.array_equal(r["resume/param"], r[f"trace/{STEPS}/param"])
        assert np.array_equal(r["resume/residual"], r[f"trace/{STEPS}/residual"])
        # the glue marked them; gradients' residuals are not restored into update mode
        assert str(r["resume/residuals_of"]) == "updates"
        assert "error feedback of gradients" in str(r["resume/gradients_error"])


def test_a_rank_with_nan_gradients_skips_its_step_and_loses_nothing(ranks):
    r0, r1 = ranks
    assert int(r1["nan/skipped"]) == 1 and int(r0["nan/skipped"]) == 0
    # rank 1's optimizer state did not move; rank 0's did
    assert np.array_equal(r1["nan/state_before"], r1["nan/state_after"])
    assert not np.array_equal(r0["nan/state_before"], r0["nan/state_after"])
    assert float(r1["nan/step_count"]) == 2 and float(r0["nan/step_count"]) == 3
    # rank 1 sent its residual only: what left it is gone from its residual, none added
    sent1 = r1["nan/residual_before"] - r1["nan/residual_after"]
    assert np.isfinite(r1["nan/residual_after"]).all() and np.abs(sent1).max() > 0
    for key in ("nan/param", "nan/next_param"):
        assert np.isfinite(r0[key]).all()
        assert np.array_equal(r0[key], r1[key])
    assert not np.array_equal(r0["nan/param"], r0["nan/start"])


def test_clipping_between_synchronize_and_step_still_exchanges_the_update(hvd_ranks):
    ranks = hvd_ranks
    assert np.array_equal(ranks[0]["clip/param"], ranks[1]["clip/param"])
    assert int(ranks[0]["clip/sent"]) > 0
    assert not np.array_equal(ranks[0]["clip/param"], ranks[0][f"trace/{3}/param"])


def test_a_closure_trains_as_the_plain_loop_and_its_nan_skips_one_rank(ranks):
    for r in ranks:
        assert np.array_equal(r["closure/param"], r["trace/3/param"])
        assert np.isfinite(r["closure/loss"]).all()
        assert np.isfinite(r["closure/poisoned_param"]).all()
    assert [int(r["closure/skipped"]) for r in ranks] == [0, 1]
    assert np.array_equal(ranks[0]["closure/poisoned_param"], ranks[1]["closure/poisoned_param"])


def test_gradscaler_recipe_with_an_overflow_on_one_rank_does_not_hang(ranks):
    assert [int(r["scaler/skipped"]) for r in ranks] == [0, 1]
    assert np.array_equal(ranks[0]["scaler/param"], ranks[1]["scaler/param"])
    assert np.isfinite(ranks[0]["scaler/param"]).all()
    # each rank's scaler saw its own overflow: rank 1's scale was halved
    assert float(ranks[1]["scaler/scale"]) < float(ranks[0]["scaler/scale"])


#: update_scenarios.SPECS
SPECS = ["laplace_topk:density=0.1", "dct:density=0.1", "twobit", "powersgd:rank=2",
         "auto:candidates=none|topk:density=0.1", "laplace_topk:density=0.1,min_size=20"]


@pytest.mark.parametrize("spec", SPECS)
def test_every_compressor_trains_and_ranks_agree(ranks, spec):
    assert np.array_equal(ranks[0][f"spec/{spec}/param"], ranks[1][f"spec/{spec}/param"])
    assert np.isfinite(ranks[0][f"spec/{spec}/loss"]).all()
    assert np.isfinite(ranks[0][f"spec/{spec}/param"]).all()


def test_transformers_gpt2_learns_its_batch_at_a_seventh_of_the_bytes(ranks):
    assert np.array_equal(ranks[0]["gpt2/param"], ranks[1]["gpt2/param"])
    for r in ranks:
        loss = r["gpt2/loss"]
        assert loss[-1] < 0.95 * loss[0] and (np.diff(loss) < 0).sum() >= 6, loss
    sent, dense = ranks[0]["gpt2/sent"], int(ranks[0]["gpt2/dense"])
    assert all(0 < s < 0.15 * dense for s in sent), (sent, dense)


ERRORS = {"momentum": ["compressed_momentum", "one of them"],
          "scaler": ["grad_scaler"],
          "dgc": ["momentum=0.9", "drop momentum="],
          "value": ["compressed_update", "'yes'"],
          "lbfgs": ["LBFGS"]}
HVD_ERRORS = dict(ERRORS, sum=["op=hvd.Average", "op=hvd.Sum"],
                  loss_scale=["set_loss_scale", "compressed_update=True"])
DDP_ERRORS = dict(ERRORS, sum=["op='average'", "op='sum'"],
                  no_optimizer=["compressed_update=True", "optimizer="],
                  twice=["registered twice"],
                  extra_param=["every trainable parameter", "1 of its are not the model's"],
                  param_group=["parameters changed", "add_param_group"])


@pytest.mark.parametrize("case", HVD_ERRORS)
def test_what_it_cannot_be_combined_with_gets_a_clear_error(hvd_ranks, case):
    for r in hvd_ranks:
        msg = str(r[f"errors/{case}"])
        assert msg and all(w in msg for w in HVD_ERRORS[case]), msg


@pytest.mark.parametrize("case", DDP_ERRORS)
def test_ddp_hook_what_it_cannot_be_combined_with_gets_a_clear_error(ddp_ranks, case):
    for r in ddp_ranks:
        msg = str(r[f"errors/{case}"])
        assert msg and all(w in msg for w in DDP_ERRORS[case]), msg


def test_the_compressed_momentum_environment_variable_does_not_refuse_it(hvd_ranks):
    for r in hvd_ranks:
        assert str(r["errors/environment"]) == ""


def test_ranks_that_differ_get_a_clear_error(ranks):
    for r in ranks:
        msg = str(r["mismatch/error"])
        assert "configured differently" in msg and "compressed_update" in msg, msg
    # rank 0 (compressed updates) had taken its own step: the failed exchange undid it
    assert np.array_equal(ranks[0]["mismatch/param"], ranks[0]["mismatch/start"])


def test_a_malformed_payload_raises_everywhere_undoes_the_step_and_the_next_trains(ranks):
    for r in ranks:
        assert str(r["malformed/error"]), "no error for rank 1's corrupted payload"
        assert np.array_equal(r["malformed/param"], r["malformed/start"])
        # the step's residual writes undone: what it sent was never applied
        assert np.array_equal(r["malformed/residual_after"], r["malformed/residual_before"])
        assert np.isfinite(r["malformed/next_param"]).all()
        assert not np.array_equal(r["malformed/next_param"], r["malformed/param"])
    assert np.array_equal(ranks[0]["malformed/next_param"], ranks[1]["malformed/next_param"])


def test_ddp_scheduler_made_before_and_another_parameter_order_change_nothing(ddp_ranks):
    """An LR scheduler made before register() wraps the optimizer's old step (the
    exchange would be skipped, the ranks drift); rank 1's optimizer lists the parameters
    backwards (the updates must still be laid out in the model's order)."""
    for r in ddp_ranks:
        np.testing.assert_allclose(r["scheduler_order/param"], r["trace/3/param"],
                                   rtol=1e-6, atol=1e-7)


def test_ddp_unused_parameters_bucket_views_and_two_dtypes(ddp_ranks):
    assert np.array_equal(ddp_ranks[0]["features/param"], ddp_ranks[1]["features/param"])
    for r in ddp_ranks:
        loss = r["features/loss"]
        assert np.isfinite(r["features/param"]).all() and loss[-1] < loss[0], loss
        assert int(r["features/sent"]) > 0


def test_ddp_hook_trains_as_the_horovod_optimizer(hvd_ranks, ddp_ranks):
    """The same rule through two glues: the same parameters and residuals every step."""
    for t in range(1, STEPS + 1):
        for key in ("param", "residual"):
            np.testing.assert_allclose(ddp_ranks[0][f"trace/{t}/{key}"],
                                       hvd_ranks[0][f"trace/{t}/{key}"], rtol=1e-6, atol=1e-7)


def test_both_glues_log_the_learning_rate_measured_best_for_two_ranks(hvd_ranks, ddp_ranks):
    """The glue tells the user the rate the updates trained best at (docs/adam-adamw.md)."""
    assert set(_LOGS) == {"horovodrun", "torchrun"}, set(_LOGS)
    for launcher, log in _LOGS.items():
        assert "compressed_update=True on 2 ranks" in log, (launcher, log[-2000:])
        assert "sqrt(2) = 1.4 times dense training's learning rate" in log, launcher


def test_ddp_gpt2_example_learns_with_compressed_updates(tmp_path):
    """examples/ddp_gpt2.py as a user runs it (torchrun, a transformers GPT-2, AdamW,
    compressed updates), shrunk to one layer and 8 steps: its loss goes down, the bytes
    are laplace_topk's at 1%, and its JSON holds the curve and each step's time."""
    out = tmp_path / "gpt2.json"
    rc, log = torchrun([ROOT / "examples/ddp_gpt2.py", "--compressed-update", "--steps", 8,
                        "--eval-every", 4, "--layers", 1, "--width", 64, "--no-progress",
                        "--json", out], tmp_path, timeout=240)
    assert rc == 0, log[-4000:]
    assert "done: AdamW updates: hvd_compress.ddp laplace_topk:density=0.01" in log, log[-2000:]
    result = json.loads(out.read_text())
    losses = [loss for _, _, loss in result["curve"]]
    assert len(losses) == 3 and losses[-1] < losses[0], losses
    dense = result["dense_bytes_per_step"] * len(result["step_s"])
    assert 30 < dense / result["total_sent"] < 100, (dense, result["total_sent"])
