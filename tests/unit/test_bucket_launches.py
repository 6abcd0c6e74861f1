"""The bucket paths of twobit and rangefloat (the compressor, and the sparsifiers'
``values=rangefloat*``) where the kernels run: on CUDA, and here with
HVD_COMPRESS_BACKEND=triton under Triton's interpreter (TRITON_INTERPRET=1, set by
conftest.py).  A bucket of 4 and one of 40 tensors cost the same kernel launches and the
same framework ops; each twobit bucket kernel matches its torch reference (the
range-float ones: test_rangefloat_segments.py); and the payload is the bytes of the
tensor-by-tensor torch path (the wire format did not change)."""

import pytest
import torch

from hvd_compress.buckets import layout
from hvd_compress.kernels import rangefloat as RF
from hvd_compress.kernels import rangefloat_segments as RS
from hvd_compress.kernels import twobit as TB
from hvd_compress.kernels import twobit_segments as TS
from hvd_compress.spec import from_spec

import counting  # tests/counting.py
from bucket_data import DEVICE, LENGTHS, laplace, same_bits, same_values, with_specials

SPARSE = "laplace_topk:density=0.01,fused=1,values=rangefloat8"


def one_exchange(T, spec):
    """(Triton launches, ATen ops) of a bucket exchange of T tensors (counting.py)."""
    return counting.one_exchange(T, spec, lambda n, step: laplace(n, seed=step))


#: error feedback: twobit's pack writes the residual over the compensated gradient (was a
#: second pass, subtract_segments); both keep the old residuals where the kernels flagged
#: NaN/Inf, in a copy that needs no host sync
CODEC_LAUNCHES = {
    "twobit": {"segment_abs_sum_max": 1, "twobit_pack_segments": 1, "twobit_decode_segments": 1,
               "copy_if_flagged": 1},
    "twobit:threshold=0.5": {"twobit_pack_segments": 1, "twobit_decode_segments": 1,
                             "copy_if_flagged": 1},
    # decompress checks the other ranks' headers in one program (header_stats), where
    # some 17 framework ops did; the encode writes error feedback's residual (was a decode
    # of the own payload and a subtraction)
    "rangefloat:bits=8": {"rangefloat_segment_exponent": 1, "rangefloat_encode_segments": 1,
                          "rangefloat_decode_sum": 1, "copy_if_flagged": 1, "header_stats": 1},
    # the encode also writes what the ranks will decode of its own values: error feedback
    # decodes nothing (was a decode and a table of segments, three launches)
    SPARSE: {"rangefloat_segment_exponent": 1, "rangefloat_encode_segments": 1,
             "rangefloat_decode_segments": 1, "header_stats": 1},
    # the stochastic quantizers: the draws of a whole bucket in one launch (a counter-based
    # hash); TernGrad packs and decodes with twobit's bucket kernels
    "qsgd": {"segment_abs_sum_max": 1, "uniform_segments": 1},
    "terngrad": {"segment_abs_sum_max": 1, "uniform_segments": 1, "twobit_pack_segments": 1,
                 "twobit_decode_segments": 1},
    # 1-bit signs: one pack launch, one decode launch for every rank (and error feedback's
    # own), the levels by segment sums
    "onebit": {"segment_abs_sum_max": 1, "segment_sign_sums": 1, "onebit_pack_segments": 1,
               "onebit_decode_segments": 2, "copy_if_flagged": 1},
    "signsgd": {"segment_abs_sum_max": 1, "onebit_pack_segments": 1,
                "onebit_decode_segments": 2, "copy_if_flagged": 1},
}


@pytest.mark.parametrize("spec", list(CODEC_LAUNCHES))
def test_launches_and_ops_do_not_grow_with_the_tensors_of_a_bucket(monkeypatch, spec):
    """Compress (own decode for error feedback included) and decompress of two ranks'
    payloads: the same launches and ATen ops for 4 and 40 tensors (before: one encode
    launch per tensor and one decode launch per tensor and rank, 80 and 160 launches for
    40 tensors of twobit and rangefloat8)."""
    monkeypatch.setenv("HVD_COMPRESS_BACKEND", "triton")
    l4, o4 = one_exchange(4, spec)
    l40, o40 = one_exchange(40, spec)
    # (24: the fused search's start and band offsets are launches of their own, in place
    # of some 55 framework ops, and so is a table of segments counted on the device, two
    # launches for some 23 ops, in the encode and each decode of values=rangefloat*)
    assert l4 == l40 and sum(l4.values()) <= 24, (l4, l40)
    codec = {k: v for k, v in l4.items() if k in CODEC_LAUNCHES[spec] or k.startswith(
        ("twobit", "rangefloat", "uniform", "onebit", "header"))}
    assert codec == CODEC_LAUNCHES[spec]
    assert o4 == o40, set(o40.items()) ^ set(o4.items())


#: Python calls of a bucket exchange per tensor of the bucket, at most (the residuals, draw
#: keys and step counters of every tensor were fetched and checked one by one: 10 to 41 a
#: tensor before; what is left is arithmetic such as each tensor's k or block count)
CALLS_PER_TENSOR = 8


@pytest.mark.parametrize("spec", [*CODEC_LAUNCHES, "topk:density=0.01", "randomk:density=0.01",
                                  "laplace_topk:density=0.01,fused=1",
                                  "laplace_topk:density=0.01,padded=1"])
def test_python_calls_per_tensor_of_a_bucket_are_few(monkeypatch, spec):
    """The host's own work per tensor, which launches and ops do not show: a bucket of 40
    tensors makes at most CALLS_PER_TENSOR more Python calls a tensor than one of 4."""
    monkeypatch.setenv("HVD_COMPRESS_BACKEND", "triton")
    data = lambda n, step: laplace(n, seed=step)  # noqa: E731
    few, many = counting.python_calls(4, spec, data), counting.python_calls(40, spec, data)
    assert (many - few) / 36 <= CALLS_PER_TENSOR, (few, many)


# -- twobit kernels against their references ----------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_twobit_pack_segments_matches_reference_and_per_tensor_packing(dtype):
    x = with_specials(laplace(sum(LENGTHS))).to(dtype)
    t = torch.rand(len(LENGTHS), device=DEVICE) + 0.1
    words, bad = TS.pack_segments(x, LENGTHS, t, backend="triton")
    want_words, want_bad = TS.pack_segments_reference(x, LENGTHS, t)
    assert words.dtype == torch.int32 and torch.equal(words, want_words)
    assert torch.equal(bad, want_bad) and bad.tolist() == [1, 0, 0, 0, 1, 0, 0]
    alone = [TB.pack(p, t[s], backend="triton") for s, p in enumerate(torch.split(x, LENGTHS))]
    assert torch.equal(words, torch.cat(alone))                 # the wire format


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_twobit_subtract_segments_is_c_minus_its_decoded_codes(dtype):
    """Error feedback's residual in one launch, in place: the bits of ``c - cast(decode(
    pack(c, t)))`` (one rank), the two-pass way it was computed before; a NaN threshold
    (a non-finite tensor's scale, whose old residual error feedback keeps anyway) leaves
    its tensor as it was, where the decoded NaNs made it NaN."""
    lengths = tuple(n for n in LENGTHS if n)
    c = with_specials(laplace(sum(lengths))).to(dtype)
    t = torch.rand(len(lengths), device=DEVICE) + 0.1
    t[3] = float("nan")
    want = TS.subtract_segments_reference(c, lengths, t)
    words, _ = TS.pack_segments(c, lengths, t, backend="torch")
    decoded = TS.decode_segments_reference(words, t.reshape(1, -1), lengths)
    got = c.clone()
    assert TS.subtract_segments(got, lengths, t, backend="triton") is got
    assert got.dtype == dtype and same_values(got, want)
    nan_at = slice(sum(lengths[:3]), sum(lengths[:4]))
    assert same_values(got[nan_at], c[nan_at])
    two_pass = c - decoded.to(dtype)
    assert two_pass[nan_at].isnan().all()
    two_pass[nan_at] = c[nan_at]
    assert same_values(got, two_pass)
    with pytest.raises(TypeError, match="bfloat16"):
        TS.subtract_segments(c.to(torch.bfloat16), lengths, t, backend="triton")


@pytest.mark.parametrize("fit", [False, True])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_twobit_pack_writes_the_residual_subtract_segments_computes(fit, backend):
    """``residual=True``: the pack's launch also writes error feedback's residual over
    ``x``, the bits of :func:`subtract_segments` against the thresholds it packed with
    (for :func:`pack_fit`, the fitted ones; a tensor holding NaN/Inf, whose scale is
    NaN, gets ``x - q`` too: error feedback keeps its old residual anyway), and the same
    words, scales and flags as without."""
    lengths = tuple(n for n in LENGTHS if n)
    x = with_specials(laplace(sum(lengths)) * 3)
    kept = x.clone()
    t = torch.rand(len(lengths), device=DEVICE) + 0.1
    if fit:
        abs_sum = torch.stack([p.abs().sum() for p in torch.split(kept, lengths)])
        abs_max = torch.stack([p.abs().max() for p in torch.split(kept, lengths)])
        want = TS.pack_fit(kept, lengths, abs_sum, abs_max, 1.5, backend=backend)
        got = TS.pack_fit(x, lengths, abs_sum, abs_max, 1.5, backend=backend, residual=True)
        n = torch.tensor(lengths, dtype=torch.float32, device=DEVICE)
        t = 1.5 * abs_sum / n                       # the thresholds the pack used
    else:
        want = TS.pack_segments(kept, lengths, t, backend=backend)
        got = TS.pack_segments(x, lengths, t, backend=backend, residual=True)
    assert all(same_values(a, b) for a, b in zip(got, want))
    residual = TS.subtract_segments_reference(kept, lengths, t)
    assert same_bits(x.nan_to_num(), residual.nan_to_num()) and same_values(x, residual)
    with pytest.raises(ValueError, match="contiguous 1-D float32"):
        TS.pack_segments(kept.half(), lengths, t, backend=backend, residual=True)


@pytest.mark.parametrize("flags", [[0, 0, 0], [0, 1, 0], [True], [7]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_if_flagged_copies_only_when_a_flag_is_set(flags, dtype):
    from hvd_compress.kernels import flagged_copy as FC
    src = with_specials(laplace(9000)).to(dtype)
    dst = laplace(9000, seed=1).to(dtype)
    flags = torch.tensor(flags, device=DEVICE)
    want = FC.copy_if_flagged_reference(dst.clone(), src, flags)
    got = dst.clone()
    assert FC.copy_if_flagged(got, src, flags, backend="triton", block=1024) is got
    assert same_bits(got, want)
    assert same_bits(got, src if bool(flags.any()) else dst)


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_twobit_decode_segments_matches_reference(ranks):
    lengths = tuple(n for n in LENGTHS if n)                    # as a bucket's (no empty)
    t = torch.rand(len(lengths), device=DEVICE) + 0.1
    words = torch.cat([TS.pack_segments(laplace(sum(lengths), seed=r), lengths, t,
                                        backend="torch")[0] for r in range(ranks)])
    scales = torch.rand(ranks, len(lengths), device=DEVICE) + 0.1
    scales[0, 2] = float("nan")                                 # a non-finite rank's tensor
    got = TS.decode_segments(words, scales, lengths, backend="triton")
    want = TS.decode_segments_reference(words, scales, lengths)
    assert got.shape == (sum(lengths),)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())
    if ranks <= 2 and DEVICE == "cpu":                          # the CPU decoder's bits
        rows, at, wat = words.reshape(ranks, -1), 0, 0
        for s, n in enumerate(lengths):
            w = -(-n // 16)
            cpu = TB.unpack_cpu(rows[:, wat:wat + w].contiguous(), scale=scales[:, s], n=n)
            assert torch.equal(got[at:at + n].nan_to_num(), cpu.nan_to_num())
            at, wat = at + n, wat + w


@pytest.mark.parametrize("counts", [[5, 0, 2048, 1, 1023], [0], [7], [0, 0, 3, 0],
                                    [1024, 1024, 1, 0, 5000] * 7])
@pytest.mark.parametrize("g", [1, 2, 4])
def test_device_blocks_kernels_match_their_torch_ops(counts, g):
    """The table from counts on the device: a scan program and a binary search per block
    (two launches) give the integers of the reference's ~24 torch ops."""
    from hvd_compress.kernels import segmented
    c = torch.tensor(counts, dtype=torch.int64, device=DEVICE)
    got = segmented.device_blocks(c, sum(counts), g, 1024, backend="triton")
    want = segmented.device_blocks_reference(c, sum(counts), g, 1024)
    for a, b in zip(got, want):
        assert a.dtype == torch.int64 and torch.equal(a.reshape(-1), b.reshape(-1))


def test_device_table_blocks_never_straddle_and_cover_every_value():
    counts = torch.tensor([5, 0, 2048, 1, 1023], device=DEVICE)
    table, groups = RS.device_table(counts, int(counts.sum()), 2, block=1024)
    covered = torch.zeros(int(counts.sum()), dtype=torch.int64)
    for a, b, s in zip(table.starts.tolist(), table.stops.tolist(), table.segs.tolist()):
        if a == b:                                   # a surplus block of the upper bound
            continue
        lo, hi = int(table.vstart[s]), int(table.vstart[s] + counts[s])
        assert lo <= a < hi and b == hi and (a - lo) % 1024 == 0
        covered[a:min(b, a + 1024)] += 1
    assert covered.eq(1).all() and int(groups) == 3 + 0 + 1024 + 1 + 512


# -- the payload: the bytes of the torch path ---------------------------------------------

BUCKET = layout([f"t{i}" for i in range(6)], [(5000,), (1,), (30, 10), (12000,), (7,), (4096,)])


def exchange(spec, monkeypatch, backend, steps=2):
    """Per step: (payload, decompressed two-rank aggregate); then the residuals."""
    monkeypatch.setenv("HVD_COMPRESS_BACKEND", backend)
    c = from_spec(spec)
    out = []
    for step in range(steps):
        flat = laplace(BUCKET.total, seed=step, dyadic=True)
        if step == 1:
            flat[5001 + 17] = float("nan")                     # tensor 2 not finite
        payload, ctx = c.compress_bucket(flat, BUCKET)
        two = c.decompress_bucket(tuple(torch.cat([p, p]) for p in payload), ctx)
        out.append((payload, two))
    return out, [c.residual(n).clone() for n in BUCKET.names]


@pytest.mark.parametrize("spec", ["twobit", "twobit:threshold=0.5", "rangefloat:bits=8",
                                  "rangefloat:bits=6", "rangefloat:bits=12", SPARSE,
                                  "topk:density=0.01,values=rangefloat4"])
def test_kernel_path_payload_is_the_torch_paths(spec, monkeypatch):
    """The same bytes on the wire as the tensor-by-tensor torch path, the same aggregate
    and residuals; step 2 has a NaN in one tensor.  twobit's thresholds come from sums
    of |r| whose order of additions differs between the paths: bit for bit on the first
    step (exact sums here), within float rounding after error feedback."""
    torch_path, r_torch = exchange(spec, monkeypatch, "torch")
    kernel_path, r_kernel = exchange(spec, monkeypatch, "triton")
    exact_sums = not spec.startswith("twobit") or "threshold" in spec
    for step, ((pa, da), (pb, db)) in enumerate(zip(torch_path, kernel_path)):
        if step == 0 or exact_sums:
            assert len(pa) == len(pb) and all(same_bits(a, b) for a, b in zip(pa, pb)), step
            assert same_values(da, db), step
        else:
            assert same_bits(pa[0], pb[0]) or (pa[0] != pb[0]).float().mean() < 1e-3
            assert torch.allclose(pa[1], pb[1], rtol=1e-6, equal_nan=True)
    if exact_sums:
        assert all(same_values(a, b) for a, b in zip(r_torch, r_kernel))


@pytest.mark.parametrize("spec", ["twobit", "rangefloat:bits=8", "rangefloat:bits=4"])
def test_single_tensor_on_the_kernel_path(spec, monkeypatch):
    x = laplace(4099, dyadic=True).reshape(-1)
    got = []
    for backend in ("torch", "triton"):
        monkeypatch.setenv("HVD_COMPRESS_BACKEND", backend)
        c = from_spec(spec)
        payload, ctx = c.compress(x.clone(), "w")
        got.append((payload, c.decompress(tuple(torch.cat([p, p]) for p in payload), ctx)))
    (pa, da), (pb, db) = got
    assert all(same_bits(a, b) for a, b in zip(pa, pb)) and same_values(da, db)


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests/malformed.py makes CPU tensors: "
                    "the kernels run on those only in the interpreter (no GPU)")
@pytest.mark.parametrize("spec", ["twobit", "rangefloat:bits=8",
                                  "topk:density=0.1,values=rangefloat8", "qsgd", "terngrad",
                                  "onebit", "signsgd"])
def test_malformed_payloads_on_the_kernel_path_fail_as_on_the_torch_path(spec, monkeypatch):
    """Every mutation of tests/malformed.py: a clear error naming the compressor, or
    well formed, exactly as on the torch path."""
    from malformed import MUTATIONS, Torch, check
    fw = Torch()
    for how in MUTATIONS:
        for which in range(3):
            monkeypatch.delenv("HVD_COMPRESS_BACKEND", raising=False)
            want = check(fw, spec, how, which, 3, "int64")
            monkeypatch.setenv("HVD_COMPRESS_BACKEND", "triton")
            assert check(fw, spec, how, which, 3, "int64") == want, (how, which)


@pytest.mark.parametrize("spec", ["twobit", "twobit:scale=2,ef=0", "rangefloat:bits=8",
                                  "rangefloat:bits=6", SPARSE, "qsgd", "qsgd:block=7,ef=1",
                                  "terngrad", "terngrad:ef=1", "onebit", "signsgd",
                                  "signsgd:ef=0"])
def test_kernel_path_bucket_equals_kernel_path_tensor_by_tensor(spec, monkeypatch):
    """On the kernel path, a bucket's aggregate and residuals are those of compressing
    its tensors one by one (tensors below one block: the same sums of |r|, but see
    :func:`_same_sums`); the last
    step of the dense codecs has a NaN in one tensor (the aggregate only: a bucket then
    keeps every tensor's residual; a sparsifier's sends the whole bucket)."""
    monkeypatch.setenv("HVD_COMPRESS_BACKEND", "triton")
    same = same_bits if _same_sums(spec) else _rounding_apart
    lay = layout(["a", "b", "c", "d"], [(30, 20), (7,), (1,), (1000,)])
    tensorwise, bucketed = from_spec(spec), from_spec(spec)
    for step in range(2 if "values=" in spec else 3):
        flat = laplace(lay.total, seed=step) * 3
        if step == 2:
            flat[3] = float("nan")
        ref = []
        for part, name, shape in zip(torch.split(flat, lay.numels), lay.names, lay.shapes):
            p, ctx = tensorwise.compress(part.clone().reshape(shape), name)
            ref.append(tensorwise.decompress(tuple(torch.cat([t, t]) for t in p), ctx).reshape(-1))
        p, ctx = bucketed.compress_bucket(flat.clone(), lay)
        got = bucketed.decompress_bucket(tuple(torch.cat([t, t]) for t in p), ctx)
        assert same(got, torch.cat(ref)), step
        for name in lay.names if step < 2 else ():
            if tensorwise.residual(name) is not None:
                assert same(tensorwise.residual(name).reshape(-1),
                            bucketed.residual(name).reshape(-1)), (step, name)


def _same_sums(spec):
    """Do a lone tensor and the same tensor in a bucket get the same float sums (twobit's
    sum of |r|, QSGD's norms, the 1-bit levels) on the kernel path?  In the interpreter,
    yes.  On CUDA, not for twobit's (seen on an H200; the lone tensor then summed with
    torch.sum), and a reduction may add in another order where a tensor's values start
    elsewhere in memory: those compare within rounding there."""
    return (DEVICE == "cpu" or not spec.startswith(("twobit", "qsgd", "onebit", "signsgd"))
            or "threshold=" in spec)


def _rounding_apart(a, b):
    """Equal but for rounding: entries within 1e-5 of each other relative to the larger
    magnitudes (a residual ``c - q`` near 0 carries the thresholds' rounding whole), but
    for at most 1% of them (an entry next to the threshold may get the other code)."""
    near = torch.isclose(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().nan_to_num().max()),
                         equal_nan=True)
    return bool((~near).float().mean() <= 0.01)


def test_no_segment_and_empty_segments():
    e, m = RF.SPLITS[8]
    none = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    x = torch.zeros(0, device=DEVICE)
    assert RS.segment_max_exponent(x, none, backend="triton").numel() == 0
    data, header = RS.encode_segments(x, none, e, m, backend="triton")
    assert data.numel() == 0 and header.numel() == 0
    assert RS.decode_segments(data, none, none, e, m, total=0, backend="triton").numel() == 0
    two = torch.zeros(2, dtype=torch.int64, device=DEVICE)      # two segments, no value
    data, header = RS.encode_segments(x, two, e, m, backend="triton")
    assert data.numel() == 0 and header.tolist() == [-127, 0, -127, 0]


@pytest.mark.parametrize("spec", ["twobit", "rangefloat:bits=8", SPARSE])
def test_malformed_bucket_payloads_raise_on_the_kernel_path(spec, monkeypatch):
    monkeypatch.setenv("HVD_COMPRESS_BACKEND", "triton")
    c = from_spec(spec)
    payload, ctx = c.compress_bucket(laplace(BUCKET.total), BUCKET)
    bad = [list(payload) for _ in range(3)]
    bad[0][0] = payload[0][:-1]                                  # truncated codes / bytes
    bad[1][1] = torch.cat([payload[1], payload[1][:1]])          # one scale / header word more
    if spec != "twobit":
        bad[2][1] = payload[1].clone()
        bad[2][1][0] = 500                                       # an exponent out of range
    for mutated in bad[:3 if spec != "twobit" else 2]:
        with pytest.raises(ValueError, match="malformed"):
            c.decompress_bucket(tuple(mutated), ctx)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("spec", ["twobit", "rangefloat:bits=8", "qsgd", "qsgd:ef=1", "terngrad",
                                  "onebit", "signsgd"])
def test_empty_tensors_alone_and_in_a_bucket(spec, backend, monkeypatch):
    """An empty tensor compressed on its own decodes to an empty tensor, and one inside a
    bucket takes no norm block, scale or value of its neighbours' (QSGD's bucket path gave
    the empty tensor a block; a lone empty tensor failed to decode for every quantizer).
    (The glue's buckets leave empty tensors out; on the kernel path a bucket holding one
    goes tensor by tensor, so the stochastic quantizers' draws there are the generator's,
    not those of a lone tensor: compared for shape and finiteness only.)"""
    monkeypatch.setenv("HVD_COMPRESS_BACKEND", backend)
    lay = layout(["a", "e", "b"], [(40,), (0,), (7,)])
    c = from_spec(spec)
    x = laplace(lay.total)
    payload, ctx = c.compress_bucket(x.clone(), lay)
    two = c.decompress_bucket(tuple(torch.cat([p, p]) for p in payload), ctx)
    ref = from_spec(spec)
    alone = [ref.decompress(tuple(torch.cat([p, p]) for p in pc[0]), pc[1]).reshape(-1)
             for pc in (ref.compress(part.clone(), name) for part, name in
                        zip(torch.split(x, lay.numels), lay.names) if part.numel())]
    assert two.shape == (47,) and bool(torch.isfinite(two).all())
    if backend == "torch" or not spec.startswith(("qsgd", "terngrad")):
        assert torch.allclose(two, torch.cat(alone), rtol=1e-5, atol=1e-5)
    p, ctx = from_spec(spec).compress(torch.zeros(0, device=DEVICE), "z")
    assert from_spec(spec).decompress(tuple(torch.cat([t, t]) for t in p), ctx).numel() == 0


@pytest.mark.parametrize("lengths, block, want", [
    ((768, 3072, 768), 4096, 16), ((1000, 24), 4096, 8), ((6, 10), 4096, 2), ((7, 16), 4096, 1),
    ((64,), 4096, 16), ((0, 32), 4096, 16), ((32, 32), 24, 8)])
def test_alignment_divides_every_offset_the_kernels_are_told_of(lengths, block, want):
    """The kernels tell the compiler (``tl.multiple_of``) that every start and stop of a
    block table, and every tensor's offset and length of a word table, is a multiple of
    ``align``: 16-byte loads.  A wrong claim would be a misaligned access on a GPU, which
    the interpreter cannot see, so the claim is checked here against the tables."""
    from hvd_compress.kernels.segmented import alignment, block_table, word_table
    assert alignment(lengths, block) == want
    blocks = block_table(lengths, "cpu", block)
    assert blocks.align == want
    assert all(int(v) % want == 0 for v in torch.cat([blocks.starts, blocks.stops]))
    _, xoff, _, n, _, align = word_table(lengths, 16, "cpu", 256)
    assert align == alignment(lengths, 16)
    assert all(int(v) % align == 0 for v in torch.cat([xoff, n]))
