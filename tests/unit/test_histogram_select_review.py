"""Review of laplace_topk's fused search (``fused=1``, kernels/histogram_select.py): edge
cases of the bracket arithmetic in bit space, NaN/Inf and error feedback, and the host
synchronisations of a bucket compress.  Both backends: the torch references and the
kernels (forced with HVD_COMPRESS_BACKEND=triton, run by Triton's interpreter on the CPU,
TRITON_INTERPRET=1 being set by conftest.py)."""
import math

import numpy as np
import pytest
import torch

from hvd_compress.buckets import layout
from hvd_compress.compressors.fused_search import HISTOGRAM_PASSES, select_histogram
from hvd_compress.kernels import band_compact as B
from hvd_compress.kernels import histogram_select as H
from hvd_compress.ops import torch_ops
from hvd_compress.spec import from_spec

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FLT_MAX = float(np.finfo(np.float32).max)
DENORMAL = float(np.float32(1e-42))             # a float32 denormal (bits 0x000003e7)


def brute_topk(x, lay, k_of):
    """Per tensor: the k largest magnitudes, ties by lowest index, zeros dropped."""
    out = []
    for off, n in zip(lay.offsets, lay.numels):
        a = x[off:off + n].float().abs()
        order = torch.sort(-a, stable=True).indices[:k_of(n)]
        order = order[a[order] > 0]
        out.append(order.sort().values + off)
    return torch.cat(out).to(torch.int32)


def edge_buckets():
    """name -> (Layout, flat float32 tensor)."""
    rng = np.random.default_rng(7)
    cases = {}

    def add(name, parts):
        lay = layout([f"{name}{i}" for i in range(len(parts))], [(len(p),) for p in parts])
        cases[name] = (lay, torch.tensor(np.concatenate(parts).astype(np.float32), device=DEVICE))

    lap = lambda n: rng.laplace(size=n)                                   # noqa: E731
    add("all_equal", [np.full(1000, 1.0), lap(800), np.full(3, -2.5)])   # t0/2 > max: lo > hi
    add("all_zero", [np.zeros(500), lap(700), np.zeros(1)])
    add("few_nonzero", [np.where(np.arange(900) % 300 == 0, 1.0, 0.0), lap(600)])
    add("denormal", [np.full(400, DENORMAL) * (1 + np.arange(400) % 3), lap(300)])
    add("neg_zero", [np.concatenate([np.full(300, -0.0), lap(200)]), np.full(50, -0.0)])
    add("near_flt_max", [np.concatenate([[-FLT_MAX * 0.9], lap(1000) * 1e-3]), [FLT_MAX] + [0.0] * 63])
    add("one_element", [[3.0], [-0.0], [DENORMAL], lap(129)])
    add("ties_at_k", [np.sign(lap(2000)) * rng.integers(1, 3, 2000), lap(256)])
    add("tiny_scale", [lap(1500) * 1e-38, lap(1500) * 1e30])
    return cases


EDGES = edge_buckets()


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("name", sorted(EDGES))
@pytest.mark.parametrize("density", [0.01, 0.5, 1.0])
def test_fused_exact_is_brute_force_topk_on_edge_cases(monkeypatch, backend, name, density):
    """exact=1: the k largest per tensor (ties by index, zeros dropped); tolerance mode:
    every tensor's count within floor(tol * k) of min(k, nonzero) and no unsent
    magnitude above a sent one."""
    monkeypatch.setenv("HVD_COMPRESS_BACKEND", backend)
    lay, x = EDGES[name]
    exact = from_spec(f"laplace_topk:density={density},exact=1,fused=1")
    got, finite = select_histogram(exact, x.clone(), lay, torch_ops)
    want = brute_topk(x, lay, exact.k)
    assert finite
    assert torch.equal(got.sort().values, want), (name, got.numel(), want.numel())
    tol = from_spec(f"laplace_topk:density={density},fused=1")
    idx, _ = select_histogram(tol, x.clone(), lay, torch_ops)
    assert torch.equal(idx.sort().values, idx)                       # index order
    for off, n in zip(lay.offsets, lay.numels):
        a = x[off:off + n].float().abs()
        sel = idx[(idx >= off) & (idx < off + n)].long() - off
        k = tol.k(n)
        want_count = min(k, int((a > 0).sum()))
        assert abs(sel.numel() - want_count) <= math.floor(0.01 * k), (name, off)
        assert bool((a[sel] > 0).all())                               # no zero sent
        rest = torch.ones(n, dtype=torch.bool, device=x.device)
        rest[sel] = False
        if sel.numel() and rest.any():
            assert a[sel].min() >= a[rest].max()


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("bad", ["nan", "-nan", "inf", "-inf"])
def test_non_finite_entry_sends_the_bucket_whole(monkeypatch, backend, bad):
    monkeypatch.setenv("HVD_COMPRESS_BACKEND", backend)
    lay = layout(["a", "b", "c"], [(700,), (1,), (2000,)])
    x = torch.tensor(np.random.default_rng(1).laplace(size=lay.total).astype(np.float32),
                     device=DEVICE)
    if bad == "-nan":                    # sign bit set: bits 0xffc00000
        x[900] = torch.tensor(-0x400000, dtype=torch.int32).view(torch.float32)
        assert torch.isnan(x[900]) and x[900:901].view(torch.int32).item() < 0
    else:
        x[900] = float(bad)
    idx, finite = select_histogram(from_spec("laplace_topk:density=0.01,fused=1"),
                                   x, lay, torch_ops)
    assert finite is False
    assert torch.equal(idx, torch.arange(lay.total, dtype=torch.int32, device=DEVICE))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_pick_from_a_bracket_with_lo_above_hi_and_few_nonzero(backend):
    """A start with ``lo > hi`` (the fit above the maximum) and a tensor with fewer
    nonzero entries than k: kernel = reference, the invariant c_lo >= k > c_hi (or all
    nonzero) after each pass, and the bracket collapsed after 4 passes."""
    lengths = [1000, 300, 5]
    x = torch.zeros(sum(lengths), device=DEVICE)
    x[:1000] = 1.0                                                   # all equal
    x[1000:1300:100] = torch.tensor([2.0, -3.0, 0.5])                 # 3 nonzero < k
    x[1300:] = torch.tensor([1e-40, 0.0, -0.0, 7.0, 7.0])
    k = torch.tensor([10, 5, 2], device=DEVICE)
    slack = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    blocks = H.block_table(lengths, x.device, block=256)
    lo = torch.tensor([2.0, 10.0, 8.0], device=DEVICE).view(torch.int32).long()
    hi = torch.tensor([1.0, 3.0, 7.0], device=DEVICE).view(torch.int32).long()
    state = H.search_start(lo, hi, torch.ones(3, device=DEVICE), torch.ones(3, device=DEVICE))
    ref = state.clone()
    for _ in range(4):
        h = H.segment_histogram(x, blocks, state, 2046, backend=backend)
        H.histogram_pick(h, state, k, slack, 2046, backend=backend)
        hr = H.segment_histogram_reference(x, blocks, ref, 2046)
        H.histogram_pick_reference(hr, ref, k, slack, 2046)
        assert torch.equal(state, ref)
    assert not state[H.ACTIVE].any()
    idx, finite = B.band_select(x, blocks, state, backend=backend)
    assert finite
    assert idx.tolist() == list(range(10)) + [1000, 1100, 1200, 1303, 1304]



@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_finite_bucket_whose_abs_sum_overflows_float32_keeps_error_feedback(monkeypatch, backend):
    """Finite data whose sum|g| is past float32's range (here 4 x 1e38 in one tensor):
    the non-fused path selects k entries and updates the residual; the fused path must
    not treat the bucket as non-finite (it then sends every entry and leaves the residual
    as it was, so the residual is sent again at the next step: error feedback double
    counts it)."""
    monkeypatch.setenv("HVD_COMPRESS_BACKEND", backend)
    lay = layout(["big", "small"], [(4,), (1000,)])
    rng = np.random.default_rng(3)
    g0 = torch.tensor(rng.laplace(size=lay.total).astype(np.float32), device=DEVICE)
    g = g0.clone()
    g[:4] = torch.tensor([1e38, -1e38, 1e38, 1e38])
    assert torch.isfinite(g).all() and not torch.isfinite(g.abs().sum())
    counts = {}
    for spec in ("laplace_topk:density=0.01,exact=1", "laplace_topk:density=0.01,exact=1,fused=1"):
        c = from_spec(spec)
        c.compress_bucket(g0.clone(), lay)                 # a nonzero residual
        r_before = torch.cat([c.residual(n) for n in lay.names]).clone()
        payload, ctx = c.compress_bucket(g.clone(), lay)
        sent = c.decompress_bucket(payload, ctx)
        r_after = torch.cat([c.residual(n) for n in lay.names])
        counts[spec] = payload[1].numel()
        # error feedback conserves: what is sent plus what is kept = g + old residual
        assert torch.equal(sent + r_after, g + r_before), spec
    assert len(set(counts.values())) == 1, counts


def test_bucket_search_sums_with_unchecked_segment_reduce(monkeypatch):
    """``torch.segment_reduce`` with ``lengths`` checks them with two ``.item()`` calls
    unless ``unsafe=True`` (ATen SegmentReduce.cpp): on CUDA that is 2 host
    synchronisations per call, 4 per fused compress (sum and max), on top of the one
    promised.  The block table is the package's own, so the check is not needed."""
    monkeypatch.setenv("HVD_COMPRESS_BACKEND", "triton")
    calls = []
    real = torch.segment_reduce

    def spy(*args, **kw):
        calls.append(kw.get("unsafe", False))
        return real(*args, **kw)

    monkeypatch.setattr(torch, "segment_reduce", spy)
    lay = layout(["a", "b"], [(3000,), (5000,)])
    c = from_spec("laplace_topk:density=0.01,fused=1")
    for step in range(2):
        c.compress_bucket(torch.randn(lay.total, device=DEVICE), lay)
    assert calls and all(calls), f"segment_reduce called with unsafe={calls}"

@pytest.mark.parametrize("fold", [False, True])
def test_every_pass_leaves_the_shared_counts_zero(monkeypatch, fold):
    """The passes of one search share one counts buffer (``histogram_select.
    _zeroed_counts``), each counting into rows of its own width: after every pass (its
    pick, or with ``FOLD_PICK`` each tensor's last block) the whole buffer is zero again,
    with tensors that stop being searched after the first passes and a bucket with an
    Inf (no tensor searched)."""
    from hvd_compress.compressors.fused_search import histogram_search
    monkeypatch.setenv("HVD_COMPRESS_BACKEND", "triton")
    monkeypatch.setattr(H, "FOLD_PICK", fold)
    step, seen = torch_ops.histogram_step, []

    def checked(flat, blocks, state, bins, k, slack, buffers, local=False):
        out = step(flat, blocks, state, bins, k, slack, buffers, local)
        seen.append((bins, int(state[H.ACTIVE].sum())))
        assert not buffers["counts"].any(), (bins, buffers["counts"].nonzero()[:5])
        return out
    monkeypatch.setattr(torch_ops, "histogram_step", checked)
    rng = np.random.default_rng(4)
    parts = [rng.laplace(size=9000), [2.0], rng.laplace(size=4097) * 1e-3, rng.normal(size=300)]
    lay = layout([f"z{i}" for i in range(4)], [(len(p),) for p in parts])
    x = torch.tensor(np.concatenate(parts).astype(np.float32), device=DEVICE)
    inf = x.clone()
    inf[9001 + 5] = float("inf")
    for flat in (x, inf):
        for spec in ("laplace_topk:density=0.01,fused=1",
                     "laplace_topk:density=0.3,fused=1,exact=1"):
            histogram_search(from_spec(spec), flat.clone(), lay, torch_ops)
    assert len(seen) == 4 * len(HISTOGRAM_PASSES)
    assert {b for b, _ in seen} == set(HISTOGRAM_PASSES)
    assert any(0 < active < 4 for _, active in seen)           # some tensors left the search


@pytest.mark.parametrize("spec", ["laplace_topk:density=0.01,fused=1",
                                  "laplace_topk:density=0.3,fused=1,exact=1"])
def test_pick_folded_into_the_histogram_launch_searches_the_same(monkeypatch, spec):
    """``FOLD_PICK``: each tensor's last block to finish counting makes the step; the
    state after every pass and the selection are those of a separate pick launch, for
    tensors of several blocks (block 4096) and of a single value, a bucket with an Inf,
    and the edge cases above (the counters are left zero for the next compress)."""
    from hvd_compress.compressors.fused_search import histogram_search
    monkeypatch.setenv("HVD_COMPRESS_BACKEND", "triton")
    rng = np.random.default_rng(3)
    parts = [rng.laplace(size=9000), [2.0], rng.laplace(size=4097) * 1e-3]
    lay = layout([f"m{i}" for i in range(3)], [(len(p),) for p in parts])
    x = torch.tensor(np.concatenate(parts).astype(np.float32), device=DEVICE)
    inf = x.clone()
    inf[9001 + 5] = float("inf")
    cases = [(lay, x), (lay, inf), *EDGES.values()]
    c = from_spec(spec)
    for fold in (False, True, True):          # twice: the counters were left zero
        monkeypatch.setattr(H, "FOLD_PICK", fold)
        got = [(histogram_search(c, flat.clone(), lay_, torch_ops)[1],
                select_histogram(c, flat.clone(), lay_, torch_ops)) for lay_, flat in cases]
        if not fold:
            want = got
            continue
        for (state, (idx, finite)), (w_state, (w_idx, w_finite)) in zip(got, want):
            assert torch.equal(state, w_state) and finite == w_finite
            assert torch.equal(idx, w_idx)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("spec", ["laplace_topk:density=0.05,fused=1,ef=0",
                                  "laplace_topk:density=0.05,fused=1,exact=1,ef=0"])
def test_without_error_feedback_the_callers_gradient_is_left_as_it_was(monkeypatch, backend, spec):
    """The write pass writes +0.0 over the sent entries only of a buffer that error
    feedback owns: with ``ef=0`` the caller's tensor (compress) and bucket
    (compress_bucket) keep every bit, and the payload is the selection's values."""
    monkeypatch.setenv("HVD_COMPRESS_BACKEND", backend)
    rng = np.random.default_rng(5)
    lay = layout(["a", "b"], [(300,), (700,)])
    flat = torch.tensor(rng.laplace(size=1000).astype(np.float32), device=DEVICE)
    c = from_spec(spec)
    for call in (lambda t: c.compress(t, "a"), lambda t: c.compress_bucket(t, lay)):
        t = flat.clone()
        (values, idx), _ = call(t)
        assert torch.equal(t.view(torch.int32), flat.view(torch.int32))
        assert idx.numel() > 0 and torch.equal(values, flat[idx.long()])
