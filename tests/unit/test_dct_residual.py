"""dct's error feedback in the coefficient domain (since 2026-11-28): the same algorithm as
the gradient-domain residual it replaced (``R = DCT(pad(r))``; each tensor's padding held
at zero by the projection of its last block), one transform per compress fewer; residuals
named ``@dct<block>:<numel>/<name>``; a gradient-domain checkpoint of an earlier version
converted on load, on PyTorch and TensorFlow."""

import numpy as np
import pytest
import torch

import hvd_compress
from hvd_compress.buckets import layout
from hvd_compress.compressors import dct as dct_module
from hvd_compress.kernels import dct as kernels

SHAPES = [(30, 20), (7,), (3, 3, 4, 4), (), (1000,), (64,)]    # one is a block multiple


def grads(lay, seed):
    rng = np.random.default_rng(seed)
    scales = np.repeat([1.0, 100.0, 1e-3, 5.0, 0.5, 2.0][:len(lay.numels)], lay.numels)
    return torch.from_numpy((rng.laplace(size=lay.total) * scales).astype(np.float32))


def gradient_domain_reference(spec, lay, steps):
    """The earlier algorithm: ``c = g + r``, the payload of ``DCT(c)``, ``r = c -
    decode(own payload)``, written with the compressor's ``ef=0`` form."""
    c = hvd_compress.from_spec(spec + ",ef=0")
    r = torch.zeros(lay.total)
    outs, payloads = [], []
    for step in range(steps):
        comp = grads(lay, step) + r
        payload, ctx = c.compress_bucket(comp.clone(), lay)
        out = c.decompress_bucket(payload, ctx)
        r = comp - out
        outs.append(out)
        payloads.append(payload)
    return outs, payloads, r


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("block", [32, 256])
def test_coefficient_domain_is_the_gradient_domain_algorithm(monkeypatch, backend, block):
    monkeypatch.setenv("HVD_COMPRESS_BACKEND", backend)
    spec = f"dct:density=0.05,block={block}"
    lay = layout([f"p{i}" for i in range(len(SHAPES))], SHAPES)
    steps = 4
    want, want_payloads, r = gradient_domain_reference(spec, lay, steps)
    c = hvd_compress.from_spec(spec)
    for step in range(steps):
        payload, ctx = c.compress_bucket(grads(lay, step), lay)
        # the same coefficients chosen (float32 rounding may move a value's code by one)
        assert torch.equal(payload[2], want_payloads[step][2]), step
        got = c.decompress_bucket(payload, ctx)
        torch.testing.assert_close(got, want[step], rtol=1e-4,
                                   atol=1e-5 * float(want[step].abs().max()))
    resid = torch.cat([c.residual(n) for n in lay.names])
    torch.testing.assert_close(resid, r, rtol=1e-4, atol=1e-5 * float(r.abs().max()))


def test_the_padding_of_the_residual_stays_zero():
    """Without the projection of the last blocks, the sent coefficients' padding would
    pile up in the residual (receivers drop it): checked on the stored coefficients."""
    lay = layout(["a", "b"], [(100,), (7,)])
    c = hvd_compress.from_spec("dct:density=0.1,block=32")
    for step in range(3):
        c.compress_bucket(grads(lay, step), lay)
    state = c.state_dict()["state"]
    assert sorted(state) == ["residual/@dct32:100/a", "residual/@dct32:7/b"]
    for key, n in (("residual/@dct32:100/a", 100), ("residual/@dct32:7/b", 7)):
        x = kernels.idct(state[key], 32)
        assert x.numel() == -(-n // 32) * 32
        assert float(x[n:].abs().max()) <= 1e-6 * float(x[:n].abs().max()), key
    assert c.residual("a").shape == (100,) and c.residual("b").shape == (7,)
    assert c.residual("missing") is None


def test_without_the_projection_the_padding_piles_up(monkeypatch):
    """The check above can fail: the projection off, the padding holds residual."""
    monkeypatch.setattr(dct_module, "project_tails", lambda coefs, *a: coefs)
    lay = layout(["a", "b"], [(100,), (7,)])
    c = hvd_compress.from_spec("dct:density=0.1,block=32")
    for step in range(3):
        c.compress_bucket(grads(lay, step), lay)
    x = kernels.idct(c.state_dict()["state"]["residual/@dct32:7/b"], 32)
    assert float(x[7:].abs().max()) > 1e-3 * float(x[:7].abs().max())


def _old_format(c, names):
    """What an earlier version's state_dict held: gradient-domain residuals by name."""
    return {"spec": c.spec, "state": {"residual/" + n: c.residual(n).clone() for n in names}}


def test_a_gradient_domain_checkpoint_is_converted(caplog):
    lay = layout(["a", "b", "c"], [(300,), (1,), (64,)])
    c = hvd_compress.from_spec("dct:density=0.05,block=32")
    for step in range(2):
        c.compress_bucket(grads(lay, step), lay)
    twin = hvd_compress.from_spec(c.spec)
    with caplog.at_level("INFO", logger="hvd_compress.compressors.dct"):
        twin.load_state_dict(_old_format(c, lay.names))
    assert "3 gradient-domain residuals converted" in caplog.text
    assert sorted(twin.state_dict()["state"]) == sorted(c.state_dict()["state"])
    for n in lay.names:
        torch.testing.assert_close(twin.residual(n), c.residual(n), rtol=1e-5, atol=1e-6)
    mine, ctx = c.compress_bucket(grads(lay, 2), lay)
    theirs, _ = twin.compress_bucket(grads(lay, 2), lay)
    assert torch.equal(mine[2], theirs[2])
    torch.testing.assert_close(twin.decompress_bucket(theirs, ctx), c.decompress_bucket(mine, ctx),
                               rtol=1e-4, atol=1e-6)
    # strict: a tensor the converted checkpoint has no residual for is still refused
    other = hvd_compress.from_spec(c.spec)
    other.load_state_dict(_old_format(c, ["a"]))
    with pytest.raises(ValueError, match="none for '@dct32:1/b'"):
        other.compress_bucket(grads(lay, 3), lay)


def test_tensorflow_coefficient_residuals_and_an_old_checkpoint():
    tf = pytest.importorskip("tensorflow")
    g = [np.random.default_rng(s).laplace(size=(10, 50)).astype(np.float32) for s in range(4)]
    ref, c = hvd_compress.from_spec("dct:density=0.05,block=64"), \
        hvd_compress.from_spec("dct:density=0.05,block=64")
    total_in, total_sent = np.zeros(500), np.zeros(500)
    for x in g[:3]:
        out_tf = c.decompress(*c.compress(tf.constant(x), "w")).numpy()
        out_torch = ref.decompress(*ref.compress(torch.from_numpy(x), "w")).numpy()
        np.testing.assert_allclose(out_tf, out_torch, rtol=1e-4, atol=1e-5)
        total_in += x.reshape(-1)
        total_sent += out_tf.reshape(-1)
    r = c.residual("w").numpy()
    assert list(c.state_dict()["state"]) == ["residual/@dct64:500/w"] and r.shape == (500,)
    np.testing.assert_allclose(total_sent + r, total_in, atol=1e-4)
    twin = hvd_compress.from_spec(c.spec)
    twin.load_state_dict({"spec": c.spec, "state": {"residual/w": r}}, "tensorflow")
    np.testing.assert_allclose(twin.residual("w").numpy(), r, rtol=1e-5, atol=1e-6)
    a, ctx = c.compress(tf.constant(g[3]), "w")
    b, _ = twin.compress(tf.constant(g[3]), "w")
    np.testing.assert_array_equal(a[2].numpy(), b[2].numpy())


def test_conversion_survives_a_rolled_back_step_and_sizes_are_checked():
    """The conversion is not journaled (compressed-momentum Adam may roll back the first
    step after a restore), and a checkpoint of another size raises, strict or not."""
    from hvd_compress.stores import Journal
    lay = layout(["a", "b"], [(100,), (7,)])
    c = hvd_compress.from_spec("dct:density=0.1,block=32")
    c.compress_bucket(grads(lay, 0), lay)
    old = _old_format(c, lay.names)
    twin, journal = hvd_compress.from_spec(c.spec), Journal()
    twin.attach_journal(journal)
    twin.compress_bucket(grads(lay, 5), lay)                 # a step before the restore
    journal.clear()
    twin.load_state_dict(old)
    twin.compress_bucket(grads(lay, 1), lay)
    journal.rollback()                                        # the step is dropped
    assert sorted(twin.state_dict()["state"]) == sorted(c.state_dict()["state"])
    torch.testing.assert_close(twin.residual("b"), c.residual("b"), rtol=1e-5, atol=1e-6)
    other = layout(["a", "b"], [(100,), (9,)])                # b of another size
    for strict in (True, False):
        bad = hvd_compress.from_spec(c.spec)
        bad.load_state_dict(c.state_dict(), strict=strict)
        with pytest.raises(ValueError, match="residual of 'b' has 7 values .* the tensor has 9"):
            bad.compress_bucket(grads(other, 0), other)


def test_tensorflow_restore_into_a_compressor_that_has_run():
    """TensorFlow's store keeps its variables (graphs hold them): a converted checkpoint
    is assigned to the variable a step already made, and a later state without it
    resets that variable to zeros."""
    tf = pytest.importorskip("tensorflow")
    x = np.random.default_rng(0).laplace(size=300).astype(np.float32)
    c = hvd_compress.from_spec("dct:density=0.05,block=64")
    c.compress(tf.constant(x), "w")                          # the variable exists
    r = np.random.default_rng(1).standard_normal(300).astype(np.float32)
    c.load_state_dict({"spec": c.spec, "state": {"residual/w": r}}, "tensorflow")
    np.testing.assert_allclose(c.residual("w").numpy(), r, rtol=1e-5, atol=1e-5)
    c.load_state_dict({"spec": c.spec, "state": {}}, "tensorflow", strict=False)
    assert not c.residual("w").numpy().any()
