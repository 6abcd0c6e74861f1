"""Aggregation-aware selection (agg=union/leader/hint) in one process: the two-round
protocol with the collectives done by ``aggregation.in_process`` (concatenation and
sum), checked against the numpy reference of tests/horovod_checks.py.  The same calls
over real Horovod: tests/integration/test_horovod_torch.py and tests/integration/test_horovod_tensorflow.py."""
import numpy as np
import pytest
import torch

import hvd_compress
from hvd_compress.compressors.aggregation import in_process
from horovod_checks import agg_reference

FAMILIES = ["topk:density=0.05", "laplace_topk:density=0.05", "dgc:density=0.05",
            "gaussian_k:density=0.05", "sidco_exp:density=0.05", "randomk:density=0.05",
            "dct:density=0.05,block=32"]
STRATEGIES = ["agg=union", "agg=leader", "agg=hint", "agg=hint,beta=4,hint=union"]
SHAPE = (30, 20)


def grads(P, steps, seed=0, shape=SHAPE):
    rng = np.random.default_rng(seed)
    common = rng.standard_normal(shape).astype(np.float32)      # overlap between ranks
    return [[(common + rng.standard_normal(shape)).astype(np.float32) for _ in range(P)]
            for _ in range(steps)]


def run(spec, data, name="w", comps=None):
    comps = comps or [hvd_compress.from_spec(spec) for _ in data[0]]
    outs, infos = [], []
    for step in data:
        out, info = in_process(comps, [torch.from_numpy(g) for g in step], name)
        outs.append(out)
        infos.append(info)
    return outs, infos, comps


# -- spec ------------------------------------------------------------------------------

def test_spec_round_trip_and_default_unchanged():
    assert hvd_compress.from_spec("topk:density=0.01").spec == "topk:density=0.01,ef=1"
    c = hvd_compress.from_spec("laplace_topk:density=0.01,agg=hint,beta=2,hint=union")
    assert hvd_compress.from_spec(c.spec).spec == c.spec
    assert "agg=hint" in c.spec and "beta=2.0" in c.spec and c.collective == "two_round"
    assert hvd_compress.from_spec("randomk:density=0.1,agg=leader,seed=3").seed == 3
    assert hvd_compress.from_spec("topk:density=0.01,agg=local").collective == "allgather"


@pytest.mark.parametrize("spec,message", [
    ("topk:agg=bogus", "agg must be one of local, union, leader, hint"),
    ("topk:agg=union,beta=2", "beta is the hint boost; it needs agg=hint"),
    ("topk:agg=hint,beta=-1", "beta must be a finite number >= 0"),
    ("topk:agg=hint,hint=sometimes", "hint must be one of top, union"),
    ("topk:hint=top", "hint needs agg=hint"),
    ("topk:agg=union,values=rangefloat8", "values=rangefloat8 needs agg=local"),
    ("threshold:agg=union", "unknown parameter(s) agg"),
])
def test_bad_configuration_names_the_argument(spec, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        hvd_compress.from_spec(spec)


# -- the protocol ------------------------------------------------------------------------

@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("family", FAMILIES)
def test_every_rank_same_sum_and_nothing_lost(family, strategy):
    """All ranks end with the same aggregate, and error feedback conserves: the sum of
    aggregates plus every rank's residual is the sum of every gradient."""
    P, steps = 4, 5
    data = grads(P, steps)
    outs, infos, comps = run(f"{family},{strategy}", data)
    for out in outs:
        for o in out[1:]:
            assert torch.equal(o, out[0])
    sent = sum(out[0].double() for out in outs)
    kept = sum(c.residual("w").double().reshape(SHAPE) for c in comps)
    given = torch.from_numpy(sum(g.astype(np.float64) for step in data for g in step))
    torch.testing.assert_close(sent + kept, given, rtol=1e-4, atol=1e-4)
    k = infos[0]["k"]
    for info in infos:
        if "leader" in strategy:
            # only the leader proposes; the union is its selection (k for exact selectors)
            assert sum(p > 0 for p in info["proposed"]) <= 1
            assert info["union"] == max(info["proposed"])
            assert info["union"] == k or not family.startswith(("topk", "randomk"))
        else:
            assert info["union"] <= sum(info["proposed"])


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_topk_equals_independent_reference(strategy):
    P, steps = 4, 5
    data = grads(P, steps, seed=1)
    spec = f"topk:density=0.05,{strategy}"
    outs, infos, comps = run(spec, data)
    inputs = [{(s, "w"): data[s][r] for s in range(steps)} for r in range(P)]
    ref, unions, res = agg_reference(inputs, spec, steps)
    for s in range(steps):
        np.testing.assert_allclose(outs[s][0].numpy(), ref[s]["w"], rtol=1e-5, atol=1e-6)
        assert infos[s]["union"] == unions[s]
    for r in range(P):
        np.testing.assert_allclose(comps[r].residual("w").numpy(), res[r]["w"], rtol=1e-5,
                                   atol=1e-6)


def test_hint_shrinks_the_union_and_leader_is_k():
    """On gradients that share a common part, agg=hint's union is smaller than union's,
    and the leader's is exactly k."""
    data = grads(8, 10, seed=2)
    sizes = {}
    for strategy in ("agg=union", "agg=hint,beta=4", "agg=leader"):
        _, infos, _ = run(f"topk:density=0.05,{strategy}", data)
        sizes[strategy] = np.mean([i["union"] / i["k"] for i in infos[1:]])
    assert sizes["agg=leader"] == 1.0
    assert sizes["agg=hint,beta=4"] < sizes["agg=union"]


def test_nonfinite_rank_sends_everything_and_keeps_its_residual():
    P = 3
    data = grads(P, 2, seed=3)
    comps = [hvd_compress.from_spec("topk:density=0.05,agg=union") for _ in range(P)]
    run(None, data[:1], comps=comps)
    before = comps[1].residual("w").clone()
    bad = [g.copy() for g in data[1]]
    bad[1][3, 4] = np.nan
    out, info = in_process(comps, [torch.from_numpy(g) for g in bad], "w")
    assert info["union"] == bad[0].size                  # rank 1 proposed every index
    assert torch.isnan(out[0][3, 4]) and torch.isfinite(out[0][0, 0])
    assert torch.equal(comps[1].residual("w"), before)   # not poisoned, not lost
    assert not comps[0].residual("w").any()              # everything of rank 0 was sent


def test_nothing_to_propose_gives_an_empty_union():
    """ef=0, all-zero gradients: laplace_topk proposes nothing; the union is empty and
    the aggregate zero, no error (over Horovod: no rank waits, see the horovodrun tests)."""
    for strategy in ("agg=union", "agg=leader", "agg=hint"):
        comps = [hvd_compress.from_spec(f"laplace_topk:density=0.05,ef=0,{strategy}")
                 for _ in range(2)]
        out, info = in_process(comps, [torch.zeros(SHAPE), torch.zeros(SHAPE)], "w")
        assert info["union"] == 0 and not out[0].any() and out[0].shape == SHAPE


@pytest.mark.parametrize("strategy", ["agg=leader", "agg=hint", "agg=hint,hint=union"])
def test_checkpoint_holds_leader_counter_and_hint(strategy):
    P, steps = 3, 6
    data = grads(P, steps, seed=4)
    spec = f"topk:density=0.05,{strategy}"
    straight, _, _ = run(spec, data)
    _, _, first = run(spec, data[:3])
    state = [c.state_dict() for c in first]
    keys = set(state[0]["state"])
    assert ("agg/w" in keys) if "leader" in strategy else ("hint/w" in keys)
    comps = [hvd_compress.from_spec(spec) for _ in range(P)]
    for c, s in zip(comps, state):
        c.load_state_dict(s)
    resumed, _, _ = run(spec, data[3:], comps=comps)
    for a, b in zip(resumed, straight[3:]):
        assert torch.equal(a[0], b[0])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_low_precision_gradients_keep_their_dtype(dtype):
    comps = [hvd_compress.from_spec("topk:density=0.1,agg=union") for _ in range(2)]
    ts = [torch.randn(40, generator=torch.Generator().manual_seed(i)).to(dtype) for i in range(2)]
    rounds = [c.propose(t, "w", r, 2) for r, (c, t) in enumerate(zip(comps, ts))]
    gathered = torch.cat([idx for idx, _ in rounds])
    values, rnd = comps[0].agree(gathered, rounds[0][1])
    # bfloat16 is summed as float32 (Gloo cannot sum it); others in their own dtype
    assert values.dtype == (torch.float32 if dtype == torch.bfloat16 else dtype)
    out = comps[0].finish(values * 2, rnd)
    assert out.dtype == dtype and out.shape == (40,)


def test_compress_of_a_two_round_exchange_says_what_to_use():
    comp = hvd_compress.from_spec("topk:density=0.1,agg=leader")
    with pytest.raises(TypeError, match="two-round exchange.*DistributedOptimizer"):
        comp.compress(torch.randn(10), "w")


def test_malformed_round_inputs_are_rejected():
    comp = hvd_compress.from_spec("topk:density=0.1,agg=union")
    idx, rnd = comp.propose(torch.randn(50), "w", 0, 2)
    with pytest.raises(ValueError, match="index out of range"):
        comp.agree(torch.tensor([3, 50], dtype=torch.int32), rnd)
    values, rnd = comp.agree(idx, rnd)
    with pytest.raises(ValueError, match="summed values for a union of"):
        comp.finish(values[:-1], rnd)


def test_bucket_equals_tensor_by_tensor():
    """propose_bucket on two tensors end to end: the same sum and residuals as one
    exchange per tensor (the union of a bucket is the per-tensor unions, offset)."""
    from hvd_compress import buckets
    rng = np.random.default_rng(5)
    shapes = {"a": (20, 10), "b": (37,)}
    lay = buckets.layout(list(shapes), list(shapes.values()))
    for strategy in ("agg=union", "agg=leader", "agg=hint"):
        spec = f"topk:density=0.05,{strategy}"
        tensorwise = [hvd_compress.from_spec(spec) for _ in range(2)]
        bucketed = [hvd_compress.from_spec(spec) for _ in range(2)]
        for step in range(3):
            g = [{n: torch.from_numpy(rng.standard_normal(s).astype(np.float32))
                  for n, s in shapes.items()} for _ in range(2)]
            expected = [in_process(tensorwise, [g[r][n] for r in range(2)], n)[0][0].reshape(-1)
                        for n in shapes]
            rounds = [c.propose_bucket(torch.cat([g[r][n].reshape(-1) for n in shapes]), lay, r, 2)
                      for r, c in enumerate(bucketed)]
            gathered = torch.cat([idx for idx, _ in rounds])
            agreed = [c.agree(gathered, rnd) for c, (_, rnd) in zip(bucketed, rounds)]
            outs = [c.finish(agreed[0][0] + agreed[1][0], rnd)
                    for c, (_, rnd) in zip(bucketed, agreed)]
            assert torch.equal(outs[0], torch.cat(expected)), (strategy, step)
            assert torch.equal(outs[1], outs[0])
        for n in shapes:
            assert torch.equal(bucketed[1].residual(n), tensorwise[1].residual(n))


def test_tensorflow_matches_torch_eager_and_in_tf_function():
    tf = pytest.importorskip("tensorflow")
    data = grads(3, 3, seed=6)
    for strategy in ("agg=union", "agg=leader", "agg=hint"):
        spec = f"topk:density=0.05,{strategy}"
        ref, _, _ = run(spec, data)
        for mode in ("eager", "function"):
            comps = [hvd_compress.from_spec(spec) for _ in range(3)]

            def step(*ts):
                return in_process(comps, list(ts), "w")[0][0]
            fn = tf.function(step) if mode == "function" else step
            for s, gs in enumerate(data):
                out = fn(*[tf.constant(g) for g in gs])
                np.testing.assert_allclose(out.numpy(), ref[s][0].numpy(), rtol=1e-6,
                                           err_msg=f"{spec} {mode} step {s}")


@pytest.mark.parametrize("family", FAMILIES)
def test_hint_with_beta_0_is_union(family):
    """beta=0 boosts nothing: every selector (gaussian_k's fit included) sees the
    gradient itself, so agg=hint,beta=0 makes the same choices as agg=union."""
    data = grads(3, 3, seed=7)
    union, _, _ = run(f"{family},agg=union", data)
    hint, _, _ = run(f"{family},agg=hint,beta=0", data)
    for a, b in zip(union, hint):
        assert torch.equal(a[0], b[0])
