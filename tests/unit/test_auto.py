"""``auto`` in one process: the step model and the decision on synthetic timings, the
spec, the calibration / check schedule driven with made-up timings, residuals across a
switch and checkpoints.  (Through horovodrun: test_horovod_torch.py / _tensorflow.py.)"""
import logging
import math

import numpy as np
import pytest
import torch

import hvd_compress
from hvd_compress import buckets
from hvd_compress.strategies.auto import Auto, BucketCost, decide, fit_link, predict
from hvd_compress.ops import torch_ops
from auto_drive import FakeComm, drive  # tests/auto_drive.py

MS = 1e-3


def bucket(key, ready, compress, comm, decompress):
    return BucketCost(key, ready, tuple(compress), tuple(comm), tuple(decompress))


# -- the step model ------------------------------------------------------------------------

def test_predict_by_hand():
    # two buckets, one candidate: ready at -10 ms and 0 ms, 4 ms and 6 ms on the link
    costs = [bucket("a", -10 * MS, [1 * MS], [4 * MS], [0.5 * MS]),
             bucket("b", 0.0, [2 * MS], [6 * MS], [1 * MS])]
    # a: compressed by -9, on the link until -5; b: compressed by 3 (backward pushed 3 ms),
    # on the link 3..9; tail: t=3 -> max(3,-5)+0.5=3.5 -> max(3.5, 9)+1 = 10
    assert predict(costs, [0, 0], compute=100 * MS) == pytest.approx(110 * MS)
    # scale 2: a on the link -9..-1; b 3..15; tail = 15 + 1
    assert predict(costs, [0, 0], scale=2.0) == pytest.approx(16 * MS)


def test_fast_link_chooses_none():
    # none: 2 ms on the link; the sparsifier: 15 ms to compress, 0.1 ms on the link
    costs = [bucket("fc", 0.0, [0.0, 15 * MS], [2 * MS, 0.1 * MS], [0.0, 3 * MS])]
    assert decide(costs, 2) == [0]


def test_slow_link_chooses_the_sparsifier():
    costs = [bucket("fc", 0.0, [0.0, 15 * MS], [400 * MS, 4 * MS], [0.0, 3 * MS])]
    assert decide(costs, 2) == [1]


def test_bucket_whose_codec_costs_more_than_it_saves_stays_none():
    # "small": its communication hides behind backward anyway; compressing it only costs
    costs = [bucket("small", -50 * MS, [0.0, 5 * MS], [3 * MS, 0.1 * MS], [0.0, 1 * MS]),
             bucket("big", 0.0, [0.0, 15 * MS], [400 * MS, 4 * MS], [0.0, 3 * MS])]
    assert decide(costs, 2) == [0, 1]


def test_mixed_choice_beats_every_single_candidate():
    costs = [bucket("early", -30 * MS, [0.0, 10 * MS], [25 * MS, 1 * MS], [0.0, 2 * MS]),
             bucket("late", 0.0, [0.0, 10 * MS], [200 * MS, 2 * MS], [0.0, 2 * MS])]
    choice = decide(costs, 2)
    mixed = predict(costs, choice)
    assert choice == [0, 1]
    assert all(mixed < predict(costs, [c, c]) for c in range(2))


def test_ties_keep_the_earlier_candidate_whatever_the_order():
    same = [1 * MS, 1 * MS, 1 * MS]
    costs = [bucket("a", -5 * MS, same, [2 * MS] * 3, same), bucket("b", 0.0, same, [2 * MS] * 3, same)]
    assert decide(costs, 3) == [0, 0]
    costs = [bucket("a", 0.0, [5 * MS, 1 * MS, 1 * MS], [2 * MS] * 3, [0.0] * 3)]
    assert decide(costs, 3) == [1]          # 1 and 2 tie: the earlier


def test_decide_is_optimal_on_random_small_cases():
    rng = np.random.default_rng(0)
    import itertools
    for _ in range(40):
        n, nb = 3, 3
        costs = [bucket(str(b), -float(rng.uniform(0, 0.05)), rng.uniform(0, 0.02, n),
                        rng.uniform(0, 0.1, n), rng.uniform(0, 0.01, n)) for b in range(nb)]
        costs.sort(key=lambda b: b.ready)
        best = min(predict(costs, list(c)) for c in itertools.product(range(n), repeat=nb))
        assert predict(costs, decide(costs, n)) <= best + 1e-9
        # coordinate descent (many buckets): never worse than the best single candidate
        alone = min(predict(costs, [c] * nb) for c in range(n))
        assert predict(costs, decide(costs, n, exhaustive=0)) <= alone + 1e-9


def test_fit_link_recovers_alpha_and_beta():
    alpha, beta = 0.5 * MS, 100e6
    points = [(b, alpha + b / beta) for b in (1e4, 1e5, 1e6, 1e7)]
    a, b = fit_link(points)
    assert a == pytest.approx(alpha, rel=1e-6) and b == pytest.approx(beta, rel=1e-6)
    assert fit_link([(1e3, 1.0), (1e6, 1.0)])[1] == math.inf


# -- the spec -------------------------------------------------------------------------------

def test_spec_round_trip_and_defaults():
    a = hvd_compress.from_spec("auto")
    assert [m.name for m in a.members] == ["none", "fp16", "laplace_topk", "laplace_topk"]
    assert a.calibrate == 20 and a.every == 100
    assert hvd_compress.from_spec(a.spec).spec == a.spec
    b = hvd_compress.from_spec("auto:candidates=none|topk:density=0.1+ef=1,calibrate=4,every=0")
    assert [m.spec for m in b.members] == ["none:ef=0", "topk:density=0.1,ef=1"]
    assert hvd_compress.from_spec(b.spec).spec == b.spec
    c = Auto(candidates=["none", hvd_compress.from_spec("fp16")], calibrate=2)
    assert c.names == ["none", "fp16:ef=0"]


@pytest.mark.parametrize("spec,words", [
    ("auto:calibrate=2", "calibrate"),                    # fewer steps than candidates
    ("auto:every=-1", "every"),
    ("auto:drift=0", "drift"),
    ("auto:candidates=none|nosuch", "nosuch"),
    ("auto:candidates=none|topk:density=0.1+agg=union", "agg=union"),
    ("auto:candidates=none|powersgd", "powersgd"),
    ("auto:candidates=none|dgc:density=0.1", "dgc"),         # (not segmented)
    ("auto:candidates=none|none", "distinct"),
    ("auto:candidates=none|auto", "auto"),
])
def test_bad_parameters_name_themselves(spec, words):
    with pytest.raises(ValueError, match=words):
        hvd_compress.from_spec(spec)


def test_auto_is_not_a_codec_itself():
    with pytest.raises(TypeError, match="DistributedOptimizer"):
        hvd_compress.from_spec("auto").compress(torch.ones(3), "x")


# -- the schedule, driven with made-up timings --------------------------------------------

def test_calibration_decides_then_checks_then_recalibrates_on_drift():
    auto = Auto(candidates=["none", "topk:density=0.01"], calibrate=4, every=3, drift=0.5,
                trial=0, verbose=False)
    comm = FakeComm()
    slow = {"big": [(0.0, 0.4, 0.0), (0.010, 0.004, 0.003)],
            "small": [(0.0, 0.001, 0.0), (0.005, 0.0001, 0.001)]}
    used = [drive(auto, comm, slow) for _ in range(4)]
    assert [u["big"] for u in used] == [0, 0, 1, 1] and auto.blocking is False
    assert auto.choice == {"big": 1, "small": 0}
    assert [c[0] for c in comm.calls[-2:]] == ["auto.decision", "auto.choice"]
    for _ in range(3):
        drive(auto, comm, slow)
    assert auto.phase == "check" and auto.blocking
    drive(auto, comm, slow)                     # check: as predicted -> same choice
    assert auto.phase == "run" and auto.scale == pytest.approx(1.0)
    assert [c[0] for c in comm.calls[-5:]] == ["auto.check", "auto.verdict", "auto.costs",
                                               "auto.decision", "auto.choice"]
    assert comm.calls[-4][1] == [0.0, pytest.approx(1.0)]
    # the link becomes 100x faster: the check sees the collectives 10x faster than predicted
    fast = {"big": [(0.0, 0.004, 0.0), (0.010, 0.0004, 0.003)],
            "small": [(0.0, 0.0001, 0.0), (0.005, 0.00001, 0.001)]}
    for _ in range(3):
        drive(auto, comm, fast)
    drive(auto, comm, fast)                     # check -> drift -> calibrate again
    assert auto.phase == "calibrate"
    for _ in range(4):
        drive(auto, comm, fast)
    assert auto.choice == {"big": 0, "small": 0}
    assert len(auto.decisions) == 3
    assert "choice" in auto.decisions[-1]


def test_decision_is_rank_zeros():
    auto = Auto(candidates=["none", "topk:density=0.01"], calibrate=2, trial=0, verbose=False)

    class Rank1(FakeComm):
        rank = 1

        def broadcast(self, values, name):
            return [1.0] * len(values)          # rank 0 chose candidate 1 everywhere

        def allgather(self, values, name):
            return [list(values)]
    times = {"b": [(0.0, 0.001, 0.0), (0.1, 0.001, 0.1)]}
    for _ in range(2):
        drive(auto, Rank1(), times)
    assert auto.choice == {"b": 1}


def test_verbose_logs_the_decision_table(caplog):
    auto = Auto(candidates=["none", "topk:density=0.01"], calibrate=2, trial=0)
    with caplog.at_level(logging.INFO, logger="hvd_compress"):
        for _ in range(2):
            drive(auto, FakeComm(), {"b": [(0.0, 0.5, 0.0), (0.01, 0.001, 0.001)]})
    out = "\n".join(r.getMessage() for r in caplog.records if r.name == "hvd_compress")
    assert "hvd_compress auto" in out and "topk:density=0.01" in out and "predicted step" in out


# -- residuals across a switch, and checkpoints --------------------------------------------

def test_residual_goes_on_with_the_next_candidate_and_none_sends_it():
    auto = Auto(candidates=["none", "topk:density=0.25", "randomk:density=0.5"], calibrate=3,
                trial=0, verbose=False)
    lay = buckets.layout(["a", "b"], [(4,), (4,)])
    topk, randomk, none = auto.members[1], auto.members[2], auto.members[0]
    g = torch.arange(1.0, 9.0)
    payload, ctx = topk.compress_bucket(auto.carry(lay, g.clone(), topk, torch_ops), lay)
    sent = topk.decompress_bucket(payload, ctx)
    r = torch.cat([auto.residual("a"), auto.residual("b")]).clone()
    torch.testing.assert_close(sent + r, g)
    assert randomk.residual("a") is not None            # one store: randomk sees it
    g2 = torch.ones(8)
    flat = auto.carry(lay, g2.clone(), none, torch_ops)  # none: the residual travels now
    torch.testing.assert_close(flat, g2 + r)
    assert auto.residual("a") is None and auto.residual("b") is None
    assert auto.carry(lay, g2.clone(), topk, torch_ops).equal(g2)   # EF keeps its own


def test_carry_fills_tensors_without_a_residual_with_zeros():
    auto = Auto(candidates=["none", "topk:density=0.25"], calibrate=2, trial=0, verbose=False)
    topk, one = auto.members[1], buckets.layout(["a"], [(4,)])
    topk.compress_bucket(auto.carry(one, torch.arange(1.0, 5.0), topk, torch_ops), one)
    r = auto.residual("a").clone()
    lay = buckets.layout(["a", "b"], [(4,), (3,)])
    flat = auto.carry(lay, torch.zeros(7), auto.members[0], torch_ops)
    torch.testing.assert_close(flat, torch.cat([r, torch.zeros(3)]))


def test_state_dict_restores_the_decision_and_the_residuals():
    auto = Auto(candidates=["none", "topk:density=0.01"], calibrate=2, every=0, trial=0, verbose=False)
    times = {"b": [(0.0, 0.5, 0.0), (0.01, 0.001, 0.001)]}
    for _ in range(2):
        drive(auto, FakeComm(), times)
    lay = buckets.layout(["b"], [(4,)])
    auto.members[1].compress_bucket(auto.carry(lay, torch.arange(1.0, 5.0), auto.members[1],
                                               torch_ops), lay)
    sd = auto.state_dict()
    import io
    buf = io.BytesIO()
    torch.save(sd, buf)                      # plain types: loads with weights_only=True
    sd = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    again = hvd_compress.from_spec(auto.spec)
    again.load_state_dict(sd)
    assert again.choice == auto.choice == {"b": 1} and again.phase == "run"
    assert again.steps == auto.steps
    torch.testing.assert_close(again.residual("b"), auto.residual("b"))
    assert again.members[1]._store is again._store
    with pytest.raises(ValueError, match="state_dict is for"):
        hvd_compress.from_spec("auto:calibrate=30").load_state_dict(sd)


def test_auto_prefers_small_buckets_unless_told(monkeypatch):
    monkeypatch.delenv(buckets.ENV_VAR, raising=False)
    auto = hvd_compress.from_spec("auto")
    assert buckets.bucket_mb(None, auto) == 1.0
    assert buckets.bucket_mb(None, hvd_compress.from_spec("auto:bucket_mb=4")) == 4.0
    assert buckets.bucket_mb(8, auto) == 8.0
    assert buckets.bucket_mb(None, hvd_compress.from_spec("topk:density=0.1")) == 25.0
    monkeypatch.setenv(buckets.ENV_VAR, "2")
    assert buckets.bucket_mb(None, auto) == 2.0
    with pytest.raises(ValueError, match="bucket_mb"):
        hvd_compress.from_spec("auto:bucket_mb=-1")


def test_measurements_of_every_rank_combine():
    """Collective time: min over ranks (the last to arrive waits only for the transfer);
    codec and compute: max (the slowest rank sets the pace)."""
    auto = Auto(candidates=["none", "topk:density=0.01"], calibrate=2, trial=0, verbose=False)

    class TwoRanks(FakeComm):
        def allgather(self, values, name):
            other = list(values)
            if name == "auto.costs":     # rank 1: collectives 3x longer, codecs 2x
                # [compute, ready, C0, C1, T0, T1, D0, D1, B0, B1]
                other[0] *= 2
                other[2:4] = [2 * v for v in values[2:4]]
                other[4:6] = [3 * v for v in values[4:6]]
            return [list(values), other]
    for _ in range(2):
        drive(auto, TwoRanks(), {"b": [(0.001, 0.2, 0.0), (0.01, 0.002, 0.001)]})
    (b,) = auto.costs
    assert b.comm == pytest.approx((0.2, 0.002))
    assert b.compress == pytest.approx((0.002, 0.02))


def test_policy_restores_an_auto_without_residuals():
    policy = hvd_compress.Policy({"x": "topk:density=0.5"},
                                 default=Auto(candidates=["none", "fp16"], calibrate=2,
                                              trial=0, verbose=False))
    auto = policy.default
    for _ in range(2):
        drive(auto, FakeComm(), {"b": [(0.0, 0.1, 0.0), (0.0, 0.01, 0.0)]})
    assert auto.phase == "run"
    again = hvd_compress.Policy({"x": "topk:density=0.5"},
                                default=Auto(candidates=["none", "fp16"], calibrate=2,
                                             trial=0, verbose=False))
    again.load_state_dict(policy.state_dict())
    assert again.default.phase == "run" and again.default.choice == auto.choice


def test_dense_collectives_follow_the_fitted_link_so_noise_cannot_pay_for_a_codec():
    """Dense buckets of 10 KB, 1 MB and 4 MB on a 1 ms + 1 GB/s link; the 10 KB one's dense
    collective was timed 3 ms (noise).  The line predicts 1.01 ms for it, and the
    sparsifier's 0.2 ms is floored at the line: compressing it does not pay."""
    auto = Auto(candidates=["none", "topk:density=0.01"], calibrate=2, trial=0, verbose=False)
    link = lambda nbytes: 1e-3 + nbytes / 1e9          # noqa: E731
    times = {"tiny": [(0.0, 3e-3, 0.0, 1e4), (0.5e-3, 0.2e-3, 0.2e-3, 1e2)],
             "mid": [(0.0, link(1e6), 0.0, 1e6), (5e-3, link(1e4), 1e-3, 1e4)],
             "big": [(0.0, link(4e6), 0.0, 4e6), (20e-3, link(4e4), 1e-3, 4e4)]}
    for _ in range(2):
        drive(auto, FakeComm(), times)
    alpha, beta = auto.link
    assert 1e-3 <= alpha < 3e-3 and 0.5e9 < beta < 2e9    # least squares: pulled by noise
    tiny = next(b for b in auto.costs if b.key == "tiny")
    assert tiny.comm[0] < 3e-3                                      # the line, not 3 ms
    assert tiny.comm[1] >= alpha                                    # floored
    assert auto.choice["tiny"] == 0


def test_hvd_compress_env_var_selects_auto(monkeypatch):
    monkeypatch.setenv(hvd_compress.ENV_VAR, "auto:every=0")
    auto = hvd_compress.from_env()
    assert isinstance(auto, Auto) and auto.every == 0


def test_nothing_to_send_decides_nothing_without_collectives_of_size_zero():
    auto = Auto(candidates=["none", "fp16"], calibrate=2, verbose=False)
    comm = FakeComm()
    for _ in range(2):
        drive(auto, comm, {})
    assert auto.phase == "run" and auto.choice == {}
    assert "auto.decision" not in [c[0] for c in comm.calls]


def test_without_logging_configured_the_table_reaches_stdout_on_rank_0_only():
    """A worker under horovodrun configures no logging: rank 0's table is on stdout as a
    plain line, rank 1 logs nothing; with a root handler the record propagates instead."""
    import subprocess
    import sys
    code = ("import logging, sys\n"
            "from hvd_compress.log import info_rank0\n"
            "info_rank0(0, 'hvd_compress auto at step 20 (calibration)')\n"
            "info_rank0(1, 'from rank 1')\n"
            "logging.basicConfig(stream=sys.stderr, format='root: %(message)s')\n"
            "info_rank0(0, 'configured')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout == "hvd_compress auto at step 20 (calibration)\n"
    assert out.stderr.strip().endswith("root: configured")
