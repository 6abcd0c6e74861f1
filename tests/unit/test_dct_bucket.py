"""dct on a bucket of several tensors (``segmented``): per-tensor semantics (each tensor
padded to whole blocks, its own selection and exponent range, its own residual), the
payload of tensor-by-tensor compresses with indices into the bucket's coefficient layout,
and -- where the kernels run (HVD_COMPRESS_BACKEND=triton, Triton's interpreter here:
TRITON_INTERPRET=1 from conftest.py) -- a number of kernel launches and framework ops
that does not grow with the number of tensors."""

import numpy as np
import pytest
import torch

import hvd_compress
from hvd_compress.buckets import layout
from hvd_compress.compressors.dct import padded_layout
from hvd_compress.compressors.fused_search import HISTOGRAM_PASSES

import counting  # tests/counting.py

#: a matrix, a short vector, a conv kernel, a 1-value (0-d) tensor, none a block multiple
#: but one (64 values)
SHAPES = [(30, 20), (7,), (3, 3, 4, 4), (), (1000,), (64,)]
SPEC = "dct:density=0.05,block=32"


def laplace(n, seed=0, scale=1.0):
    x = np.random.default_rng(seed).laplace(size=n) * scale
    return torch.from_numpy(x.astype(np.float32))


def grads(lay, seed):
    """One bucket of gradients with very different scales per tensor."""
    scales = torch.repeat_interleave(torch.tensor([1.0, 100.0, 1e-3, 5.0, 0.5, 2.0][:len(lay.numels)]),
                                     torch.tensor(lay.numels))
    return laplace(lay.total, seed) * scales


def aggregate(payloads):
    return tuple(torch.cat([p[i] for p in payloads]) for i in range(len(payloads[0])))


def bits(t):
    t = t.detach().contiguous()
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


def tensorwise_payload(payloads, lay, block):
    """Tensor-by-tensor payloads as one bucket payload: indices offset to the layout."""
    play = padded_layout(lay, block)
    return (torch.cat([p[0] for p in payloads]), torch.cat([p[1] for p in payloads]),
            torch.cat([p[2] + off for p, off in zip(payloads, play.offsets)]))


@pytest.fixture(params=["torch", "triton"])
def backend(request, monkeypatch):
    monkeypatch.setenv("HVD_COMPRESS_BACKEND", request.param)
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_bucket_equals_tensor_by_tensor(backend, dtype):
    if backend == "triton" and dtype == torch.bfloat16:
        pytest.skip("fp32 and fp16 suffice for the kernels' path (time under the interpreter)")
    names = [f"p{i}" for i in range(len(SHAPES))]
    lay = layout(names, SHAPES)
    tw = [hvd_compress.from_spec(SPEC) for _ in range(2)]
    bk = [hvd_compress.from_spec(SPEC) for _ in range(2)]
    assert bk[0].segmented
    for step in range(3):
        gs = [grads(lay, 10 * step + r).to(dtype) for r in range(2)]
        own, ref = [], []
        for i, (name, off, n, shape) in enumerate(zip(names, lay.offsets, lay.numels, SHAPES)):
            sent = [c.compress(g[off:off + n].reshape(shape).clone(), name) for c, g in zip(tw, gs)]
            own.append(sent[0][0])
            ref.append(tw[0].decompress(aggregate([p for p, _ in sent]), sent[0][1]))
        sent = [c.compress_bucket(g.clone(), lay) for c, g in zip(bk, gs)]
        want = tensorwise_payload(own, lay, 32)
        assert all(torch.equal(a, b) for a, b in zip(sent[0][0], want)), step
        out = bk[0].decompress_bucket(aggregate([p for p, _ in sent]), sent[0][1])
        assert out.dtype == dtype and out.shape == (lay.total,)
        for i, got in enumerate(lay.split(out, bk[0]._ops)):
            assert torch.equal(bits(got), bits(ref[i])), (step, names[i])
        for a, b in zip(tw, bk):
            for name in names:
                assert torch.equal(bits(a.residual(name)), bits(b.residual(name))), (step, name)


def test_error_feedback_conserves_the_gradient(backend):
    lay = layout(["a", "b", "c"], [(300, 20), (7,), (500,)])
    c = hvd_compress.from_spec("dct:density=0.02,block=64")
    total_in, total_sent = torch.zeros(lay.total), torch.zeros(lay.total)
    for step in range(3):
        g = grads(lay, step)
        total_in += g
        payload, ctx = c.compress_bucket(g.clone(), lay)
        total_sent += c.decompress_bucket(payload, ctx)
    resid = torch.cat([c.residual(n) for n in lay.names])
    torch.testing.assert_close(total_sent + resid, total_in, atol=2e-4, rtol=1e-5)


def one_exchange(T, spec=SPEC):
    """(Triton launches, ATen ops) of a bucket exchange of T tensors (counting.py)."""
    return counting.one_exchange(T, spec, laplace, size=100)


def test_launches_and_ops_do_not_grow_with_the_tensors_of_a_bucket(monkeypatch):
    monkeypatch.setenv("HVD_COMPRESS_BACKEND", "triton")
    l4, o4 = one_exchange(4)
    l40, o40 = one_exchange(40)
    # (27: the fused search's start and band offsets, the tables of the values'
    # segments counted on the device, and the check of the other ranks' headers are
    # launches of their own, each in place of some 17 to 35 framework ops)
    assert l4 == l40 and sum(l4.values()) <= 27, (l4, l40)
    assert l4["header_stats"] == 1
    # the bucket's DCT, and the aggregate's inverse; error feedback in the coefficient
    # domain inverts no bucket, only its tensors' last blocks (an inverse and a DCT)
    assert l4["dct_segments"] == 2 and l4["idct_segments"] == 2
    assert l4["segment_histogram_pick"] == len(HISTOGRAM_PASSES)     # (FOLD_PICK, on)
    assert sum(o4.values()) == sum(o40.values()), set(o40.items()) ^ set(o4.items())


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_tensor_sends_the_bucket_whole_and_keeps_residuals(backend, bad):
    lay = layout(["a", "b", "c"], [(100,), (40,), (7,)])
    c = hvd_compress.from_spec(SPEC)
    c.compress_bucket(grads(lay, 0), lay)
    before = [c.residual(n).clone() for n in lay.names]
    g = grads(lay, 1)
    g[110] = bad                                              # in tensor b
    payload, ctx = c.compress_bucket(g.clone(), lay)
    assert payload[2].numel() == padded_layout(lay, 32).total  # every coefficient
    assert all(torch.equal(c.residual(n), r) for n, r in zip(lay.names, before))
    a, b, cc = torch.split(c.decompress_bucket(payload, ctx), lay.numels)
    assert not torch.isfinite(b).all() and torch.isfinite(a).all() and torch.isfinite(cc).all()


def test_checkpoint_restores_the_next_payload(backend):
    lay = layout(["a", "b", "c"], [(300,), (1,), (70,)])
    c, twin = hvd_compress.from_spec(SPEC), hvd_compress.from_spec(SPEC)
    for step in range(2):
        c.compress_bucket(grads(lay, step), lay)
    twin.load_state_dict(c.state_dict())
    g = grads(lay, 7)
    a, _ = c.compress_bucket(g.clone(), lay)
    b, _ = twin.compress_bucket(g.clone(), lay)
    assert all(torch.equal(u, v) for u, v in zip(a, b))


def test_malformed_bucket_payloads_raise_value_errors():
    lay = layout(["a", "b"], [(100,), (50,)])
    c = hvd_compress.from_spec(SPEC)
    (data, headers, idx), ctx = c.compress_bucket(grads(lay, 0), lay)
    for bad, match in [((data[:-1], headers, idx), "malformed"),
                       ((data, headers[:-2], idx), "pair per tensor"),
                       ((data, headers, idx[:-1]), "values but"),
                       ((data, headers, idx * 0 + 10_000), "out of range"),
                       ((data, headers), "payload is")]:
        with pytest.raises(ValueError, match=match):
            c.decompress_bucket(bad, ctx)


def test_two_round_dct_is_not_segmented():
    c = hvd_compress.from_spec("dct:density=0.1,agg=union")
    assert not c.segmented
    with pytest.raises(TypeError):
        c.compress_bucket(torch.zeros(8), layout(["a", "b"], [(4,), (4,)]))


def test_tensorflow_bucket_equals_tensor_by_tensor():
    tf = pytest.importorskip("tensorflow")
    lay = layout([f"p{i}" for i in range(len(SHAPES))], SHAPES)
    tw, bk = hvd_compress.from_spec(SPEC), hvd_compress.from_spec(SPEC)
    for step in range(2):
        g = grads(lay, step).numpy()
        own, ref = [], []
        for name, off, n in zip(lay.names, lay.offsets, lay.numels):
            p, ctx = tw.compress(tf.constant(g[off:off + n]), name)
            own.append(p)
            ref.append(tw.decompress(p, ctx).numpy())
        payload, ctx = bk.compress_bucket(tf.constant(g), lay)
        want = tensorwise_payload([tuple(torch.from_numpy(t.numpy()) for t in p) for p in own],
                                  lay, 32)
        assert all(np.array_equal(a.numpy(), b.numpy()) for a, b in zip(payload, want))
        np.testing.assert_array_equal(bk.decompress_bucket(payload, ctx).numpy(),
                                      np.concatenate(ref))
