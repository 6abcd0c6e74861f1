"""Peer baselines (qsgd, terngrad, signsgd, onebit, powersgd) in one process, PyTorch and
TensorFlow: references computed here in numpy, unbiasedness, error-feedback
conservation, buckets, checkpoints, bad input.  Through real Horovod they run in the
horovodrun jobs (tests/cases.py SPECS and BUCKET_SPECS)."""
import zlib

import numpy as np
import pytest
import torch

import hvd_compress
from hvd_compress.compressors.aggregation import in_process
from hvd_compress.buckets import layout

STOCHASTIC = ["qsgd", "qsgd:levels=4,block=8", "terngrad"]
DETERMINISTIC = ["signsgd", "onebit"]


def _rng(seed=0):
    return np.random.default_rng(seed)


def _ranks(spec, n):
    """n compressors of ``spec``, one per simulated rank (independent draws)."""
    sep = "," if ":" in spec else ":"
    if spec.split(":")[0] in ("qsgd", "terngrad"):
        return [hvd_compress.from_spec(f"{spec}{sep}rank={r}") for r in range(n)]
    return [hvd_compress.from_spec(spec) for _ in range(n)]


# -- references in numpy ---------------------------------------------------------------

def sign_reference(g):
    a = np.abs(g.astype(np.float64)).sum() / g.size
    return np.where(g >= 0, a, -a).astype(np.float32)


def onebit_reference(g):
    pos, neg = g[g >= 0], g[g < 0]
    a = pos.astype(np.float64).mean() if pos.size else 0.0
    b = neg.astype(np.float64).mean() if neg.size else 0.0
    return np.where(g >= 0, a, b).astype(np.float32)


def powersgd_reference(grads, rank, seed=0, name="w"):
    """First step of PowerSGD, from scratch: P^ = orth(sum M_w Q0), out = P^ P^T sum M_w."""
    m = [g.reshape(g.shape[0], -1).astype(np.float64) for g in grads]
    r = min(rank, *m[0].shape)
    q0 = np.random.RandomState(zlib.crc32(f"{seed}/{name}".encode())).standard_normal(
        (m[0].shape[1], r)).astype(np.float32)
    p, _ = np.linalg.qr(sum(mw @ q0 for mw in m))
    return (p @ p.T @ sum(m)).reshape(grads[0].shape)


@pytest.mark.parametrize("spec,ref", [("signsgd", sign_reference), ("onebit", onebit_reference)])
def test_sign_methods_equal_reference(spec, ref):
    g = [_rng(i).standard_normal((30, 7)).astype(np.float32) for i in range(3)]
    outs, _ = in_process(_ranks(spec, 3), [torch.from_numpy(x) for x in g], "g")
    expected = sum(ref(x) for x in g)
    for o in outs:
        np.testing.assert_allclose(o.numpy(), expected, rtol=1e-5, atol=1e-6)


def test_payload_bytes():
    """The wire sizes the docstrings promise, for 1000 values."""
    g = torch.from_numpy(_rng().standard_normal(1000).astype(np.float32))
    sizes = {}
    for spec in ["qsgd", "terngrad", "signsgd", "onebit", "twobit"]:
        payload, _ = _ranks(spec, 1)[0].compress(g, "g")
        sizes[spec] = sum(t.numel() * t.element_size() for t in payload)
    assert sizes == {"qsgd": 1000 + 2 * 4, "terngrad": 63 * 4 + 4, "signsgd": 125 + 8,
                     "onebit": 125 + 8, "twobit": 63 * 4 + 4}


def test_qsgd_levels_and_norms():
    """Every value is sign(g) * norm_b * l / s with l = floor or ceil of |g| s / norm_b."""
    g = _rng().standard_normal(100).astype(np.float32)
    c = hvd_compress.from_spec("qsgd:levels=4,block=16")
    (codes, norms), _ = c.compress(torch.from_numpy(g), "g")
    codes, norms = codes.numpy().astype(np.int64), norms.numpy()
    blocks = np.arange(100) // 16
    ref_norms = np.array([np.linalg.norm(g[blocks == b]) for b in range(7)], np.float32)
    np.testing.assert_allclose(norms, ref_norms, rtol=1e-6)
    u = np.abs(g) * 4 / ref_norms[blocks]
    assert np.all((np.abs(codes) == np.floor(u)) | (np.abs(codes) == np.ceil(u)))
    assert np.all((codes == 0) | (np.sign(codes) == np.sign(g)))


@pytest.mark.parametrize("spec", STOCHASTIC)
def test_stochastic_quantizers_are_unbiased(spec):
    """The mean of many draws approaches the gradient (ef=0, the default)."""
    g = _rng().standard_normal(64).astype(np.float32)
    c = hvd_compress.from_spec(spec)
    assert not c.ef
    steps = 3000
    total = np.zeros(64)
    for _ in range(steps):
        payload, ctx = c.compress(torch.from_numpy(g), "g")
        total += c.decompress(payload, ctx).numpy()
    mean = total / steps
    # standard error of the mean: the per-value spread is at most max|g| (terngrad)
    assert np.abs(mean - g).max() < 5 * np.abs(g).max() / np.sqrt(steps)
    single = c.decompress(*c.compress(torch.from_numpy(g), "g")[::1]).numpy()
    assert np.abs(single - g).max() > 1e-3          # one draw is not the gradient


@pytest.mark.parametrize("spec", STOCHASTIC)
def test_draws_are_reproducible_and_independent_between_ranks(spec):
    g = torch.from_numpy(_rng().standard_normal(500).astype(np.float32))
    a, b, other = _ranks(spec, 1)[0], _ranks(spec, 1)[0], _ranks(spec, 2)[1]
    pa, pb, po = (c.compress(g, "g")[0][0] for c in (a, b, other))
    assert torch.equal(pa, pb)
    assert not torch.equal(pa, po)
    assert not torch.equal(a.compress(g, "g")[0][0], pa)         # a new step, new draws
    assert a.state_dict()["state"]["step/g"] == 2


def test_rank_comes_from_the_launcher(monkeypatch):
    from hvd_compress.compressors.stochastic import process_rank
    for var in ("HOROVOD_RANK", "RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        monkeypatch.delenv(var, raising=False)
    assert process_rank() == 0
    monkeypatch.setenv("RANK", "3")
    assert process_rank() == 3
    monkeypatch.setenv("HOROVOD_RANK", "1")
    assert process_rank() == 1


@pytest.mark.parametrize("spec", ["signsgd", "onebit", "qsgd:ef=1", "terngrad:ef=1"])
def test_error_feedback_conserves_the_gradient(spec):
    """sum_t D(C(c_t)) + r_T == sum_t g_t, per rank."""
    c = _ranks(spec, 1)[0]
    assert c.ef
    total_g = np.zeros((20, 9))
    total_sent = np.zeros((20, 9))
    for step in range(6):
        g = _rng(step).standard_normal((20, 9)).astype(np.float32)
        payload, ctx = c.compress(torch.from_numpy(g), "g")
        total_g += g
        total_sent += c.decompress(payload, ctx).numpy()
    residual = c.residual("g").numpy().reshape(20, 9)
    np.testing.assert_allclose(total_sent + residual, total_g, atol=2e-5)


def test_powersgd_first_step_equals_reference():
    g = [_rng(i).standard_normal((12, 10)).astype(np.float32) for i in range(3)]
    cs = _ranks("powersgd:rank=2", 3)
    outs, _ = in_process(cs, [torch.from_numpy(x) for x in g], "w")
    expected = powersgd_reference(g, 2)
    for o in outs:
        np.testing.assert_allclose(o.numpy(), expected, rtol=1e-4, atol=1e-5)


def test_powersgd_recovers_low_rank_gradients_and_conserves():
    """Gradients of rank <= r are sent exactly (after the warm start has found their
    column space); over steps, what all ranks sent + their residuals == all gradients."""
    rng = _rng()
    u, v = rng.standard_normal((40, 2)), rng.standard_normal((2, 30))
    cs = _ranks("powersgd:rank=2", 2)
    total_g, total_out = 0, 0
    for step in range(4):
        g = [(u @ (v * (1 + 0.1 * w + step))).astype(np.float32) for w in range(2)]
        outs, _ = in_process(cs, [torch.from_numpy(x) for x in g], "w")
        total_g, total_out = total_g + sum(g), total_out + outs[0].numpy()
    np.testing.assert_allclose(outs[0].numpy(), sum(g), rtol=1e-4, atol=1e-4)
    residuals = sum(c.residual("w").numpy().reshape(40, 30) for c in cs)
    np.testing.assert_allclose(total_out + residuals, total_g, rtol=1e-4, atol=1e-3)


def test_powersgd_sends_vectors_and_small_matrices_uncompressed():
    c = hvd_compress.from_spec("powersgd:rank=4")
    assert c.for_tensor("b", torch.zeros(100)).name == "none"
    assert c.for_tensor("s", torch.zeros(())).name == "none"
    assert c.for_tensor("small", torch.zeros(8, 8)).name == "none"    # (8+8)4*2 >= 64
    assert c.for_tensor("i", torch.zeros(50, 50, dtype=torch.int32)).name == "none"
    assert c.for_tensor("w", torch.zeros(64, 3, 3, 3)) is c
    assert c.for_tensor("b", torch.zeros(3)) is c.for_tensor("b2", torch.zeros(5))  # one bucket
    with pytest.raises(TypeError, match="two-round"):
        c.compress(torch.zeros(64, 27), "w")


def test_powersgd_bucket_equals_tensor_by_tensor():
    shapes = {"conv": (6, 4, 3, 3), "big": (40, 30), "w": (12, 10)}
    by_tensor = _ranks("powersgd:rank=2", 2)
    bucketed = _ranks("powersgd:rank=2", 2)
    lay = layout(list(shapes), list(shapes.values()))
    for step in range(3):
        g = [{n: torch.from_numpy(_rng(10 * step + w).standard_normal(s).astype(np.float32))
              for n, s in shapes.items()} for w in range(2)]
        ref = {n: in_process(by_tensor, [gw[n] for gw in g], n)[0][0] for n in shapes}
        rounds = [c.propose_bucket(torch.cat([gw[n].reshape(-1) for n in shapes]), lay, w, 2)
                  for w, (c, gw) in enumerate(zip(bucketed, g))]
        p_sum = rounds[0][0] + rounds[1][0]
        agreed = [c.agree(p_sum, rnd) for c, (_, rnd) in zip(bucketed, rounds)]
        outs = [c.finish(agreed[0][0] + agreed[1][0], rnd) for c, (_, rnd) in zip(bucketed, agreed)]
        assert torch.equal(outs[0], outs[1])
        for n, o in zip(shapes, lay.split(outs[0], hvd_compress.ops.torch_ops)):
            assert torch.equal(o, ref[n]), n
    for a, b in zip(by_tensor, bucketed):
        sa, sb = a.state_dict()["state"], b.state_dict()["state"]
        assert sorted(sa) == sorted(sb)
        for k in sa:
            assert torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("spec", ["qsgd", "terngrad", "signsgd", "onebit"])
def test_codes_bucket_equals_tensor_by_tensor(spec):
    shapes = {"a": (5, 7), "b": (3,), "c": (40,), "d": ()}
    alone, bucketed = _ranks(spec, 2), _ranks(spec, 2)
    lay = layout(list(shapes), list(shapes.values()))
    for step in range(2):
        g = [{n: torch.from_numpy(np.asarray(_rng(step * 2 + w).standard_normal(s), np.float32))
              for n, s in shapes.items()} for w in range(2)]
        pay = [c.compress_bucket(torch.cat([gw[n].reshape(-1) for n in shapes]), lay)
               for c, gw in zip(bucketed, g)]
        gathered = tuple(torch.cat([p[i] for p, _ in pay]) for i in range(2))
        out = lay.split(bucketed[0].decompress_bucket(gathered, pay[0][1]),
                        hvd_compress.ops.torch_ops)
        for n, o in zip(shapes, out):
            ref = in_process(alone, [gw[n] for gw in g], n)[0][0]
            assert torch.equal(o, ref), (n, step)


@pytest.mark.parametrize("spec", ["qsgd", "terngrad", "signsgd", "onebit", "powersgd:rank=2"])
def test_nonfinite_gradient_makes_the_aggregate_nonfinite_and_keeps_residuals(spec):
    cs = _ranks(spec if spec.startswith("powersgd") else spec + ":ef=1", 2)
    g0 = [torch.from_numpy(_rng(w).standard_normal((12, 10)).astype(np.float32)) for w in range(2)]
    in_process(cs, g0, "w")
    before = [c.state_dict()["state"] for c in cs]
    bad = [g0[0].clone(), g0[1]]
    bad[0][3, 4] = float("nan")
    outs, _ = in_process(cs, bad, "w")
    assert not torch.isfinite(outs[1]).all()
    # the rank with the NaN keeps its residual; with PowerSGD every rank does (the
    # summed P is not finite) and keeps its warm-start Q
    keeping = cs if spec.startswith("powersgd") else cs[:1]
    for c, old in zip(keeping, before):
        state = c.state_dict()["state"]
        for k in old:
            if not k.startswith("step/"):
                assert torch.equal(state[k], old[k]), k
    outs, _ = in_process(cs, g0, "w")                  # and the next step is fine again
    assert torch.isfinite(outs[0]).all()


@pytest.mark.parametrize("spec", ["signsgd", "qsgd", "powersgd:rank=2"])
def test_checkpoint_restore_is_bitwise_identical(spec):
    cs = _ranks(spec, 2)
    grads = [[torch.from_numpy(_rng(10 * s + w).standard_normal((12, 10)).astype(np.float32))
              for w in range(2)] for s in range(5)]
    for g in grads[:3]:
        in_process(cs, g, "w")
    saved = [c.state_dict() for c in cs]
    straight = [in_process(cs, g, "w")[0][0] for g in grads[3:]]
    fresh = _ranks(spec, 2)
    for c, s in zip(fresh, saved):
        c.load_state_dict(s)
    resumed = [in_process(fresh, g, "w")[0][0] for g in grads[3:]]
    for a, b in zip(straight, resumed):
        assert torch.equal(a, b)


@pytest.mark.parametrize("spec", ["qsgd", "terngrad", "signsgd", "onebit", "powersgd:rank=2"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_keeps_its_dtype(spec, dtype):
    g = [torch.from_numpy(_rng(w).standard_normal((12, 10)).astype(np.float32)).to(dtype)
         for w in range(2)]
    outs, _ = in_process(_ranks(spec, 2), g, "w")
    assert outs[0].dtype == dtype and outs[0].shape == (12, 10)
    assert torch.isfinite(outs[0]).all()


@pytest.mark.parametrize("spec", ["qsgd", "terngrad", "signsgd", "onebit"])
def test_zero_d_and_all_zero_tensors(spec):
    for t in (torch.tensor(1.5), torch.zeros(17)):
        outs, _ = in_process(_ranks(spec, 2), [t, t], "x")
        assert outs[0].shape == t.shape and torch.isfinite(outs[0]).all()
        if not t.any():
            assert not outs[0].any()


@pytest.mark.parametrize("spec,match", [
    ("qsgd:levels=0", "levels"), ("qsgd:levels=200", "levels"), ("qsgd:levels=2.5", "levels"),
    ("qsgd:block=0", "block"), ("terngrad:rank=-1", "rank"), ("powersgd:rank=0", "rank"),
    ("powersgd:rank=1.5", "rank"), ("powersgd:min_compression_rate=0.5", "min_compression_rate")])
def test_bad_parameters_name_themselves(spec, match):
    with pytest.raises(ValueError, match=match):
        hvd_compress.from_spec(spec)


@pytest.mark.parametrize("spec", ["qsgd:rank=0", "terngrad:rank=0", "signsgd", "onebit",
                                  "powersgd:rank=2"])
def test_tensorflow_eager_and_function(spec):
    """The same algorithm in TensorFlow: deterministic methods give PyTorch's result;
    stochastic ones run eagerly and in tf.function (their draws come from TF's
    generator) and stay on their lattice."""
    tf = pytest.importorskip("tensorflow")
    g = [_rng(w).standard_normal((12, 10)).astype(np.float32) for w in range(2)]
    want = in_process(_ranks(spec, 2), [torch.from_numpy(x) for x in g], "w")[0][0].numpy()
    eager = in_process(_ranks(spec, 2), [tf.constant(x) for x in g], "w")[0][0].numpy()
    cs = _ranks(spec, 2)
    graph = tf.function(lambda a, b: in_process(cs, [a, b], "w")[0][0])(
        tf.constant(g[0]), tf.constant(g[1])).numpy()
    if spec.startswith(("qsgd", "terngrad")):
        np.testing.assert_allclose(eager, graph, rtol=1e-5, atol=1e-6)   # the same draws
        assert np.linalg.norm(eager - sum(g)) < 1.5 * np.linalg.norm(sum(g))
    else:
        np.testing.assert_allclose(eager, want, rtol=1e-5, atol=2e-6)
        np.testing.assert_allclose(graph, want, rtol=1e-5, atol=2e-6)


def test_powersgd_malformed_aggregates_raise():
    c = hvd_compress.from_spec("powersgd:rank=2")
    p, rnd = c.propose(torch.ones(12, 10), "w", 0, 2)
    with pytest.raises(ValueError, match="powersgd.*P"):
        c.agree(p[:-1], rnd)
    q, rnd = c.agree(p, rnd)
    with pytest.raises(ValueError, match="powersgd.*Q"):
        c.finish(torch.cat([q, q[:1]]), rnd)


@pytest.mark.parametrize("transpose", ["", "a", "b"])
@pytest.mark.parametrize("cols", [1, 4, 16, 17])
def test_torch_matmul_of_few_columns_is_the_product(transpose, cols):
    """``ops.matmul`` computes a product with at most 16 columns as ``(b^T a^T)^T`` on the
    CPU (PowerSGD's ``M Q``, ``M^T P^``): the same product, contiguous, float32."""
    from hvd_compress.ops import torch_ops
    g = torch.Generator().manual_seed(cols)
    a = torch.randn((200, 300) if transpose == "a" else (300, 200), generator=g)
    b = torch.randn((cols, 200) if transpose == "b" else (200, cols), generator=g)
    got = torch_ops.matmul(a, b, transpose_a=transpose == "a", transpose_b=transpose == "b")
    want = (a.t() if transpose == "a" else a).double() @ (b.t() if transpose == "b" else b).double()
    assert got.shape == (300, cols) and got.is_contiguous() and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
