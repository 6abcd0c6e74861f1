"""``laplace_topk:padded=1``: the fused search with a fixed number of slots per tensor, so
that compress reads nothing back (the sync counts are in tests/counting.py).  The padded
band write against its torch reference (the kernel under TRITON_INTERPRET=1, set by
conftest.py), and the compressor against ``fused=1``: the same aggregates and residuals,
bit for bit, on both backends; NaN in every slot of a non-finite bucket."""
import numpy as np
import pytest
import torch

import hvd_compress
from hvd_compress.buckets import layout
from hvd_compress.kernels import band_compact as B
from hvd_compress.kernels import histogram_select as H
from hvd_compress.kernels import segmented

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LENGTHS = [5000, 1, 300, 12000, 7, 4096]


def bits(v):
    return torch.tensor(float(v)).view(torch.int32).item()


def laplace(n, seed=0):
    return torch.from_numpy(np.random.default_rng(seed).laplace(size=n).astype(np.float32)).to(
        DEVICE)


def band_state(x):
    """A state whose brackets and quotas take 0 to 1000 entries of each tensor."""
    state = torch.zeros(7, len(LENGTHS), dtype=torch.int64, device=DEVICE)
    state[H.LO] = torch.tensor([bits(1.0), -1, 0, bits(2.0), bits(1e30), bits(0.5)])
    state[H.HI] = torch.tensor([bits(2.0), -1, bits(3.0), bits(2.0), bits(1e30), bits(2.0)])
    state[H.QUOTA] = torch.tensor([3, 0, 1000, 50, 2, 0])
    state[H.FINITE] = 1
    return state


def per_tensor(idx):
    """The bucket indices ``idx`` split by tensor (lists)."""
    ends = np.cumsum(LENGTHS)
    out = [[] for _ in LENGTHS]
    for i in idx.tolist():
        out[int(np.searchsorted(ends, i, side="right"))].append(i)
    return out


@pytest.mark.parametrize("backend, chunk", [("torch", None), ("triton", None), ("triton", 64)])
@pytest.mark.parametrize("dtype, zero", [(torch.float32, True), (torch.float32, False),
                                         (torch.float16, False)])
def test_padded_band_select_fills_each_tensors_slots(monkeypatch, backend, chunk, dtype, zero):
    """Tensor t's taken entries in its own slots, the first ``sizes[t]`` of them in index
    order (a tensor that takes more keeps its first), then padding: its first index, 0.0;
    ``zero``: +0.0 over exactly the entries written, the dropped ones untouched.
    ``chunk``: the band's programs read their blocks 64 entries at a time
    (``BAND_CHUNK``), as on CUDA."""
    if chunk:
        monkeypatch.setenv("HVD_COMPRESS_CHUNKS_ON_CPU", "1")
        monkeypatch.setattr(B, "BAND_CHUNK", chunk)
    x = laplace(sum(LENGTHS)).to(dtype)
    blocks = H.block_table(LENGTHS, x.device, block=1024)
    state = band_state(x)
    taken = per_tensor(B.band_select_reference(x.clone(), blocks, state)[0])
    counts = [len(t) for t in taken]
    assert counts[4] == 0 and counts[1] == 1 and counts[0] > 40 and counts[3] > 50
    sizes = [40, 1, counts[2], counts[3] + 7, 3, 0]        # fewer, exact, more, empty
    slots = B.slot_table(LENGTHS, sizes, x.device)
    before = x.clone()
    idx, bad, values, got_counts = B.band_select(x, blocks, state, backend=backend,
                                                    gather=True, zero=zero, slots=slots)
    assert idx.dtype == torch.int32 and idx.numel() == values.numel() == sum(sizes)
    assert bad.tolist() == [0] and got_counts.tolist() == sizes
    offsets = np.cumsum([0] + LENGTHS[:-1])
    want_idx, want_values, kept = [], [], []
    for t, size in enumerate(sizes):
        mine = taken[t][:size]
        kept += mine
        want_idx += mine + [int(offsets[t])] * (size - len(mine))
        want_values += [before[mine].cpu(), torch.zeros(size - len(mine), dtype=dtype)]
    assert idx.tolist() == want_idx
    assert values.dtype == dtype and torch.equal(values.cpu(), torch.cat(want_values))
    sent = torch.tensor(kept, dtype=torch.long, device=x.device)
    expect = before.clone()
    if zero:
        expect[sent] = 0.0
    assert torch.equal(x.view(torch.int32 if dtype == torch.float32 else torch.int16),
                       expect.view(torch.int32 if dtype == torch.float32 else torch.int16))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_padded_non_finite_bucket_sends_nan_in_every_slot(backend):
    x = laplace(sum(LENGTHS))
    x[9000] = float("inf")
    blocks = H.block_table(LENGTHS, x.device)
    sums, peaks = segmented.segment_abs_sum_max_reference(x, LENGTHS)
    state = H.search_start(torch.zeros(len(LENGTHS), dtype=torch.int64, device=DEVICE),
                           torch.ones(len(LENGTHS), dtype=torch.int64, device=DEVICE), sums, peaks)
    sizes = [50, 1, 3, 120, 7, 41]
    idx, bad, values, _ = B.band_select(x, blocks, state, backend=backend, gather=True,
                                           slots=B.slot_table(LENGTHS, sizes, x.device))
    assert bad.tolist() == [1]                                 # the flag: not finite
    assert bool(torch.isnan(values).all()) and values.numel() == sum(sizes)
    offsets = np.cumsum([0] + LENGTHS[:-1])
    assert idx.tolist() == [int(o) + j for o, s in zip(offsets, sizes) for j in range(s)]


def test_slot_table_and_band_select_refuse_what_they_cannot():
    with pytest.raises(ValueError, match="slots"):
        B.slot_table([3, 4], [4, 1], DEVICE)                 # more slots than values
    x = laplace(sum(LENGTHS))
    blocks = H.block_table(LENGTHS, x.device)
    with pytest.raises(ValueError, match="slots= needs gather=True"):
        B.band_select(x, blocks, band_state(x), slots=B.slot_table(LENGTHS, [1] * 6, DEVICE))


# -- the compressor ---------------------------------------------------------------------

SIZES = [3000, 17, 64 * 50, 20000, 1, 500]
SPECS = ["laplace_topk:density=0.02", "laplace_topk:density=0.02,exact=1",
         "laplace_topk:density=0.02,values=rangefloat8", "laplace_topk:density=0.02,ef=0"]


def with_sparse_tensors(g, lay):
    """``g`` with its second tensor all zero and its last one 3 nonzero entries short of
    k: tensors whose slots are all, or mostly, padding."""
    g[lay.offsets[1]:lay.offsets[1] + lay.numels[1]] = 0.0
    g[lay.offsets[5] + 3:lay.offsets[5] + lay.numels[5]] = 0.0
    return g


def exchange(c, lay, grads, dtype):
    """Both ranks' compress (each its own compressor state), the aggregate decompressed
    by rank 0; ``(aggregate, payloads, residuals of rank 0)``."""
    payloads = [cc.compress_bucket(g.clone().to(dtype), lay) for cc, g in zip(c, grads)]
    gathered = tuple(torch.cat(parts) for parts in zip(*(p for p, _ in payloads)))
    total = c[0].decompress_bucket(gathered, payloads[0][1])
    residuals = [c[0].residual(n) for n in lay.names] if c[0].ef else []
    return total, [p for p, _ in payloads], residuals


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("spec, dtype", [(s, torch.float32) for s in SPECS] + [
    (s, torch.float16) for s in SPECS if "rangefloat" not in s])
def test_padded_equals_the_fused_search_bit_for_bit(monkeypatch, backend, spec, dtype):
    """Two ranks over three steps (NaN in rank 1's last): the aggregates and rank 0's
    residuals of ``padded=1`` hold the bits of ``fused=1``'s in finite steps (padding adds
    nothing, error feedback's subtraction included: float16 buckets subtract the payload);
    every payload is the slots' size; a non-finite step gives NaN wherever a slot of the
    bad bucket lands and keeps every residual."""
    monkeypatch.setenv("HVD_COMPRESS_BACKEND", backend)
    lay = layout([f"t{i}" for i in range(len(SIZES))], [(n,) for n in SIZES])
    fused = [hvd_compress.from_spec(spec + ",fused=1") for _ in range(2)]
    padded = [hvd_compress.from_spec(spec + ",padded=1") for _ in range(2)]
    assert padded[0].fused and "padded=1" in padded[0].spec
    tol = 0.0 if "exact=1" in spec else 0.01
    slots = sum(min(n, padded[0].k(n) + int(tol * padded[0].k(n))) for n in SIZES)
    for step in range(3):
        grads = [with_sparse_tensors(laplace(lay.total, seed=10 * step + r), lay)
                 for r in range(2)]
        if step == 2:
            grads[1][20500] = float("nan")
        want, _, want_r = exchange(fused, lay, grads, dtype)
        got, payloads, got_r = exchange(padded, lay, grads, dtype)
        assert all(p[-1].numel() == slots for p in payloads), (slots, payloads[0][-1].numel())
        for a, b in zip(want_r, got_r):
            assert torch.equal(a.view(torch.int16 if a.dtype == torch.float16 else torch.int32),
                               b.view(torch.int16 if b.dtype == torch.float16 else torch.int32))
        if step < 2:
            assert torch.equal(got.float().view(torch.int32), want.float().view(torch.int32))
        else:
            nan_at = torch.unique(payloads[1][-1].long())
            assert bool(torch.isnan(got[nan_at]).all()) and bool(torch.isnan(want).any())
            rest = torch.ones(lay.total, dtype=torch.bool)
            rest[nan_at] = False
            assert bool(torch.isfinite(got[rest]).all())


def test_a_lone_tensor_compressed_padded():
    """``compress`` of one tensor (the glue's tensor-by-tensor path): slots of that tensor."""
    x = laplace(5000).reshape(50, 100)
    a = hvd_compress.from_spec("laplace_topk:density=0.01,fused=1,ef=0")
    b = hvd_compress.from_spec("laplace_topk:density=0.01,padded=1,ef=0")
    (pa, ca), (pb, cb) = a.compress(x, "w"), b.compress(x, "w")
    assert pb[1].numel() == 50 + 0 and pa[1].numel() <= 50
    assert torch.equal(a.decompress(pa, ca), b.decompress(pb, cb))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_fused_search_on_its_torch_references_warns_once(monkeypatch, caplog, backend):
    """fused=1/padded=1 where the kernels do not run (CPU tensors, or CUDA tensors with
    HVD_COMPRESS_BACKEND=torch: the torch references): one warning that it is for CUDA's
    kernels, once per process; none where the kernels run."""
    from hvd_compress.ops.torch_ops import segments
    monkeypatch.setattr(segments, "_SAID_REFERENCE", [])
    monkeypatch.setenv("HVD_COMPRESS_BACKEND", backend)
    x = laplace(5000)
    for spec in ("laplace_topk:density=0.01,padded=1", "laplace_topk:density=0.01,fused=1"):
        hvd_compress.from_spec(spec).compress(x, "w")
    said = [r for r in caplog.records if "torch references" in r.getMessage()]
    if backend == "torch":
        assert len(said) == 1 and said[0].levelname == "WARNING", caplog.text
        assert f"on {DEVICE} tensors" in said[0].getMessage()
        assert "leave fused and padded unset where they do not run" in said[0].getMessage()
    else:
        assert said == [], caplog.text


def test_padded_spec_errors_name_the_argument():
    with pytest.raises(ValueError, match="padded=1.*fused=0"):
        hvd_compress.from_spec("laplace_topk:padded=1,fused=0")
    for name in ("laplace_topk", "dct"):
        with pytest.raises(ValueError, match="padded=1.*agg=union"):
            hvd_compress.from_spec(f"{name}:padded=1,agg=union")
    for extra in ("momentum=0.9", "momentum=0.9,mask=0", "warmup_steps=5"):
        with pytest.raises(ValueError, match=f"padded=1.*{extra.split('=')[0]}="):
            hvd_compress.from_spec(f"laplace_topk:padded=1,{extra}")
    hvd_compress.from_spec("laplace_topk:padded=1,clip=1.0")          # no indices read
    c = hvd_compress.from_spec("laplace_topk:density=0.01,padded=1")
    assert hvd_compress.from_spec(c.spec).spec == c.spec


# -- dct: the same selection over each tensor's coefficients -------------------------------

def test_padded_dct_equals_dct_where_both_run_the_fused_search(monkeypatch):
    """Where the kernels run, dct selects by the fused search; ``padded=1`` gives the same
    aggregate and residual bits, in slots (the selection's count per tensor + 1%)."""
    monkeypatch.setenv("HVD_COMPRESS_BACKEND", "triton")
    lay = layout([f"t{i}" for i in range(len(SIZES))], [(n,) for n in SIZES])
    c = [hvd_compress.from_spec(s) for s in ("dct:density=0.05,block=32",
                                             "dct:density=0.05,block=32,padded=1")]
    for step in range(2):
        g = laplace(lay.total, seed=step)
        (pa, ca), (pb, cb) = (x.compress_bucket(g.clone(), lay) for x in c)
        assert pb[-1].numel() == sum(min(n, k + k // 100) for n, k in (
            (m, c[1]._select.k(m)) for m in (-(-n // 32) * 32 for n in SIZES)))
        da, db = c[0].decompress_bucket(pa, ca), c[1].decompress_bucket(pb, cb)
        assert torch.equal(da.view(torch.int32), db.view(torch.int32))
        for name in lay.names:
            assert torch.equal(c[0].residual(name).view(torch.int32),
                               c[1].residual(name).view(torch.int32))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_padded_dct_conserves_the_gradient_and_flags_nan(monkeypatch, backend):
    """On both backends (the CPU's dct selects tensor by tensor, ``padded=1`` by the fused
    search): what one rank sent plus its residual is what it had to send, every step; a
    NaN gradient makes the aggregate NaN and keeps the residuals; the payload's size
    never changes."""
    monkeypatch.setenv("HVD_COMPRESS_BACKEND", backend)
    lay = layout([f"t{i}" for i in range(len(SIZES))], [(n,) for n in SIZES])
    c = hvd_compress.from_spec("dct:density=0.05,block=32,padded=1")
    total_in, total_out = (torch.zeros(lay.total, device=DEVICE) for _ in range(2))
    sizes = set()
    for step in range(3):
        g = laplace(lay.total, seed=step)
        total_in += g
        payload, ctx = c.compress_bucket(g.clone(), lay)
        sizes.add(tuple(t.numel() for t in payload))
        total_out += c.decompress_bucket(payload, ctx)
    residual = torch.cat([c.residual(n) for n in lay.names])
    assert len(sizes) == 1 and torch.allclose(total_out + residual, total_in, atol=1e-4)
    g = laplace(lay.total, seed=9)
    g[100] = float("nan")
    payload, ctx = c.compress_bucket(g, lay)
    assert bool(torch.isnan(c.decompress_bucket(payload, ctx)).any())
    assert tuple(t.numel() for t in payload) in sizes
    assert torch.equal(torch.cat([c.residual(n) for n in lay.names]), residual)
