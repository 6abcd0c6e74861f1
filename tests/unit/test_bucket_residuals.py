"""A bucket's residuals found as one buffer (``ResidualMemory._residuals``): after a
step, the next step of the same bucket takes its residuals without fetching and checking
each tensor's, as long as the store still holds the views that step stored.  These tests
change the store between steps in every way a user can (a restored checkpoint, a step
undone by a journal, a tensor compressed alone, a residual removed) and check that the
next step then equals a compressor that starts from the same state with nothing
remembered.  On the torch path and on the kernel path (Triton's interpreter on the CPU).
"""
import numpy as np
import pytest
import torch

import hvd_compress
from hvd_compress import buckets
from hvd_compress.stores import Journal

import counting  # tests/counting.py

SPECS = ["twobit", "topk:density=0.1", "qsgd:ef=1", "rangefloat:bits=8", "onebit"]
LAY = buckets.layout(["a", "b", "c"], [(40,), (7, 3), (129,)])


def grad(step):
    rng = np.random.default_rng(100 + step)
    return torch.from_numpy(rng.laplace(size=LAY.total).astype(np.float32))


def exchange(c, step):
    """This rank's payload of ``step`` and its residuals, copied."""
    payload, _ = c.compress_bucket(grad(step), LAY)
    payload = payload if isinstance(payload, tuple) else (payload,)
    return [p.clone() for p in payload], [c.residual(n).clone() for n in LAY.names]


def after_steps(spec, steps=3):
    """A compressor that has exchanged ``steps`` bucket steps (its store remembers the
    last one's residual buffer)."""
    c = hvd_compress.from_spec(spec)
    for step in range(steps):
        exchange(c, step)
    return c


def fresh(state):
    c = hvd_compress.from_spec(state["spec"])
    c.load_state_dict(state)
    return c


def assert_same(got, want):
    for a, b in zip(got[0] + got[1], want[0] + want[1]):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.fixture(params=["torch", "triton"])
def backend(request, monkeypatch):
    monkeypatch.setenv("HVD_COMPRESS_BACKEND", request.param)
    return request.param


@pytest.mark.parametrize("spec", SPECS)
def test_a_restored_checkpoint_replaces_the_remembered_residuals(spec, backend):
    c = after_steps(spec, 2)
    saved = c.state_dict()
    exchange(c, 2)                                    # the store moves on, and remembers
    c.load_state_dict(saved)
    assert_same(exchange(c, 3), exchange(fresh(saved), 3))


@pytest.mark.parametrize("spec", SPECS)
def test_a_step_undone_by_the_journal_is_forgotten(spec, backend):
    c = after_steps(spec, 2)
    saved = c.state_dict()
    journal = Journal()
    c.attach_journal(journal)
    exchange(c, 2)
    journal.rollback()
    assert_same(exchange(c, 3), exchange(fresh(saved), 3))


@pytest.mark.parametrize("spec", SPECS)
def test_a_tensor_compressed_alone_between_bucket_steps(spec, backend):
    """The bucket's tensor ``b`` compressed on its own stores a residual of its own; the
    next bucket step must start from it, not from the bucket's buffer."""
    c = after_steps(spec, 2)
    c.compress(torch.linspace(-3, 3, 21).reshape(7, 3), "b")
    saved = c.state_dict()
    assert_same(exchange(c, 2), exchange(fresh(saved), 2))


def test_a_residual_removed_from_the_store_starts_again_from_zero(backend):
    c = after_steps("twobit", 2)
    ref = fresh(c.state_dict())
    for each in (c, ref):                  # ref: the same state, with nothing remembered
        assert each._store.pop("residual/b") is not None
    assert_same(exchange(c, 2), exchange(ref, 2))


def test_steady_state_residuals_are_views_of_one_buffer(backend):
    """What makes the next step cheap: each tensor's residual is a view of one buffer,
    in the bucket's order."""
    c = after_steps("twobit")
    views = [c._store._tensors["residual/" + n] for n in LAY.names]
    base = views[0]._base
    assert base is not None and all(v._base is base for v in views)
    assert [v.data_ptr() for v in views] == [base.data_ptr() + 4 * o for o in LAY.offsets]


def test_a_new_bucketing_of_the_same_tensors_forgets_the_old_one(backend):
    """Buckets re-planned (DDP's rebuild, auto, elastic): the store remembers only the
    current bucket of each tensor, so an old bucket's buffer is not kept alive."""
    c = after_steps("twobit", 2)
    other = buckets.layout(["c", "a"], [(129,), (40,)])
    g = grad(5)
    c.compress_bucket(torch.cat([g[LAY.offsets[2]:], g[:40]]), other)
    c.compress_bucket(torch.cat([g[LAY.offsets[2]:], g[:40]]), other)
    assert len(c._store.buckets) == 1
    ref = fresh(c.state_dict())
    assert_same(exchange(c, 2), exchange(ref, 2))


@pytest.mark.parametrize("spec", ["rangefloat:bits=8", "rangefloat:bits=12", "rangefloat:bits=4",
                                  "topk:density=0.1,values=rangefloat8",
                                  "topk:density=0.1,values=rangefloat12",
                                  "twobit:threshold=0.5", "twobit:threshold=1.5,ef=1"])
def test_residuals_the_encode_writes_are_the_decoded_payload_subtracted(spec, monkeypatch):
    """On the kernel path the range-float encode and twobit's pack write error feedback's
    residual (or a sparsifier's decoded values) in their own launch; the residuals,
    payloads and the aggregate are those of the torch path, which decodes its own
    payload and subtracts it, bit for bit, over three steps (the last with NaN in one
    tensor: the bucket keeps its old residuals; a sparsifier sends it whole).  (twobit's
    adaptive threshold sums in another order on each path: the next test.)"""
    runs = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("HVD_COMPRESS_BACKEND", backend)
        c, got = hvd_compress.from_spec(spec), []
        for step in range(3):
            g = grad(step)
            if step == 2:
                g[45] = float("nan")
            payload, ctx = c.compress_bucket(g, LAY)
            summed = c.decompress_bucket(tuple(torch.cat([p, p]) for p in payload), ctx)
            got.append(([p.clone() for p in payload], summed.clone(),
                        [c.residual(n).clone() for n in LAY.names]))
        runs[backend] = got
    for (pa, sa, ra), (pb, sb, rb) in zip(runs["torch"], runs["triton"]):
        assert all(_same(a, b) for a, b in zip(pa, pb))                # (NaN scales)
        assert _same(sa, sb) and all(_same(a, b) for a, b in zip(ra, rb))


def _same(a, b):
    """Same dtype and bits, NaN where the other is NaN (of any payload)."""
    if a.dtype != b.dtype or not torch.equal(a.isnan(), b.isnan()):
        return False
    a, b = a.nan_to_num(), b.nan_to_num()
    return torch.equal(a.view(torch.int32), b.view(torch.int32)) if a.dtype == torch.float32 \
        else torch.equal(a, b)


@pytest.mark.parametrize("spec", ["rangefloat:bits=8", "rangefloat:bits=6", "rangefloat:bits=16",
                                  "twobit", "twobit:scale=2", "dct:density=0.05,block=32",
                                  "laplace_topk:density=0.05,fused=1,values=rangefloat8",
                                  "laplace_topk:density=0.05,fused=1",
                                  "laplace_topk:density=0.05,fused=1,exact=1"])
@pytest.mark.parametrize("alone", [False, True])
def test_folded_error_feedback_equals_the_decode_and_subtraction(spec, alone, monkeypatch):
    """On the kernel path, the residual or decoded values that the encode's launch
    writes (and, for twobit's, range-float's and the fused search's buckets, ``c = g + r``
    added by their first pass; the fused search's write pass gathers the sent values,
    counts them per tensor and, for float values, writes +0.0 over them in ``c``) give the
    residuals, payloads and aggregates of the same kernel path with the folds turned off
    (error feedback adds the residuals, then decodes its own payload and subtracts), bit
    for bit over three steps, NaN in the last; a bucket, and each tensor compressed alone
    (``compress``: the one-tensor residual's spare buffer, into which the first pass
    writes ``c`` from the gradient and the residual; the gradient left as it was)."""
    from hvd_compress.compressors.laplace import LaplaceTopK
    from hvd_compress.compressors.quantize import TwoBit
    from hvd_compress.compressors.rangefloat import RangeFloat
    from hvd_compress.ops import torch_ops
    monkeypatch.setenv("HVD_COMPRESS_BACKEND", "triton")
    encode = torch_ops.rangefloat_encode_segments
    runs, launched, adds, moved = {}, {}, {}, {}
    for fold in (True, False):
        if not fold:
            monkeypatch.setattr(TwoBit, "writes_residual", False)
            monkeypatch.setattr(LaplaceTopK, "writes_residual", False)
            for cls in (TwoBit, LaplaceTopK, RangeFloat):
                monkeypatch.setattr(cls, "adds_residual", lambda *a: False)
            monkeypatch.setattr(torch_ops, "rangefloat_encode_segments",       # asks nothing
                                lambda v, c, n, e, m, write=None, add=None, source=None:
                                (*encode(v, c, n, e, m, None, add, source), None) if write
                                else encode(v, c, n, e, m, None, add, source))
        c, got = hvd_compress.from_spec(spec), []
        from hvd_compress.kernels import counting_launches
        with counting_launches() as launched[fold], counting.CountOps() as ops:
            for step in range(3):
                g = grad(step)
                if step == 2:
                    g[45] = float("nan")
                pieces = [(g, LAY)] if not alone else [
                    (p, buckets.layout([n], [(p.numel(),)])) for n, p in
                    zip(LAY.names, torch.split(g, LAY.numels))]
                for flat, lay in pieces:
                    if alone:        # (the gradient is read, never written: unchanged)
                        mine = flat.clone()
                        payload, ctx = c.compress(mine, lay.names[0])
                        assert _same(mine, flat)
                    else:
                        payload, ctx = c.compress_bucket(flat, lay)
                    two = tuple(torch.cat([p, p]) for p in payload)
                    got.append(([p.clone() for p in payload], c.decompress(two, ctx).clone()))
                got.append([c.residual(n).clone() for n in LAY.names])
        runs[fold] = got
        adds[fold] = sum(v for k, v in ops.ops.items() if k.startswith("aten.add"))
        moved[fold] = sum(v for k, v in ops.ops.items()             # gathers and scatters
                          if k.startswith(("aten.index_select", "aten.index_add")))
    if spec.startswith(("rangefloat", "twobit")):
        fewer = True
    elif "values=" in spec or spec.startswith("dct"):
        fewer = not alone        # (a lone tensor: one exponent range, the one-tensor codec)
    else:
        fewer = False            # (laplace_topk: the residuals' addition, an op, not a launch)
    assert (sum(launched[True].values()) < sum(launched[False].values())) == fewer, launched
    # the fused search's write pass gathers the values (and counts them per tensor), and
    # for float values writes c - sent, so that nothing is scattered (no 0.0 + v either)
    band = spec.startswith("laplace_topk")
    assert (moved[True] < moved[False]) == band, moved
    if not spec.startswith("dct"):  # c = g + r in the first pass (a tensor alone's too)
        assert adds[True] < adds[False], adds
    for a, b in zip(runs[True], runs[False]):
        if isinstance(a, tuple):
            assert all(_same(x, y) for x, y in zip(a[0], b[0])) and _same(a[1], b[1])
        else:
            assert all(_same(x, y) for x, y in zip(a, b))
