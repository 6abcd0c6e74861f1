"""Seed 002: range-based float (codec, compressor, sparsifier value codec) and DCT-domain
sparsification; kernels against references; bad input."""
import math

import numpy as np
import pytest
import torch

import hvd_compress
from hvd_compress.compressors.rangefloat import SPLITS, RangeFloatCodec
from hvd_compress.kernels import dct as dct_kernels
from hvd_compress.kernels import rangefloat as rf
from launch import ROOT
from reference import rangefloat_reference

REAL = np.load(ROOT / "benchmarks/data/real_gradients.npz")["cnn_step100"]


def laplace(n, seed=0, scale=1.0):
    return (scale * np.random.default_rng(seed).laplace(size=n)).astype(np.float32)


@pytest.mark.parametrize("bits", sorted(SPLITS))
@pytest.mark.parametrize("n", [1, 5, 255, 1024, 10007])
def test_rangefloat_kernels_bit_exact(bits, n):
    e, m = SPLITS[bits]
    x = torch.from_numpy(laplace(n, n) * np.float32(1e-3))
    emax = rf.max_exponent(x)
    data = rf.encode(x, emax, e, m, backend="triton")
    assert torch.equal(data, rf.encode_reference(x, emax, e, m)) and data.dtype == torch.uint8
    g, nb = rf.group(bits)
    assert data.numel() == -(-n // g) * nb                        # bits * n / 8, whole groups
    per_group = torch.full((data.numel() // nb,), int(emax), dtype=torch.int32)
    out = rf.decode(data, per_group, e, m, backend="triton")
    assert torch.equal(out, rf.decode_reference(data, per_group, e, m))
    np.testing.assert_array_equal(out[:n].numpy(), rangefloat_reference(x.numpy(), bits))


@pytest.mark.parametrize("bits", sorted(SPLITS))
def test_rangefloat_decode_ranks_kernel_equals_cpu(bits):
    """Several ranks' segments (one empty, one with a padded last group, one exponent
    each) decoded by the kernel, rank by rank into one buffer, as on the CPU."""
    e, m = SPLITS[bits]
    parts = [RangeFloatCodec(bits).encode(torch.from_numpy(laplace(n, n, scale)), _torch_ops())
             for n, scale in ((7, 1e-3), (0, 1.0), (13, 50.0), (1, 2.0))]
    data = torch.cat([p[0] for p in parts])
    h = torch.cat([p[1] for p in parts]).reshape(-1, 2)
    got = rf.decode_ranks(data, h[:, 0], h[:, 1], e, m, backend="triton")
    want = rf.decode_ranks_cpu(data, h[:, 0], h[:, 1], e, m)
    assert got.numel() == 21 and torch.equal(got.view(torch.int32), want.view(torch.int32))


def _torch_ops():
    from hvd_compress.ops import torch_ops
    return torch_ops


@pytest.mark.parametrize("bits", sorted(SPLITS))
def test_rangefloat_worst_case_relative_error(bits):
    """|x_hat - x| <= 2^-(m+1) |x| inside the range, as the docstring states."""
    codec = RangeFloatCodec(bits)
    x = laplace(200_000, 1)
    c = hvd_compress.from_spec(f"rangefloat:bits={bits},ef=0")
    out = c.decompress(*c.compress(torch.from_numpy(x), "g")).numpy()
    big = np.frexp(np.abs(x).max())[1] - 1
    inside = np.abs(x) >= 2.0 ** (big - 2**codec.e + 2)
    rel = np.abs(out - x)[inside] / np.abs(x)[inside]
    assert rel.max() <= codec.max_error()
    assert rel.max() > 0.5 * codec.max_error()                     # the bound is tight
    assert np.all(out[np.abs(x) < 2.0 ** (big - 2**codec.e + 1)] == 0)   # flushed


def test_rangefloat_exp_bits_override_and_tf_equals_torch():
    import tensorflow as tf
    x = laplace(3001, 2)
    for spec in ["rangefloat:bits=8,exp_bits=3,ef=0", "rangefloat:bits=12,ef=0"]:
        a = hvd_compress.from_spec(spec)
        pt, ctx = a.compress(torch.from_numpy(x), "g")
        b = hvd_compress.from_spec(spec)
        ptf, ctf = b.compress(tf.constant(x), "g")
        np.testing.assert_array_equal(pt[0].numpy(), ptf[0].numpy())
        np.testing.assert_array_equal(a.decompress(pt, ctx).numpy(), b.decompress(ptf, ctf).numpy())


def test_rangefloat_gathered_payloads_decode_to_the_sum():
    x, y = laplace(1001, 3), laplace(1001, 4, scale=100.0)       # very different ranges
    c = hvd_compress.from_spec("rangefloat:bits=6,ef=0")
    (dx, hx), ctx = c.compress(torch.from_numpy(x), "g")
    (dy, hy), _ = c.compress(torch.from_numpy(y), "g")
    out = c.decompress((torch.cat([dx, dy]), torch.cat([hx, hy])), ctx).numpy()
    np.testing.assert_allclose(out, rangefloat_reference(x, 6) + rangefloat_reference(y, 6),
                               rtol=1e-6)


def test_sparsifier_with_rangefloat_values():
    x = torch.from_numpy(laplace(20_000, 5))
    c = hvd_compress.from_spec("topk:density=0.01,values=rangefloat8")
    total_in, total_sent = np.zeros(20_000), np.zeros(20_000)
    for step in range(5):
        g = torch.from_numpy(laplace(20_000, 10 + step))
        payload, ctx = c.compress(g, "g")
        assert [t.dtype for t in payload] == [torch.uint8, torch.int32, torch.int32]
        assert payload[0].numel() == 200 and payload[2].numel() == 200   # 1 byte a value
        total_in += g.numpy()
        total_sent += c.decompress(payload, ctx).numpy()
    np.testing.assert_allclose(total_sent + c.residual("g").numpy(), total_in, atol=1e-4)
    # two ranks with different counts and ranges
    a, b = hvd_compress.from_spec("threshold:threshold=2,values=rangefloat8,ef=0"), \
        hvd_compress.from_spec("threshold:threshold=2,values=rangefloat8,ef=0")
    pa, ctx = a.compress(x, "g")
    pb, _ = b.compress(x * 10, "g")
    both = a.decompress(tuple(torch.cat([u, v]) for u, v in zip(pa, pb)), ctx)
    np.testing.assert_allclose(both.numpy(), (a.decompress(pa, ctx) + b.decompress(pb, ctx)).numpy(),
                               rtol=1e-6)
    with pytest.raises(ValueError, match="bits must be one of 4, 6, 8, 12, 16, got 7"):
        hvd_compress.from_spec("topk:values=rangefloat7")


@pytest.mark.parametrize("block", dct_kernels.BLOCKS)
def test_dct_kernel_round_trip(block):
    x = torch.from_numpy(laplace(3 * block + 7, block))
    coefs = dct_kernels.dct(x, block, backend="triton")
    np.testing.assert_allclose(coefs.numpy(), dct_kernels.dct_reference(x, block).numpy(),
                               atol=1e-5 * float(x.abs().max()))
    back = dct_kernels.idct(coefs, block, backend="triton")[:x.numel()]
    assert float((back - x).norm() / x.norm()) < 1e-5
    # orthonormal: energy is preserved
    assert float(coefs.norm()) == pytest.approx(float(x.norm()), rel=1e-5)


def test_dct_tensorflow_equals_torch():
    import tensorflow as tf
    from hvd_compress.ops import tf_ops
    x = laplace(1000, 6)
    c_tf = tf_ops.block_dct(tf.constant(x), 256).numpy()
    np.testing.assert_allclose(c_tf, dct_kernels.dct_reference(torch.from_numpy(x), 256).numpy(),
                               atol=1e-5)
    assert float(np.linalg.norm(tf_ops.block_idct(c_tf, 256).numpy()[:1000] - x)) < 1e-4


def test_dct_compressor_on_real_gradient():
    g = torch.from_numpy(REAL)
    c = hvd_compress.from_spec("dct:density=0.05,ef=0")
    payload, ctx = c.compress(g, "g")
    n_coefs = math.ceil(REAL.size / 256) * 256
    assert abs(payload[2].numel() - math.ceil(0.05 * n_coefs)) <= 0.01 * 0.05 * n_coefs
    out = c.decompress(payload, ctx)
    assert out.shape == g.shape
    err = float((out - g).norm() / g.norm())
    assert err < 0.5
    exact = hvd_compress.from_spec("dct:density=1,bits=16,ef=0")
    assert float((exact.decompress(*exact.compress(g, "g")) - g).norm() / g.norm()) < 1e-3


def test_dct_error_feedback_in_gradient_domain():
    c = hvd_compress.from_spec("dct:density=0.02,block=64")
    total_in, total_sent = np.zeros(5000), np.zeros(5000)
    for step in range(5):
        g = laplace(5000, 20 + step)
        total_in += g
        total_sent += c.decompress(*c.compress(torch.from_numpy(g), "g")).numpy()
    np.testing.assert_allclose(total_sent + c.residual("g").numpy(), total_in, atol=1e-4)


def test_dct_small_zero_and_nonfinite_tensors():
    c = hvd_compress.from_spec("dct:density=0.1,ef=0")
    small = torch.from_numpy(laplace(10, 7))                        # smaller than one block
    out = c.decompress(*c.compress(small, "s"))
    assert out.shape == (10,)
    zero = hvd_compress.from_spec("dct:density=0.1")
    out = zero.decompress(*zero.compress(torch.zeros(1000), "z"))
    assert not out.any() and not zero.residual("z").any()
    bad = laplace(1000, 8)
    bad[5], bad[600] = np.nan, np.inf
    ef = hvd_compress.from_spec("dct:density=0.1")
    ef.compress(torch.from_numpy(laplace(1000, 9)), "g")
    before = ef.residual("g").clone()
    out = ef.decompress(*ef.compress(torch.from_numpy(bad), "g"))
    assert not torch.isfinite(out).all()                          # passes through
    assert torch.equal(ef.residual("g"), before)                  # residual not poisoned


@pytest.mark.parametrize("spec,match", [("dct:block=100", "block must be one of 32, 64"),
                                        ("dct:bits=7", "bits must be one of 4, 6, 8, 12, 16"),
                                        ("rangefloat:bits=3", "bits must be one of"),
                                        ("dct:density=0", "density"),
                                        ("rangefloat:bits=8,exp_bits=7", "exp_bits")])
def test_bad_parameters(spec, match):
    with pytest.raises(ValueError, match=match):
        hvd_compress.from_spec(spec)


def test_malformed_rangefloat_payload():
    c = hvd_compress.from_spec("rangefloat:bits=8,ef=0")
    (data, header), ctx = c.compress(torch.from_numpy(laplace(100, 1)), "g")
    with pytest.raises(ValueError, match="malformed"):
        c.decompress((data[:50], header), ctx)


@pytest.mark.parametrize("block", [32, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_dct_segments_kernel_is_each_tensor_alone(block, dtype):
    """A bucket's one launch (rows read from the unpadded bucket, padding dropped on the
    way back) gives each tensor's single-tensor coefficients bit for bit, and matches the
    torch reference (tensor by tensor)."""
    numels = (1000, 1, 0, 64, 3 * block, 77)
    x = torch.from_numpy(laplace(sum(numels), block)).to(dtype)
    got = dct_kernels.dct_segments(x, numels, block, backend="triton")
    alone = torch.cat([dct_kernels.dct_segments(p, (p.numel(),), block, backend="triton")
                       for p in torch.split(x, list(numels))])
    assert got.dtype == torch.float32 and torch.equal(got, alone)
    want = dct_kernels.dct_segments(x, numels, block, backend="torch")
    np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-5 * float(x.abs().max()))
    back = dct_kernels.idct_segments(got, numels, block, backend="triton")
    assert back.shape == (sum(numels),)
    np.testing.assert_allclose(back.numpy(), dct_kernels.idct_segments(want, numels, block,
                                                                       backend="torch").numpy(),
                               atol=1e-5 * float(x.abs().max()))
    assert float((back - x.float()).norm() / x.float().norm()) < 1e-5
