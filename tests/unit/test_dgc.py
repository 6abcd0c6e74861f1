"""dgc's sampled threshold (issue 26): the sample is O(m) with replacement on the tensor's
device (``ops.random_sample``, a pure function of ``(seed, step)``; no ``randperm`` of
the tensor), and the adaptation loop, which takes its first count from a compaction,
selects what the loop of before selected on that sample, in PyTorch and TensorFlow,
eagerly and inside tf.function."""
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import hvd_compress
from hvd_compress.compressors.estimated_threshold import DGC
from hvd_compress.ops import torch_ops


def old_select(c, flat, n, ops, step):
    """DGC.select as it was before issue 26's change (a count read back per iteration,
    then a compaction), on the same ``ops.random_sample``."""
    k = c.k(n)
    m = max(1, min(n, math.ceil(c.sample * n)))
    s = ops.abs(ops.to_float32(ops.random_sample(flat, m, c.seed, step)))
    ks = max(1, min(m, math.ceil(c.density * m)))
    t = ops.reduce_min(ops.gather(s, ops.topk_indices(s, ks)))
    for _ in range(10):
        cnt = ops.count_above(flat, t)[0]
        high, low = cnt > int(1.3 * k), cnt < int(0.7 * k)
        if ops.host_bool(~(high | low)):
            break
        t = ops.where(high, t * 1.3, ops.where(low, t * 0.7, t))
    values, idx = ops.compact_above(flat, t)
    return ops.cond(ops.length(idx) > k,
                    lambda: ops.gather(idx, ops.topk_indices(ops.abs(ops.to_float32(values)), k)),
                    lambda: idx)


def inputs():
    """(label, float32 array, dgc options): converged at once, adapted upwards from a
    rough 10-value sample, ties that make the count jump (the 10 iterations run out),
    mostly zeros (a threshold of 0 that x0.7 cannot move)."""
    r = np.random.default_rng(3)
    lap = r.laplace(size=20000).astype(np.float32)
    sparse = np.zeros(20000, np.float32)
    sparse[r.choice(20000, 50, replace=False)] = r.standard_normal(50)
    return [("laplace", lap, {}),
            ("rough sample", lap, {"sample": 0.0005}),
            ("ties", (np.round(lap * 2) / 2).astype(np.float32), {"sample": 0.001}),
            ("gaussian", r.standard_normal(20000).astype(np.float32), {"sample": 0.002}),
            ("mostly zeros", sparse, {}),
            ("tiny", r.standard_normal(7).astype(np.float32), {"density": 0.3})]


# -- the sample ------------------------------------------------------------------------

def test_torch_sample_is_reproducible_and_in_range():
    n, m = 1000, 300
    t = torch.arange(n, dtype=torch.float32)            # a value is its own index
    a = torch_ops.random_sample(t, m, 5, 7)
    assert a.shape == (m,) and a.dtype == torch.float32
    assert torch.equal(a, torch_ops.random_sample(t, m, 5, 7))
    assert not torch.equal(a, torch_ops.random_sample(t, m, 5, 8))
    assert not torch.equal(a, torch_ops.random_sample(t, m, 6, 7))
    assert a.min() >= 0 and a.max() < n and torch.equal(a, a.round())
    assert len(set(a.tolist())) > m // 2                # spread out, not a block
    assert torch.equal(torch_ops.random_sample(t, n, 5, 7), t)     # m >= n: all of t
    assert torch.equal(torch_ops.random_sample(t[:1], 1, 0, 0), t[:1])


def test_tensorflow_sample_is_reproducible_and_in_range_in_tf_function():
    tf = pytest.importorskip("tensorflow")
    from hvd_compress.ops import tf_ops
    n, m = 1000, 300
    t = tf.range(n, dtype=tf.float32)
    a = tf_ops.random_sample(t, m, 5, 7).numpy()
    assert a.shape == (m,)
    assert np.array_equal(a, tf_ops.random_sample(t, m, 5, 7).numpy())
    assert not np.array_equal(a, tf_ops.random_sample(t, m, 5, 8).numpy())
    assert a.min() >= 0 and a.max() < n and len(set(a.tolist())) > m // 2
    graph = tf.function(lambda x, s: tf_ops.random_sample(x, m, 5, s))
    assert np.array_equal(a, graph(t, tf.constant(7, tf.int64)).numpy())
    assert np.array_equal(tf_ops.random_sample(t, n, 5, 7).numpy(), t.numpy())


def test_dgc_compress_of_2m_values_does_not_permute(monkeypatch):
    def no_randperm(*args, **kwargs):
        raise AssertionError("dgc must not call torch.randperm")
    monkeypatch.setattr(torch, "randperm", no_randperm)
    g = torch.from_numpy(np.random.default_rng(0).laplace(size=2_000_000).astype(np.float32))
    a, b = hvd_compress.from_spec("dgc:density=0.01"), hvd_compress.from_spec("dgc:density=0.01")
    for _ in range(2):
        pa, ctx = a.compress(g, "g")
        pb, _ = b.compress(g, "g")
        assert all(torch.equal(x, y) for x, y in zip(pa, pb))     # same (seed, step)
        k = a.k(g.numel())
        assert 0.7 * k <= pa[1].numel() <= k
    out = a.decompress(pa, ctx)
    assert out.shape == g.shape


def test_converged_sample_costs_one_compaction_and_no_count(monkeypatch):
    """The usual case: the sample's threshold is in range, so the compaction at it is the
    answer (on CUDA one host synchronisation: its output size)."""
    calls = {"count_above": 0, "compact_above": 0}
    for name in calls:
        real = getattr(torch_ops, name)

        def spy(*args, _real=real, _name=name):
            calls[_name] += 1
            return _real(*args)
        monkeypatch.setattr(torch_ops, name, spy)
    g = torch.from_numpy(np.random.default_rng(1).laplace(size=1_000_000).astype(np.float32))
    hvd_compress.from_spec("dgc:density=0.01,ef=0").compress(g, "g")
    assert calls == {"count_above": 0, "compact_above": 1}


# -- the adaptation selects what it selected before --------------------------------------

@pytest.mark.parametrize("label,x,opts", inputs(), ids=[i[0] for i in inputs()])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_torch_select_equals_the_loop_of_before(label, x, opts, dtype):
    c = DGC(ef=False, **opts)
    flat = torch.from_numpy(x).to(dtype)
    ctx = SimpleNamespace(numel=flat.numel())
    for step in range(3):
        new = c.select(flat, ctx, torch_ops, step)
        old = old_select(c, flat, flat.numel(), torch_ops, step)
        assert torch.equal(new.sort().values, old.sort().values), (label, step)
        assert new.numel() <= c.k(flat.numel())


@pytest.mark.parametrize("label,x,opts", inputs(), ids=[i[0] for i in inputs()])
def test_tensorflow_select_equals_the_loop_of_before_eager_and_in_tf_function(label, x, opts):
    tf = pytest.importorskip("tensorflow")
    from hvd_compress.ops import tf_ops
    c = DGC(ef=False, **opts)
    flat = tf.constant(x)
    ctx = SimpleNamespace(numel=x.size)
    graph = tf.function(lambda v, s: c.select(v, ctx, tf_ops, s))
    for step in range(3):
        new = np.sort(c.select(flat, ctx, tf_ops, step).numpy())
        old = np.sort(old_select(c, flat, x.size, tf_ops, step).numpy())
        assert np.array_equal(new, old), (label, step)
        in_graph = np.sort(graph(flat, tf.constant(step, tf.int64)).numpy())
        assert np.array_equal(in_graph, new), (label, step)
