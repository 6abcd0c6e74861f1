"""Compressed-momentum Adam, in process: the schedule (warm-up, refresh, variance
stability), the journal that undoes a skipped step's error-feedback writes for every
compressor, and the torch rule's arithmetic (L2 weight decay, maximize).  Through real
horovodrun and torchrun: tests/integration/test_momentum.py."""
import copy

import numpy as np
import pytest
import torch

from hvd_compress.buckets import layout
from hvd_compress.stores import Journal
from hvd_compress.spec import from_spec
from hvd_compress.strategies.momentum import MomentumSchedule, coefficients
from hvd_compress.torch.momentum import AdamMomentum


def test_build_accepts_the_documented_values_and_names_the_bad_ones():
    assert MomentumSchedule.build(None) is None and MomentumSchedule.build(False) is None
    assert MomentumSchedule.build(True).warmup == "auto"
    assert MomentumSchedule.build(7).warmup == 7
    assert MomentumSchedule.build({"warmup": 3, "refresh": 4}).refresh == 4
    for bad in (0, -1, 2.5, "often", [3]):
        with pytest.raises(ValueError, match="compressed_momentum"):
            MomentumSchedule.build(bad)
    with pytest.raises(ValueError, match="tol"):
        MomentumSchedule(tol=1.5)


def test_fixed_warmup_then_compressed_with_doubling_refreshes():
    s = MomentumSchedule(warmup=3, refresh=2)
    kinds = []
    for _ in range(20):
        dense = s.dense()
        kinds.append(dense)
        s.step_done(dense, s.steps + 1)
        if s.warming_up and s.observe(None, 0.999, s.steps):
            s.freeze()
    dense_steps = [i + 1 for i, d in enumerate(kinds) if d]
    # warm-up 1..3, then refreshes at T_w + R, + 3R, + 7R: 5, 9, 17
    assert dense_steps == [1, 2, 3, 5, 9, 17]
    assert s.frozen_at == 3 and s.variance_step == 17


def test_auto_warmup_ends_when_the_variance_settles():
    s = MomentumSchedule(warmup="auto", check=5, tol=0.05, min_warmup=10)
    beta2 = 0.999
    frozen = None
    for step in range(1, 200):
        s.step_done(True, step)
        # v_t of a constant gradient 1: sum = n (1 - b2^t); bias-corrected: n, constant,
        # except a growing part that settles: n (1 + 1/t)
        total = 100 * (1 - beta2 ** step) * (1 + 1 / step)
        if s.observe(total if s.wants_check() else None, beta2, step):
            s.freeze()
            frozen = step
            break
    assert frozen is not None and frozen >= 10
    # |S_t - S_{t-5}| / S_t < 0.05 first holds when 5/(t(t-5)) / (1 + 1/t) < 0.05: t = 15
    assert frozen == 15, s.history


def test_auto_warmup_stops_at_max_warmup():
    s = MomentumSchedule(warmup="auto", check=2, max_warmup=6, min_warmup=1)
    for step in range(1, 7):
        s.step_done(True, step)
        ended = s.observe(float(step * step) if s.wants_check() else None, 0.9, step)
    assert ended


def test_schedule_state_round_trips_and_refuses_another_configuration():
    s = MomentumSchedule(warmup=2)
    for _ in range(3):
        s.step_done(True, s.steps + 1)
    s.freeze()
    t = MomentumSchedule(warmup=2)
    t.load_state_dict(copy.deepcopy(s.state_dict()))
    assert t.state_dict() == s.state_dict() and not t.dense()
    with pytest.raises(ValueError, match="warmup=5"):
        MomentumSchedule(warmup=5).load_state_dict(s.state_dict())


def test_warmup_compression_is_part_of_the_configuration_and_named_when_bad():
    plain, low = MomentumSchedule(warmup=2), MomentumSchedule(warmup=2,
                                                              warmup_compression="powersgd:rank=4")
    assert "warmup_compression" not in plain.spec          # unchanged for old checkpoints
    assert "warmup_compression=powersgd:rank=4" in low.spec
    for bad in ("", 4, None):
        with pytest.raises(ValueError, match="warmup_compression"):
            MomentumSchedule(warmup=2, warmup_compression=bad)
    with pytest.raises(ValueError, match="powersgd"):
        plain.load_state_dict(low.state_dict())


def test_warmup_compressor_state_is_in_the_checkpoint():
    from hvd_compress.strategies.momentum import MomentumGlue
    comp = from_spec("topk:density=0.5")
    glue = MomentumGlue({"warmup": 2, "warmup_compression": "fp16"}, comp)
    assert glue.warmup_compressor.name == "fp16"
    assert glue.state_dict()["warmup_compression"]["spec"] == glue.warmup_compressor.spec
    assert "warmup_compression" not in MomentumGlue(2, from_spec("topk:density=0.5")).state_dict()
    other = MomentumGlue({"warmup": 2, "warmup_compression": "fp16"}, from_spec("topk:density=0.5"))
    other.load_state_dict(glue.state_dict())
    assert other.state_dict() == glue.state_dict()


def test_coefficients_are_adams_bias_corrections():
    step_size, scale, eps = coefficients(0.1, 0.9, 0.99, 1e-8, step=7, variance_step=3)
    assert step_size == pytest.approx(0.1 / (1 - 0.9 ** 7))
    assert scale == pytest.approx(np.sqrt(1 - 0.99 ** 3))


SPECS = ["laplace_topk:density=0.1", "topk:density=0.1", "onebit", "twobit",
         "rangefloat:bits=8", "dct:density=0.1", "topk:density=0.1,values=rangefloat8",
         "randomk:density=0.1", "fp16", "topk:density=0.1,momentum=0.9,clip=1.0",
         "laplace_topk:density=0.1,momentum=0.9,warmup_steps=3"]


def _state(c):
    return {k: v.clone() for k, v in c.state_dict()["state"].items()}


def _equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


CASES = [(s, False) for s in SPECS] + [(s, True) for s in SPECS if from_spec(s).segmented]


@pytest.mark.parametrize("spec,bucket", CASES)
def test_journal_rollback_restores_the_state_bit_for_bit(spec, bucket):
    """A step compressed and then rolled back leaves the state as it was, and the next
    step gives the bits a run without the undone step gives."""
    c = from_spec(spec)
    twin = from_spec(spec)
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(300, generator=gen) for _ in range(3)]
    lay = layout(["a", "b"], [(100,), (200,)])

    def compress(comp, g):
        if bucket:
            return comp.compress_bucket(g.clone(), lay)
        return comp.compress(g.clone().reshape(10, 30), "w")

    compress(c, grads[0])
    compress(twin, grads[0])
    before = _state(c)
    journal = Journal()
    c.attach_journal(journal)
    poisoned = grads[1].clone()
    poisoned[5] = float("nan")
    compress(c, poisoned)
    journal.rollback()
    assert _equal(_state(c), before)
    compress(c, grads[2])
    compress(twin, grads[2])
    assert _equal(_state(c), _state(twin))


def test_journal_covers_every_member_of_a_policy():
    from hvd_compress.strategies.policy import Policy
    policy = Policy({"w": "topk:density=0.1"}, default="onebit")
    journal = Journal()
    policy.attach_journal(journal)
    for name in ("w", "v"):
        comp = policy.for_tensor(name, torch.zeros(10))
        comp.compress(torch.randn(10), name)
    assert journal.entries
    journal.rollback()
    assert all(not s["state"] for s in policy.state_dict()["state"])


def _adam(cls, **kw):
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
    opt = cls([p], lr=0.1, **kw)
    p.grad = torch.tensor([0.5, 0.25, -1.0])
    opt.step()                                  # the state a warm-up step leaves
    return p, opt


def test_local_momentum_has_adams_l2_term_and_maximize():
    p, opt = _adam(torch.optim.Adam, weight_decay=0.1, maximize=True)
    m = AdamMomentum(opt, 1, from_spec("topk:density=0.5"))
    g = torch.tensor([1.0, 2.0, 3.0])
    expected = 0.9 * opt.state[p]["exp_avg"] + 0.1 * (-g + 0.1 * p.detach())
    assert torch.allclose(m.to_momentum(p, g.clone()), expected)
    p, opt = _adam(torch.optim.AdamW, weight_decay=0.1)       # decoupled: no L2 term
    m = AdamMomentum(opt, 1, from_spec("topk:density=0.5"))
    expected = 0.9 * opt.state[p]["exp_avg"] + 0.1 * g
    assert torch.allclose(m.to_momentum(p, g.clone()), expected)


def test_apply_is_adamw_with_the_frozen_variance_and_skips_nonfinite():
    p, opt = _adam(torch.optim.AdamW, weight_decay=0.1, amsgrad=True)
    m = AdamMomentum(opt, 1, from_spec("topk:density=0.5"))
    from hvd_compress.exchange.in_process import World
    from hvd_compress.ops import torch_ops
    m.after_dense([p], World(1, torch_ops).transport(0))     # one rank: its own decision
    assert not m.dense
    v = opt.state[p]["max_exp_avg_sq"].clone()
    p0 = p.detach().clone()
    p.grad = torch.tensor([0.2, -0.1, 0.3])          # the mean momentum
    assert m.apply([p])
    step_size = 0.1 / (1 - 0.9 ** 2)
    expected = p0 * (1 - 0.1 * 0.1) - step_size * p.grad / (
        torch.sqrt(v / (1 - 0.999 ** 1)) + 1e-8)
    assert torch.allclose(p.detach(), expected)
    assert torch.equal(opt.state[p]["exp_avg"], p.grad)
    kept = [p.detach().clone(), opt.state[p]["exp_avg"].clone(), float(opt.state[p]["step"])]
    p.grad = torch.tensor([0.2, float("inf"), 0.3])
    assert not m.apply([p])
    assert torch.equal(p.detach(), kept[0]) and torch.equal(opt.state[p]["exp_avg"], kept[1])
    assert float(opt.state[p]["step"]) == kept[2] and m.skipped == 1


def test_an_optimizer_outside_the_adam_family_is_refused_by_name():
    p = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="compressed_momentum.*Adam.*SGD"):
        AdamMomentum(torch.optim.SGD([p], lr=0.1), True, from_spec("topk:density=0.5"))


def test_auto_for_adam_keeps_only_lossless_defaults_and_what_the_user_listed():
    from hvd_compress.strategies.auto.candidates import ADAM_CANDIDATES, for_adam
    from hvd_compress.strategies.policy import Policy
    auto = from_spec("auto")
    assert for_adam(auto) == [auto]
    assert auto.specs == [from_spec(c).spec for c in ADAM_CANDIDATES]
    listed = from_spec("auto:candidates=none|topk:density=0.01")
    assert for_adam(listed) == [] and len(listed.specs) == 2
    inner = from_spec("auto")
    assert for_adam(Policy({"w": inner}, default="none")) == [inner]
    assert for_adam(from_spec("topk:density=0.01")) == []
