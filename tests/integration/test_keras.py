"""``hvd_compress.keras``: Keras 3 ``model.fit`` with compression, through real
``horovodrun -np 2 --gloo`` (see workers/keras_worker.py), compiled and with
``run_eagerly=True``.  Expected values are computed here, in numpy, from what both
ranks wrote (their local gradients from a plain tf.GradientTape), without hvd_compress."""
import math

import numpy as np
import pytest

from launch import ROOT, horovodrun, load_ranks
from reference import compressed_update_rule, reference_contribution

WORKER = ROOT / "tests/workers/keras_worker.py"
AGG_SPECS = ["topk:density=0.05", "twobit", "none"]      # as in the worker
MODES = ["compiled", "eager"]
SIZES = [6 * 8, 8, 8 * 3, 3]                               # mlp/hidden/{kernel,bias}, mlp/out/...


@pytest.fixture(scope="module")
def keras_job(tmp_path_factory):
    """One horovodrun job running every scenario but the failing one (~50 s, 2 idle cores)."""
    out = tmp_path_factory.mktemp("keras_job")
    rc, log = horovodrun([WORKER, "imports", "aggregate", "nonfinite", "checkpoint", "broadcast",
                          "xla", "mnist", "update"],
                         out, timeout=400)
    assert rc == 0, log[-6000:]
    return out


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("spec", AGG_SPECS)
def test_fit_step_equals_independent_aggregate(keras_job, spec, mode):
    """One ``fit`` step with SGD(lr=1): both ranks end with the same weights, equal to
    ``before - mean over ranks of the reference contribution of each local gradient``
    (numpy top-k / two-bit quantisation / identity)."""
    ranks = load_ranks(keras_job, "keras_aggregate")
    key = f"{spec}|{mode}"
    assert list(ranks[0][f"{key}|names"]) == ["mlp/hidden/kernel", "mlp/hidden/bias",
                                              "mlp/out/kernel", "mlp/out/bias"]
    for i in range(len(SIZES)):
        before = ranks[0][f"{key}|{i}|before"]
        np.testing.assert_array_equal(ranks[1][f"{key}|{i}|before"], before)
        after = [r[f"{key}|{i}|after"] for r in ranks]
        np.testing.assert_array_equal(after[0], after[1])
        grads = [r[f"{key}|{i}|grad"] for r in ranks]
        assert not np.array_equal(grads[0], grads[1])          # each rank its own batch
        aggregate = sum(reference_contribution(spec, g) for g in grads) / 2
        assert np.count_nonzero(aggregate) > 0
        # Keras' compiled step may round a gradient's last bit otherwise than the eager
        # tape; a wrong selection or scale would be off by a whole gradient entry
        np.testing.assert_allclose(after[0], before - aggregate, rtol=0, atol=2e-7,
                                   err_msg=f"{key}: variable {i}")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("spec", AGG_SPECS)
def test_fit_stats_count_bytes(keras_job, spec, mode):
    """``opt.stats`` after the step: one step, payload bytes as the compressor sends them."""
    steps, sent, dense = load_ranks(keras_job, "keras_aggregate")[0][f"{spec}|{mode}|stats"]
    expected = {"topk:density=0.05": sum(math.ceil(0.05 * n) * 8 for n in SIZES),
                "twobit": sum(math.ceil(n / 16) * 4 + 4 for n in SIZES),
                "none": 4 * sum(SIZES)}[spec]
    assert (steps, sent, dense) == (1, expected, 4 * sum(SIZES))


def test_nonfinite_passes_through_and_keeps_residual(keras_job):
    """NaN/Inf in rank 0's gradient (``opt.apply``): the aggregate is non-finite there on
    both ranks, rank 0's residual stays as after step 0, the next step is finite."""
    ranks = load_ranks(keras_job, "keras_nonfinite")
    for r in ranks:
        assert np.isnan(r["1|out"][0, 3]) and np.isinf(r["1|out"][2, 5])
        assert np.isfinite(r["0|out"]).all() and np.isfinite(r["2|out"]).all()
    np.testing.assert_array_equal(ranks[0]["1|residual"], ranks[0]["0|residual"])
    assert np.abs(ranks[0]["0|residual"]).sum() > 0


def test_checkpoint_round_trip_is_bitwise_identical(keras_job):
    """3 steps, save weights + optimizer variables + ``opt.compression.state_dict()``,
    restore into a fresh model and optimizer, 3 steps == 6 steps straight, bit for bit;
    restoring all but the compression state does not (the residuals matter)."""
    for r in load_ranks(keras_job, "keras_checkpoint"):
        assert r["residual_norm"] > 0
        np.testing.assert_array_equal(r["resumed|True"].view(np.int32),
                                      r["straight"].view(np.int32))
        assert not np.array_equal(r["resumed|False"], r["straight"])


def test_broadcast_variables_gives_rank_0_values(keras_job):
    ranks = load_ranks(keras_job, "keras_broadcast")
    assert not np.array_equal(ranks[0]["mine"], ranks[1]["mine"])
    for r in ranks:
        np.testing.assert_array_equal(r["after"], ranks[0]["mine"])


@pytest.mark.parametrize("mode", MODES)
def test_broadcast_callback_synchronises_fit(keras_job, mode):
    """Ranks built with different weights end ``fit`` with the same weights with
    BroadcastGlobalVariablesCallback, and with different ones without it."""
    ranks = load_ranks(keras_job, "keras_broadcast")
    np.testing.assert_array_equal(ranks[0][f"fit|{mode}|True"], ranks[1][f"fit|{mode}|True"])
    assert not np.array_equal(ranks[0][f"fit|{mode}|False"], ranks[1][f"fit|{mode}|False"])


def test_jit_compile_fails_clearly(keras_job):
    for r in load_ranks(keras_job, "keras_xla"):
        assert "jit_compile=False" in str(r["error"])
        assert r["steps"] == 1           # then without XLA it trains


def test_mnist_topk_within_one_point_of_uncompressed(keras_job):
    """examples/keras_mnist.py's training, -np 2, 6 epochs: top-k (1%) ends within one
    point of test accuracy of ``none`` (or above it) and sends about 50x fewer bytes."""
    r = load_ranks(keras_job, "keras_mnist")[0]
    none, topk = r["none|accuracy"][-1], r["topk:density=0.01|accuracy"][-1]
    assert none > 0.9 and topk > 0.9, (none, topk)
    assert topk >= none - 0.01, (none, topk)
    sent, dense = r["none|bytes"][-1]
    assert sent == dense
    sent_topk, dense_topk = r["topk:density=0.01|bytes"][-1]
    assert dense_topk == dense and 45 < dense / sent_topk <= 50


def test_ranks_with_different_compressors_fail_clearly(tmp_path):
    """Rank 0 topk, rank 1 randomk: ``fit`` raises ValueError on both ranks at the first
    step, compiled and eager, listing both configurations; the job ends (timeout)."""
    rc, log = horovodrun([WORKER, "mismatch"], tmp_path, timeout=180, gloo_timeout=30)
    assert rc != 0
    for rank in (0, 1):
        for mode in MODES:
            assert f"CONFIG_ERROR rank {rank} {mode}" in log, log[-4000:]
    assert "topk:density=0.05" in log and "randomk:density=0.05" in log


def test_import_adds_no_torch(keras_job):
    """``import hvd_compress.keras`` imports no PyTorch module beyond what ``import
    hvd_compress`` itself imports (measured in the worker)."""
    for r in load_ranks(keras_job, "keras_imports"):
        assert list(r["torch_added"]) == []


@pytest.mark.parametrize("mode", list(MODES) + ["loop"])
def test_compressed_update_every_step_matches_the_numpy_reference(keras_job, mode):
    """``compressed_update=True`` with AdamW through ``fit`` (compiled, eager) and through
    a custom TensorFlow loop (``loop``: a plain tape, ``apply_gradients``): every step's weights and
    residuals are the rule's (tests/reference.py) from the updates a plain Keras AdamW
    made of each rank's own gradient; both ranks hold the same weights."""
    ranks = [{k.split("|", 1)[1]: v for k, v in r.items() if k.startswith(mode + "|")}
             for r in load_ranks(keras_job, "keras_update")]
    sizes = dict(zip(["hidden/kernel", "hidden/bias", "out/kernel", "out/bias"], SIZES))
    for t, (param, residuals) in compressed_update_rule(ranks, 4, sizes, 0.3).items():
        np.testing.assert_array_equal(ranks[0][f"trace/{t}/param"], ranks[1][f"trace/{t}/param"])
        for r, e in zip(ranks, residuals):
            np.testing.assert_allclose(r[f"trace/{t}/param"], param, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(r[f"trace/{t}/residual"], e, rtol=1e-5, atol=1e-6)
    assert not np.array_equal(ranks[0]["trace/1/update"], ranks[1]["trace/1/update"])
    assert int(ranks[0]["sent"]) > 0


def test_compressed_update_malformed_payload_raises_everywhere_and_keeps_the_weights(
        keras_job):
    for r in load_ranks(keras_job, "keras_update"):
        assert str(r["malformed|error"]), "no error for rank 1's corrupted payload"
        np.testing.assert_array_equal(r["malformed|param"], r["nan|param"])


def test_compressed_update_nan_on_one_rank_skips_its_step_only(keras_job):
    r0, r1 = load_ranks(keras_job, "keras_update")
    assert [int(r["nan|skipped"]) for r in (r0, r1)] == [0, 1]
    assert [int(r["nan|iterations"]) for r in (r0, r1)] == [1, 0]
    assert np.isfinite(r0["nan|param"]).all()
    np.testing.assert_array_equal(r0["nan|param"], r1["nan|param"])
    # in fit's compiled step (a tf.cond instead of Python's if)
    assert [int(r["nan_compiled|iterations"]) for r in (r0, r1)] == [1, 0]
    assert np.isfinite(r0["nan_compiled|param"]).all()
    np.testing.assert_array_equal(r0["nan_compiled|param"], r1["nan_compiled|param"])


@pytest.mark.parametrize("case,words", [("sum", ["op=hvd.Average", "op=hvd.Sum"]),
                                        ("momentum", ["compressed_momentum"]),
                                        ("passes", ["backward_passes_per_step"])])
def test_compressed_update_refusals_name_the_argument(keras_job, case, words):
    for r in load_ranks(keras_job, "keras_update"):
        msg = str(r[f"errors|{case}"])
        assert msg and all(w in msg for w in words), msg
