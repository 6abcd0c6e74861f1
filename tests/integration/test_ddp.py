"""hvd_compress.ddp through real ``torchrun --nproc_per_node 2`` jobs (Gloo, CPU; no Horovod).

Workers: tests/workers/ddp_worker.py (one launch: ranks configured differently, the
aggregates, a bfloat16 model, gradient_as_bucket_view, a slow rank, checkpoints, auto) and
examples/ddp_mnist.py (two launches).
A launch costs ~15 s on 2 cores before any step (torchrun, imports; DDP imports dynamo).
Each rank saves its local gradient (from a plain, non-DDP copy of the model on the same
batch), its own contribution (a copy of its compressor, decompressing its own payload
alone) and what DDP wrote into ``p.grad``; the expected aggregates are computed here.
"""
import functools
import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cases import AUTO_STEPS, BUCKET_SHAPES
from launch import ROOT, torchrun
from reference import reference_contribution, topk_mask
from horovod_checks import _auto_reference, _bits, agg_reference

_spec = importlib.util.spec_from_file_location("ddp_worker", ROOT / "tests/workers/ddp_worker.py")
W = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(W)
NAMES = ["conv.weight", "conv.bias", "fc.weight", "fc.bias", "scale", "empty"]
DENSE = 4 * (4 * 2 * 3 * 3 + 4 + 10 * 144 + 10 + 1)      # bytes of a float32 step
#: step-0 references (no residual yet) of conftest.reference_contribution
STEP0 = {"bf16", "threshold:threshold=0.12", "laplace_topk:density=0.05,exact=1",
         "laplace_topk:density=0.05,exact=1,fused=1",
         "rangefloat:bits=8", "twobit", "topk:density=0.05,values=rangefloat8"}
HYLO = {"conv.weight": "kernel_select:fraction=0.25", "fc.weight": "twobit"}


@functools.lru_cache(maxsize=None)
def load(out_dir, scenario):
    return [dict(np.load(Path(out_dir) / f"ddp_{scenario}_rank{r}.npz")) for r in range(2)]


@pytest.fixture(scope="module")
def ddp_job(tmp_path_factory):
    """One launch for every worker scenario; (output folder, log).  "mismatch" and
    "malformed" go first: their ranks catch the ValueError and go on, so a hang there
    shows as a timeout here."""
    out = tmp_path_factory.mktemp("ddp_job")
    rc, log = torchrun([ROOT / "tests/workers/ddp_worker.py", "mismatch", "malformed",
                        "aggregate", "bf16", "views", "skew", "checkpoint", "auto"], out,
                       timeout=240)
    assert rc == 0, log[-6000:]
    return str(out), log


# -- (a) the aggregate DDP writes into p.grad -------------------------------------------------

def _inputs(ranks, key, step, name):
    return [r[f"{key}|{step}|{name}|in"] for r in ranks]


def _out(ranks, key, step, name):
    return ranks[0][f"{key}|{step}|{name}|out"]


def _ef_topk_reference(ranks, key, density):
    """topk with error feedback, both ranks, every step, in numpy: c = g + r, the k
    largest |c| sent, r = c with those zeroed; DDP averages."""
    res = [{n: 0 for n in NAMES} for _ in ranks]
    outs = []
    for step in range(W.STEPS):
        out = {}
        for n in NAMES[:-1]:
            total = 0
            for r, rank in enumerate(ranks):
                c = rank[f"{key}|{step}|{n}|in"] + res[r][n]
                sent = np.where(topk_mask(c, density), c, np.float32(0))
                res[r][n] = c - sent
                total = total + sent
            out[n] = total / np.float32(2)
        outs.append(out)
    return outs, res


@pytest.mark.parametrize("spec", W.SPECS)
def test_aggregate(ddp_job, spec):
    """3 steps of a small CNN (a 0-d and an empty parameter too) in several DDP buckets:
    (1) both ranks' p.grad bit-identical; (2) p.grad == the average of each rank's own
    contribution (its compressor, state included, run apart from DDP); (3) independent
    numpy references: none, fp16 and topk with error feedback bit for bit every step (and
    topk's residuals and bytes), step 0 of bf16, threshold, laplace_topk exact, rangefloat,
    twobit, values=rangefloat8 and Hylo's kernel_select+twobit, randomk's support, and
    agg=union/leader every step; (4) error feedback conserves the gradients."""
    ranks = load(ddp_job[0], "aggregate")
    for step in range(W.STEPS):
        for n in NAMES:           # (1) every rank ends with the same bits
            np.testing.assert_array_equal(_bits(ranks[0][f"{spec}|{step}|{n}|out"]),
                                          _bits(ranks[1][f"{spec}|{step}|{n}|out"]),
                                          err_msg=f"{spec} step {step} {n}")
            assert str(ranks[0][f"{spec}|{step}|{n}|dtype"]) == "torch.float32"
        assert ranks[0][f"{spec}|{step}|empty|out"].shape == (0, 3)
    # DDP rebuilt its buckets after step 0: then several, and one of several tensors
    buckets = list(ranks[0][f"{spec}|1|buckets"])
    assert len(buckets) >= 2 and any("+" in b for b in buckets), buckets

    # (2) the contract: aggregate == average over ranks of what each rank's own payload
    # decompresses to (each computed apart from DDP, tensor by tensor; fp16 sums halves)
    if f"{spec}|0|fc.weight|contrib" in ranks[0]:
        for step in range(W.STEPS):
            for n in NAMES[:-1]:
                expected = sum(r[f"{spec}|{step}|{n}|contrib"] for r in ranks) / np.float32(2)
                np.testing.assert_allclose(_out(ranks, spec, step, n), expected,
                                           rtol=2e-3 if spec == "fp16" else 1e-6, atol=1e-7,
                                           err_msg=f"{spec} step {step} {n}")
    else:
        assert any(w in spec for w in ("agg=", "powersgd")), "no contributions saved"

    # (3) independent references
    name, _, params = spec.partition(":")
    kv = dict(p.split("=") for p in params.split(",") if "=" in p)
    if spec == "none":
        for step in range(W.STEPS):
            for n in NAMES[:-1]:
                a, b = _inputs(ranks, spec, step, n)
                np.testing.assert_array_equal(_out(ranks, spec, step, n), (a + b) / np.float32(2))
    elif spec == "fp16":
        for step in range(W.STEPS):
            for n in NAMES[:-1]:
                a, b = (g.astype(np.float16) for g in _inputs(ranks, spec, step, n))
                np.testing.assert_array_equal(_out(ranks, spec, step, n),
                                              (a + b).astype(np.float32) / np.float32(2))
    elif spec == "topk:density=0.05":
        outs, res = _ef_topk_reference(ranks, spec, 0.05)
        for step in range(W.STEPS):
            for n in NAMES[:-1]:
                np.testing.assert_array_equal(_out(ranks, spec, step, n), outs[step][n],
                                              err_msg=f"step {step} {n}")
        for r, rank in enumerate(ranks):
            for n in NAMES[:-1]:
                np.testing.assert_array_equal(rank[f"{spec}|residual|{n}"],
                                              res[r][n].reshape(-1))
        # bytes: per DDP bucket, k (value, index) pairs per tensor + the lengths message
        for step in range(W.STEPS):
            sent = 0
            for b in ranks[0][f"{spec}|{step}|buckets"]:
                ks = [math.ceil(0.05 * np.prod(ranks[0][f"{spec}|0|{n}|in"].shape, dtype=int))
                      for n in b.split("+") if n != "empty"]
                sent += 8 * sum(ks) + (2 * 8 if ks else 0)
            assert list(ranks[0][f"{spec}|{step}|stats"]) == [sent, DENSE, step + 1]
    elif spec in STEP0 or spec == "policy:hylo":
        for n in NAMES[:-1]:
            ref = HYLO.get(n, "none") if spec == "policy:hylo" else spec
            expected = sum(reference_contribution(ref, g)
                           for g in _inputs(ranks, spec, 0, n)) / np.float32(2)
            np.testing.assert_allclose(_out(ranks, spec, 0, n), expected, rtol=1e-6, atol=1e-6,
                                       err_msg=f"{spec} {n}")
    elif name == "randomk":       # the same k random indices on both ranks: the average there
        for n in NAMES[:-1]:
            a, b = _inputs(ranks, spec, 0, n)
            out = _out(ranks, spec, 0, n)
            support = out != 0
            assert support.sum() == math.ceil(0.05 * a.size), n
            np.testing.assert_allclose(out[support], ((a + b) / 2)[support], rtol=1e-6)
    elif kv.get("agg") in ("union", "leader"):
        inputs = [{(s, n): r[f"{spec}|{s}|{n}|in"] for s in range(W.STEPS) for n in NAMES[:-1]}
                  for r in ranks]
        outs, _, _ = agg_reference(inputs, spec, W.STEPS)
        for step in range(W.STEPS):
            for n in NAMES[:-1]:
                np.testing.assert_allclose(_out(ranks, spec, step, n), outs[step][n] / 2,
                                           rtol=1e-5, atol=1e-6, err_msg=f"step {step} {n}")
    if spec.startswith("threshold"):   # some values above the threshold, most below
        nz = sum(np.count_nonzero(_out(ranks, spec, s, n)) for s in range(W.STEPS)
                 for n in NAMES[:-1])
        assert 0 < nz < W.STEPS * DENSE / 4 / 2

    # (4) error feedback loses nothing: what DDP summed plus what every rank kept equals
    # every rank's gradients, summed over the steps
    for n in NAMES[:-1]:
        if f"{spec}|residual|{n}" not in ranks[0]:
            continue
        summed = sum(2 * _out(ranks, spec, s, n).astype(np.float64) for s in range(W.STEPS))
        kept = sum(r[f"{spec}|residual|{n}"].astype(np.float64).reshape(summed.shape)
                   for r in ranks)
        given = sum(g.astype(np.float64) for s in range(W.STEPS)
                    for g in _inputs(ranks, spec, s, n))
        np.testing.assert_allclose(summed + kept, given, rtol=1e-4, atol=1e-5,
                                   err_msg=f"{spec}: error feedback lost gradient in {n}")
    stats = ranks[0][f"{spec}|{W.STEPS - 1}|stats"]
    assert stats[1] == DENSE and stats[2] == W.STEPS and 0 < stats[0]


@pytest.mark.parametrize("spec", W.BF16_SPECS)
def test_bf16_model(ddp_job, spec):
    """A bfloat16 model: DDP's buckets are bfloat16; p.grad stays bfloat16, the same on
    both ranks, the average of the ranks' own contributions."""
    ranks = load(ddp_job[0], "bf16")
    key = "bf16model|" + spec
    for step in range(W.STEPS):
        for n in NAMES[:-1]:
            out = ranks[0][f"{key}|{step}|{n}|out"]
            np.testing.assert_array_equal(out, ranks[1][f"{key}|{step}|{n}|out"])
            assert str(ranks[0][f"{key}|{step}|{n}|dtype"]) == "torch.bfloat16"
            expected = sum(r[f"{key}|{step}|{n}|contrib"] for r in ranks) / 2
            scale = max(float(np.abs(expected).max()), 1e-30)
            np.testing.assert_allclose(out, expected, rtol=1e-2, atol=1e-2 * scale,
                                       err_msg=f"{spec} step {step} {n}")


@pytest.mark.parametrize("spec", W.VIEW_SPECS)
def test_gradient_as_bucket_view(ddp_job, spec):
    """DDP(gradient_as_bucket_view=True): the same bits as with copies."""
    views, plain = load(ddp_job[0], "views")[0], load(ddp_job[0], "aggregate")[0]
    for step in range(W.STEPS):
        for n in NAMES:
            np.testing.assert_array_equal(_bits(views[f"views|{spec}|{step}|{n}|out"]),
                                          _bits(plain[f"{spec}|{step}|{n}|out"]))


@pytest.mark.parametrize("spec", W.SKEW_SPECS)
def test_slow_rank(ddp_job, spec):
    """Rank 1's backward slower between buckets: collectives still pair up (the launch did
    not fail or hang), and every gradient has the bits of the run without the delay."""
    ranks = load(ddp_job[0], "skew")
    assert int(ranks[0][f"{spec}|True|buckets"]) >= 3      # several buckets per step
    for key in ranks[0]:
        if key.startswith(f"{spec}|True|") and not key.endswith("buckets"):
            for r in ranks:
                np.testing.assert_array_equal(_bits(r[key]),
                                              _bits(ranks[0][key.replace("|True|", "|False|")]),
                                              err_msg=key)


# -- (b) checkpoint / restore -------------------------------------------------------------------

@pytest.mark.parametrize("spec", W.CKPT_SPECS)
def test_checkpoint_resumes_bitwise(ddp_job, spec):
    """3 steps, checkpoint (model, optimizer, state.state_dict()), 2 more; a new process
    group and model restoring the checkpoint take the same 2 steps to the same bits."""
    for rank in load(ddp_job[0], "checkpoint"):
        assert int(rank[f"{spec}|steps"]) == 5
        for n in NAMES:
            np.testing.assert_array_equal(_bits(rank[f"{spec}|resumed|{n}"]),
                                          _bits(rank[f"{spec}|straight|{n}"]), err_msg=n)


# -- (c) ranks configured differently -------------------------------------------------------------

def test_mismatch_raises_on_every_rank(ddp_job):
    """Rank 1 with another compressor, then another op: ValueError on both ranks at the
    first step, naming each rank's configuration (no hang: the launch has a timeout)."""
    log = ddp_job[1]
    assert "NO_ERROR" not in log and "OTHER_ERROR" not in log, log[-6000:]
    for what in ("compressor", "op"):
        for rank in (0, 1):
            assert f"CONFIG_ERROR {what} rank {rank}: hvd_compress.ddp: ranks are configured " \
                   "differently" in log
    assert "rank 0: topk:density=0.05" in log and "rank 1: randomk:density=0.05" in log
    assert "op=average" in log and "op=sum" in log


@pytest.mark.parametrize("spec", W.MALFORMED_SPECS)
def test_a_malformed_payload_raises_on_every_rank(ddp_job, spec):
    """Rank 1's indices past its tensors: ValueError on both ranks at the first step,
    naming the compressor and the malformed payload (the checks deferred inside the step,
    read back once at its end); no hang (the launch has a timeout); a new model then
    trains a step on both ranks, with the same averaged gradient."""
    log = ddp_job[1]
    assert f"NO_ERROR malformed {spec} rank" not in log, log[-6000:]
    assert f"OTHER_ERROR malformed {spec} rank" not in log, log[-6000:]
    name = spec.split(":")[0]
    for rank in (0, 1):
        said = f"PAYLOAD_ERROR {spec} rank {rank}: {name} (bucket."
        assert said in log, log[-6000:]
        assert "payload index out of range" in log.split(said, 1)[1].split("\n", 1)[0]
    after = load(ddp_job[0], "malformed")
    assert np.array_equal(after[0]["after"], after[1]["after"]) and after[0]["after"].size


def test_auto_ranks_with_other_candidates_or_state_fail_clearly(ddp_job):
    """auto with other candidates on rank 1, then auto restored from a checkpoint on rank 1
    only: ValueError on both ranks at the first step, naming what differs (no hang)."""
    log = ddp_job[1]
    for what in ("auto", "auto_restored"):
        for rank in (0, 1):
            assert f"CONFIG_ERROR {what} rank {rank}: hvd_compress.ddp: ranks are configured " \
                   "differently" in log, what
        assert f"NO_ERROR {what}" not in log
    assert "rank 0: auto:candidates=none:ef=0|topk:density=0.1+ef=1" in log
    assert "auto step=0 phase=calibrate:0" in log and "auto step=3 phase=run:1" in log


def test_module_does_not_import_horovod():
    code = ("import sys, hvd_compress.ddp\n"
            "assert not any(m.startswith('horovod') for m in sys.modules)")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)


# -- (d) MNIST-5k -------------------------------------------------------------------------------

#: 7 of the example's 15 epochs: at 7, uncompressed 95.0% and top-k 95.4% (at 5, top-k
#: still trails by 1.4 points); the run is deterministic (one thread per rank)
MNIST_EPOCHS = 7


def _mnist(tmp_path, spec):
    out = tmp_path / f"{spec.replace(':', '_').replace('=', '')}.json"
    rc, log = torchrun([ROOT / "examples/ddp_mnist.py", "--compression", spec, "--epochs",
                        MNIST_EPOCHS, "--no-progress", "--json", out], tmp_path, timeout=300)
    assert rc == 0, log[-4000:]
    assert "final test accuracy" in log and "median step" in log
    return json.loads(out.read_text())


def test_mnist_topk_within_one_point_of_uncompressed(tmp_path):
    """examples/ddp_mnist.py, the same seed and steps: top-k (1%) within one point of
    uncompressed DDP training, ~50x fewer bytes, a median step time reported."""
    dense, topk = _mnist(tmp_path, "none"), _mnist(tmp_path, "topk:density=0.01")
    acc = {k: run["epochs_log"][-1]["test_accuracy"] for k, run in (("none", dense),
                                                                     ("topk", topk))}
    assert acc["none"] > 0.9, acc                              # the baseline really learned
    assert acc["topk"] >= acc["none"] - 0.01, acc
    assert dense["epochs_log"][-1]["ratio"] == pytest.approx(1.0)
    assert topk["epochs_log"][-1]["ratio"] > 45                # 1%: value + index each
    assert topk["median_step_ms"] > 0 and topk["stats"]["steps"] == topk["steps"]


def test_gpt2_example_hook_starts_compressing_after_dense_steps(tmp_path):
    """``--hook hvd_compress:start=2`` (as PyTorch's start_powerSGD_iter): DDP's dense
    allreduce for two steps, counted as dense, then hvd_compress (~2% of dense a step
    for top-k at 1%: a value and an index each); the loss goes down."""
    out = tmp_path / "gpt2.json"
    rc, log = torchrun([ROOT / "examples/ddp_gpt2.py", "--hook", "hvd_compress:start=2",
                        "--compression", "topk:density=0.01", "--steps", 4, "--eval-every", 2,
                        "--layers", 1, "--width", 64, "--no-progress", "--json", out],
                       tmp_path, timeout=240)
    assert rc == 0, log[-4000:]
    assert "gradients: hvd_compress.ddp topk:density=0.01" in log, log[-2000:]
    assert " start=2; GPT-2 of" in log, log[-2000:]
    result = json.loads(out.read_text())
    dense, sent = result["dense_bytes_per_step"], result["total_sent"]
    assert 2 * dense < sent < 2.2 * dense, (sent / dense)
    losses = [loss for _, _, loss in result["curve"]]
    assert losses[-1] < losses[0], losses


# -- (e) auto: a compressor chosen per DDP bucket --------------------------------------------

AUTO_CANDIDATES = ["none", "topk:density=0.1", "fp16"]


def test_auto_same_choice_on_every_rank_and_its_aggregate(ddp_job):
    """auto:candidates=none|topk|fp16,calibrate=3,every=2 for AUTO_STEPS steps of DDP
    (one bucket at the first step, three after DDP rebuilt them): (a) both ranks send the
    same auto buckets with the same candidate at every step; calibration goes through the
    candidates in turn; a check step decided again; (b) p.grad (op sum) is, bit for bit,
    the numpy aggregate of the candidates used, with residuals carried across switches
    (topk: error feedback per tensor; none, fp16: the residual sent with the gradient;
    fp16 sums in float16), and the residuals left are the reference's."""
    ranks = load(ddp_job[0], "auto")
    for step in range(AUTO_STEPS):
        np.testing.assert_array_equal(ranks[0][f"sent|{step}"], ranks[1][f"sent|{step}"])
        np.testing.assert_array_equal(ranks[0][f"choice|{step}"], ranks[1][f"choice|{step}"])
    assert len(ranks[0]["sent|0"]) == 1 and len(ranks[0]["sent|1"]) == 3, ranks[0]["sent|1"]
    for step in range(3):             # calibration: every bucket with candidate step % 3
        assert set(ranks[0][f"choice|{step}"].tolist()) == {step}
    assert int(ranks[0]["decisions"]) >= 2         # the calibration's and a check step's
    keys = {k.rpartition("=")[0] for k in ranks[0][f"sent|{AUTO_STEPS - 1}"]}
    assert set(json.loads(str(ranks[0]["stats_choices"]))) == keys

    expected, residuals = _auto_reference(ranks, AUTO_CANDIDATES, AUTO_STEPS,
                                          lambda step: ranks[0][f"choice|{step}"])
    for step in range(AUTO_STEPS):
        for n in BUCKET_SHAPES:
            for r in ranks:
                np.testing.assert_array_equal(_bits(r[f"out|{step}|{n}"]),
                                              _bits(expected[step][n].reshape(BUCKET_SHAPES[n])),
                                              err_msg=f"step {step} {n}")
    for r, res in zip(ranks, residuals):
        for n in BUCKET_SHAPES:
            got, want = r[f"residual|{n}"], res[n].reshape(-1)
            if got.size == 0:             # no residual held: nothing may be owed
                assert not want.any(), n
            else:
                np.testing.assert_array_equal(got, want, err_msg=n)


def test_auto_checkpoint_resumes_choices_and_bits(ddp_job):
    """auto:candidates=none|topk,calibrate=2,every=0: 6 steps straight vs 3 steps,
    state.state_dict(), and a new process group, DDP model and state restoring it for
    steps 3-5: the same candidate per tensor and the same bits.  The restored model's
    first step has one DDP bucket: it is sent as the saved auto buckets.  The buckets
    DDP made after its first step were never sent with none in calibration (step 0 was
    DDP's one bucket): none is not chosen for them (unmeasured is not free)."""
    for r in load(ddp_job[0], "auto"):
        for step in range(2, 6):
            assert set(r[f"ckpt|straight|choice|{step}"].tolist()) == {1}, step
        for step in range(3, 6):
            np.testing.assert_array_equal(r[f"ckpt|resumed|choice|{step}"],
                                          r[f"ckpt|straight|choice|{step}"])
            assert sorted(r[f"ckpt|resumed|sent|{step}"]) == sorted(r[f"ckpt|straight|sent|{step}"])
            for n in BUCKET_SHAPES:
                np.testing.assert_array_equal(_bits(r[f"ckpt|resumed|out|{step}|{n}"]),
                                              _bits(r[f"ckpt|straight|out|{step}|{n}"]),
                                              err_msg=f"step {step} {n}")


def test_auto_inside_a_policy(ddp_job):
    """Policy(w: topk, late: fp16, default auto:candidates=none|topk): DDP's bucket
    [late, s, b, w] holds three exchanges; auto chooses for s, b (and big, conv) only;
    every tensor's aggregate is, bit for bit, that of its compressor (the candidate auto
    used, with its residuals carried; topk and fp16 fixed), the same on both ranks."""
    ranks = load(ddp_job[0], "auto")
    fixed = {n: AUTO_CANDIDATES.index(c) for n, c in W.AUTO_POLICY.items()}
    names = list(BUCKET_SHAPES)
    choices = []
    for step in range(W.AUTO_POLICY_STEPS):
        got = ranks[0][f"policy|choice|{step}"]
        np.testing.assert_array_equal(got, ranks[1][f"policy|choice|{step}"])
        assert all((got[i] == -1) == (n in fixed) for i, n in enumerate(names)), got
        choices.append([fixed.get(n, c) for n, c in zip(names, got)])
    assert {c for row in choices[1:] for n, c in zip(names, row) if n not in fixed} <= {0, 1}
    expected, _ = _auto_reference(ranks, AUTO_CANDIDATES, W.AUTO_POLICY_STEPS,
                                  lambda step: choices[step])
    for step in range(W.AUTO_POLICY_STEPS):
        for n in BUCKET_SHAPES:
            for r in ranks:
                np.testing.assert_array_equal(_bits(r[f"policy|out|{step}|{n}"]),
                                              _bits(expected[step][n].reshape(BUCKET_SHAPES[n])),
                                              err_msg=f"step {step} {n}")
