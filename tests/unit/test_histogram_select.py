"""laplace_topk's fused search (``fused=1``, hvd_compress/kernels/histogram_select.py):
each kernel against its torch reference (under TRITON_INTERPRET=1 on the CPU, set by
conftest.py; on CUDA tensors on a GPU), the search against the grid search, and the
number of kernel launches and framework ops of a bucket compress, which must not grow
with the number of tensors in the bucket."""
import math

import numpy as np
import pytest
import torch

from hvd_compress import kernels as K
from hvd_compress.buckets import layout
from hvd_compress.compressors.fused_search import (COARSE_BINS, HISTOGRAM_BINS, HISTOGRAM_PASSES,
                                                   WARM_FOLDED_PASSES, select_histogram)
from hvd_compress.kernels import band_compact as B
from hvd_compress.kernels import histogram_select as H
from hvd_compress.ops import torch_ops
from hvd_compress.spec import from_spec

import counting  # tests/counting.py

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LENGTHS = [5000, 1, 300, 12000, 7, 4096]


def bits(v):
    return torch.tensor(float(v)).view(torch.int32).item()


def make(kind, n, seed=0):
    rng = np.random.default_rng(seed)
    if kind == "laplace":
        x = rng.laplace(size=n)
    elif kind == "gaussian":
        x = rng.normal(size=n)
    elif kind == "student_t":
        x = rng.standard_t(2, size=n)
    elif kind == "ties":
        x = rng.integers(-3, 4, size=n).astype(float)
    elif kind == "bimodal":          # far from Laplace: the fit's bracket misses
        x = np.where(rng.random(n) < 0.5, rng.normal(size=n) * 1e-3, 100 + rng.normal(size=n))
    elif kind == "sparse":           # fewer nonzero entries than k in most tensors
        x = np.zeros(n)
        x[::997] = rng.normal(size=x[::997].size)
    return torch.from_numpy(x.astype(np.float32)).to(DEVICE)


def state_for(lengths, lo, hi, active=None):
    T = len(lengths)
    lo_t = torch.tensor(lo, dtype=torch.int64, device=DEVICE)
    hi_t = torch.tensor(hi, dtype=torch.int64, device=DEVICE)
    state = H.search_start(lo_t, hi_t, torch.ones(T, device=DEVICE), torch.ones(T, device=DEVICE))
    if active is not None:
        state[H.ACTIVE] = torch.tensor(active, device=DEVICE)
    return state


# brackets per tensor: ordinary, all-selected (-1), empty (lo > hi), zero lower end, tight
LO = [bits(0.3), -1, 0, bits(0.5), bits(9.0), bits(1.0)]
HI = [bits(2.5), -1, bits(3.0), bits(0.5), bits(1.0), bits(1.0) + 3]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bins, local", [(14, False), (2046, False), (14, True), (62, True)])
@pytest.mark.parametrize("active", [None, [1, 0, 1, 1, 0, 1]])
def test_segment_histogram_matches_reference_and_counts_above_its_edges(dtype, bins, local,
                                                                        active):
    """Both ways of counting (an atomic per entry; a histogram per block, ``local``)."""
    x = make("laplace", sum(LENGTHS)).to(dtype)
    x[7000:7100] = 0.5                           # ties on a bracket end
    x[10] = 0.0
    blocks = H.block_table(LENGTHS, x.device, block=1024)
    state = state_for(LENGTHS, LO, HI, active)
    got = H.segment_histogram(x, blocks, state, bins, backend="triton", local=local)
    want = H.segment_histogram_reference(x, blocks, state, bins)
    assert got.dtype == torch.int64 and torch.equal(got, want)
    above = torch.flip(torch.cumsum(torch.flip(want, [1]), 1), [1])   # count(> E_j)
    edges = H.histogram_edges(state[H.LO], state[H.HI], bins)
    b = x.float().abs().view(torch.int32).long()
    off = 0
    for s, n in enumerate(LENGTHS):
        seg = b[off:off + n]
        off += n
        if active is not None and not active[s]:
            assert not want[s].any()
            continue
        brute = (seg[None, :] > edges[s][:, None]).sum(1)
        assert torch.equal(above[s], brute), s


@pytest.mark.parametrize("chunk", [64, 256, 4096])
@pytest.mark.parametrize("bins, local", [(2046, False), (62, True)])
def test_a_block_read_in_chunks_counts_as_a_block_read_whole(monkeypatch, chunk, bins, local):
    """``HISTOGRAM_CHUNK``: a program reads its block in a loop of ``block // chunk``
    parts (fewer registers a thread); the counts are the reference's whatever the chunk,
    with tensors that end inside a chunk and tensors not searched.  4096 is more than the
    block: the block is read whole."""
    monkeypatch.setenv("HVD_COMPRESS_CHUNKS_ON_CPU", "1")      # (CPU tensors: as on CUDA)
    monkeypatch.setattr(H, "HISTOGRAM_CHUNK", chunk)
    x = make("student_t", sum(LENGTHS), seed=3)
    blocks = H.block_table(LENGTHS, x.device, block=1024)
    state = state_for(LENGTHS, LO, HI, [1, 1, 0, 1, 1, 1])
    got = H.segment_histogram(x, blocks, state, bins, backend="triton", local=local)
    assert torch.equal(got, H.segment_histogram_reference(x, blocks, state, bins))
    assert got[0].sum() > 0 and not got[2].any()


@pytest.mark.parametrize("bins, local", [(2046, False), (62, True)])
def test_window_bins_are_exact_on_every_edge(bins, local):
    """The kernel bins ``floor((b - lo - 1) * bins / W)`` by a float64 product (no 64-bit
    division): entries whose bits lie on every edge ``E_j`` of the bracket and one bit
    either side, for widths of 1 bit to nearly 2^31 (where the product is largest and a
    fraction of 1 / W is smallest) and widths one off a multiple of the bins."""
    top = 0x7F800000                                          # bits of +Inf
    brackets = [(bits(1.0), bits(1.0) + 1), (bits(1.0), bits(1.0) + bins),
                (bits(1.0), bits(1.0) + bins + 1), (bits(1.0), bits(1.0) + bins - 1),
                (bits(0.3), bits(0.3) + 3 * bins + 1), (0, top - 1), (-1, top),
                (bits(1e-30), bits(3e38)), (bits(2.0) - 7, bits(2.0) + 12345677)]
    lo = torch.tensor([b[0] for b in brackets], dtype=torch.int64)
    hi = torch.tensor([b[1] for b in brackets], dtype=torch.int64)
    edges = H.histogram_edges(lo, hi, bins)
    parts = []
    for s in range(len(brackets)):
        e = torch.cat([edges[s], edges[s] - 1, edges[s] + 1]).clamp(0, top)
        parts.append(e.to(torch.int32).view(torch.float32) * (1 - 2 * (e % 2)))   # both signs
    lengths = [p.numel() for p in parts]
    x = torch.cat(parts).to(DEVICE)
    state = state_for(lengths, lo.tolist(), hi.tolist())
    blocks = H.block_table(lengths, x.device, block=1024)
    got = H.segment_histogram(x, blocks, state, bins, backend="triton", local=local)
    want = H.segment_histogram_reference(x, blocks, state, bins)
    assert torch.equal(got, want)
    above = torch.flip(torch.cumsum(torch.flip(want, [1]), 1), [1])        # count(> E_j)
    b = x.abs().view(torch.int32).long()
    off = 0
    for s, n in enumerate(lengths):
        brute = (b[off:off + n][None, :] > edges[s].to(DEVICE)[:, None]).sum(1)
        off += n
        if lo[s] < 0:        # lo = -1 (the search's select-all bracket): zeros lie in the
            brute[0] = n     # window, so the first suffix sum counts them, E_0 = 0 or not
        assert torch.equal(above[s], brute), brackets[s]


@pytest.mark.parametrize("start", ["odd brackets", "from zero to max"])
def test_histogram_pick_matches_reference(start):
    bins = 14
    x = make("student_t", sum(LENGTHS))
    blocks = H.block_table(LENGTHS, x.device, block=512)
    k = torch.tensor([50, 1, 3, 120, 7, 40], device=DEVICE)
    slack = torch.tensor([0, 0, 0, 1, 0, 0], device=DEVICE)
    if start == "odd brackets":
        s_ref = state_for(LENGTHS, LO, HI, [1, 1, 1, 1, 0, 1])
    else:
        peaks = K.segmented.segment_abs_sum_max_reference(x, LENGTHS)[1]
        s_ref = state_for(LENGTHS, [0] * len(LENGTHS), peaks.view(torch.int32).tolist())
    s_ker = s_ref.clone()
    for _ in range(3):
        h_ref = H.segment_histogram(x, blocks, s_ref, bins, backend="torch")
        h_ker = H.segment_histogram(x, blocks, s_ker, bins, backend="triton")
        H.histogram_pick_reference(h_ref, s_ref, k, slack, bins)
        H.histogram_pick(h_ker, s_ker, k, slack, bins, backend="triton")
        assert torch.equal(s_ref, s_ker)
        assert not h_ker.any() and not h_ref.any()        # zeroed for the next pass
    if start == "from zero to max":       # the bracket's invariant
        c_lo, c_hi = s_ref[H.C_LO], s_ref[H.C_HI]
        nonzero = torch.tensor([int((x[o:o + n] != 0).sum()) for o, n in
                                zip(np.cumsum([0] + LENGTHS[:-1]), LENGTHS)], device=DEVICE)
        assert torch.equal(c_lo >= k, nonzero >= k) and bool((c_hi < k).all())
        assert bool((s_ref[H.HI] - s_ref[H.LO] >= 0).all())


@pytest.mark.parametrize("dtype, block", [(torch.float32, 1024), (torch.float16, 1024),
                                          (torch.float32, 8)])
def test_band_select_matches_reference(monkeypatch, dtype, block):
    """(block 8: more blocks than the offsets program takes at once, OFFSETS_BLOCK)"""
    monkeypatch.setattr(B, "OFFSETS_BLOCK", 1024)       # 2,676 blocks of 8: 3 at once
    x = make("ties", sum(LENGTHS)).to(dtype)
    blocks = H.block_table(LENGTHS, x.device, block=block)
    state = state_for(LENGTHS, [bits(1.0), -1, 0, bits(2.0), 0, bits(1.0)],
                      [bits(2.0), -1, bits(3.0), bits(2.0), bits(3.0), bits(2.0)])
    state[H.QUOTA] = torch.tensor([3, 0, 1000, 50, 2, 0], device=DEVICE)
    got, finite = B.band_select(x, blocks, state, backend="triton")
    want, want_finite = B.band_select_reference(x, blocks, state)
    assert got.dtype == torch.int32 and torch.equal(got, want) and finite and want_finite
    assert torch.equal(got.sort().values, got)                    # index order


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype, zero", [(torch.float32, True), (torch.float32, False),
                                         (torch.float16, False)])
@pytest.mark.parametrize("chunk", [2048, 4])
def test_band_select_gathers_the_values_and_zeroes_them_in_x(monkeypatch, backend, dtype, zero,
                                                             chunk):
    """``gather=True``: the taken values from the launch that writes the indices, and
    their number per tensor from the offsets program (``chunk``: tensors it takes at
    once; at 4, the count and write programs also read their blocks in chunks of 128,
    ``BAND_CHUNK``, the write's ranks carried from chunk to chunk); ``zero=True``
    (float32): +0.0 written over exactly those entries of ``x`` (error feedback's
    ``c - sent``), every other bit of ``x`` as it was."""
    monkeypatch.setattr(B, "OFFSETS_BLOCK", chunk)
    if chunk == 4:
        monkeypatch.setenv("HVD_COMPRESS_CHUNKS_ON_CPU", "1")
        monkeypatch.setattr(B, "BAND_CHUNK", 128)
    x = make("laplace", sum(LENGTHS)).to(dtype)
    j = int(x[:LENGTHS[0]].abs().argmax())
    x[j] = -x[j].abs()                                    # a negative taken entry
    blocks = H.block_table(LENGTHS, x.device, block=1024)
    state = state_for(LENGTHS, [bits(1.0), -1, 0, bits(2.0), 0, bits(0.5)],
                      [bits(2.0), -1, bits(3.0), bits(2.0), bits(3.0), bits(2.0)])
    state[H.QUOTA] = torch.tensor([100, 0, 1000, 50, 2, 0], device=DEVICE)   # 100: past 1 chunk
    state[H.LO, 4] = state[H.HI, 4] = bits(1e30)           # a tensor that sends nothing
    before = x.clone()
    want, _ = B.band_select_reference(before.clone(), blocks, state)
    idx, finite, values, counts = B.band_select(x, blocks, state, backend=backend, gather=True,
                                                zero=zero)
    assert torch.equal(idx, want) and finite and j in idx.tolist()
    ends = torch.tensor(np.cumsum(LENGTHS), device=DEVICE)
    per = torch.bincount(torch.searchsorted(ends, idx.long(), right=True), minlength=len(LENGTHS))
    assert counts.dtype == torch.int64 and torch.equal(counts, per) and 0 in per.tolist()
    assert B.band_select(before.clone(), blocks, state, backend=backend, gather=True,
                         count=False)[3] is None
    assert values.dtype == dtype and torch.equal(values, before[idx.long()])
    if zero:
        expect = before.clone()
        expect[idx.long()] = 0.0
        assert torch.equal(x.view(torch.int32), expect.view(torch.int32))    # +0.0, bits
    else:
        assert torch.equal(x, before)


def test_band_select_refuses_to_zero_what_it_cannot():
    x = make("laplace", sum(LENGTHS))
    blocks = H.block_table(LENGTHS, x.device)
    state = state_for(LENGTHS, [0] * len(LENGTHS), [bits(2.0)] * len(LENGTHS))
    with pytest.raises(ValueError, match="zero= needs gather=True"):
        B.band_select(x, blocks, state, zero=True)
    with pytest.raises(ValueError, match="contiguous 1-D float32"):
        B.band_select(x.half(), blocks, state, gather=True, zero=True)


def test_a_non_finite_bucket_selects_everything():
    x = make("laplace", sum(LENGTHS))
    x[4000] = float("nan")
    blocks = H.block_table(LENGTHS, x.device)
    sums, peaks = K.segmented.segment_abs_sum_max_reference(x, LENGTHS)
    state = H.search_start(torch.zeros(len(LENGTHS), dtype=torch.int64, device=DEVICE),
                           torch.ones(len(LENGTHS), dtype=torch.int64, device=DEVICE), sums, peaks)
    for backend in ("torch", "triton"):
        idx, finite = B.band_select(x, blocks, state, backend=backend)
        assert not finite and idx.numel() == x.numel()


KINDS = ["laplace", "gaussian", "student_t", "ties", "bimodal", "sparse"]
SHAPES = [(3000,), (17,), (64, 50), (20000,), (1,), (500,)]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("density", [0.01, 0.3])
def test_fused_search_exact_is_the_grid_search(monkeypatch, backend, kind, density):
    """``exact=1``: the same indices as the grid search (the k largest, ties by index);
    tolerance mode: every tensor's count within tol of k (or all its nonzero entries),
    and no unsent magnitude above a sent one."""
    monkeypatch.setenv("HVD_COMPRESS_BACKEND", backend)
    lay = layout([f"t{i}" for i in range(len(SHAPES))], SHAPES)
    x = make(kind, lay.total, seed=density > 0.1)
    grid = from_spec(f"laplace_topk:density={density},exact=1")
    want = grid.select_segmented(x.clone(), lay, torch_ops)
    got, finite = select_histogram(from_spec(f"laplace_topk:density={density},exact=1,fused=1"),
                                   x.clone(), lay, torch_ops)
    assert finite and torch.equal(got.sort().values, want.sort().values)
    tol = from_spec(f"laplace_topk:density={density},fused=1")
    idx, _ = select_histogram(tol, x.clone(), lay, torch_ops)
    for off, n in zip(lay.offsets, lay.numels):
        k, seg = tol.k(n), x[off:off + n].abs()
        sel = idx[(idx >= off) & (idx < off + n)].long() - off
        want_count = min(k, int((seg > 0).sum()))
        assert abs(sel.numel() - want_count) <= math.floor(0.01 * k), (off, sel.numel(), k)
        rest = torch.ones(n, dtype=torch.bool, device=x.device)
        rest[sel] = False
        if sel.numel() and rest.any():
            assert seg[sel].min() >= seg[rest].max()


@pytest.mark.parametrize("values", [None, "rangefloat8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fused_bucket_compress_conserves_error_feedback_and_restores(values, dtype):
    lay = layout(["a", "b", "c"], [(300, 20), (7,), (5000,)])
    spec = "laplace_topk:density=0.01,fused=1" + (f",values={values}" if values else "")
    c, twin = from_spec(spec), from_spec(spec)
    for step in range(3):
        g = make("laplace", lay.total, seed=step).to(dtype)
        r_before = [c.residual(n) for n in lay.names]
        comp = g.float() + (torch.cat(r_before).float() if step else 0)
        payload, ctx = c.compress_bucket(g.clone(), lay)
        sent = c.decompress_bucket(payload, ctx).float()
        r_after = torch.cat([c.residual(n) for n in lay.names]).float()
        tol = 0.0 if dtype == torch.float32 else 2e-2
        assert torch.allclose(sent + r_after, comp, atol=tol, rtol=tol)
        assert 0 < int((sent != 0).sum()) < lay.total
    twin.load_state_dict(c.state_dict())
    g = make("gaussian", lay.total, seed=9).to(dtype)
    a, ca = c.compress_bucket(g.clone(), lay)
    b, cb = twin.compress_bucket(g.clone(), lay)
    assert all(torch.equal(u, v) for u, v in zip(a, b))


def test_fused_nan_bucket_is_sent_whole_and_residuals_stay():
    lay = layout(["a", "b"], [(1000,), (3000,)])
    c = from_spec("laplace_topk:density=0.01,fused=1")
    c.compress_bucket(make("laplace", lay.total), lay)
    before = [c.residual(n).clone() for n in lay.names]
    g = make("laplace", lay.total, seed=2)
    g[1500] = float("inf")
    payload, ctx = c.compress_bucket(g.clone(), lay)
    assert payload[1].numel() == lay.total
    assert all(torch.equal(c.residual(n), r) for n, r in zip(lay.names, before))
    assert torch.isinf(c.decompress_bucket(payload, ctx)).any()


def test_fused_single_tensor_and_spec():
    c = from_spec("laplace_topk:density=0.05,fused=1")
    assert "fused=1" in c.spec and from_spec(c.spec).fused
    x = make("laplace", 4000).reshape(40, 100)
    payload, ctx = c.compress(x, "w")
    assert payload[1].numel() == 200                            # exactly k: Laplace data
    assert c.decompress(payload, ctx).shape == (40, 100)
    p0, _ = c.compress(torch.tensor(3.0, device=DEVICE), "scalar")   # 0-d
    assert p0[1].tolist() == [0]


def one_exchange(T, spec):
    """(Triton launches, ATen ops) of a bucket exchange of T tensors (counting.py)."""
    return counting.one_exchange(T, spec, lambda n, step: make("laplace", n, seed=step))


@pytest.mark.parametrize("fold", [False, True])
@pytest.mark.parametrize("spec", ["laplace_topk:density=0.01,fused=1",
                                  "laplace_topk:density=0.01,fused=1,exact=1",
                                  "laplace_topk:density=0.01,warm=1"])
def test_launches_and_ops_do_not_grow_with_the_tensors_of_a_bucket(monkeypatch, spec, fold):
    """The CUDA code path (kernels forced with HVD_COMPRESS_BACKEND=triton, run by the
    interpreter here): a bucket of 4 and one of 40 tensors cost the same launches and the
    same framework ops; with ``FOLD_PICK`` each pass is one launch, not two.  A warm
    start (``warm=1``) makes a pass fewer (its first pass, folded into the sums pass,
    steps every tensor), and one copy of the brackets more."""
    monkeypatch.setenv("HVD_COMPRESS_BACKEND", "triton")
    monkeypatch.setattr(H, "FOLD_PICK", fold)
    l4, o4 = one_exchange(4, spec)
    l40, o40 = one_exchange(40, spec)
    passes = len(WARM_FOLDED_PASSES if "warm=1" in spec else HISTOGRAM_PASSES)
    assert l4 == l40 and sum(l4.values()) <= 14 - (passes if fold else 0), (l4, l40)
    if fold:
        assert l4["segment_histogram_pick"] == passes and not l4["histogram_pick"]
    else:
        assert l4["segment_histogram"] == passes == l4["histogram_pick"]
    assert sum(o4.values()) == sum(o40.values()), set(o40.items()) ^ set(o4.items())


@pytest.mark.parametrize("spec", ["laplace_topk:density=0.01", "topk:density=0.01"])
def test_the_default_paths_sort_a_bucket_once(monkeypatch, spec):
    """laplace_topk's and topk's default on the CUDA code path: one sort of the bucket
    (``segment_abs_topk``), the same ops for 4 tensors as for 40, where a torch.topk per
    tensor cost ~6 ops a tensor."""
    monkeypatch.setenv("HVD_COMPRESS_BACKEND", "triton")
    launches, ops = one_exchange(4, spec)
    assert (launches, ops) == one_exchange(40, spec)
    assert ops["aten.sort.stable"] == 1 and not ops["aten.topk.default"]


def test_histogram_bins_fit_a_power_of_two_row():
    for bins in HISTOGRAM_PASSES:
        row = bins + 2
        assert row & (row - 1) == 0
    assert math.prod(HISTOGRAM_PASSES) >= 2 ** 31     # the passes collapse any bracket
    assert HISTOGRAM_PASSES[0] <= COARSE_BINS < HISTOGRAM_PASSES[1]   # coarse, then fine


@pytest.mark.parametrize("T", [1, 6, 1500])
@pytest.mark.parametrize("special", [None, "nan", "inf", "overflow"])
def test_search_from_fit_matches_reference(T, special):
    """The search's start, one program on the device: the Laplace fit's bracket per
    tensor (an IEEE division), and every entry selected after a NaN/Inf (T past one
    program's block of tensors too)."""
    g = torch.Generator().manual_seed(T)
    sums = (torch.rand(T, generator=g) * 1e3).to(DEVICE)
    peaks = (torch.rand(T, generator=g) * 10).to(DEVICE)
    n = torch.randint(1, 10 ** 6, (T,), generator=g).float().to(DEVICE)
    if special == "nan":
        sums[T - 1] = float("nan")
    elif special == "inf":
        peaks[T // 2] = float("inf")
    elif special == "overflow":                  # a finite sum past float32: inf, still finite
        sums[0] = float("inf")
    factor = 0.5 * math.log(1 / 0.01)
    want = H.search_from_fit_reference(sums, peaks, n, factor)
    got = H.search_from_fit(sums, peaks, n, factor, backend="triton")
    assert torch.equal(got, want)
    finite = special in (None, "overflow")
    assert bool((want[H.FINITE] == int(finite)).all()) and bool((want[H.ACTIVE] == int(finite)).all())
    if not finite:
        assert bool((want[H.LO] == -1).all()) and bool((want[H.HI] == -1).all())


@pytest.mark.parametrize("spec", ["laplace_topk:density=0.01", "laplace_topk:density=0.01,exact=1",
                                  "laplace_topk:density=0.01,fused=1"])
def test_one_tensor_whose_abs_sum_overflows_float32_still_sends_k(spec):
    """Finite values whose sum|g| is past float32's range: the Laplace fit is inf, so
    the search starts from zero; k entries are sent and error feedback conserves."""
    g = make("laplace", 5000)
    g[:4] = torch.tensor([1e38, -1e38, 1e38, 1e38])
    c = from_spec(spec)
    payload, ctx = c.compress(g.clone(), "w")
    k = c.k(g.numel())
    assert abs(payload[1].numel() - k) <= math.floor(0.01 * k)
    assert set(range(4)) <= set(payload[1].tolist())
    assert torch.equal(c.decompress(payload, ctx) + c.residual("w"), g)


def test_own_rangefloat_payload_is_decoded_without_checking_its_headers(monkeypatch):
    """values=rangefloat8: error feedback decodes this rank's own payload knowing its
    length (the number of indices), so the header check (a host synchronisation on
    CUDA) runs only for the aggregate in decompress."""
    from hvd_compress.kernels import rangefloat_segments as rs
    monkeypatch.setenv("HVD_COMPRESS_BACKEND", "triton")
    lay = layout(["a", "b", "c"], [(300, 20), (7,), (5000,)])
    c = from_spec("laplace_topk:density=0.01,fused=1,values=rangefloat8")
    checks = []
    real = rs.check_headers
    monkeypatch.setattr(rs, "check_headers", lambda *a, **k: checks.append(1) or real(*a, **k))
    g = make("laplace", lay.total)
    payload, ctx = c.compress_bucket(g.clone(), lay)
    assert checks == []
    sent = c.decompress_bucket(payload, ctx)
    assert checks == [1]
    r = torch.cat([c.residual(n) for n in lay.names])
    assert torch.allclose(sent + r, g)
