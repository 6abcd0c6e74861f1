"""Buckets without Horovod: the segmented kernels against their torch references (on the
CPU under TRITON_INTERPRET=1, on CUDA tensors when there is a GPU) and against brute
force loops over the tensors; the TensorFlow versions against the torch ones; the bucket
plan; and compress_bucket == compress tensor by tensor for every segmented compressor,
two simulated ranks, several steps of error feedback.  (Through real horovodrun:
tests/integration/test_horovod_torch.py and tests/integration/test_horovod_tensorflow.py.)"""
import numpy as np
import pytest
import torch

import hvd_compress
from hvd_compress import buckets
from hvd_compress.kernels import compact as C
from hvd_compress.kernels import segmented as S
from hvd_compress.ops import torch_ops

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LAYOUTS = [[1], [5, 1, 300, 4097, 9000, 3], [4096, 4096], [1, 1, 1, 70_001]]


def data(lengths, seed=0, ties=False):
    rng = np.random.default_rng(seed)
    scales = np.repeat(rng.uniform(0.01, 10, len(lengths)), lengths)
    x = torch.from_numpy((rng.laplace(size=sum(lengths)) * scales).astype(np.float32))
    if ties:
        x = torch.round(x * 4) / 4
    return x.to(DEVICE)


def brute_sums(x, lengths):
    parts = torch.split(x.float().abs().cpu(), lengths)
    return [p.sum().item() for p in parts], [p.max().item() for p in parts]


@pytest.mark.parametrize("lengths", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_segment_abs_sum_max(lengths, dtype):
    x = data(lengths).to(dtype)
    s, m = S.segment_abs_sum_max(x, lengths, backend="triton")
    rs, rm = S.segment_abs_sum_max_reference(x, lengths)
    bs, bm = brute_sums(x, lengths)
    assert torch.equal(m.cpu(), rm.cpu()) and m.cpu().tolist() == bm          # max: exact
    np.testing.assert_allclose(s.cpu().numpy(), rs.cpu().numpy(), rtol=1e-5)
    np.testing.assert_allclose(rs.cpu().numpy(), bs, rtol=1e-5)


@pytest.mark.parametrize("lengths", LAYOUTS)
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("into", [False, True])
def test_segment_abs_sum_max_adds_first(lengths, backend, into):
    """``add=``: ``x + add`` written over ``x`` in the same pass (error feedback's
    ``c = g + r``), bit for bit the torch add, and the sums are those of the sum.
    ``into``: with ``source=``, ``source + add`` written into ``x`` (a tensor alone's
    spare buffer, NaN here: never read), ``source`` and ``add`` left as they were."""
    x, r = data(lengths), data(lengths) * 0.5 - 0.25
    want = x + r
    kept = (x.clone(), r.clone())
    more = {}
    if into:
        more["source"], x = x, torch.full_like(x, float("nan"))
    s, m = S.segment_abs_sum_max(x, lengths, backend=backend, add=r, **more)
    assert torch.equal(x.view(torch.int32), want.view(torch.int32))
    if into:
        assert torch.equal(more["source"], kept[0]) and torch.equal(r, kept[1])
    ws, wm = S.segment_abs_sum_max(want, lengths, backend=backend)
    assert torch.equal(m, wm)
    if backend == "torch" and x.is_cuda:   # the reference's index_add_: float atomics there
        torch.testing.assert_close(s, ws, rtol=1e-5, atol=0)
    else:
        assert torch.equal(s, ws)
    with pytest.raises(ValueError, match="add= needs"):
        S.segment_abs_sum_max(x.half(), lengths, backend=backend, add=r)
    with pytest.raises(ValueError, match="source= needs"):
        S.segment_abs_sum_max(x, lengths, backend=backend, add=r, source=r[:-1])
    with pytest.raises(ValueError, match="source= must be another buffer"):
        S.segment_abs_sum_max(x, lengths, backend=backend, add=r, source=x)
    with pytest.raises(ValueError, match="only with add="):
        S.segment_abs_sum_max(x, lengths, backend=backend, source=r)


def test_segment_abs_sum_max_rejects_bad_lengths():
    with pytest.raises(ValueError, match="lengths"):
        S.segment_abs_sum_max(torch.zeros(5), [2, 2])
    with pytest.raises(ValueError, match="lengths"):
        S.segment_abs_sum_max(torch.zeros(5), [5, 0])


@pytest.mark.parametrize("lengths", LAYOUTS)
@pytest.mark.parametrize("G", [1, 2, 5, 16])
def test_segment_count_above(lengths, G):
    x = data(lengths, ties=True).abs()
    seg = S.segment_ids(lengths, x.device)
    thr = torch.from_numpy(np.random.default_rng(G).uniform(0, 4, (len(lengths), G))
                           .astype(np.float32)).to(x.device)
    thr[:, 0] = 0.25                                          # exact ties
    got = S.segment_count_above(x, seg, thr, backend="triton")
    want = S.segment_count_above_reference(x, seg, thr)
    assert got.dtype == torch.int64 and torch.equal(got.cpu(), want.cpu())
    parts = torch.split(x.cpu(), lengths)
    brute = [[int((p > t).sum()) for t in row] for p, row in zip(parts, thr.cpu())]
    assert want.cpu().tolist() == brute


@pytest.mark.parametrize("lengths", LAYOUTS)
def test_compact_above_per_segment(lengths):
    x = data(lengths, ties=True)
    seg = S.segment_ids(lengths, x.device)
    t = torch.linspace(0, 3, len(lengths), device=x.device)
    v, i = C.compact_above(x, t, backend="triton", segment_ids=seg)
    rv, ri = C.compact_above_reference(x, t, seg)
    assert torch.equal(i.cpu(), ri.cpu()) and torch.equal(v.cpu(), rv.cpu())
    brute = torch.nonzero(x.abs().cpu() > t.cpu()[seg.cpu().long()]).reshape(-1)
    assert torch.equal(ri.cpu().long(), brute)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind", ["laplace", "ties", "nan", "inf"])
def test_segment_abs_topk_by_one_sort_is_numpys_partition(monkeypatch, dtype, kind):
    """``segment_abs_topk`` on CUDA (on the CPU: the kernel path, which takes CUDA's
    code) sorts the whole bucket once; it gives the numpy partition's indices: the k
    largest |x| of each tensor, ties by lowest index, in index order, and every index
    with the finiteness False for a bucket holding NaN/Inf."""
    lengths = [5, 1, 300, 4097, 9000, 3]
    ks = [2, 1, 3, 41, 90, 3]
    x = data(lengths, ties=kind == "ties").to(dtype)
    if kind in ("nan", "inf"):
        x[400] = float(kind)
    monkeypatch.setenv("HVD_COMPRESS_BACKEND", "torch")
    want_idx, want_finite = torch_ops.segment_abs_topk(x.cpu(), lengths, ks)      # numpy
    monkeypatch.setenv("HVD_COMPRESS_BACKEND", "triton")
    idx, finite = torch_ops.segment_abs_topk(x, lengths, ks)
    assert finite is want_finite is (kind not in ("nan", "inf"))
    assert idx.dtype == torch.int32 and idx.device == x.device
    assert torch.equal(idx.cpu(), want_idx)


@pytest.mark.parametrize("kind", ["zeros", "nan"])
def test_segment_abs_topk_drops_zeros_in_its_one_readback(monkeypatch, kind):
    """``drop_zeros`` (laplace_topk's): the picks without zeros (and -0.0), the numpy
    path's and the sort's alike, read back with the finiteness in one synchronisation;
    every index when the bucket holds NaN."""
    import counting  # tests/counting.py
    lengths, ks = [5, 300, 4097, 900], [4, 3, 41, 9]
    x = data(lengths)
    x[5:305] = 0.0                                   # a tensor of zeros: its 3 picks are 0
    x[305:305 + 4097:2] = 0.0                         # half of one tensor
    x[305 + 4097 + 10] = -0.0
    if kind == "nan":
        x[7] = float("nan")
    monkeypatch.setenv("HVD_COMPRESS_BACKEND", "torch")
    want_idx, want_finite = torch_ops.segment_abs_topk(x.cpu(), lengths, ks, drop_zeros=True)
    monkeypatch.setenv("HVD_COMPRESS_BACKEND", "triton")
    torch_ops.segment_abs_topk(x, lengths, ks, drop_zeros=True)   # the layout's constants
    with counting.CountSyncs() as syncs:
        idx, finite = torch_ops.segment_abs_topk(x, lengths, ks, drop_zeros=True)
    assert sum(syncs.syncs.values()) == 1, syncs.syncs
    assert finite is want_finite is (kind == "zeros")
    assert torch.equal(idx.cpu(), want_idx)
    if finite:
        kept, _ = torch_ops.segment_abs_topk(x, lengths, ks)
        assert torch.equal(idx.cpu(), kept.cpu()[x.cpu()[kept.cpu().long()] != 0])
        assert len(idx) < sum(ks) and bool((x.cpu()[idx.cpu().long()] != 0).all())


def test_segment_abs_topk_leaves_few_large_tensors_to_a_topk_each(monkeypatch):
    """More values than a million per tensor (or one tensor): None, a torch.topk each
    (one sort of many values is slower there; gpu_breakdown_2026-11-26)."""
    monkeypatch.setenv("HVD_COMPRESS_BACKEND", "triton")
    x = torch.zeros(2_000_001, device=DEVICE)
    assert torch_ops.segment_abs_topk(x, [1_000_000, 1_000_001], [10, 10]) is None
    assert torch_ops.segment_abs_topk(x[:100], [100], [10]) is None
    assert torch_ops.segment_abs_topk(x[:100], [50, 50], [10, 10]) is not None


def test_segment_ids():
    assert S.segment_ids([2, 1, 3]).tolist() == [0, 0, 1, 2, 2, 2]


def test_tensorflow_segment_primitives_equal_torch():
    tf = pytest.importorskip("tensorflow")
    from hvd_compress.ops import tf_ops
    lengths = [5, 1, 300, 4097, 3]
    x = data(lengths, ties=True).cpu()
    lay = buckets.layout([f"t{i}" for i in range(len(lengths))], [(n,) for n in lengths])
    seg_t, seg_f = torch_ops.segment_ids(lay, x), tf_ops.segment_ids(lay, tf.constant(x.numpy()))
    assert seg_t.tolist() == seg_f.numpy().tolist()
    s_t, m_t = torch_ops.segment_abs_sum_max(x, lay)
    s_f, m_f = tf_ops.segment_abs_sum_max(tf.constant(x.numpy()), lay)
    np.testing.assert_allclose(s_f.numpy(), s_t.numpy(), rtol=1e-5)
    assert m_f.numpy().tolist() == m_t.tolist()
    thr = np.random.default_rng(3).uniform(0, 3, (len(lengths), 4)).astype(np.float32)
    c_t = torch_ops.segment_count_above(x.abs(), seg_t, torch.from_numpy(thr))
    c_f = tf_ops.segment_count_above(tf.abs(tf.constant(x.numpy())), seg_f, tf.constant(thr))
    assert c_f.numpy().tolist() == c_t.tolist()
    t = np.linspace(0, 2, len(lengths)).astype(np.float32)
    v_t, i_t = torch_ops.segment_compact_above(x, torch.from_numpy(t), seg_t, lay)
    v_f, i_f = tf_ops.segment_compact_above(tf.constant(x.numpy()), tf.constant(t), seg_f, lay)
    assert i_f.numpy().tolist() == i_t.tolist() and v_f.numpy().tolist() == v_t.tolist()


# -- the plan ----------------------------------------------------------------------------

def test_plan_groups_by_compressor_and_size_in_backward_order():
    topk, dct = hvd_compress.from_spec("topk"), hvd_compress.from_spec("dct")
    e = [("a", (100,), topk, "f32", 4), ("b", (10,), dct, "f32", 4), ("c", (0,), topk, "f32", 4),
         ("d", (300,), topk, "f32", 4), ("e", (5,), topk, "f16", 2), ("f", (), topk, "f32", 4)]
    assert buckets.plan(e, 0) == [[5], [4], [3], [1], [0]]          # one each, empty skipped
    plan = buckets.plan(e, 25)
    assert sorted(map(sorted, plan)) == [[0, 3, 5], [1], [4]]       # dct alone; f16 apart
    # backward order (reverse registration) inside a bucket; the bucket whose last
    # gradient comes first is launched first
    assert plan == [[4], [1], [5, 3, 0]]
    small = buckets.plan(e, 1200 / 2**20)                           # 1200 bytes: 300 floats
    # d (1200 bytes) alone; f and a (404 bytes) share the bucket that d did not close
    assert small == [[4], [3], [1], [5, 0]]
    assert buckets.plan(e, 800 / 2**20) == [[5], [4], [3], [1], [0]]     # a: 400 of 800


def test_a_tensor_of_half_a_bucket_or_more_is_a_bucket_of_its_own():
    """CNNMLPLarge's shape: a 25.2 MB weight among small tensors fits a 25 MB bucket but
    would wait in it for the convolutions' gradients after it; alone, it is sent as soon
    as it is ready, and the small tensors before and after it share one bucket."""
    none = hvd_compress.from_spec("none")
    sizes = [864, 32, 18432, 64, 6291456, 1536, 15360, 10]      # registration order
    e = [(f"t{i}", (n,), none, "f32", 4) for i, n in enumerate(sizes)]
    assert buckets.plan(e, 25) == [[4], [7, 6, 5, 3, 2, 1, 0]]
    assert buckets.plan(e, 2 * 6291456 * 4 / 2**20) == [[4], [7, 6, 5, 3, 2, 1, 0]]
    assert buckets.plan(e, 2 * 6291456 * 4 / 2**20 + 1e-6) == [[7, 6, 5, 4, 3, 2, 1, 0]]


@pytest.mark.parametrize("value", [-1, "x", float("nan"), float("inf")])
def test_bucket_mb_is_checked(value):
    with pytest.raises(ValueError, match="bucket_mb"):
        buckets.bucket_mb(value)


def test_bucket_mb_from_environment(monkeypatch):
    monkeypatch.setenv(buckets.ENV_VAR, "0")
    assert buckets.bucket_mb() == 0
    monkeypatch.delenv(buckets.ENV_VAR)
    assert buckets.bucket_mb() == buckets.DEFAULT_MB


def test_hier_compressors_prefer_4_mb_buckets(monkeypatch):
    monkeypatch.delenv(buckets.ENV_VAR, raising=False)
    hier = hvd_compress.from_spec("hier:laplace_topk:density=0.01")
    assert buckets.bucket_mb(None, hier) == 4.0
    assert buckets.bucket_mb(None, hvd_compress.from_spec("laplace_topk")) == buckets.DEFAULT_MB
    assert buckets.bucket_mb(12, hier) == 12.0                # the argument wins
    monkeypatch.setenv(buckets.ENV_VAR, "0")
    assert buckets.bucket_mb(None, hier) == 0                 # and the environment


def test_a_compressor_that_is_not_segmented_refuses_a_bucket():
    lay = buckets.layout(["a", "b"], [(4,), (4,)])
    with pytest.raises(TypeError, match="one tensor at a time"):
        hvd_compress.from_spec("dgc").compress_bucket(torch.zeros(8), lay)


def test_twobit_bucket_rejects_a_malformed_payload():
    lay = buckets.layout(["a", "b"], [(20,), (3,)])
    c = hvd_compress.from_spec("twobit")
    (words, thr), ctx = c.compress_bucket(torch.randn(23), lay)
    with pytest.raises(ValueError, match="malformed"):
        c.decompress_bucket((words[:-1], thr), ctx)


# -- compress_bucket == compress, tensor by tensor ----------------------------------------

SHAPES = [(30, 20), (7,), (3, 3, 4, 4), (1000,), ()]
EXACT = ["none", "fp16", "bf16", "none:ef=1", "fp16:ef=1", "topk:density=0.1",
         "randomk:density=0.1,seed=3", "threshold:threshold=1.5",
         "laplace_topk:density=0.1,exact=1", "laplace_topk:density=0.02,exact=1,small=0",
         "topk:density=0.1,values=rangefloat8",
         "laplace_topk:density=0.05,exact=1,values=rangefloat12",
         "twobit", "twobit:threshold=0.5", "twobit:scale=2,ef=0",
         "rangefloat:bits=8", "rangefloat:bits=4", "rangefloat:bits=12,exp_bits=3"]


def _aggregate(c, payloads):
    if c.collective == "allreduce":
        return sum(payloads[1:], payloads[0])
    return tuple(torch.cat([p[i] for p in payloads]) for i in range(len(payloads[0])))


def _steps(spec, steps=4, nonfinite_step=None):
    names = [f"p{i}" for i in range(len(SHAPES))]
    lay = buckets.layout(names, SHAPES)
    tensorwise = [hvd_compress.from_spec(spec) for _ in range(2)]
    bucketed = [hvd_compress.from_spec(spec) for _ in range(2)]
    rng = np.random.default_rng(0)
    for step in range(steps):
        grads = [[torch.from_numpy(np.asarray(rng.laplace(size=s) * (i + 1), dtype=np.float32))
                  for i, s in enumerate(SHAPES)] for _ in range(2)]
        if step == nonfinite_step:
            grads[0][0][1, 2] = float("nan")
        ref = []
        for i, name in enumerate(names):
            sent = [c.compress(g[i].clone(), name) for c, g in zip(tensorwise, grads)]
            ref.append(tensorwise[0].decompress(_aggregate(tensorwise[0], [p for p, _ in sent]),
                                                sent[0][1]))
        sent = [c.compress_bucket(torch.cat([t.reshape(-1) for t in g]), lay)
                for c, g in zip(bucketed, grads)]
        out = bucketed[0].decompress_bucket(_aggregate(bucketed[0], [p for p, _ in sent]), sent[0][1])
        yield step, names, lay, ref, lay.split(out, torch_ops), tensorwise, bucketed, sent


def _bits(t):
    t = t.detach().contiguous()
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


@pytest.mark.parametrize("spec", EXACT)
def test_compress_bucket_equals_tensor_by_tensor(spec):
    for step, names, lay, ref, got, tw, bk, _ in _steps(spec):
        for i, name in enumerate(names):
            assert tuple(got[i].shape) == tuple(ref[i].shape)
            assert torch.equal(_bits(got[i]), _bits(ref[i])), f"{spec} step {step} {name}"
            for a, b in zip(tw, bk):
                if a.residual(name) is not None:
                    assert torch.equal(_bits(a.residual(name)), _bits(b.residual(name)))
        assert sorted(tw[0].state_dict()["state"]) == sorted(bk[0].state_dict()["state"])


@pytest.mark.parametrize("spec", ["laplace_topk:density=0.05", "laplace_topk:density=0.01,tol=0.05"])
def test_bucketed_laplace_topk_counts_per_tensor_within_tolerance(spec):
    """Through compress_bucket (on the CPU: each tensor's own selection), and the
    segmented search itself (one search for the bucket, as on CUDA)."""
    c = hvd_compress.from_spec(spec)
    for step, names, lay, ref, got, tw, bk, sent in _steps(spec):
        flat = torch.from_numpy(np.random.default_rng(step).laplace(size=lay.total)
                                .astype(np.float32)) * torch.repeat_interleave(
            torch.tensor([1.0, 100.0, 1e-3, 5.0, 1.0]), torch.tensor(lay.numels))
        for idx in (sent[0][0][-1], c.select_segmented(flat, lay, torch_ops)):
            assert torch.unique(idx).numel() == idx.numel()
            for off, n in zip(lay.offsets, lay.numels):
                count = int(((idx >= off) & (idx < off + n)).sum())
                k = c.k(n)
                assert abs(count - k) <= c.tol * k + 1, (step, n, count, k)


@pytest.mark.parametrize("spec", ["laplace_topk:density=0.03,exact=1",
                                  "laplace_topk:density=0.01,tol=0.05"])
def test_tensorflow_segmented_search_equals_torch(spec):
    """The bucket search written once: TensorFlow (eager and tf.function, its per-tensor
    k and slack graph constants) selects what PyTorch selects."""
    tf = pytest.importorskip("tensorflow")
    from hvd_compress.ops import tf_ops
    lengths = [1, 30, 5000, 7, 20_000]
    lay = buckets.layout([f"t{i}" for i in range(len(lengths))], [(n,) for n in lengths])
    x = data(lengths, seed=9).cpu()
    c = hvd_compress.from_spec(spec)
    want = sorted(c.select_segmented(x, lay, torch_ops).tolist())
    eager = c.select_segmented(tf.constant(x.numpy()), lay, tf_ops)
    graph = tf.function(lambda t: c.select_segmented(t, lay, tf_ops))(tf.constant(x.numpy()))
    assert sorted(eager.numpy().tolist()) == want
    assert sorted(graph.numpy().tolist()) == want


def test_segmented_exact_search_is_the_k_largest_of_each_tensor():
    lengths = [1, 30, 5000, 7, 20_000]
    lay = buckets.layout([f"t{i}" for i in range(len(lengths))], [(n,) for n in lengths])
    x = torch.round(data(lengths, seed=5).cpu() * 8) / 8           # many ties
    c = hvd_compress.from_spec("laplace_topk:density=0.03,exact=1")
    idx = c.select_segmented(x, lay, torch_ops).long()
    for off, n in zip(lay.offsets, lay.numels):
        part = x[off:off + n].abs()
        mine = idx[(idx >= off) & (idx < off + n)] - off
        order = np.argsort(-part.numpy(), kind="stable")[:c.k(n)]  # ties: lowest index first
        assert sorted(mine.tolist()) == sorted(order.tolist())


def test_nonfinite_in_a_bucket_sends_it_whole_and_keeps_residuals():
    for step, names, lay, ref, got, tw, bk, sent in _steps("topk:density=0.1", steps=3,
                                                           nonfinite_step=1):
        if step == 0:
            before = [bk[0].residual(n).clone() for n in names]
        if step == 1:
            assert sent[0][0][-1].numel() == lay.total                 # every index
            assert torch.isnan(got[0][1, 2])
            for n, r in zip(names, before):
                assert torch.equal(bk[0].residual(n), r)


def test_checkpoint_moves_between_paths():
    spec = "laplace_topk:density=0.1,exact=1"
    runs = list(_steps(spec, steps=2))
    bucketed = runs[-1][6][0]
    state = bucketed.state_dict()
    tensorwise = hvd_compress.from_spec(spec)
    tensorwise.load_state_dict(state)
    for name in runs[-1][1]:
        assert torch.equal(tensorwise.residual(name), bucketed.residual(name))
