"""Compressed-momentum Adam (``compressed_momentum=``) through real ``horovodrun -np 2
--gloo`` (hvd_compress.torch.DistributedOptimizer) and ``torchrun --nproc_per_node 2``
(the DDP hook): one launch each of tests/workers/momentum_worker.py.

The compressed steps are checked against a numpy reference of the rule written here
(:func:`reference_rule`), from the local gradients each rank recorded; the warm-up
against a plain ``torch.optim.AdamW`` on the dense average, bit for bit.
"""
import math

import numpy as np
import pytest

from launch import ROOT, horovodrun, load_ranks, torchrun
from reference import split_sizes, topk_mask

WORKER = ROOT / "tests/workers/momentum_worker.py"
STEPS, WARMUP, DENSITY = 7, 3, 0.3
LR, B1, B2, EPS, WD = 0.05, 0.9, 0.99, 1e-8, 0.1
#: the MLP's tensors in parameter order, and their sizes
SIZES = {"fc1.weight": 96, "fc1.bias": 16, "fc2.weight": 48, "fc2.bias": 3}


@pytest.fixture(scope="module", params=["horovod", "ddp"])
def ranks(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"momentum_{request.param}")
    if request.param == "horovod":
        rc, log = horovodrun([WORKER], out)
    else:
        rc, log = torchrun([WORKER], out, timeout=600)
    assert rc == 0, log[-3000:]
    return load_ranks(out, f"momentum_{request.param}")


def split(flat):
    return split_sizes(flat, SIZES)


def sorted_residual(parts):
    """The worker saves residuals in sorted-name order."""
    return np.concatenate([parts[n] for n in sorted(SIZES)])


def reference_rule(ranks):
    """Compressed steps WARMUP+1..STEPS of AdamW with compressed momentum and top-k,
    from each rank's recorded local gradients and the state after the warm-up:
    m_i = b1 m + (1-b1) g_i; c_i = m_i + e_i; s_i = topk(c_i) per tensor; e_i = c_i - s_i;
    m = mean(s_i); p <- p (1 - lr wd) - lr/(1-b1^t) m / (sqrt(v/(1-b2^T_w)) + eps)."""
    r0 = ranks[0]
    p, m, v = (r0[f"trace/{WARMUP}/{k}"].copy() for k in ("param", "m", "v"))
    e = [np.zeros_like(p) for _ in ranks]
    expected = {}
    for t in range(WARMUP + 1, STEPS + 1):
        sent = []
        for i, r in enumerate(ranks):
            c = B1 * m + (1 - B1) * r[f"trace/{t}/grad"] + e[i]
            parts = split(c)
            s = np.concatenate([np.where(topk_mask(parts[n], DENSITY), parts[n], 0)
                                for n in SIZES])
            e[i] = c - s
            sent.append(s)
        m = sum(sent) / len(ranks)
        p = p * (1 - LR * WD) - LR / (1 - B1 ** t) * m / (
            np.sqrt(v / (1 - B2 ** WARMUP)) + EPS)
        expected[t] = (p.copy(), m.copy(), [sorted_residual(split(x)) for x in e])
    return expected


def test_warmup_steps_equal_dense_adamw_bit_for_bit(ranks):
    for r in ranks:
        for t in range(1, WARMUP + 1):
            assert np.array_equal(r[f"trace/{t}/param"], r[f"trace/{t}/dense_ref"]), t


def test_every_rank_applies_the_same_update(ranks):
    for t in range(1, STEPS + 1):
        for key in ("param", "m", "v"):
            assert np.array_equal(ranks[0][f"trace/{t}/{key}"], ranks[1][f"trace/{t}/{key}"])
    # and the update is not trivially zero: the parameters move every step
    for t in range(2, STEPS + 1):
        assert not np.array_equal(ranks[0][f"trace/{t}/param"], ranks[0][f"trace/{t-1}/param"])


def test_step_hooks_run_once_a_step_and_see_the_step_applied(ranks):
    """torch's optimizer step hooks, in dense warm-up steps and compressed ones: once a
    step, the post hook after the whole step (it sees the parameters the step ends with)."""
    for r in ranks:
        for t in range(1, STEPS + 1):
            assert list(r[f"trace/{t}/hooks"]) == ["pre", "post"], t
            assert np.array_equal(r[f"trace/{t}/hook_param"], r[f"trace/{t}/param"]), t


def test_compressed_steps_match_numpy_reference(ranks):
    expected = reference_rule(ranks)
    for t, (p, m, residuals) in expected.items():
        np.testing.assert_allclose(ranks[0][f"trace/{t}/m"], m, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(ranks[0][f"trace/{t}/param"], p, rtol=1e-5, atol=1e-6)
        for r, e in zip(ranks, residuals):
            np.testing.assert_allclose(r[f"trace/{t}/residual"], e, rtol=1e-5, atol=1e-6)
    # the variance stays frozen after the warm-up
    for t in range(WARMUP + 1, STEPS + 1):
        assert np.array_equal(ranks[0][f"trace/{t}/v"], ranks[0][f"trace/{WARMUP}/v"])


def test_residuals_are_conserved(ranks):
    """Sum over ranks of the residuals' growth = sum of the local momenta - P * mean sent,
    from the recorded values alone (nothing is lost, only delayed)."""
    for t in range(WARMUP + 1, STEPS + 1):
        m_prev, m = ranks[0][f"trace/{t-1}/m"], ranks[0][f"trace/{t}/m"]
        local = sum(B1 * m_prev + (1 - B1) * r[f"trace/{t}/grad"] for r in ranks)
        grow = sum(r[f"trace/{t}/residual"] - (r[f"trace/{t-1}/residual"]
                                                if t > WARMUP + 1 else 0) for r in ranks)
        np.testing.assert_allclose(grow, sorted_residual(split(local - len(ranks) * m)),
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("k", [2, 5])
def test_checkpoint_in_each_phase_resumes_bit_for_bit(ranks, k):
    for r in ranks:
        assert np.array_equal(r[f"resume{k}/param"], r[f"trace/{STEPS}/param"])
        assert np.array_equal(r[f"resume{k}/residual"], r[f"trace/{STEPS}/residual"])


def test_nonfinite_step_leaves_everything_as_it_was(ranks):
    for r in ranks:
        assert int(r["nan/skipped"]) == 1
        for name in ("param", "m", "v", "residual"):
            assert np.array_equal(r[f"nan/{name}/before"], r[f"nan/{name}/after"]), name
        assert np.isfinite(r["nan/next_param"]).all()
        assert not np.array_equal(r["nan/next_param"], r["nan/param/after"])
    assert np.array_equal(ranks[0]["nan/next_param"], ranks[1]["nan/next_param"])


SPECS = ["laplace_topk:density=0.1", "topk:density=0.1", "onebit", "twobit",
         "rangefloat:bits=8", "dct:density=0.1", "powersgd:rank=2",
         "auto:candidates=none|topk:density=0.1"]


@pytest.mark.parametrize("spec", SPECS)
def test_every_compressor_trains_and_ranks_agree(ranks, spec):
    assert np.array_equal(ranks[0][f"spec/{spec}/param"], ranks[1][f"spec/{spec}/param"])
    loss = ranks[0][f"spec/{spec}/loss"]
    assert np.isfinite(loss).all()
    assert np.isfinite(ranks[0][f"spec/{spec}/param"]).all()


def test_transformers_gpt2_sends_compressed_momentum_after_warmup(ranks):
    assert np.array_equal(ranks[0]["gpt2/param"], ranks[1]["gpt2/param"])
    sent, dense = ranks[0]["gpt2/sent"], int(ranks[0]["gpt2/dense"])
    assert all(s == dense for s in sent[:2])                 # warm-up: dense float32
    # laplace_topk at 5%: values and indices, 8 bytes each, within its tolerance
    assert all(0 < s <= math.ceil(0.05 * dense / 4 * 1.3) * 8 for s in sent[2:]), sent


def test_warmup_compression_sends_low_rank_gradients_and_resumes_bit_for_bit(ranks):
    assert np.array_equal(ranks[0]["warm/param"], ranks[1]["warm/param"])
    sent, dense = ranks[0]["warm/sent"], int(ranks[0]["warm/dense"])
    # the warm-up's dense Adam steps: PowerSGD rank 2 on fc1's 16x6 weight (P and Q,
    # float32); fc2's 3x16 (its rank-2 factors would not save enough) and the biases as
    # they are, instead of the whole dense float32 gradient
    low_rank = 4 * (2 * (16 + 6) + 3 * 16 + 16 + 3)
    assert list(sent[:3]) == [low_rank] * 3, sent
    assert all(0 < s < dense for s in sent[3:]), sent
    # the checkpoint at step 2 holds PowerSGD's state, and the run resumes bit for bit
    assert "warmup_compression" in list(ranks[0]["warm/saved_keys"])
    for r in ranks:
        assert np.array_equal(r["warm/resumed"], r["warm/param"])


def test_ranks_with_different_settings_get_a_clear_error(ranks):
    for r in ranks:
        msg = str(r["mismatch/error"])
        assert "configured differently" in msg and "warmup=3" in msg and "warmup=4" in msg


def test_dgc_recipe_trains_with_plain_sgd_and_refuses_a_second_momentum(ranks):
    assert np.array_equal(ranks[0]["dgc/param"], ranks[1]["dgc/param"])
    assert np.isfinite(ranks[0]["dgc/loss"]).all()
    assert list(ranks[0]["dgc/velocity_keys"]) == [f"velocity/{n}" for n in sorted(SIZES)]
    for r in ranks:
        assert "momentum=0" in str(r["dgc/error"])
