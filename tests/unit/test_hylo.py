"""Hylo (seed 004): twobit, kernel_select, per-parameter policies, Hylo.from_model."""
import numpy as np
import pytest
import torch

import hvd_compress
from hvd_compress.compressors.kernel_select import adaptive_fraction
from hvd_compress.kernels import twobit as twobit_kernels
from reference import reference_contribution


def grad(seed, shape):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("n", [1, 15, 16, 17, 1000, 4099])
@pytest.mark.parametrize("t", [0.1, 0.8, 2.5])
def test_twobit_pack_kernel_is_bit_exact(n, t):
    x = torch.from_numpy(grad(n, n))
    words = twobit_kernels.pack(x, t, backend="triton")
    assert torch.equal(words, twobit_kernels.pack_reference(x, t))
    assert words.dtype == torch.int32 and words.numel() == -(-n // 16)
    signs = twobit_kernels.unpack(words, backend="triton")
    assert torch.equal(signs, twobit_kernels.unpack_reference(words))
    want = np.where(x.numpy() >= t, 1, np.where(x.numpy() <= -t, -1, 0))
    np.testing.assert_array_equal(signs[:n].numpy(), want)
    assert not signs[n:].any()


def test_twobit_sign_bit_word():
    """Code 2 (-t) in lane 15 sets bit 31: the word is negative and still round-trips."""
    x = torch.zeros(16)
    x[15] = -5.0
    words = twobit_kernels.pack(x, 1.0, backend="triton")
    assert words.item() == -2**31
    assert twobit_kernels.unpack(words, backend="triton")[15].item() == -1.0


def test_twobit_tf_packing_equals_torch():
    import tensorflow as tf
    from hvd_compress.ops import tf_ops
    x = grad(3, 1001)
    words_tf = tf_ops.twobit_pack(tf.constant(x), tf.constant(0.7))
    np.testing.assert_array_equal(words_tf.numpy(), twobit_kernels.pack_reference(torch.from_numpy(x), 0.7).numpy())
    np.testing.assert_array_equal(tf_ops.twobit_unpack(words_tf).numpy(),
                                  twobit_kernels.unpack_reference(torch.from_numpy(words_tf.numpy())).numpy())


@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
def test_twobit_is_mxnet_scheme_with_residual(framework):
    """r += g; q = +-t where |r| >= t; r -= q -- over several steps, both frameworks."""
    import tensorflow as tf
    c = hvd_compress.from_spec("twobit:threshold=0.5")
    r = np.zeros(200, np.float32)
    for step in range(5):
        g = grad(step, 200)
        x = torch.from_numpy(g) if framework == "torch" else tf.constant(g)
        payload, ctx = c.compress(x, "fc")
        out = np.asarray(c.decompress(payload, ctx))
        r = r + g
        q = np.where(r >= 0.5, 0.5, np.where(r <= -0.5, -0.5, 0)).astype(np.float32)
        r = r - q
        np.testing.assert_array_equal(out, q)
        np.testing.assert_allclose(np.asarray(c.residual("fc")), r, atol=1e-6)


def test_twobit_adaptive_threshold_and_bytes():
    g = grad(1, (64, 100))
    c = hvd_compress.from_spec("twobit")
    (words, t), ctx = c.compress(torch.from_numpy(g), "fc")
    assert t.item() == pytest.approx(np.abs(g).mean(), rel=1e-5)
    assert words.numel() * 4 + 4 == 6400 // 4 + 4                  # 16x fewer bytes + t
    out, want = c.decompress((words, t), ctx).numpy(), reference_contribution("twobit", g)
    np.testing.assert_array_equal(np.sign(out), np.sign(want))     # which codes
    np.testing.assert_allclose(out, want, rtol=1e-6)                 # t: order of the sum


def test_twobit_all_zero_and_malformed():
    c = hvd_compress.from_spec("twobit,ef=0".replace(",", ":", 1))
    payload, ctx = c.compress(torch.zeros(40), "z")
    assert not c.decompress(payload, ctx).any()
    with pytest.raises(ValueError, match="malformed"):
        c.decompress((payload[0][:1], payload[1]), ctx)
    with pytest.raises(ValueError, match="threshold"):
        hvd_compress.from_spec("twobit:threshold=0")


@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
def test_kernel_select_sends_top_norm_kernels(framework):
    import tensorflow as tf
    if framework == "torch":
        g, spec = grad(5, (16, 8, 3, 3)), "kernel_select:fraction=0.1"
        x = torch.from_numpy(g)
    else:
        g, spec = grad(5, (3, 3, 8, 16)), "kernel_select:fraction=0.1,layout=keras"
        x = tf.constant(g)
    c = hvd_compress.from_spec("kernel_select:fraction=0.1")
    (values, ids), ctx = c.compress(x, "conv")
    assert len(np.asarray(ids)) == 13 and len(np.asarray(values)) == 13 * 9
    out = np.asarray(c.decompress((values, ids), ctx))
    np.testing.assert_array_equal(out, reference_contribution(spec, g))
    np.testing.assert_allclose(out + np.asarray(c.residual("conv")).reshape(g.shape), g, atol=1e-6)


def test_kernel_select_fraction_adapts_to_layer_size():
    sizes = [1_000, 10_000, 100_000, 1_000_000, 100_000_000]
    fractions = [adaptive_fraction(p) for p in sizes]
    assert fractions == sorted(fractions, reverse=True)            # larger layer, smaller share
    assert fractions[1] == pytest.approx(0.25) and fractions[0] == 0.5 and fractions[-1] == 0.01


def test_kernel_select_rejects_non_convolution_and_bad_fraction():
    with pytest.raises(ValueError, match="convolution weight"):
        hvd_compress.from_spec("kernel_select").compress(torch.ones(10, 10), "fc")
    for bad in ("0", "1.5"):
        with pytest.raises(ValueError, match="fraction"):
            hvd_compress.from_spec(f"kernel_select:fraction={bad}")


class Mixed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(1000, 16)
        self.conv1 = torch.nn.Conv2d(3, 8, 3)               # 216 values: below min_size
        self.bn = torch.nn.BatchNorm2d(8)
        self.conv2 = torch.nn.Conv2d(8, 64, 3)              # 4608 values
        self.fc = torch.nn.Linear(1024, 64)
        self.head = torch.nn.Linear(64, 10)                 # 640 values: below min_size


def test_hylo_policy_from_torch_model():
    policy = hvd_compress.Hylo.from_model(Mixed(), min_size=4096)
    chosen = {n: policy.compressor_for(n).name for n, _ in Mixed().named_parameters()}
    assert chosen == {"emb.weight": "twobit", "conv1.weight": "none", "conv1.bias": "none",
                      "bn.weight": "none", "bn.bias": "none", "conv2.weight": "kernel_select",
                      "conv2.bias": "none", "fc.weight": "twobit", "fc.bias": "none",
                      "head.weight": "none", "head.bias": "none"}
    table = policy.table()
    assert "conv2.weight" in table and "kernel_select" in table and "216 < 4096" in table


def test_hylo_policy_from_keras_model():
    import tensorflow as tf
    model = tf.keras.Sequential([
        tf.keras.Input((12,)),
        tf.keras.layers.Embedding(1000, 16),
        tf.keras.layers.Reshape((12, 16, 1)),
        tf.keras.layers.Conv2D(64, 3),
        tf.keras.layers.BatchNormalization(),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(32),
        tf.keras.layers.Dense(4)])
    policy = hvd_compress.Hylo.from_model(model, min_size=500)
    chosen = {n.split("/", 1)[1]: policy.compressor_for(n).name for n in policy.exact}
    assert chosen == {"embedding/embeddings": "twobit", "conv2d/kernel": "kernel_select",
                      "conv2d/bias": "none", "batch_normalization/gamma": "none",
                      "batch_normalization/beta": "none", "dense/kernel": "twobit",
                      "dense/bias": "none", "dense_1/kernel": "none",    # 128 < 500 values
                      "dense_1/bias": "none"}


def test_policy_patterns_default_and_state():
    policy = hvd_compress.Policy({"conv*.weight": "kernel_select:fraction=0.5",
                                  "fc.weight": "twobit"}, default="fp16")
    assert policy.compressor_for("conv9.weight").name == "kernel_select"
    assert policy.compressor_for("fc.weight").name == "twobit"
    assert policy.compressor_for("anything").name == "fp16"
    g = torch.from_numpy(grad(0, (4, 2, 3, 3)))
    c = policy.for_tensor("conv1.weight", g)
    c.compress(g, "conv1.weight")
    other = hvd_compress.Policy({"conv*.weight": "kernel_select:fraction=0.5",
                                 "fc.weight": "twobit"}, default="fp16")
    other.load_state_dict(policy.state_dict())
    assert torch.equal(other.residual("conv1.weight"), policy.residual("conv1.weight"))
    with pytest.raises(ValueError, match="another policy"):
        hvd_compress.Policy({"x": "twobit"}).load_state_dict(policy.state_dict())
    with pytest.raises(TypeError, match="for_tensor"):
        policy.compress(g, "conv1.weight")
