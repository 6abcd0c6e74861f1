"""The fused search started at a previous search's brackets (``histogram_search(warm=)``,
``histogram_select.search_from_fit(warm=)``), its first pass folded into the sums pass
or not (``search_state.warm_search``): the start, the folded pass and the pick past a
bracket's top against their torch references (kernels under TRITON_INTERPRET=1 on the
CPU), how many passes read the bucket, and that the selection stays within tolerance,
and exact where asked, wherever the threshold moved."""
import math

import numpy as np
import pytest
import torch

from hvd_compress.buckets import layout
from hvd_compress.compressors import fused_search as fs
from hvd_compress.kernels import band_compact as B
from hvd_compress.kernels import histogram_select as H
from hvd_compress.kernels import search_state as S
from hvd_compress.ops import torch_ops
from hvd_compress.spec import from_spec

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LENGTHS = [20000, 5000, 1, 30000]


def laplace(seed=0):
    x = np.random.default_rng(seed).laplace(size=sum(LENGTHS))
    return torch.from_numpy(x.astype(np.float32)).to(DEVICE)


def search(spec, x, warm, backend, monkeypatch, fold=True):
    """``(state, histogram passes that read the bucket, selected indices)``."""
    monkeypatch.setenv("HVD_COMPRESS_BACKEND", backend)
    sel = from_spec(spec)
    lay = layout([f"t{i}" for i in range(len(LENGTHS))], [(n,) for n in LENGTHS])
    reading = []
    blocks, state = fs.histogram_search(sel, x.clone(), lay, torch_ops, warm=warm,
                                        reading=reading, fold=fold)
    idx, finite = B.band_select(x, blocks, state, backend=backend)
    passes, entries = fs.reads(reading, LENGTHS)
    assert entries <= passes and (entries > 0) == (passes > 0)
    return state, passes, idx


@pytest.mark.parametrize("fold", [False, True])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_warm_search_reads_once_where_the_threshold_stayed_and_three_times_past_it(
        backend, fold, monkeypatch):
    """Unfolded, the first pass reads the bucket; folded into the sums pass it reads
    nothing more, within the spread or past it; past it above, the folded start narrows
    ``(hi, +Inf]`` to ``(hi, bits(max|c|)]``, where one more pass lands (two unfolded)."""
    spec = "laplace_topk:density=0.01,fused=1"
    x = laplace()
    state0, cold_reads, _ = search(spec, x, None, backend, monkeypatch)
    assert cold_reads == 2
    warm = fs.warm_brackets(state0)
    assert warm.shape == (2, len(LENGTHS)) and bool((warm[0] >= 0).all())
    k = torch.tensor([max(1, int(0.01 * n)) for n in LENGTHS], device=DEVICE)
    # within 1.13, above, below: reads unfolded, folded
    for scale, reads in ((1.05, (1, 0)), (1.5, (3, 1)), (0.6, (3, 2))):
        moved = x * scale
        state, got, idx = search(spec, moved, warm, backend, monkeypatch, fold)
        assert got == reads[fold], scale
        sent = state[H.C_HI] + state[H.QUOTA]
        assert bool(((sent - k).abs() <= torch.floor(0.01 * k.float()).long()).all()), scale
        if scale == 1.5:           # the pick past the warm bracket: (hi, +Inf] first
            assert bool((state[H.HI] < H.INF_BITS).all())     # then collapsed below Inf
        # no unsent magnitude above a sent one, per tensor
        off = 0
        for n in LENGTHS:
            mine = idx[(idx >= off) & (idx < off + n)]
            rest = torch.ones(n, dtype=torch.bool, device=DEVICE)
            rest[mine - off] = False
            if rest.any():
                assert moved[off:off + n][rest].abs().max() <= moved[mine].abs().min()
            off += n


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_an_exact_warm_search_selects_what_a_cold_one_does(backend, monkeypatch):
    spec = "laplace_topk:density=0.02,fused=1,exact=1"
    x = laplace(seed=1)
    state0, _, _ = search(spec, x, None, backend, monkeypatch)
    warm = fs.warm_brackets(state0)
    warm[0, 1] = warm[1, 1] = -1                     # one tensor without: from its fit
    for scale in (1.02, 3.0, 0.2):
        moved = x * scale
        _, _, cold = search(spec, moved, None, backend, monkeypatch)
        for fold in (False, True):
            _, _, got = search(spec, moved, warm, backend, monkeypatch, fold)
            assert torch.equal(cold, got), (scale, fold)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_three_passes_after_a_folded_start_collapse_any_bracket(backend, monkeypatch):
    """The folded start steps every tensor once, a cold one from ``(0, +Inf]`` in 62
    parts: its three passes (one fewer than unfolded) leave no tensor searched and the
    k largest magnitudes sent, even where the bracket left is widest and the entries
    densest (some 20 an ulp: no count lands on k by chance): a first search, and
    thresholds moved by 1e5 and 1e-6 past their warm brackets.  (Two passes left the
    first search's tensors still searched.)"""
    spec = "laplace_topk:density=0.01,fused=1,exact=1"
    monkeypatch.setenv("HVD_COMPRESS_BACKEND", backend)
    lay = layout([f"t{i}" for i in range(len(LENGTHS))], [(n,) for n in LENGTHS])
    offsets = np.cumsum([0] + LENGTHS[:-1]).tolist()
    g = np.random.default_rng(7)
    u, sign = g.uniform(size=sum(LENGTHS)), g.choice([-1, 1], sum(LENGTHS))
    state0, _, _ = search(spec, laplace(seed=2), None, backend, monkeypatch)
    none = torch.full((2, len(LENGTHS)), -1, dtype=torch.int64, device=DEVICE)
    for scale, warm in ((1.0, none), (1e5, fs.warm_brackets(state0)),
                        (1e-6, fs.warm_brackets(state0))):
        x = torch.from_numpy((sign * scale * (1 + u * 2.0 ** -13)).astype(np.float32))
        x = x.to(DEVICE)
        reading = []
        _, state = fs.histogram_search(from_spec(spec), x.clone(), lay, torch_ops, warm=warm,
                                       reading=reading)
        assert len(reading) == len(fs.WARM_FOLDED_PASSES) == 3
        assert not state[H.ACTIVE].any(), scale
        _, _, idx = search(spec, x, warm, backend, monkeypatch)
        for o, n in zip(offsets, LENGTHS):
            kk = max(1, int(0.01 * n))
            mine = idx[(idx >= o) & (idx < o + n)]
            assert mine.numel() == kk
            assert torch.equal(torch.sort(x[mine].abs()).values,
                               torch.sort(torch.topk(x[o:o + n].abs(), kk).values).values)


def test_after_a_nonfinite_bucket_the_next_search_starts_cold(monkeypatch):
    spec = "laplace_topk:density=0.01,fused=1"
    bad = laplace().clone()
    bad[7] = float("nan")
    state, _, _ = search(spec, bad, None, "torch", monkeypatch)
    warm = fs.warm_brackets(state)
    assert bool((warm == -1).all())
    sums, peaks = torch.rand(4, device=DEVICE), torch.rand(4, device=DEVICE) + 1
    n = torch.full((4,), 1000.0, device=DEVICE)
    for backend in ("torch", "triton"):
        cold = H.search_from_fit(sums, peaks, n, 2.3, backend=backend)
        assert torch.equal(H.search_from_fit(sums, peaks, n, 2.3, warm, 99, backend=backend),
                           cold)


@pytest.mark.parametrize("T", [1, 6, 1500])
def test_the_warm_start_matches_its_reference(T):
    """One program on the device: a tensor with a warm bracket starts at ``(lo - spread,
    min(hi + spread, bits(max))]`` (``lo - spread`` clipped at 0), one without (``lo`` =
    -1) at its Laplace fit; after a NaN every bracket is (-1, -1] still."""
    g = torch.Generator().manual_seed(T)
    sums = (torch.rand(T, generator=g) * 1e3).to(DEVICE)
    peaks = (torch.rand(T, generator=g) * 10 + 1).to(DEVICE)
    n = torch.randint(1, 10 ** 6, (T,), generator=g).float().to(DEVICE)
    lo = torch.randint(0, 0x3F800000, (T,), generator=g)
    lo[::3] = -1                                   # no warm bracket: the fit's
    lo[1::5] = 5                                   # below the spread: from 0
    hi = torch.minimum(lo + torch.randint(1, 1 << 24, (T,), generator=g), torch.tensor(0x7F000000))
    warm = torch.stack([lo, hi]).to(DEVICE)
    spread = fs.WARM_SPREAD_BITS
    factor = 0.5 * math.log(1 / 0.01)
    want = H.search_from_fit_reference(sums, peaks, n, factor, warm, spread)
    got = H.search_from_fit(sums, peaks, n, factor, warm, spread, backend="triton")
    assert torch.equal(got, want)
    cold = H.search_from_fit_reference(sums, peaks, n, factor)
    use = warm[0] >= 0
    assert torch.equal(want[H.LO][~use], cold[H.LO][~use])
    assert torch.equal(want[H.LO][use], torch.clamp(warm[0][use] - spread, min=0))
    assert torch.equal(want[H.HI][use], torch.minimum(warm[1] + spread, cold[H.HI])[use])
    sums[0] = float("nan")
    got = H.search_from_fit(sums, peaks, n, factor, warm, spread, backend="triton")
    assert bool((got[H.LO] == -1).all()) and bool((got[H.HI] == -1).all())
    assert torch.equal(got, H.search_from_fit_reference(sums, peaks, n, factor, warm, spread))


def test_the_pick_past_a_bracket_matches_its_reference():
    """k or more entries above a bracket's top: the next bracket is ``(hi, +Inf]`` with
    counts ``(count(> hi), 0)``, on the device as in torch."""
    x = laplace()
    blocks = H.block_table(LENGTHS, x.device, block=512)
    T = len(LENGTHS)
    lo = torch.tensor([H.INF_BITS // 4] * T, device=DEVICE)
    hi = lo + 1000                                 # far below the data's top-k
    k = torch.tensor([50, 1, 1, 120], device=DEVICE)
    slack = torch.zeros(T, dtype=torch.int64, device=DEVICE)
    ones = torch.ones(T, device=DEVICE)
    ref = H.search_start(lo, hi, ones, ones)
    ker = ref.clone()
    for bins in fs.HISTOGRAM_PASSES:
        hr = H.segment_histogram(x, blocks, ref, bins, backend="torch")
        hk = H.segment_histogram(x, blocks, ker, bins, backend="triton")
        H.histogram_pick_reference(hr, ref, k, slack, bins)
        H.histogram_pick(hk, ker, k, slack, bins, backend="triton")
        assert torch.equal(ref, ker)
        if bins == fs.HISTOGRAM_PASSES[0]:
            above = torch.tensor([int((x[o:o + n].abs().view(torch.int32) > hi[0]).sum())
                                  for o, n in zip([0, 20000, 25000, 25001], LENGTHS)],
                                 device=DEVICE)
            past = above >= k
            assert bool(past[[0, 3]].all())
            assert torch.equal(ref[H.LO][past], hi[past])
            assert bool((ref[H.HI][past] == H.INF_BITS).all())
            assert torch.equal(ref[H.C_LO][past], above[past]) and not ref[H.C_HI][past].any()
    assert not ref[H.ACTIVE].any()           # collapsed within the passes
    want = torch.cat([torch.topk(x[o:o + n].abs(), int(kk)).indices + o for o, n, kk in
                      zip([0, 20000, 25000, 25001], LENGTHS, k.tolist())])
    idx, _ = B.band_select(x, blocks, ref, backend="torch")
    assert torch.equal(torch.sort(idx).values, torch.sort(want).values)


def test_a_malformed_warm_bracket_is_a_clear_error():
    ones = torch.ones(3, device=DEVICE)
    for warm in (torch.zeros(2, 4, dtype=torch.int64), torch.zeros(2, 3),
                 torch.zeros(3, 2, dtype=torch.int64).t()):
        with pytest.raises(ValueError, match="warm must be a contiguous int64"):
            H.search_from_fit(ones, ones, ones, 1.0, warm.to(DEVICE), 10)


def folded_inputs(special=None):
    """``(x, blocks, warm, add)``: a bucket, brackets around its top 1% for tensors 0 and
    3, none for 1 (cold), and far below the data for 2; ``special``: a NaN or Inf."""
    x = laplace(seed=3)
    if special:
        x[20003] = float(special)
    blocks = H.block_table(LENGTHS, x.device)
    top = [float(torch.topk(p.abs(), max(1, len(p) // 100)).values[-1])
           for p in torch.split(x, LENGTHS)]
    bits = lambda v: int(np.float32(v).view(np.int32))                    # noqa: E731
    warm = torch.tensor([[bits(top[0] * 0.99), -1, 5, bits(top[3] * 1.2)],
                         [bits(top[0] * 1.01), 0, 9, bits(top[3] * 1.3)]],
                        dtype=torch.int64, device=DEVICE)
    add = torch.from_numpy(np.random.default_rng(4).normal(size=x.numel()).astype(
        np.float32)).to(DEVICE) * 0.1
    return x, blocks, warm, add


@pytest.mark.parametrize("how", ["plain", "add", "source"])
def test_the_folded_first_pass_matches_its_reference(how):
    """One read: ``c`` written as the sums pass writes it, the sums and maxima, and the
    histogram of the tensors with a warm bracket over the uncapped window, the one
    without over ``(0, +Inf]`` in 62 parts (its row's first 64 columns), on the device as
    in torch."""
    x, blocks, warm, add = folded_inputs()
    out = {}
    for backend in ("torch", "triton"):
        flat = x.clone() if how != "source" else torch.zeros_like(x)
        hist = torch.zeros(len(LENGTHS), 2048, dtype=torch.int64, device=DEVICE)
        sums = S.warm_first_pass(flat, blocks, warm, fs.WARM_SPREAD_BITS, 2046, hist,
                                 add=None if how == "plain" else add,
                                 source=x if how == "source" else None, backend=backend)
        out[backend] = (flat, *sums, hist)
    (f0, s0, m0, h0), (f1, s1, m1, h1) = out["torch"], out["triton"]
    assert torch.equal(f0, f1) and torch.equal(m0, m1) and torch.equal(h0, h1)
    assert torch.allclose(s0, s1, rtol=1e-5)        # (the sums add in another order)
    want = x if how == "plain" else x + add
    assert torch.equal(f0, want)
    assert h0[0].sum() == LENGTHS[0] - int((want[:LENGTHS[0]] == 0).sum())
    cold = want[LENGTHS[0]:LENGTHS[0] + LENGTHS[1]]
    assert h0[1, :S.COLD_BINS + 2].sum() == int((cold != 0).sum()) and h0[3].sum() > 0
    assert not h0[1, S.COLD_BINS + 2:].any() and h0[1, [0, S.COLD_BINS + 1]].sum() == 0
    assert h0[2, -1] == LENGTHS[2] - int(want[LENGTHS[0] + LENGTHS[1]] == 0)  # all above


@pytest.mark.parametrize("special", [None, "nan", "inf"])
def test_the_warm_start_after_a_folded_pass_matches_its_reference(special):
    """The start and the counted tensors' step, a program per tensor: the same state as
    the torch reference from the same counts; the warm tensors' brackets narrowed from
    the window, the cold one's to a 62nd of ``(0, +Inf]``; every count left zero; after
    a NaN/Inf every tensor selects everything."""
    x, blocks, warm, _ = folded_inputs(special)
    T = len(LENGTHS)
    k = torch.tensor([max(1, int(0.01 * n)) for n in LENGTHS], device=DEVICE)
    slack = torch.floor(0.01 * k.float()).long()
    n = torch.tensor(LENGTHS, dtype=torch.float32, device=DEVICE)
    factor = 0.5 * math.log(100)
    counted = torch.zeros(T, 2048, dtype=torch.int64, device=DEVICE)
    # one pass for both: the reference's sums add with atomics on CUDA, in no fixed order
    # (two passes' fits differed by 2 ulp on the H200, 2026-11-30)
    sums = S.warm_first_pass(x.clone(), blocks, warm, fs.WARM_SPREAD_BITS, 2046, counted,
                             backend="torch")
    states, hists = [], []
    for backend in ("torch", "triton"):
        hist = counted.clone()
        states.append(S.warm_start(hist, *sums, n, factor, warm, fs.WARM_SPREAD_BITS, k,
                                   slack, 2046, backend=backend))
        hists.append(hist)
    assert torch.equal(states[0], states[1])
    assert not hists[0].any() and not hists[1].any()
    state = states[0]
    if special:
        assert bool((state[H.LO] == -1).all()) and not state[H.ACTIVE].any()
        return
    # cold: the part of (0, +Inf] where the count crosses k, searched by the next passes
    assert state[H.C_LO, 1] >= k[1] >= state[H.C_HI, 1] and state[H.ACTIVE, 1] == 1
    assert 0 < state[H.HI, 1] - state[H.LO, 1] <= -(-H.INF_BITS // S.COLD_BINS)
    cold = x[LENGTHS[0]:LENGTHS[0] + LENGTHS[1]].abs().view(torch.int32)
    assert state[H.C_HI, 1] == int((cold > state[H.HI, 1]).sum())
    window_lo = torch.clamp(warm[0] - fs.WARM_SPREAD_BITS, min=0)
    assert state[H.LO, 0] >= window_lo[0] and state[H.C_LO, 0] >= k[0] >= state[H.C_HI, 0]
    assert state[H.LO, 3] == 0 and state[H.HI, 3] == window_lo[3]   # fewer than k above
    # a miss above: (hi, +Inf] narrowed to (hi, bits(max|c|)], the same entries
    assert state[H.LO, 2] == warm[1, 2] + fs.WARM_SPREAD_BITS
    assert state[H.HI, 2] == sums[1][2].view(torch.int32).item() < H.INF_BITS


def test_a_warm_search_as_the_first_kernel_of_a_process_runs_in_the_interpreter():
    """The warm start's kernel calls ``histogram_select._pick``: in a fresh process where
    no other kernel ran first (a run restored warm from a checkpoint), Triton's
    interpreter finds what ``_pick`` uses (it found no ``tl`` once)."""
    import os
    import subprocess
    import sys
    code = (
        "import torch\n"
        "from hvd_compress.kernels import search_state as S, segmented\n"
        "x = torch.arange(1, 5001, dtype=torch.float32)\n"
        "blocks = segmented.block_table([5000], x.device)\n"
        "warm = torch.tensor([[0x45000000], [0x45100000]], dtype=torch.int64)\n"
        "k, slack = torch.tensor([50]), torch.tensor([0])\n"
        "state = S.warm_search(x, blocks, warm, k, slack, torch.tensor([5000.0]), 2.3,\n"
        "                      100000, 2046, backend='triton')\n"
        "print(int(state[S.C_LO, 0]), int(state[S.C_HI, 0]))\n")
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    c_lo, c_hi = map(int, r.stdout.split())
    assert c_lo >= 50 >= c_hi
