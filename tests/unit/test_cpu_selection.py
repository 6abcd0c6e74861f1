"""The CPU selection paths in numpy (``ops.topk_indices`` and ``ops.segment_abs_topk``:
a sampled threshold then ``np.partition`` of the candidates, or ``np.partition`` of the
whole tensor, the latter also finding NaN/Inf; ``kernels.compact.abs_above_cpu``
behind the compaction and count references) against
brute force in torch: the same sets, ties by lowest index, NaN and Inf, half precision,
and sizes across numpy's 64K-value chunks.  Every test runs twice: with every top-k
taking the sampled threshold first where ``4 k <= n`` (whatever ``n``), and with none
taking it (TensorFlow's graph path too)."""
import numpy as np
import pytest
import torch

from hvd_compress import kernels as K
from hvd_compress.kernels.compact import NUMPY_CHUNK, abs_above_cpu
from hvd_compress.ops import _cpu_topk
from hvd_compress.ops import torch_ops as ops


@pytest.fixture(autouse=True, params=["sampled", "whole"])
def sampled_threshold(request, monkeypatch):
    """``sampled``: every top-k with ``4 k <= n`` takes the sampled threshold first;
    ``whole``: none does."""
    monkeypatch.setattr(_cpu_topk, "PREFILTER_MIN", 1 if request.param == "sampled" else 2**62)
    return request.param


def lowest_index_topk(scores, k):
    """The k largest by a stable sort: ties by lowest index (the reference)."""
    order = np.argsort(-scores.double().numpy(), kind="stable")
    return np.sort(order[:k])


@pytest.mark.parametrize("n", [1, 5, 1000, NUMPY_CHUNK + 3, 3 * NUMPY_CHUNK + 17])
@pytest.mark.parametrize("ties", [False, True])
def test_topk_indices_are_the_k_largest_ties_by_lowest_index(n, ties):
    x = torch.from_numpy(np.random.default_rng(n).laplace(size=n).astype(np.float32)).abs()
    if ties:
        x = torch.round(x * 2) / 2                    # few distinct values: many ties
    for k in sorted({1, max(1, n // 100), max(1, n // 2), max(1, n - 1), n}):
        got = ops.topk_indices(x, k)
        assert got.dtype == torch.int32 and got.numel() == k
        assert np.array_equal(np.sort(got.numpy()), lowest_index_topk(x, k)), (n, k)


def misled(n, seed):
    """Laplace magnitudes whose strided sample (every 61st value) holds the largest
    values: the sample's threshold has fewer than k of 1% at or above it."""
    x = np.abs(np.random.default_rng(seed).laplace(size=n)).astype(np.float32)
    x[::_cpu_topk.SAMPLE_STRIDE] = 1000 + np.arange(x[::_cpu_topk.SAMPLE_STRIDE].size)
    return torch.from_numpy(x)


def test_sampled_threshold_is_taken_and_a_misleading_sample_falls_back(monkeypatch,
                                                                       sampled_threshold):
    """Step 0 of _cpu_topk selects where it runs (None: the whole partition instead) and
    gives way when the sample misleads; both answers are the k largest."""
    calls, real = [], _cpu_topk._sampled
    monkeypatch.setattr(_cpu_topk, "_sampled", lambda *a: calls.append(real(*a)) or calls[-1])
    n = 3 * NUMPY_CHUNK + 17
    typical = torch.from_numpy(np.random.default_rng(3).laplace(size=n).astype(np.float32))
    for x in (typical, misled(n, 4)):
        for scores in (x, x.abs()):
            got = ops.topk_indices(scores, n // 100)
            assert np.array_equal(np.sort(got.numpy()), lowest_index_topk(scores, n // 100))
        idx, finite = ops.segment_abs_topk(x, (n,), (n // 100,))
        assert finite and np.array_equal(idx.numpy(), lowest_index_topk(x.abs(), n // 100))
    if sampled_threshold == "sampled":
        assert [c is not None for c in calls] == [True] * 3 + [False] * 3
    else:
        assert calls == []


def test_tf_graph_sampled_threshold_falls_back_on_a_misleading_sample_and_nan():
    """TensorFlow's step 0 inside tf.function: the same sets as a stable sort, also when
    the sample misleads, and tf.math.top_k's when a NaN lies outside the sample."""
    tf = pytest.importorskip("tensorflow")
    from hvd_compress.ops import tf_ops
    n = NUMPY_CHUNK + 3
    fn = tf.function(lambda t: tf_ops.topk_indices(t, 655))
    for x in (misled(n, 5), torch.from_numpy(np.random.default_rng(6).laplace(size=n)
                                             .astype(np.float32))):
        got = fn(tf.constant(x.numpy()))
        assert np.array_equal(np.sort(got.numpy()), lowest_index_topk(x, 655))
    x = np.abs(np.random.default_rng(6).laplace(size=n)).astype(np.float32)
    x[1] = np.nan
    want = tf.math.top_k(tf.constant(x), k=655, sorted=False).indices.numpy()
    assert np.array_equal(np.sort(fn(tf.constant(x)).numpy()), np.sort(want))


def test_topk_indices_with_nan_ranks_it_highest_as_torch_does():
    x = torch.tensor([0.5, float("nan"), 2.0, 1.0, float("inf"), 0.0])
    for k in (1, 2, 3):
        got = set(ops.topk_indices(x, k).tolist())
        assert got == set(torch.topk(x, k).indices.tolist()), k
    assert set(ops.topk_indices(x, 2).tolist()) == {1, 4}     # NaN, then Inf


def with_zeros(n, frac, seed, rows=1):
    """Laplace values with about ``frac`` of them zero, in runs of ``rows`` (an
    embedding's gradient: whole rows of tokens that were not in the batch)."""
    rng = np.random.default_rng(seed)
    x = rng.laplace(size=n).astype(np.float32)
    runs = -(-n // rows)
    x[np.repeat(rng.random(runs) < frac, rows)[:n]] = 0.0
    return torch.from_numpy(x)


@pytest.mark.parametrize("frac", [0.0, 0.05, 0.4, 0.67, 0.995, 1.0])
@pytest.mark.parametrize("signed", [False, True])
def test_topk_indices_with_many_zeros(frac, signed):
    """At least 1/16 zeros in the sample of non-negative scores: the k smallest of -x
    (the zeros tie on top); the same sets, ties at 0 by lowest index (k beyond the
    nonzeros included)."""
    n = 3 * NUMPY_CHUNK + 17
    x = with_zeros(n, frac, seed=int(frac * 1000), rows=256)
    x = x if signed else x.abs()
    x[::3] = torch.where(x[::3] == 0, -0.0, x[::3])   # -0.0 and +0.0 tie
    if frac == 0.0 or frac >= 0.4:                      # (5%: either order)
        # signed scores keep numpy's order: their zeros are not at the bottom
        assert _cpu_topk._many_zeros(x.numpy(), absolute=False) == \
            (frac >= 0.4 and (not signed or frac == 1.0))
        assert _cpu_topk._many_zeros(x.numpy(), absolute=True) == (frac >= 0.4)
    nonzero = int((x != 0).sum())
    for k in sorted({1, n // 100, max(1, nonzero), min(n - 1, nonzero + 5), n - 1}):
        got = ops.topk_indices(x, k)
        assert np.array_equal(np.sort(got.numpy()), lowest_index_topk(x, k)), (frac, k)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_many_zeros_find_nan_and_inf_anywhere(bad):
    """The negated order puts NaN last (not among the k): found by the max instead."""
    x = with_zeros(NUMPY_CHUNK + 100, 0.9, seed=7)
    for where in (0, 777, NUMPY_CHUNK + 99):
        y = x.clone()
        y[where] = bad
        for t in (y, y.to(torch.float16)):
            for k in (1, 3):
                idx, finite = ops.segment_abs_topk(t, (t.numel(),), (k,))
                assert finite is False and np.array_equal(idx.numpy(), np.arange(t.numel()))
        got = set(ops.topk_indices(y, 2).tolist())
        assert got == set(torch.topk(y, 2).indices.tolist()) or bad == -float("inf")
        if bad != bad or bad > 0:                       # NaN and +Inf rank highest
            assert where in got


def test_segment_abs_topk_with_an_embedding_like_tensor():
    numels = (5000 * 16, 300, 1000)
    x = torch.cat([with_zeros(numels[0], 0.67, seed=8, rows=16),
                   with_zeros(numels[1], 0.0, seed=9), torch.zeros(numels[2])])
    ks = (800, 3, 10)
    idx, finite = ops.segment_abs_topk(x, numels, ks)
    assert finite is True
    assert np.array_equal(idx.numpy(), brute_segments(x, numels, ks))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_topk_indices_of_other_float_dtypes(dtype):
    x = torch.from_numpy(np.random.default_rng(1).laplace(size=5000).astype(np.float32))
    x = x.abs().to(dtype)
    got = ops.topk_indices(x, 50)
    assert np.array_equal(np.sort(got.numpy()), lowest_index_topk(x.float(), 50))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_abs_above_across_chunks_with_nan_inf_and_per_entry_thresholds(dtype):
    n = 2 * NUMPY_CHUNK + 11
    x = torch.from_numpy(np.random.default_rng(2).laplace(size=n).astype(np.float32))
    x[[3, NUMPY_CHUNK - 1, NUMPY_CHUNK, n - 1]] = torch.tensor(
        [float("nan"), float("inf"), -float("inf"), float("nan")])
    x = x.to(dtype)
    brute = lambda t: (x.float().abs() > t).numpy()           # noqa: E731 - NaN is never above
    assert np.array_equal(abs_above_cpu(x, 0.5), brute(0.5))
    assert np.array_equal(abs_above_cpu(x, torch.tensor(0.5)), brute(0.5))
    per_entry = torch.linspace(0, 3, n)
    assert np.array_equal(abs_above_cpu(x, per_entry), brute(per_entry))
    v, i = K.compact_above_reference(x, 1.0)
    assert np.array_equal(i.numpy(), np.flatnonzero(brute(1.0)))
    assert torch.equal(v, x[i.long()]) and v.dtype == dtype
    thr = torch.tensor([0.0, 1.0, 2.5])
    assert K.count_above_reference(x, thr).tolist() == [int(brute(t).sum()) for t in thr]
    assert K.count_above_reference(x, thr[1:2]).tolist() == [int(brute(1.0).sum())]


# -- segment_abs_topk: each tensor's top-k of |x| and the bucket's finiteness, one pass --

def brute_segments(x, numels, ks):
    out, off = [], 0
    for n, k in zip(numels, ks):
        out.append(lowest_index_topk(x[off:off + n].abs(), min(k, n)) + off)
        off += n
    return np.concatenate(out)


@pytest.mark.parametrize("ties", [False, True])
def test_segment_abs_topk_is_each_tensors_top_k_of_magnitudes(ties):
    numels = (1, 7, 0, 1000, NUMPY_CHUNK + 5, 2 * NUMPY_CHUNK + 9, 3)
    ks = (1, 2, 1, 10, 700, 1, 3)                       # k >= n: every entry
    x = torch.from_numpy(np.random.default_rng(3).laplace(size=sum(numels)).astype(np.float32))
    if ties:
        x = torch.round(x * 2) / 2                      # +-v tie on |x| as well
    idx, finite = ops.segment_abs_topk(x, numels, ks)
    assert finite is True and idx.dtype == torch.int32
    assert np.array_equal(idx.numpy(), brute_segments(x, numels, ks))   # index order


def test_segment_abs_topk_reuses_its_buffer_across_sizes():
    rng = np.random.default_rng(4)
    for n in (50_000, 3000, 200_000, 10):               # grows, shrinks, grows
        x = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
        k = max(1, n // 100)
        idx, _ = ops.segment_abs_topk(x, (n,), (k,))
        assert np.array_equal(idx.numpy(), lowest_index_topk(x.abs(), k))
        assert np.array_equal(np.sort(ops.topk_indices(x, k).numpy()), lowest_index_topk(x, k))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("where", [0, 5000, NUMPY_CHUNK + 1])
def test_segment_abs_topk_finds_nan_and_inf_anywhere(bad, where):
    """Not only among the k largest: a NaN/Inf anywhere partitions into the top."""
    x = torch.from_numpy(np.random.default_rng(5).laplace(size=NUMPY_CHUNK + 100).astype(np.float32))
    x[where] = bad
    numels = (5000, x.numel() - 5000)
    for t in (x, x.to(torch.float16)):
        idx, finite = ops.segment_abs_topk(t, numels, (1, 3))
        assert finite is False and np.array_equal(idx.numpy(), np.arange(x.numel()))


def test_topk_compress_sends_everything_for_a_non_finite_bucket_and_keeps_the_residual():
    from hvd_compress.buckets import layout
    from hvd_compress.spec import from_spec
    lay = layout(["a", "b"], [(300,), (5000,)])
    c = from_spec("topk:density=0.01")
    g = torch.from_numpy(np.random.default_rng(6).laplace(size=lay.total).astype(np.float32))
    (values, idx), _ = c.compress_bucket(g.clone(), lay)
    assert idx.numel() == 3 + 50
    before = c.state_dict()["state"]
    bad = g.clone()
    bad[4000] = float("inf")
    (values, idx), _ = c.compress_bucket(bad.clone(), lay)
    assert np.array_equal(idx.numpy(), np.arange(lay.total))        # every index
    after = c.state_dict()["state"]
    assert before.keys() == after.keys() == {"residual/a", "residual/b"}
    for key in before:
        assert torch.equal(before[key], after[key]), key           # residual left as it was


def test_segment_abs_topk_is_not_the_kernel_path(monkeypatch):
    """HVD_COMPRESS_BACKEND=triton runs CUDA's code on the CPU: no numpy fast path."""
    monkeypatch.setenv("HVD_COMPRESS_BACKEND", "triton")
    assert ops.segment_abs_topk(torch.ones(10), (10,), (1,)) is None


def test_laplace_topk_below_small_is_the_partition_with_zeros_dropped():
    from hvd_compress.spec import from_spec
    x = torch.from_numpy(np.random.default_rng(7).laplace(size=20_000).astype(np.float32))
    x[::3] = 0.0                                        # 6667 zeros
    for density in (0.01, 0.5):                         # k below / above the nonzeros
        (values, idx), _ = from_spec(f"laplace_topk:density={density},ef=0").compress(x, "g")
        want = lowest_index_topk(x.abs(), int(np.ceil(density * x.numel())))
        want = want[x.numpy()[want] != 0]
        assert np.array_equal(np.sort(idx.numpy()), want), density
        assert torch.equal(values, x[idx.long()])


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_laplace_topk_below_small_sends_a_non_finite_tensor_whole(bad):
    from hvd_compress.spec import from_spec
    c = from_spec("laplace_topk:density=0.01")
    x = torch.from_numpy(np.random.default_rng(8).laplace(size=5000).astype(np.float32))
    c.compress(x.clone(), "g")
    before = c.residual("g").clone()
    x[1234] = bad
    (values, idx), _ = c.compress(x.clone(), "g")
    assert np.array_equal(idx.numpy(), np.arange(5000))
    assert torch.equal(c.residual("g"), before)


def test_laplace_topk_crossover_on_the_cpu_is_2_27_whatever_torchs_threads():
    """The sampled top-k beat the search up to 128M values on one thread and two."""
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            assert ops.small_topk_below(torch.ones(1)) == 1 << 27
    finally:
        torch.set_num_threads(threads)


# -- TensorFlow on the CPU: the same numpy selection eagerly; tf.math.top_k in tf.function --

@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("ties", [False, True])
def test_tf_topk_indices_are_the_k_largest_ties_by_lowest_index(graph, ties):
    tf = pytest.importorskip("tensorflow")
    from hvd_compress.ops import tf_ops
    n = NUMPY_CHUNK + 3
    x = torch.from_numpy(np.random.default_rng(7).laplace(size=n).astype(np.float32)).abs()
    if ties:
        x = torch.round(x * 2) / 2
    for k in (1, 655, n // 2, n - 1, n):
        fn = (lambda t, k=k: tf_ops.topk_indices(t, k))
        got = (tf.function(fn) if graph else fn)(tf.constant(x.numpy()))
        assert got.dtype == tf.int32 and got.shape == (k,)
        assert np.array_equal(np.sort(got.numpy()), lowest_index_topk(x, k)), (k, graph)


def test_tf_topk_indices_with_nan_and_half_precision():
    tf = pytest.importorskip("tensorflow")
    from hvd_compress.ops import tf_ops
    x = np.array([0.5, np.nan, 2.0, 1.0, np.inf, 0.0], np.float32)
    assert set(tf_ops.topk_indices(tf.constant(x), 2).numpy()) == {1, 4}    # NaN, then Inf
    y = np.random.default_rng(8).laplace(size=3000).astype(np.float32)
    for dtype in (tf.float16, tf.bfloat16):
        t = tf.cast(tf.abs(tf.constant(y)), dtype)
        got = tf_ops.topk_indices(t, 30).numpy()
        want = lowest_index_topk(torch.from_numpy(tf.cast(t, tf.float32).numpy()), 30)
        assert np.array_equal(np.sort(got), want)


def test_tf_segment_abs_topk_eagerly_and_its_absence_in_tf_function():
    """Eager CPU tensors: the same indices and finiteness as PyTorch's, every index when
    the bucket holds an Inf; inside tf.function None (numpy would run through
    tf.numpy_function there: see tf_ops.core._eager_on_cpu), and the generic
    check-then-select runs."""
    tf = pytest.importorskip("tensorflow")
    from hvd_compress.ops import tf_ops
    x = np.random.default_rng(9).laplace(size=NUMPY_CHUNK + 700).astype(np.float32)
    x = torch.from_numpy(x)
    numels, ks = (0, 700, 1, NUMPY_CHUNK - 1), (0, 7, 1, 650)
    idx, finite = tf_ops.segment_abs_topk(tf.constant(x.numpy()), numels, ks)
    assert finite is True and idx.dtype == tf.int32
    assert np.array_equal(idx.numpy(), ops.segment_abs_topk(x, numels, ks)[0].numpy())
    assert np.array_equal(idx.numpy(), brute_segments(x, numels, ks))
    bad = x.clone()
    bad[NUMPY_CHUNK] = float("inf")
    idx, finite = tf_ops.segment_abs_topk(tf.constant(bad.numpy()), numels, ks)
    assert finite is False and np.array_equal(idx.numpy(), np.arange(x.numel()))
    seen = []
    tf.function(lambda t: seen.append(tf_ops.segment_abs_topk(t, numels, ks)) or t)(
        tf.constant(x.numpy()))
    assert seen == [None]


def test_tf_laplace_topk_crossover_on_the_cpu_is_2_25_eagerly_and_in_tf_function():
    tf = pytest.importorskip("tensorflow")
    from hvd_compress.ops import tf_ops
    x = tf.zeros(10)
    assert tf_ops.small_topk_below(x) == 1 << 25
    seen = []
    tf.function(lambda t: seen.append(tf_ops.small_topk_below(t)) or t)(x)
    assert seen == [1 << 25]             # the sampled top-k in TF ops (no GPU here)


@pytest.mark.parametrize("spec", ["topk:density=0.01", "laplace_topk:density=0.01"])
def test_tf_compressors_select_the_same_indices_as_torch_on_the_cpu(spec):
    """A bucket through topk and laplace_topk (below ``small``: the partition), eager and
    in tf.function, against PyTorch's: the same payload indices; a non-finite bucket
    sends every index."""
    tf = pytest.importorskip("tensorflow")
    from hvd_compress.buckets import layout
    from hvd_compress.spec import from_spec
    lay = layout(["a", "b"], [(300,), (5000,)])
    g = np.random.default_rng(10).laplace(size=lay.total).astype(np.float32)
    (_, want), _ = from_spec(spec).compress_bucket(torch.from_numpy(g.copy()), lay)
    for graph in (False, True):
        c = from_spec(spec)
        fn = (lambda t: c.compress_bucket(t, lay)[0][1])
        got = (tf.function(fn) if graph else fn)(tf.constant(g))
        assert np.array_equal(np.sort(got.numpy()), np.sort(want.numpy())), graph
    g[4000] = np.nan
    (_, idx), _ = from_spec(spec).compress_bucket(tf.constant(g), lay)
    assert np.array_equal(np.sort(idx.numpy()), np.arange(lay.total))
