"""DGC's training recipe as options of the density sparsifiers (momentum correction,
local gradient clipping, momentum factor masking, density warm-up), against a numpy
reference written here; per-tensor semantics in a bucket; PyTorch and TensorFlow agree."""
import math

import numpy as np
import pytest
import torch

from hvd_compress.buckets import layout
from hvd_compress.compressors.dgc_recipe import density_at
from hvd_compress.spec import from_spec
from hvd_compress.torch.momentum import check_dgc
from reference import topk_mask


def reference(grads, density, momentum, clip, mask=True):
    """Per step: (what this rank sends, densely; residual; velocity)."""
    u = np.zeros_like(grads[0], np.float64)
    r = np.zeros_like(u)
    out = []
    for g in grads:
        g = g.astype(np.float64)
        if clip:
            g = g * min(1.0, clip / np.linalg.norm(g))
        u = momentum * u + g
        c = u + r
        sel = topk_mask(c, density)
        sent = np.where(sel, c, 0.0)
        r = c - sent
        if mask:
            u = np.where(sel, 0.0, u)
        out.append((sent, r.copy(), u.copy()))
    return out


def steps(seed=0, n=60, count=5):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(n).astype(np.float32) * (1 + i) for i in range(count)]


@pytest.mark.parametrize("mask", [True, False])
def test_topk_with_the_recipe_matches_the_numpy_reference(mask):
    c = from_spec(f"topk:density=0.2,momentum=0.9,clip=3.0,mask={int(mask)}")
    grads = steps()
    for g, (sent, r, u) in zip(grads, reference(grads, 0.2, 0.9, 3.0, mask)):
        payload, ctx = c.compress(torch.from_numpy(g.copy()), "w")
        np.testing.assert_allclose(c.decompress(payload, ctx).numpy(), sent, rtol=1e-5,
                                   atol=1e-6)
        state = c.state_dict()["state"]
        np.testing.assert_allclose(state["residual/w"].numpy(), r, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(state["velocity/w"].numpy(), u, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("spec", ["topk:density=0.2", "laplace_topk:density=0.2,exact=1",
                                  "randomk:density=0.2"])
def test_a_bucket_keeps_per_tensor_semantics(spec):
    spec += ",momentum=0.9,clip=2.0,warmup_steps=3"
    whole, alone = from_spec(spec), from_spec(spec)
    lay = layout(["a", "b"], [(40,), (80,)])
    for i, g in enumerate(steps(n=120, count=4)):
        pb, cb = whole.compress_bucket(torch.from_numpy(g.copy()), lay)
        bucket = whole.decompress_bucket(pb, cb).numpy()
        parts = []
        for name, (lo, hi) in (("a", (0, 40)), ("b", (40, 120))):
            p, c = alone.compress(torch.from_numpy(g[lo:hi].copy()), name)
            parts.append(alone.decompress(p, c).numpy())
        np.testing.assert_allclose(bucket, np.concatenate(parts), rtol=1e-6, atol=1e-6)
    a, b = whole.state_dict()["state"], alone.state_dict()["state"]
    assert sorted(a) == sorted(b)
    for k in a:
        np.testing.assert_allclose(a[k].numpy(), b[k].numpy(), rtol=1e-6, atol=1e-6)


def test_density_warms_up_exponentially_from_a_quarter():
    assert density_at(0.01, 0, 4) == pytest.approx(0.25)
    assert density_at(0.01, 2, 4) == pytest.approx(0.01 * 25 ** 0.5)
    assert density_at(0.01, 4, 4) == 0.01 and density_at(0.01, 9, 4) == 0.01
    assert density_at(0.5, 0, 4) == 0.5            # already above 25%: no warm-up
    c = from_spec("topk:density=0.01,warmup_steps=4")
    ks = [len(c.compress(torch.randn(1000), "w")[0][0]) for _ in range(6)]
    assert ks == [math.ceil(density_at(0.01, t, 4) * 1000) for t in range(6)]
    assert ks[0] == 250 and ks[-1] == 10


def test_pytorch_and_tensorflow_send_the_same():
    tf = pytest.importorskip("tensorflow")
    spec = "topk:density=0.2,momentum=0.9,clip=3.0,warmup_steps=2"
    ct, cf = from_spec(spec), from_spec(spec)
    for g in steps():
        pt, xt = ct.compress(torch.from_numpy(g.copy()), "w")
        pf, xf = cf.compress(tf.constant(g), "w")
        np.testing.assert_allclose(ct.decompress(pt, xt).numpy(), cf.decompress(pf, xf).numpy(),
                                   rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ct.state_dict()["state"]["velocity/w"].numpy(),
                               cf.state_dict()["state"]["velocity/w"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bad,match", [("momentum=1.5", "momentum"), ("clip=0", "clip"),
                                       ("mask=1", "mask=1"), ("warmup_steps=-2", "warmup_steps"),
                                       ("momentum=0.9,agg=union", "agg=local")])
def test_bad_options_are_named(bad, match):
    with pytest.raises(ValueError, match=match):
        from_spec(f"topk:density=0.1,{bad}")


def test_the_glue_refuses_a_second_momentum():
    p = torch.nn.Parameter(torch.zeros(3))
    c = from_spec("topk:density=0.1,momentum=0.9")
    with pytest.raises(ValueError, match="momentum=0"):
        check_dgc(c, torch.optim.SGD([p], lr=0.1, momentum=0.9), None)
    check_dgc(c, torch.optim.SGD([p], lr=0.1), None)
    with pytest.raises(ValueError, match="compressed_momentum"):
        check_dgc(c, torch.optim.Adam([p]), True)


def test_specs_without_the_recipe_are_unchanged():
    assert from_spec("topk:density=0.01").spec == "topk:density=0.01,ef=1"
    assert "momentum" not in from_spec("laplace_topk:density=0.01").spec
