"""Compressor contract, without Horovod: round trips, error-feedback conservation,
spec parsing, bad input.  Each test runs on PyTorch and on TensorFlow tensors."""
import math

import numpy as np
import pytest

import hvd_compress
from reference import reference_contribution

ALL_SPECS = ["none", "fp16", "bf16", "topk:density=0.1", "randomk:density=0.1",
             "laplace_topk:density=0.1,exact=1",
             "threshold:threshold=0.5"]


class Torch:
    name = "torch"

    def __init__(self):
        import torch
        self.t = torch

    def tensor(self, a, dtype=None):
        x = self.t.from_numpy(np.array(a))
        return x.to(getattr(self.t, dtype)) if dtype else x

    def numpy(self, x):
        return (x.float() if x.is_floating_point() else x).numpy()


class TF:
    name = "tensorflow"

    def __init__(self):
        import tensorflow as tf
        self.t = tf

    def tensor(self, a, dtype=None):
        x = self.t.constant(a)
        return self.t.cast(x, getattr(self.t, dtype)) if dtype else x

    def numpy(self, x):
        return (self.t.cast(x, self.t.float32) if x.dtype.is_floating else x).numpy()


@pytest.fixture(params=["torch", "tensorflow"], scope="module")
def fw(request):
    return Torch() if request.param == "torch" else TF()


def grad(seed, shape=(20, 30)):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("spec", [s for s in ALL_SPECS if not s.startswith("randomk")])
def test_round_trip_matches_reference(fw, spec):
    g = grad(0)
    c = hvd_compress.from_spec(spec)
    payload, ctx = c.compress(fw.tensor(g), "g")
    out = c.decompress(payload, ctx)
    assert tuple(out.shape) == g.shape
    np.testing.assert_allclose(fw.numpy(out), reference_contribution(spec, g), rtol=1e-3, atol=1e-6)


def test_randomk_sends_k_entries_exactly(fw):
    g = grad(1)
    c = hvd_compress.from_spec("randomk:density=0.1,seed=7")
    out = fw.numpy(c.decompress(*c.compress(fw.tensor(g), "g")))
    nz = out != 0
    assert nz.sum() == math.ceil(0.1 * g.size)
    np.testing.assert_array_equal(out[nz], g[nz])


def test_randomk_draws_differ_between_steps_and_agree_between_instances(fw):
    g = fw.tensor(grad(2))
    a, b = (hvd_compress.from_spec("randomk:density=0.05,ef=0") for _ in range(2))
    pa = [fw.numpy(a.compress(g, "g")[0][1]) for _ in range(2)]
    pb = [fw.numpy(b.compress(g, "g")[0][1]) for _ in range(2)]
    np.testing.assert_array_equal(pa[0], pb[0])          # same seed, same step
    assert set(pa[0].tolist()) != set(pa[1].tolist())    # a new draw each step


@pytest.mark.parametrize("spec", ["topk:density=0.05", "randomk:density=0.05",
                                  "threshold:threshold=1.5"])
def test_error_feedback_conserves_everything(fw, spec):
    """sum of what was sent + final residual == sum of all gradients fed in."""
    c = hvd_compress.from_spec(spec)
    total_in = np.zeros((20, 30), np.float64)
    total_sent = np.zeros((20, 30), np.float64)
    for step in range(25):
        g = grad(100 + step)
        total_in += g
        total_sent += fw.numpy(c.decompress(*c.compress(fw.tensor(g), "g")))
    residual = fw.numpy(c.residual("g")).reshape(20, 30)
    assert np.abs(residual).sum() > 0
    np.testing.assert_allclose(total_sent + residual, total_in, atol=1e-4)


def test_ef_off_keeps_no_residual(fw):
    c = hvd_compress.from_spec("topk:density=0.05,ef=0")
    c.compress(fw.tensor(grad(3)), "g")
    assert c.residual("g") is None


def test_state_dict_round_trip_continues_identically(fw):
    a = hvd_compress.from_spec("randomk:density=0.1")
    for s in range(3):
        a.compress(fw.tensor(grad(s)), "g")
    b = hvd_compress.from_spec("randomk:density=0.1")
    b.load_state_dict(a.state_dict(), framework=fw.name)
    for s in range(3, 6):
        pa, ctx = a.compress(fw.tensor(grad(s)), "g")
        pb, _ = b.compress(fw.tensor(grad(s)), "g")
        np.testing.assert_array_equal(fw.numpy(a.decompress(pa, ctx)), fw.numpy(b.decompress(pb, ctx)))
    np.testing.assert_array_equal(fw.numpy(a.residual("g")), fw.numpy(b.residual("g")))


def test_state_dict_for_another_spec_is_rejected(fw):
    a = hvd_compress.from_spec("topk:density=0.1")
    a.compress(fw.tensor(grad(0)), "g")
    with pytest.raises(ValueError, match="topk:density=0.1"):
        hvd_compress.from_spec("topk:density=0.2").load_state_dict(a.state_dict(), fw.name)


@pytest.mark.parametrize("spec", ["topk:density=0.1", "hier:topk:density=0.1", "policy",
                                  "auto"])
def test_gradient_residuals_are_not_restored_as_update_residuals(fw, spec):
    """Every glue marks what a compressor's residuals hold (check_compressed_update:
    updates with compressed_update=True, else gradients); a checkpoint of either mode
    refuses the other, whether restored after the glue took the compressor or before;
    one without the mark (before 2026-11-29) loads into both."""
    from hvd_compress.strategies.momentum import check_compressed_update

    def build(update=None):
        c = (hvd_compress.Policy({"*bias": "none"}, default="topk:density=0.1")
             if spec == "policy" else hvd_compress.from_spec(spec))
        if update is not None:                     # what a glue does
            check_compressed_update(update, None, c, True, ("op=Average", "op=Sum"))
        return c
    grads = build(False)
    if spec != "auto":                          # (auto compresses through the Driver)
        getattr(grads, "inner", grads).for_tensor("g", fw.tensor(grad(0))).compress(
            fw.tensor(grad(0)), "g")
    updates = build(True)
    assert (grads.state_dict()["residuals_of"], updates.state_dict()["residuals_of"]) == (
        "gradients", "updates")
    assert build().state_dict()["residuals_of"] == "gradients"      # no glue yet
    with pytest.raises(ValueError, match=r"error feedback of gradients .*compressed_update="
                                         r"False.*of updates \(compressed_update=True"):
        updates.load_state_dict(grads.state_dict(), fw.name)
    with pytest.raises(ValueError, match="error feedback of updates"):
        build(False).load_state_dict(updates.state_dict(), fw.name)
    early = build()                             # restored before a glue takes it
    early.load_state_dict(grads.state_dict(), fw.name)
    with pytest.raises(ValueError, match="error feedback of gradients"):
        check_compressed_update(True, None, early, True, ("op=Average", "op=Sum"))
    early = build()
    early.load_state_dict(updates.state_dict(), fw.name)
    check_compressed_update(True, None, early, True, ("op=Average", "op=Sum"))
    old = {k: v for k, v in grads.state_dict().items() if k != "residuals_of"}
    updates.load_state_dict(old, fw.name)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("spec", ALL_SPECS)
def test_half_precision_gradients_keep_their_dtype(fw, spec, dtype):
    g = grad(4)
    c = hvd_compress.from_spec(spec)
    x = fw.tensor(g, dtype)
    out = c.decompress(*c.compress(x, "g"))
    assert out.dtype == x.dtype
    got = fw.numpy(out)
    if spec.startswith("randomk"):
        nz = got != 0
        np.testing.assert_allclose(got[nz], fw.numpy(x)[nz])
    else:
        np.testing.assert_allclose(got, reference_contribution(spec, fw.numpy(x)), rtol=1e-2, atol=1e-2)


def test_zero_d_tensor(fw):
    c = hvd_compress.from_spec("topk:density=0.01")
    x = fw.tensor(np.float32(2.5))
    out = c.decompress(*c.compress(x, "s"))
    assert tuple(out.shape) == () and float(fw.numpy(out)) == 2.5


def test_integer_tensors_go_uncompressed(fw):
    x = fw.tensor(np.arange(10, dtype=np.int32))
    c = hvd_compress.from_spec("topk:density=0.1")
    chosen = c.for_tensor("i", x)
    assert chosen.name == "none" and chosen.collective == "allreduce"
    np.testing.assert_array_equal(fw.numpy(chosen.decompress(*chosen.compress(x, "i"))), np.arange(10))
    with pytest.raises(TypeError, match="integer tensors"):
        c.compress(x, "i")


def test_nonfinite_sent_whole_and_residual_untouched(fw):
    c = hvd_compress.from_spec("topk:density=0.05")
    c.compress(fw.tensor(grad(5)), "g")
    before = fw.numpy(c.residual("g")).copy()
    bad = grad(6)
    bad[1, 2] = np.nan
    bad[3, 4] = -np.inf
    out = fw.numpy(c.decompress(*c.compress(fw.tensor(bad), "g")))
    assert np.isnan(out[1, 2]) and out[3, 4] == -np.inf
    np.testing.assert_array_equal(fw.numpy(c.residual("g")), before)


def test_non_contiguous_torch_gradient():
    import torch
    g = torch.from_numpy(grad(7)).t()
    assert not g.is_contiguous()
    c = hvd_compress.from_spec("topk:density=0.1")
    out = c.decompress(*c.compress(g, "g"))
    np.testing.assert_array_equal(out.numpy(), reference_contribution("topk:density=0.1", g.numpy()))


def test_decompress_rejects_out_of_range_indices(fw):
    c = hvd_compress.from_spec("topk:density=0.1,ef=0")
    (values, idx), ctx = c.compress(fw.tensor(grad(8)), "g")
    bad = fw.tensor(np.full(int(fw.numpy(idx).size), 600, np.int32))
    with pytest.raises(ValueError, match=r"out of range \[0, 600\)"):
        c.decompress((values, bad), ctx)
    neg = fw.tensor(-np.ones(int(fw.numpy(idx).size), np.int32))
    with pytest.raises(ValueError, match="out of range"):
        c.decompress((values, neg), ctx)


def test_decompress_rejects_malformed_payloads(fw):
    c = hvd_compress.from_spec("topk:density=0.1,ef=0")
    (values, idx), ctx = c.compress(fw.tensor(grad(8)), "g")
    with pytest.raises(ValueError, match="values but"):
        c.decompress((values, fw.tensor(np.zeros(3, np.int32))), ctx)
    with pytest.raises(ValueError, match="a payload is 2 tensors, got 1"):
        c.decompress((values,), ctx)
    b = hvd_compress.from_spec("bf16")
    (bits,), ctx = b.compress(fw.tensor(grad(8)), "g")
    with pytest.raises(ValueError, match="whole number"):
        b.decompress((fw.tensor(np.zeros(7, np.int16)),), ctx)


@pytest.mark.parametrize("density", ["0", "-0.1", "1.5", "nan", "abc"])
def test_density_outside_unit_interval(density):
    with pytest.raises(ValueError, match="density"):
        hvd_compress.from_spec(f"topk:density={density}")
    with pytest.raises(ValueError, match="density"):
        hvd_compress.TopK(density=float(density) if density != "abc" else density)


def test_density_one_sends_everything(fw):
    g = grad(9)
    c = hvd_compress.from_spec("topk:density=1")
    np.testing.assert_array_equal(fw.numpy(c.decompress(*c.compress(fw.tensor(g), "g"))), g)


def test_spec_errors_list_what_is_valid():
    with pytest.raises(ValueError, match="unknown compressor 'top_k'; valid: ") as err:
        hvd_compress.from_spec("top_k")
    for name in ("bf16", "fp16", "none", "randomk", "threshold", "topk", "laplace_topk"):
        assert name in str(err.value)
    with pytest.raises(ValueError, match="valid: density, ef"):
        hvd_compress.from_spec("topk:densty=0.1")
    with pytest.raises(ValueError, match="key=value"):
        hvd_compress.from_spec("topk:0.1")
    with pytest.raises(ValueError, match="ef must be"):
        hvd_compress.from_spec("topk:ef=maybe")
    with pytest.raises(ValueError, match="threshold"):
        hvd_compress.from_spec("threshold:threshold=-1")


@pytest.mark.parametrize("spec", ALL_SPECS + ["topk:density=0.5,ef=0", "randomk:seed=3"])
def test_spec_round_trip(spec):
    c = hvd_compress.from_spec(spec)
    again = hvd_compress.from_spec(c.spec)
    assert again.spec == c.spec and type(again) is type(c)


def test_env_var_selects_compressor(monkeypatch):
    monkeypatch.setenv("HVD_COMPRESS", "topk:density=0.02")
    assert hvd_compress.from_env().spec == "topk:density=0.02,ef=1"
    monkeypatch.delenv("HVD_COMPRESS")
    assert hvd_compress.from_env().name == "none"


def test_stock_horovod_call_without_name():
    """Horovod's own optimizer calls compress(tensor) with no name: allreduce-able
    compressors work, the others say which optimizer to use."""
    import torch
    g = torch.from_numpy(grad(10))
    fp16 = hvd_compress.from_spec("fp16")
    payload, ctx = fp16.compress(g)
    assert payload.dtype == torch.float16
    with pytest.raises(TypeError, match="hvd_compress.torch.DistributedOptimizer"):
        hvd_compress.from_spec("topk:density=0.1").compress(g)


def test_package_imports_without_horovod_or_tensorflow():
    import subprocess
    import sys
    code = ("import sys; sys.modules['horovod'] = None; sys.modules['tensorflow'] = None\n"
            "import hvd_compress, torch\n"
            "c = hvd_compress.from_spec('topk:density=0.5')\n"
            "print(c.decompress(*c.compress(torch.ones(4), 'x')).sum().item())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "2.0"


def test_tf_function_compress_and_residual():
    import tensorflow as tf
    c = hvd_compress.from_spec("topk:density=0.05")

    @tf.function
    def step(x):
        payload, ctx = c.compress(x, "g")
        return c.decompress(payload, ctx)

    total_in = np.zeros((20, 30))
    total_sent = np.zeros((20, 30))
    for s in range(5):
        g = grad(200 + s)
        total_in += g
        total_sent += step(tf.constant(g)).numpy()
    np.testing.assert_allclose(total_sent + c.residual("g").numpy().reshape(20, 30), total_in,
                               atol=1e-4)


@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
@pytest.mark.parametrize("case", ["size", "dtype"])
def test_checkpoint_of_another_model_names_the_tensor_and_both_shapes(framework, case):
    """A residual that does not fit the tensor: ValueError at the first step, naming the
    tensor, both sizes and dtypes (never a raw shape error inside an operator)."""
    import torch
    if framework == "tensorflow":
        tf = pytest.importorskip("tensorflow")
        make = {"size": lambda: tf.random.normal([12]), "dtype": lambda: tf.random.normal([10], dtype=tf.float16)}
        first = tf.random.normal([10])
    else:
        make = {"size": lambda: torch.randn(12), "dtype": lambda: torch.randn(10).half()}
        first = torch.randn(10)
    saved = hvd_compress.from_spec("topk:density=0.1")
    saved.compress(first, "layer.weight")
    restored = hvd_compress.from_spec("topk:density=0.1")
    restored.load_state_dict(saved.state_dict(), framework)
    with pytest.raises(ValueError, match=r"'layer.weight' has 10 values of float32, but the tensor "
                                         r"has (12 of float32|10 of float16)"):
        restored.compress(make[case](), "layer.weight")


def test_tensorflow_state_restore_keeps_variables_and_resets_new_ones():
    """TFStore.load_state_dict assigns in place (tf.function graphs keep their variables);
    state created after the saved one goes back to its initial value (zero residual); a
    residual of another shape raises ValueError naming it."""
    tf = pytest.importorskip("tensorflow")
    c = hvd_compress.from_spec("topk:density=0.1")
    empty = c.state_dict()
    c.compress(tf.random.normal([10]), "w")
    var = c._store._vars["residual/w"]
    assert float(tf.reduce_sum(tf.abs(var))) > 0
    c.load_state_dict(empty, "tensorflow")
    assert c._store._vars["residual/w"] is var and not var.numpy().any()
    other = hvd_compress.from_spec("topk:density=0.1")
    other.compress(tf.random.normal([12]), "w")
    with pytest.raises(ValueError, match=r"'residual/w' has shape \(12,\), but this compressor's is \(10,\)"):
        c.load_state_dict(other.state_dict(), "tensorflow")


@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
def test_checkpoint_without_a_tensor_names_it(framework):
    if framework == "tensorflow":
        tf = pytest.importorskip("tensorflow")
        make = lambda n: tf.random.normal([n])  # noqa: E731
    else:
        import torch
        make = lambda n: torch.randn(n)  # noqa: E731
    saved = hvd_compress.from_spec("topk:density=0.1")
    saved.compress(make(10), "a")
    restored = hvd_compress.from_spec("topk:density=0.1")
    restored.load_state_dict(saved.state_dict(), framework)
    restored.compress(make(10), "a")                       # in the checkpoint: fine
    with pytest.raises(ValueError, match=r"residuals for 1 tensors but none for 'b'"):
        restored.compress(make(7), "b")


def test_torch_random_indices_are_a_uniform_k_subset_without_a_permutation_of_n():
    """randomk's indices (torch): k distinct, in range, the same for the same (seed,
    step), new for a new step, and every position about equally often (both paths:
    first distinct draws for k <= n/2, the smallest of n keys above)."""
    import numpy as np
    from hvd_compress.ops import torch_ops
    STEPS = 600
    for n, k in [(1000, 50), (1000, 400), (1000, 700)]:
        counts = np.zeros(n)
        for step in range(STEPS):
            idx = torch_ops.random_indices(n, k, 7, step).numpy()
            assert idx.dtype == np.int32 and len(set(idx.tolist())) == k
            assert idx.min() >= 0 and idx.max() < n
            counts[idx] += 1
        p = k / n                     # each position: Binomial(STEPS, p) times
        chi2 = ((counts - STEPS * p) ** 2).sum() / (STEPS * p * (1 - p))
        assert abs(chi2 - (n - 1)) < 5 * np.sqrt(2 * (n - 1)), (n, k, chi2)  # chi2(n-1)
        assert np.array_equal(torch_ops.random_indices(n, k, 7, 3).numpy(),
                              torch_ops.random_indices(n, k, 7, 3).numpy())
        assert not np.array_equal(torch_ops.random_indices(n, k, 7, 3).numpy(),
                                  torch_ops.random_indices(n, k, 7, 4).numpy())
    assert torch_ops.random_indices(10, 0, 1, 1).numel() == 0


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_torch_random_indices_same_on_the_cpu_path_and_the_kernels_path(monkeypatch, backend):
    """The CPU's own draws (numpy uint32 hashing, a k-smallest selection per tensor) give
    the indices of the kernels' path (int64 torch ops over the bucket, what CUDA runs;
    here HVD_COMPRESS_BACKEND=triton), in the same order, in a bucket and one by one;
    the k-smallest path's indices ascend."""
    import numpy as np
    import torch
    from hvd_compress.ops import torch_ops
    from hvd_compress.ops.torch_ops import _draws
    numels = (1000, 5000, 37, 0, 300, 10, 70_000, 1)
    ks = (700, 50, 30, 1, 150, 10, 40_000, 1)              # both paths, k = n, n = 1
    steps = [3, 4, 5, 6, 7, 8, 9, 10]
    monkeypatch.setenv("HVD_COMPRESS_BACKEND", "triton")
    want = _draws.draw_segments(numels, ks, 11, steps)
    monkeypatch.setenv("HVD_COMPRESS_BACKEND", backend)
    got = _draws.draw_segments(numels, ks, 11, steps)
    assert torch.equal(got, want)
    offsets = np.cumsum((0,) + numels[:-1])
    alone = [torch_ops.random_indices(n, k, 11, s) + int(o)
             for n, k, s, o in zip(numels, ks, steps, offsets) if k]
    assert torch.equal(torch.cat(alone), want)
    big = torch_ops.random_indices(70_000, 40_000, 11, 9)
    assert bool((big[1:] > big[:-1]).all())
