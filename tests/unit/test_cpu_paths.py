"""The vectorised CPU paths are bit-identical to the torch references they replace
(which are also what the Triton kernels are tested against), on random, tied, signed-zero,
subnormal, extreme and edge-size inputs; and error feedback's in-place buffers give the
same bits as the out-of-place update, step after step, for every compressor family."""
import numpy as np
import pytest
import torch

import hvd_compress
from hvd_compress.kernels import rangefloat as R, twobit as T
from hvd_compress.memory import ResidualMemory
from hvd_compress.stores import TorchStore
from hvd_compress.ops import torch_ops

SIZES = [1, 3, 15, 16, 17, 255, 1000, 4099]


def bits(t):
    if not t.is_floating_point():
        return t
    return t.contiguous().view(torch.int32 if t.element_size() == 4 else torch.int16)


def inputs(n, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.laplace(size=n).astype(np.float32) * np.float32(10.0 ** rng.integers(-20, 3))
    yield "laplace", torch.from_numpy(x)
    yield "ties", torch.from_numpy(np.round(x * 4) / 4)
    z = x.copy()
    specials = np.array([0.0, -0.0, 1e-45, -1e-45, 1e-38, 3.0e38, -3.0e38, 1.0, -1.0],
                        dtype=np.float32)
    z[:min(n, specials.size)] = specials[:min(n, specials.size)]
    yield "specials", torch.from_numpy(z)


@pytest.mark.parametrize("n", SIZES)
def test_twobit_pack_and_unpack_match_reference(n):
    for _, x in inputs(n):
        for t in (float(x.abs().mean()) or 1.0, 0.25, 1e30):
            words = T.pack_cpu(x, t)
            assert torch.equal(words, T.pack_reference(x, t))
            assert torch.equal(bits(T.unpack_cpu(words)), bits(T.unpack_reference(words)))
    half = torch.randn(n).half()
    assert torch.equal(T.pack_cpu(half, 0.5), T.pack_reference(half, 0.5))


@pytest.mark.parametrize("n", SIZES + [4 * T.PAIR_TABLE_FROM + 5])   # last: the pair table
@pytest.mark.parametrize("ranks", [1, 2, 3, 5])
def test_twobit_decode_sum_matches_reference(n, ranks):
    xs = [torch.randn(n) for _ in range(ranks)]
    words = torch.cat([T.pack_cpu(x, 0.5) for x in xs])
    for scale in (torch.rand(ranks) + 0.1, -torch.rand(ranks)):      # negative: malformed
        per = -(-n // 16) * 16
        signs = T.unpack_reference(words).reshape(-1, per)[:, :n]
        want = (signs * scale[:, None]).reshape(-1).reshape(-1, n).sum(0)
        assert torch.equal(bits(T.unpack_cpu(words, scale=scale, n=n)), bits(want))


@pytest.mark.parametrize("width", sorted(R.SPLITS))
@pytest.mark.parametrize("n", SIZES)
def test_rangefloat_encode_and_decode_match_reference(width, n):
    e, m = R.SPLITS[width]
    g, nb = R.group(width)
    for _, x in inputs(n, seed=width):
        for emax in (R.max_exponent(x), torch.tensor(127), torch.tensor(-126), torch.tensor(3)):
            data = R.encode_cpu(x, emax, e, m)
            assert torch.equal(data, R.encode_reference(x, emax, e, m))
            per_group = torch.full((data.numel() // nb,), int(emax), dtype=torch.int32)
            assert torch.equal(bits(R.decode_cpu(data, per_group, e, m)),
                               bits(R.decode_reference(data, per_group, e, m)))


@pytest.mark.parametrize("width", sorted(R.SPLITS))
def test_rangefloat_non_finite_and_random_bytes(width):
    e, m = R.SPLITS[width]
    g, nb = R.group(width)
    x = torch.randn(100)
    x[3], x[7], x[11] = float("nan"), float("inf"), -float("inf")
    emax = R.max_exponent(x)
    assert int(emax) == 128                              # the reference runs: NaN stays NaN
    assert torch.equal(R.encode_cpu(x, emax, e, m), R.encode_reference(x, emax, e, m))
    nan_low = torch.tensor([0x7F800001, 0x7FC00000, -0x00800000], dtype=torch.int32)
    for emax in (torch.tensor(127), torch.tensor(128), torch.tensor(129)):
        xs = nan_low.view(torch.float32)
        assert torch.equal(R.encode_cpu(xs, emax, e, m), R.encode_reference(xs, emax, e, m))
    rng = np.random.default_rng(width)                   # every code, several exponents
    data = torch.from_numpy(rng.integers(0, 256, size=nb * 600, dtype=np.uint8))
    per_group = torch.from_numpy(np.repeat([-120, 5, 5, 128, 40, -3], 100).astype(np.int32))
    assert torch.equal(bits(R.decode_cpu(data, per_group, e, m)),
                       bits(R.decode_reference(data, per_group, e, m)))


@pytest.mark.parametrize("width", sorted(R.SPLITS))
def test_rangefloat_codec_decode_of_several_ranks_is_the_generic_decode(width):
    from hvd_compress.compressors.rangefloat import RangeFloatCodec
    codec = RangeFloatCodec(width)
    parts = [codec.encode(torch.randn(n) * s, torch_ops) for n, s in ((7, 1e-3), (0, 1), (13, 50))]
    data = torch.cat([p[0] for p in parts])
    headers = torch.cat([p[1] for p in parts])
    fast = codec.decode(data, headers, torch_ops)
    h = headers.reshape(-1, 2)
    emax, counts = h[:, 0], h[:, 1]
    groups = (counts + codec.per_group - 1) // codec.per_group
    values = R.decode_reference(data, torch.repeat_interleave(emax, groups), codec.e, codec.m)
    padded = groups * codec.per_group
    keep = torch.cat([torch.arange(p) < c for p, c in zip(padded.tolist(), counts.tolist())])
    assert torch.equal(bits(fast), bits(values[keep]))


SPECS = ["topk:density=0.05", "laplace_topk:density=0.05", "randomk:density=0.05",
         "threshold:threshold=0.5", "dgc:density=0.05", "twobit", "rangefloat:bits=8",
         "rangefloat:bits=4", "dct:density=0.05,block=32", "kernel_select",
         "topk:density=0.05,values=rangefloat8", "none:ef=1", "fp16:ef=1"]


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_in_place_error_feedback_equals_out_of_place(spec, dtype):
    fast, slow = hvd_compress.from_spec(spec), hvd_compress.from_spec(spec)
    slow.payload_is_copy = False                     # the out-of-place path of before
    if hasattr(slow, "sparse_residual"):
        slow.sparse_residual = False                 # dense decode, then subtract
    rng = np.random.default_rng(1)
    for step in range(4):
        g = torch.from_numpy(rng.laplace(size=(8, 4, 3, 3)).astype(np.float32)).to(dtype)
        if step == 2:
            g[0, 0, 0, 0] = float("nan")             # residual must be left as it was
        pa, ctx = fast.compress(g, "w")
        pb, _ = slow.compress(g, "w")
        pa = pa if isinstance(pa, tuple) else (pa,)
        pb = pb if isinstance(pb, tuple) else (pb,)
        for a, b in zip(pa, pb):
            assert torch.equal(bits(a), bits(b)), (spec, step)
        if fast.ef:
            assert torch.equal(bits(fast.residual("w")), bits(slow.residual("w"))), (spec, step)
    if fast.ef:                                      # checkpoints carry the same state
        a, b = fast.state_dict()["state"], slow.state_dict()["state"]
        assert set(a) == set(b)
        assert all(torch.equal(bits(a[k]), bits(b[k])) for k in a)


def test_payload_of_none_with_error_feedback_is_not_overwritten():
    c = hvd_compress.from_spec("none:ef=1")
    g = torch.randn(100)
    payload, ctx = c.compress(g, "g")
    assert torch.equal(payload, g)                   # the payload survives the update
    assert not c.residual("g").any()


def test_residual_buffers_are_reused_without_allocation_per_step():
    store = TorchStore()
    mem = ResidualMemory(store, torch_ops, reuse=True)
    g = torch.randn(1000)
    ptrs = set()
    for _ in range(4):
        c = mem.compensate("g", g)
        mem.update("g", c, lambda cc, inplace: torch_ops.subtract(cc, 0.5 * cc, inplace), True)
        ptrs.add(store.get("residual/g", None).data_ptr())
    assert len(ptrs) == 2                            # two buffers, swapped every step


@pytest.mark.parametrize("n", [1, 17, 1000])
def test_shared_primitives_agree_between_frameworks(n):
    tf = pytest.importorskip("tensorflow")
    from hvd_compress.ops import tf_ops
    from hvd_compress.compressors.base import Ctx
    xs = [torch.randn(n) for _ in range(3)]
    words = torch.cat([T.pack_cpu(x, 0.5) for x in xs])
    thr = torch.rand(3) + 0.1
    twobit, ctx = hvd_compress.from_spec("twobit"), Ctx((n,), torch.float32, n, "w")
    got_torch = twobit.decode((words, thr), ctx, torch_ops)          # table-lookup path
    got_tf = twobit.decode((tf.constant(words.numpy()), tf.constant(thr.numpy())), ctx,
                           tf_ops)                                  # generic path
    np.testing.assert_array_equal(got_torch.numpy(), got_tf.numpy())
    c = torch.randn(n)
    idx = torch.from_numpy(np.random.default_rng(0).choice(n, max(1, n // 3), replace=False)
                           .astype(np.int32))
    vals = c[idx.long()] * 0.5
    got_torch = torch_ops.subtract_at(c, idx, vals)
    got_tf = tf_ops.subtract_at(tf.constant(c.numpy()), tf.constant(idx.numpy()),
                                tf.constant(vals.numpy()))
    np.testing.assert_array_equal(got_torch.numpy(), got_tf.numpy())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_subtract_at_is_the_dense_subtraction_bit_for_bit(dtype, index_dtype):
    """Error feedback's residual of a sparse payload (``ops.subtract_at``, one
    ``index_add_`` of ``0.0 + v``, ``alpha=-1``): the bits of ``a - cast(scatter_sum(...))``, signed
    zeros, subnormals and Inf on either side included (a NaN stays a NaN; its sign bit is
    the hardware's); ``a`` untouched unless in place."""
    from hvd_compress.ops import torch_ops
    special = [0.0, -0.0, float("nan"), float("inf"), -float("inf"), 1e-40, -3.5, 1e-3]
    a = torch.tensor(special * 7 + [2.0] * 11).to(dtype)
    n = a.numel()
    idx = torch.arange(0, n, 2, dtype=index_dtype)
    v = torch.tensor((special * 7)[:idx.numel()][::-1]).to(dtype)
    v[::5] = a[idx[::5].long()]                                  # own values: c - c
    a[0], v[0] = -0.0, -0.0              # -0.0 - (0.0 + -0.0) is -0.0; -0.0 - -0.0 is +0.0
    dense = a - torch_ops.scatter_sum(n, idx, v).to(dtype)
    bits = torch.int32 if dtype == torch.float32 else torch.int16

    def same(x, y):
        return torch.equal(x.isnan(), y.isnan()) and torch.equal(
            x.nan_to_num(0.0).view(bits), y.nan_to_num(0.0).view(bits))
    before = a.clone()
    got = torch_ops.subtract_at(a, idx, v)
    assert same(got, dense) and same(a, before)
    assert not same(got, before)                                 # (it did subtract)
    assert torch_ops.subtract_at(a, idx, v, inplace=True) is a and same(a, dense)


def test_twobit_pack_of_nan_and_inf_across_numpy_chunks():
    """numpy's compares in 64K chunks: NaN gets code 0, +-Inf +-1, as in the reference."""
    from hvd_compress.kernels.compact import NUMPY_CHUNK
    n = 2 * NUMPY_CHUNK + 21
    x = torch.from_numpy(np.random.default_rng(9).laplace(size=n).astype(np.float32))
    x[[0, NUMPY_CHUNK - 1, NUMPY_CHUNK, n - 1]] = torch.tensor(
        [float("nan"), float("inf"), -float("inf"), float("nan")])
    for t in (0.5, torch.tensor(0.5), torch.tensor([0.5]), float("inf")):
        assert torch.equal(T.pack_cpu(x, t), T.pack_reference(x, t))


def test_twobit_residual_without_decoding_is_the_decode_subtract_bit_for_bit():
    """Error feedback's ``c - decode(pack(c, t))`` from ``c`` and ``t`` alone, per tensor
    of a bucket, across numpy's chunks, with ties at +-t, -0.0, NaN and +-Inf; also for
    NaN and Inf thresholds (a non-finite tensor's scale, a sum that overflowed)."""
    from hvd_compress.kernels.compact import NUMPY_CHUNK
    numels = (5, NUMPY_CHUNK + 7, 1000, 1)
    rng = np.random.default_rng(10)
    c = torch.from_numpy(rng.laplace(size=sum(numels)).astype(np.float32))
    c[:4] = torch.tensor([0.5, -0.5, -0.0, float("inf")])          # ties at +-t
    c[[10, 20]] = torch.tensor([float("nan"), -float("inf")])
    nan, inf = float("nan"), float("inf")
    for ts in (torch.tensor([0.5, 0.25, 2.0, 0.1]), torch.tensor([nan, 0.25, inf, 0.1])):
        want, off = [], 0
        for n, t in zip(numels, ts):
            seg = c[off:off + n]
            want.append(seg - T.unpack_cpu(T.pack_cpu(seg, t), scale=t.reshape(1), n=n))
            off += n
        want = torch.cat(want)
        got = T.subtract_own_cpu(c, ts, numels)
        assert torch.equal(bits(got), bits(want)) and got.data_ptr() != c.data_ptr()
        same = c.clone()
        assert T.subtract_own_cpu(same, ts, numels, inplace=True).data_ptr() == same.data_ptr()
        assert torch.equal(bits(same), bits(want))


def test_twobit_error_feedback_is_the_same_on_the_fast_path_and_the_generic_one(monkeypatch):
    from hvd_compress.buckets import layout
    from hvd_compress.ops import torch_ops
    from hvd_compress.spec import from_spec
    lay = layout(["a", "b"], [(300,), (70_000,)])
    grads = [torch.from_numpy(np.random.default_rng(s).laplace(size=lay.total).astype(np.float32))
             for s in range(3)]

    def run():
        c = from_spec("twobit")
        payloads = [c.compress_bucket(g.clone(), lay)[0] for g in grads]
        return payloads, c.state_dict()["state"]

    fast_payloads, fast_state = run()
    monkeypatch.setattr(torch_ops, "twobit_subtract_own", lambda *a: None)
    slow_payloads, slow_state = run()
    for f, s in zip(fast_payloads, slow_payloads):
        assert all(torch.equal(a, b) for a, b in zip(f, s))
    assert fast_state.keys() == slow_state.keys()
    for key in fast_state:
        assert torch.equal(bits(fast_state[key]), bits(slow_state[key])), key


def test_twobit_subtract_own_leaves_what_it_cannot_do_in_place_to_the_generic_path():
    from hvd_compress.ops import torch_ops
    c = torch.randn(64, 2)
    t = torch.tensor([0.5])
    assert torch_ops.twobit_subtract_own(c.t(), t, (128,), True) is None       # strided
    assert torch_ops.twobit_subtract_own(c.reshape(-1).half(), t, (128,), True) is None
    assert torch_ops.twobit_subtract_own(c.reshape(-1), t, (128,), True) is not None


def _low_rank_pairs(seed=0, shapes=((7, 2, 5), (1, 1, 9), (40, 4, 33))):
    rng = np.random.default_rng(seed)
    return [(torch.from_numpy(rng.standard_normal((rows, r)).astype(np.float32)),
             torch.from_numpy(rng.standard_normal((cols, r)).astype(np.float32)))
            for rows, r, cols in shapes]


def test_low_rank_products_write_each_product_into_its_place():
    """PowerSGD's ``P^ Q^T`` of every tensor of a bucket, written into one flat tensor:
    the same bits as each ``a @ b^T`` flattened and concatenated."""
    pairs = _low_rank_pairs()
    expected = torch.cat([(a @ b.t()).reshape(-1) for a, b in pairs])
    got = torch_ops.low_rank_products(pairs)
    assert got.dtype == torch.float32 and torch.equal(bits(got), bits(expected))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("inplace", [False, True])
def test_subtract_low_rank_products_equals_the_subtraction_of_the_product(dtype, inplace):
    """PowerSGD's residual ``c - P^ Q_w^T`` (float32: one addmm per tensor, no product
    tensor) equals ``c - cast(products)``; in place it is ``c``'s own buffer, else ``c``
    is left as it was."""
    pairs = _low_rank_pairs(1)
    n = sum(a.shape[0] * b.shape[0] for a, b in pairs)
    c = torch.from_numpy(np.random.default_rng(2).standard_normal(n).astype(np.float32))
    c = c.to(dtype)
    before = c.clone()
    expected = before - torch_ops.low_rank_products(pairs).to(dtype)
    got = torch_ops.subtract_low_rank_products(c, pairs, inplace)
    assert got.dtype == dtype
    if dtype == torch.float32:
        np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(bits(got), bits(expected))
    assert (got.data_ptr() == c.data_ptr()) == inplace
    if not inplace:
        assert torch.equal(bits(c), bits(before))


def test_low_rank_products_agree_between_frameworks():
    tf = pytest.importorskip("tensorflow")
    from hvd_compress.ops import tf_ops
    pairs = _low_rank_pairs(3)
    tf_pairs = [(tf.constant(a.numpy()), tf.constant(b.numpy())) for a, b in pairs]
    np.testing.assert_allclose(tf_ops.low_rank_products(tf_pairs).numpy(),
                               torch_ops.low_rank_products(pairs).numpy(), rtol=1e-5, atol=1e-5)
    n = sum(a.shape[0] * b.shape[0] for a, b in pairs)
    c = np.random.default_rng(4).standard_normal(n).astype(np.float32)
    np.testing.assert_allclose(
        tf_ops.subtract_low_rank_products(tf.constant(c), tf_pairs).numpy(),
        torch_ops.subtract_low_rank_products(torch.from_numpy(c), pairs).numpy(),
        rtol=1e-5, atol=1e-5)
