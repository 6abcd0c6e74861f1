"""Compressed-momentum Adam in Keras 3 through real ``horovodrun -np 2 --gloo`` (one
launch of tests/workers/momentum_keras_worker.py).  Compressed steps are checked against
a numpy reference of Keras' Adam arithmetic with the frozen variance, written here."""
import numpy as np
import pytest

from launch import ROOT, horovodrun, load_ranks
from reference import topk_mask

WORKER = ROOT / "tests/workers/momentum_keras_worker.py"
STEPS, WARMUP, DENSITY = 7, 3, 0.3
LR, B1, B2, EPS, WD = 0.05, 0.9, 0.99, 1e-7, 0.1
SIZES = [96, 16, 48, 3]          # fc1 kernel, fc1 bias, fc2 kernel, fc2 bias


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("momentum_keras")
    rc, log = horovodrun([WORKER], out)
    assert rc == 0, log[-3000:]
    return load_ranks(out, "momentum_keras")


def per_tensor_topk(c):
    out, at = [], 0
    for n in SIZES:
        part = c[at:at + n]
        out.append(np.where(topk_mask(part, DENSITY), part, 0.0))
        at += n
    return np.concatenate(out)


def test_warmup_equals_plain_keras_adamw_on_the_dense_average(ranks):
    for r in ranks:
        for t in range(1, WARMUP + 1):
            np.testing.assert_array_equal(r[f"trace/{t}/param"], r[f"trace/{t}/dense_ref"])


def test_compressed_steps_match_keras_adam_with_frozen_variance(ranks):
    r0 = ranks[0]
    p, m, v = (r0[f"trace/{WARMUP}/{k}"].copy() for k in ("param", "m", "v"))
    e = [np.zeros_like(p) for _ in ranks]
    for t in range(WARMUP + 1, STEPS + 1):
        sent = []
        for i, r in enumerate(ranks):
            c = B1 * m + (1 - B1) * r[f"trace/{t}/grad"] + e[i]
            s = per_tensor_topk(c)
            e[i] = c - s
            sent.append(s)
        m = sum(sent) / len(ranks)
        p = p - p * WD * LR
        p = p - LR * np.sqrt(1 - B2 ** WARMUP) / (1 - B1 ** t) * m / (np.sqrt(v) + EPS)
        for r, ei in zip(ranks, e):
            np.testing.assert_allclose(r[f"trace/{t}/m"], m, rtol=1e-5, atol=1e-7)
            np.testing.assert_allclose(r[f"trace/{t}/param"], p, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(r[f"trace/{t}/residual"], ei, rtol=1e-5, atol=1e-6)
            np.testing.assert_array_equal(r[f"trace/{t}/v"], r0[f"trace/{WARMUP}/v"])
    assert np.array_equal(ranks[0][f"trace/{STEPS}/param"], ranks[1][f"trace/{STEPS}/param"])


def test_checkpoint_after_a_compressed_step_resumes_bit_for_bit(ranks):
    for r in ranks:
        np.testing.assert_array_equal(r["resume/param"], r[f"trace/{STEPS}/param"])


def test_nonfinite_step_leaves_everything_as_it_was(ranks):
    for r in ranks:
        assert int(r["nan/skipped"]) == 1
        for name in ("param", "m", "v", "residual"):
            np.testing.assert_array_equal(r[f"nan/{name}/before"], r[f"nan/{name}/after"])
        assert np.isfinite(r["nan/next_param"]).all()
    assert np.array_equal(ranks[0]["nan/next_param"], ranks[1]["nan/next_param"])


def test_model_fit_runs_eagerly_with_compressed_momentum(ranks):
    assert np.array_equal(ranks[0]["fit/param"], ranks[1]["fit/param"])
    assert np.isfinite(ranks[0]["fit/loss"]).all() and int(ranks[0]["fit/frozen_at"]) == 2


def test_warmup_compression_sends_low_rank_gradients_and_resumes_bit_for_bit(ranks):
    assert np.array_equal(ranks[0]["warm/param"], ranks[1]["warm/param"])
    sent = ranks[0]["warm/sent"]
    # warm-up: PowerSGD rank 2 on fc1's 6x16 kernel, fc2's 16x3 kernel and the biases as
    # they are (a rank-2 factorisation of 16x3 would not save enough)
    assert list(sent[:3]) == [4 * (2 * (6 + 16) + 16 * 3 + 16 + 3)] * 3, sent
    assert all(0 < s < 4 * sum(SIZES) for s in sent[3:]), sent
    assert "warmup_compression" in list(ranks[0]["warm/saved_keys"])
    for r in ranks:
        assert np.array_equal(r["warm/resumed"], r["warm/param"])


def test_ranks_with_different_settings_get_a_clear_error(ranks):
    for r in ranks:
        msg = str(r["mismatch/error"])
        assert "configured differently" in msg and "warmup=3" in msg and "warmup=4" in msg
