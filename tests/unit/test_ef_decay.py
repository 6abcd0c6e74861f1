"""``ef_decay=`` (any compressor with error feedback): the residual kept is
``beta (c - sent)`` (hvd_compress.memory), on every path that writes residuals: one
tensor, a bucket, the two-round exchanges (``agg=union``, PowerSGD), dct's coefficients,
and TensorFlow."""
import importlib.util

import numpy as np
import pytest
import torch

import hvd_compress
from hvd_compress import buckets
from hvd_compress.exchange.in_process import run

BETA = 0.75


def grads(seed, n=2, size=300):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(size, generator=g) for _ in range(n)]


def with_decay(spec):
    return f"{spec}{',' if ':' in spec else ':'}ef_decay={BETA}"


def residual(c, name):
    return getattr(c, "inner", c).residual(name).clone()


@pytest.mark.parametrize("spec", ["topk:density=0.1,ef_decay=0.9",
                                  "laplace_topk:density=0.01,ef_decay=0.5,min_size=100",
                                  "hier:topk:density=0.1,ef_decay=0.9",
                                  "powersgd:rank=2,ef_decay=0.8", "twobit:ef_decay=0.95",
                                  "dct:density=0.1,ef_decay=0.9"])
def test_spec_round_trips(spec):
    c = hvd_compress.from_spec(spec)
    assert "ef_decay=" in c.spec and hvd_compress.from_spec(c.spec).spec == c.spec
    assert getattr(c, "inner", c).ef_decay == float(spec.split("ef_decay=")[1].split(",")[0])
    assert hvd_compress.from_spec("topk:density=0.1,ef_decay=0.9,hier=1").spec == \
        hvd_compress.from_spec("hier:topk:density=0.1,ef_decay=0.9").spec
    # an explicit 1 stays (plain error feedback, also for compressed updates); none: none
    assert "ef_decay=1.0" in hvd_compress.from_spec("topk:density=0.1,ef_decay=1").spec
    assert "ef_decay" not in hvd_compress.from_spec("topk:density=0.1").spec


@pytest.mark.parametrize("spec,words", [("topk:density=0.1,ef_decay=0", ["ef_decay", "0"]),
                                        ("topk:density=0.1,ef_decay=1.5", ["(0, 1]", "1.5"]),
                                        ("topk:density=0.1,ef_decay=x", ["ef_decay", "'x'"]),
                                        ("topk:density=0.1,ef=0,ef_decay=0.9", ["ef=0"]),
                                        ("auto:ef_decay=0.9", ["auto", "ef_decay"])])
def test_bad_ef_decay_is_a_clear_error(spec, words):
    with pytest.raises(ValueError) as e:
        hvd_compress.from_spec(spec)
    assert all(w in str(e.value) for w in words), str(e.value)


@pytest.mark.parametrize("spec", ["topk:density=0.05", "laplace_topk:density=0.05",
                                  "twobit", "signsgd", "dct:density=0.1", "powersgd:rank=2",
                                  "topk:density=0.05,agg=union"])
def test_two_ranks_keep_beta_times_what_they_did_not_send(spec):
    """Step 1 (zero residuals): the decayed residual is beta times plain error feedback's.
    Step 2, plain error feedback given the decayed residuals: both compress the same
    ``c = g + beta r``, so they send the same, and the decayed one keeps beta times what
    the plain one keeps."""
    plain = [hvd_compress.from_spec(spec) for _ in range(2)]
    decayed = [hvd_compress.from_spec(with_decay(spec)) for _ in range(2)]
    g1 = [t.reshape(20, 15) for t in grads(1)]
    run(plain, g1, "w")
    run(decayed, g1, "w")
    for p, d in zip(plain, decayed):
        # as kept (dct: coefficients, whose inverse DCT rounds as this CPU's matmul does:
        # 1.3e-7 off at one value of 300 on one machine) and as the gradient's residual
        mine, theirs = getattr(p, "inner", p)._store, getattr(d, "inner", d)._store
        keys = [k for k in theirs.keys() if k.startswith("residual/")]
        assert keys and sorted(keys) == sorted(k for k in mine.keys()
                                               if k.startswith("residual/"))
        for key in keys:
            torch.testing.assert_close(theirs.get(key, None), BETA * mine.get(key, None),
                                       rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(residual(d, "w"), BETA * residual(p, "w"), rtol=1e-5,
                                   atol=1e-6)
    # step 2 from the same compensated input: plain's residual set to beta r_1, as kept
    g2 = [t.reshape(20, 15) for t in grads(2)]
    for p, d in zip(plain, decayed):          # the stored form (dct: its coefficients)
        mine, theirs = getattr(p, "inner", p)._store, getattr(d, "inner", d)._store
        for key in [k for k in theirs.keys() if k.startswith("residual/")]:
            mine.set(key, theirs.get(key, None).clone())
    ref = run(plain, g2, "w")
    out = run(decayed, g2, "w")
    torch.testing.assert_close(out[0].result, ref[0].result, rtol=1e-6, atol=1e-6)
    for p, d in zip(plain, decayed):
        torch.testing.assert_close(residual(d, "w"), BETA * residual(p, "w"), rtol=1e-5,
                                   atol=1e-6)


@pytest.mark.parametrize("spec", ["topk:density=0.05", "laplace_topk:density=0.05", "twobit",
                                  "rangefloat"])
def test_a_bucket_keeps_beta_times_each_tensors_residual(spec):
    lay = buckets.layout(["a", "b", "c"], [(40,), (7, 3), (129,)])
    plain, decayed = (hvd_compress.from_spec(s) for s in (spec, with_decay(spec)))
    if not plain.segmented or not plain.ef:
        pytest.skip(f"{spec} takes no buckets or keeps no residual")
    flat = torch.randn(lay.total, generator=torch.Generator().manual_seed(3))
    plain.compress_bucket(flat.clone(), lay)
    decayed.compress_bucket(flat.clone(), lay)
    for name in lay.names:
        torch.testing.assert_close(decayed.residual(name), BETA * plain.residual(name),
                                   rtol=1e-6, atol=1e-7)


def test_nan_keeps_the_residual_undecayed():
    c = hvd_compress.from_spec(f"topk:density=0.1,ef_decay={BETA}")
    c.compress(grads(1, 1)[0], "w")
    before = c.residual("w").clone()
    bad = grads(2, 1)[0]
    bad[5] = float("nan")
    c.compress(bad, "w")
    assert torch.equal(c.residual("w"), before)


@pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None,
                    reason="tensorflow is not importable here (CI has it)")
@pytest.mark.parametrize("spec", ["topk:density=0.05", "twobit"])
def test_tensorflow_keeps_beta_times_the_residual(spec):
    import tensorflow as tf
    g = np.random.default_rng(0).standard_normal(300).astype(np.float32)
    plain, decayed = (hvd_compress.from_spec(s) for s in (spec, with_decay(spec)))
    for c in (plain, decayed):
        c.compress(tf.constant(g), "w")
    np.testing.assert_allclose(np.asarray(decayed.residual("w")),
                               BETA * np.asarray(plain.residual("w")), rtol=1e-6, atol=1e-7)


def test_a_policy_decays_the_residuals_of_its_members_with_error_feedback():
    policy = hvd_compress.Policy({"a*": "topk:density=0.1", "b*": "fp16"}, default="twobit")
    assert policy.decay_residuals(0.8) is policy
    assert [(c.name, c.ef_decay) for c in policy.compressors()] == \
        [("topk", 0.8), ("fp16", 1.0), ("twobit", 0.8)]
    with pytest.raises(ValueError, match="none of the policy's compressors"):
        hvd_compress.Policy({"a*": "fp16"}, default="none").decay_residuals(0.8)
    with pytest.raises(ValueError, match="in \\(0, 1\\]"):
        hvd_compress.Policy({"a*": "topk:density=0.1"}).decay_residuals(1.5)
    mixed = hvd_compress.Policy({"a*": "topk:density=0.1"}, default="auto")
    with pytest.raises(ValueError, match="auto chooses per bucket"):
        mixed.decay_residuals(0.8)
    assert mixed.compressors()[0].ef_decay == 1.0


def _marked(compression, update):
    """What every glue does with the compressor it takes (check_compressed_update)."""
    from hvd_compress.strategies.momentum import check_compressed_update
    check_compressed_update(update, None, compression, True, ("op=Average", "op=Sum"))
    return compression


@pytest.mark.parametrize("spec,updates,gradients", [
    ("topk:density=0.01", 0.9, 1.0), ("laplace_topk:density=0.001", 0.99, 1.0),
    ("topk:density=0.1", 0.9, 1.0), ("dct:density=0.01", 0.9, 1.0),
    ("gaussian_k:density=0.0001", 0.999, 1.0),
    ("randomk:density=0.01", 1.0, 1.0), ("twobit", 1.0, 1.0), ("powersgd:rank=2", 1.0, 1.0),
    ("topk:density=0.01,ef_decay=1", 1.0, 1.0), ("topk:density=0.01,ef_decay=0.5", 0.5, 0.5),
    ("hier:topk:density=0.01", 0.9, 1.0)])
def test_compressed_updates_decay_a_sparsifiers_residuals_by_default(spec, updates, gradients):
    """Unless the spec gives ef_decay, a sparsifier of a density keeps
    max(0.9, 1 - 10 density) of what it does not send of an *update*, and all of a
    gradient's; the spec stays as given (checkpoints and the ranks' check see no
    difference)."""
    for update, want in ((True, updates), (False, gradients)):
        c = _marked(hvd_compress.from_spec(spec), update)
        assert c.ef_decay == pytest.approx(want) and c.spec == hvd_compress.from_spec(spec).spec
    if spec.startswith(("dct", "hier", "powersgd")):    # (their residuals: tests above)
        return
    c = _marked(hvd_compress.from_spec(spec), True)
    g = grads(4, 1)[0]
    c.for_tensor("w", g).compress(g.clone(), "w")
    plain = hvd_compress.from_spec(spec.split(",ef_decay")[0] + ",ef_decay=1"
                                   if "density" in spec else spec)
    plain.for_tensor("w", g).compress(g.clone(), "w")
    torch.testing.assert_close(residual(c, "w"), updates * residual(plain, "w"),
                               rtol=1e-6, atol=1e-7)


def test_the_default_reaches_a_policys_members_and_autos_candidates():
    policy = _marked(hvd_compress.Policy({"a*": "topk:density=0.001"},
                                         default="laplace_topk:density=0.05"), True)
    assert [c.ef_decay for c in policy.compressors()] == [pytest.approx(0.99), 0.9]
    auto = _marked(hvd_compress.from_spec("auto:candidates=none|topk:density=0.01"), True)
    assert [c.ef_decay for c in auto.members if c.ef] == [0.9]


def test_one_compressor_is_not_taken_in_both_modes():
    """Two glues sharing one compressor, one with compressed_update=True: refused (its
    residuals and decay cannot be both)."""
    c = _marked(hvd_compress.from_spec("topk:density=0.01"), True)
    _marked(c, True)                                     # the same mode again: fine
    with pytest.raises(ValueError, match="taken already by a glue whose error feedback "
                                         "holds updates"):
        _marked(c, False)
    assert c.ef_decay == 0.9 and c.residuals_of == "updates"


def test_plain_error_feedback_given_loads_a_checkpoint_written_without_ef_decay():
    """Checkpoints before ef_decay (or with plain error feedback) carry no ef_decay in
    their spec: an explicit ef_decay=1 restores them; another decay does not."""
    old = _marked(hvd_compress.from_spec("topk:density=0.1"), True)
    old.compress(grads(5, 1)[0], "w")
    plain = _marked(hvd_compress.from_spec("topk:density=0.1,ef_decay=1"), True)
    plain.load_state_dict(old.state_dict())
    torch.testing.assert_close(residual(plain, "w"), residual(old, "w"))
    with pytest.raises(ValueError, match="state_dict is for compressor"):
        hvd_compress.from_spec("topk:density=0.1,ef_decay=0.9").load_state_dict(
            old.state_dict())
    policy = hvd_compress.Policy({"w": "topk:density=0.1"})
    policy.for_tensor("w", grads(5, 1)[0]).compress(grads(5, 1)[0], "w")
    hvd_compress.Policy({"w": "topk:density=0.1,ef_decay=1"}).load_state_dict(
        policy.state_dict())


def test_a_nested_policy_decays_its_members_too():
    inner = hvd_compress.Policy({"a*": "topk:density=0.1"}, default="none")
    outer = hvd_compress.Policy({"b*": inner}, default="fp16")
    outer.decay_residuals(0.8)
    assert inner.compressors()[0].ef_decay == 0.8


def test_the_glue_logs_the_decay_it_chose(caplog):
    import logging
    with caplog.at_level(logging.INFO, logger="hvd_compress"):
        _marked(hvd_compress.from_spec("topk:density=0.001"), True)
        _marked(hvd_compress.from_spec("topk:density=0.01,ef_decay=1"), True)
        _marked(hvd_compress.from_spec("topk:density=0.01"), False)
    said = [r.getMessage() for r in caplog.records if "ef_decay=" in r.getMessage()]
    assert len(said) == 1 and "ef_decay=0.99 (topk:density=0.001" in said[0]


@pytest.mark.parametrize("spec,update,ranks,hint", [
    ("topk:density=0.01", True, 8, True), ("topk:density=0.01", True, None, False),
    ("topk:density=0.01", True, 1, False), ("topk:density=0.01", False, 8, False),
    ("topk:density=0.01,ef_decay=1", True, 8, False), ("twobit", True, 8, False)])
def test_the_glue_logs_sqrt_ranks_times_the_learning_rate_for_decayed_updates(
        caplog, spec, update, ranks, hint):
    """Only where it was measured: sparsified updates with the default decay, P > 1."""
    import logging
    from hvd_compress.strategies.momentum import check_compressed_update
    with caplog.at_level(logging.INFO, logger="hvd_compress"):
        check_compressed_update(update, None, hvd_compress.from_spec(spec), True,
                                ("op=Average", "op=Sum"), ranks=ranks)
    said = [r.getMessage() for r in caplog.records if "learning rate" in r.getMessage()]
    assert said == ([f"hvd_compress: compressed_update=True on {ranks} ranks: sparsified AdamW "
                     f"updates trained best at about sqrt({ranks}) = 2.8 times dense "
                     "training's learning rate (docs/adam-adamw.md); the optimizer's own rate "
                     "is used as given"] if hint else [])
