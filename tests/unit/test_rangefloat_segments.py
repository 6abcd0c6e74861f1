"""The range-float bucket kernels (``hvd_compress/kernels/rangefloat_segments.py``,
``header_check.py``) against their torch references, where the kernels run: on CUDA, and
here under Triton's interpreter (TRITON_INTERPRET=1, set by conftest.py).  Per-segment
exponents, the encode and decode of every segment of a bucket (and of several ranks'
payloads at once), the decoded sum, and the check of other ranks' headers, on segments
that no block divides, with NaN, Inf, zeros and subnormals in some."""
import pytest
import torch

from hvd_compress.kernels import rangefloat as RF
from hvd_compress.kernels import rangefloat_segments as RS

from bucket_data import BITS, DEVICE, LENGTHS, laplace, same_bits, same_values, with_specials


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("on_device", [False, True])
def test_segment_max_exponent_matches_reference(dtype, on_device):
    x = with_specials(laplace(sum(LENGTHS)) * 1e3).to(dtype)
    counts = torch.tensor(LENGTHS, device=DEVICE) if on_device else LENGTHS
    got = RS.segment_max_exponent(x, counts, backend="triton")
    want = RS.segment_max_exponent_reference(x, LENGTHS)
    assert got.dtype == torch.int32 and torch.equal(got, want)
    assert got[0] == 128 and got[3] == -127                     # NaN; the empty segment
    if dtype == torch.float32:
        assert got[1] == -127 and got[2] == -127                # zero; subnormals


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("on_device", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_encode_segments_matches_reference_and_each_segment_alone(bits, on_device, dtype):
    e, m = RF.SPLITS[bits]
    x = with_specials(laplace(sum(LENGTHS), seed=bits)).to(dtype)
    x[2000:2100] = 0.0
    counts = torch.tensor(LENGTHS, device=DEVICE)
    data, header = RS.encode_segments(x, counts if on_device else None, e, m,
                                      lengths=None if on_device else LENGTHS, backend="triton")
    want_data, want_header = RS.encode_segments_reference(x, LENGTHS, e, m)
    assert data.dtype == torch.uint8 and torch.equal(data, want_data)
    assert header.dtype == torch.int32 and torch.equal(header, want_header)
    parts = torch.split(x, LENGTHS)                              # the codec's per-tensor path
    alone = [RF.encode(p, RF.max_exponent(p), e, m, backend="torch") for p in parts]
    assert torch.equal(data, torch.cat(alone))


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("on_device", [False, True])
@pytest.mark.parametrize("into", ["itself", "another", "reference", "minus", "minus_reference"])
def test_encode_segments_writes_what_decode_segments_makes_of_its_bytes(bits, on_device, into):
    """``decoded=``: the encode's launch also writes each value as every rank will decode
    it (the sender's error feedback then decodes nothing), bit for bit, NaN included;
    over ``x`` itself (each entry read before it is written), or into another buffer;
    with ``minus=True``, ``x`` minus that (error feedback's residual), over ``x``."""
    e, m = RF.SPLITS[bits]
    x = with_specials(laplace(sum(LENGTHS), seed=bits) * 7)
    x[2000:2100] = 0.0
    x[2100] = -0.0
    counts = torch.tensor(LENGTHS, device=DEVICE)
    kept = x.clone()
    minus, backend = into.startswith("minus"), "torch" if "reference" in into else "triton"
    out = x if into in ("itself", "minus", "minus_reference") else torch.full_like(x, 5.0)
    data, header = RS.encode_segments(x, counts if on_device else None, e, m,
                                      lengths=None if on_device else LENGTHS, decoded=out,
                                      minus=minus, backend=backend)
    want_data, want_header = RS.encode_segments_reference(kept, LENGTHS, e, m)
    assert torch.equal(data, want_data) and torch.equal(header, want_header)
    if out is not x:
        assert same_bits(x, kept)                                   # the input untouched
    h = header.reshape(-1, 2)
    decoded = RS.decode_segments(data, h[:, 0], h[:, 1], e, m, lengths=LENGTHS, backend=backend)
    if minus:
        residual = kept - decoded                   # what error feedback subtracted before
        assert same_values(out, residual)
        assert same_bits(out.nan_to_num(), residual.nan_to_num())
        assert out[2100].item() == 0.0                                # -0.0 - 0.0
        return
    # bit for bit but NaN's payload: CUDA's adds make NaN canonical (the decode adds each
    # value to 0.0; the encode writes its bits), the interpreter's keep it (H200, 2026-11-29)
    assert same_values(out, decoded) and same_bits(out.nan_to_num(), decoded.nan_to_num())
    assert same_values(out, RS.decode_segments_reference(data, h[:, 0], h[:, 1], e, m))
    assert out[2100].item() == 0.0 and not out[2100].signbit()        # never -0.0


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("on_device", [False, True])
@pytest.mark.parametrize("into", [False, True])
def test_encode_segments_adds_first(backend, on_device, into):
    """``add=``: the exponent pass writes ``x + add`` over ``x`` (error feedback's
    ``c = g + r``, torch's bits) and the bytes and headers are those of the sum's;
    ``into``: with ``source=``, ``source + add`` written into ``x`` (NaN before: not
    read), ``source`` left as it was."""
    e, m = RF.SPLITS[8]
    x = with_specials(laplace(sum(LENGTHS), seed=3))
    r = laplace(sum(LENGTHS), seed=4) * 0.25
    want = x + r
    more = {}
    if into:
        more["source"], x = x, torch.full_like(x, float("nan"))
        kept = more["source"].clone()
    counts = torch.tensor(LENGTHS, device=DEVICE)
    data, header = RS.encode_segments(x, counts if on_device else None, e, m,
                                      lengths=None if on_device else LENGTHS, add=r,
                                      backend=backend, **more)
    assert same_values(x, want) and same_bits(x.nan_to_num(), want.nan_to_num())
    if into:
        assert same_bits(more["source"].nan_to_num(), kept.nan_to_num())
    want_data, want_header = RS.encode_segments_reference(want, LENGTHS, e, m)
    assert torch.equal(data, want_data) and torch.equal(header, want_header)
    with pytest.raises(ValueError, match="add= needs"):
        RS.encode_segments(x.half(), None, e, m, lengths=LENGTHS, add=r, backend=backend)


def test_encode_segments_refuses_a_decoded_buffer_it_cannot_fill():
    x = laplace(sum(LENGTHS))
    n = sum(LENGTHS)     # (made on the device: .to() would copy the strided one densely)
    for bad in (torch.zeros(n, dtype=torch.float16, device=DEVICE),
                torch.zeros(7, device=DEVICE), torch.zeros(2 * n, device=DEVICE)[::2]):
        for backend in ("torch", "triton"):
            with pytest.raises(ValueError, match="decoded must be a contiguous float32"):
                RS.encode_segments(x, None, 4, 3, lengths=LENGTHS, decoded=bad,
                                   backend=backend)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("trusted", [False, True])
def test_decode_segments_matches_reference_and_the_cpu_decoder(bits, trusted):
    e, m = RF.SPLITS[bits]
    ranks = 3
    x = with_specials(laplace(sum(LENGTHS), seed=bits))
    data, header = RS.encode_segments_reference(x, LENGTHS, e, m)
    data, header = torch.cat([data] * ranks), torch.cat([header] * ranks)   # ranks' payloads
    h = header.reshape(-1, 2)
    emax, counts = h[:, 0], h[:, 1]
    if trusted:
        got = RS.decode_segments(data, emax, counts, e, m, lengths=LENGTHS * ranks,
                                 backend="triton")
    else:
        total, expected, bad, _ = RS.check_headers(data, emax, counts, e, m)
        assert (total, expected, bad) == (sum(LENGTHS) * ranks, data.numel(), False)
        got = RS.decode_segments(data, emax, counts, e, m, total=total, backend="triton")
    want = RS.decode_segments_reference(data, emax, counts, e, m)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())
    if DEVICE == "cpu":
        cpu = RF.decode_ranks_cpu(data, emax, counts, e, m)
        assert torch.equal(got.nan_to_num(), cpu.nan_to_num())


@pytest.mark.parametrize("bits", [4, 8, 12])
@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_decode_sum_is_the_sum_of_the_ranks_decoded_rows(bits, ranks):
    """A dense payload's aggregate in one launch: the bits of decoding every rank's
    segments and summing the rows (the path it replaces), NaN/Inf included."""
    from hvd_compress.ops import torch_ops
    e, m = RF.SPLITS[bits]
    lengths = tuple(n for n in LENGTHS if n)                    # a bucket's (no empty)
    payloads = [RS.encode_segments_reference(with_specials(laplace(sum(lengths), seed=r)),
                                             lengths, e, m) for r in range(ranks)]
    data = torch.cat([p[0] for p in payloads])
    emax = torch.cat([p[1] for p in payloads]).reshape(-1, 2)[:, 0]
    want = RS.decode_sum_reference(data, emax, lengths, ranks, e, m)
    rows = RS.decode_segments_reference(data, emax, torch.tensor(lengths * ranks), e, m)
    assert same_values(want, torch_ops.sum_rows(rows, sum(lengths)))
    got = RS.decode_sum(data, emax, lengths, ranks, e, m, backend="triton")
    assert got.shape == (sum(lengths),) and same_values(got, want)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_check_headers_flags_what_the_codec_rejects(backend, monkeypatch):
    monkeypatch.setenv("HVD_COMPRESS_BACKEND", backend)    # header_check's kernel or not
    e, m = RF.SPLITS[8]
    data = torch.zeros(10, dtype=torch.uint8, device=DEVICE)
    i32 = lambda v: torch.tensor(v, dtype=torch.int32, device=DEVICE)  # noqa: E731
    assert RS.check_headers(data, i32([3, 3]), i32([4, 6]), e, m) == (10, 10, False, None)
    assert RS.check_headers(data, i32([3, 3]), i32([4, 7]), e, m)[1:3] == (11, False)
    assert RS.check_headers(data, i32([3, 200]), i32([4, 6]), e, m)[2]
    assert RS.check_headers(data, i32([3, -128]), i32([4, 6]), e, m)[2]
    assert RS.check_headers(data, i32([3, 3]), i32([4, -6]), e, m)[2]
    e6, m6 = RF.SPLITS[6]                                        # 4 codes in 3 bytes
    assert RS.check_headers(data, i32([0, 0]), i32([5, 1]), e6, m6) == (6, 9, False, None)
    bounds = tuple(torch.tensor(v, device=DEVICE) for v in (-1, 2**40))   # read back alongside
    assert RS.check_headers(data, i32([3, 3]), i32([4, 6]), e, m, bounds) == (10, 10, False,
                                                                             [-1, 2**40])
    assert RS.check_headers(data, i32([]), i32([]), e, m) == (0, 0, False, None)


def random_headers(H, seed, sane=False, dtype=torch.int32):
    """``[H, 2]`` headers: exponents around [-127, 128], counts up to 2^31 - 1 (the
    largest first), some negative unless ``sane``."""
    gen = torch.Generator().manual_seed(seed)
    h = torch.stack([torch.randint(-130, 131, (H,), generator=gen),
                     torch.randint(-3, 2**31 - 1, (H,), generator=gen)], 1)
    if H:
        h[0, 1] = 2**31 - 1
    if sane:
        h[:, 0], h[:, 1] = h[:, 0].clamp(-127, 128), h[:, 1].clamp(min=0)
    return h.to(dtype).to(DEVICE)


@pytest.mark.parametrize("H", [0, 1, 1023, 1025, 3000])
@pytest.mark.parametrize("bits", [4, 6, 8, 12, 16])
def test_header_stats_kernel_matches_its_reference(H, bits):
    """The headers' totals and flags in one program, from the strided columns of a
    payload's header view, with and without the counts every rank must hold (``want``)
    and the indices' bounds; every group size and across the program's loop steps."""
    from hvd_compress.kernels import header_check as HC
    g, nb = RF.group(1 + sum(RF.SPLITS[bits]))
    bounds = torch.aminmax(torch.tensor([7, -3, 99], dtype=torch.int32, device=DEVICE))
    for sane in (False, True):
        h = random_headers(H, seed=H + bits, sane=sane)
        emax, counts = h[:, 0], h[:, 1]
        wants = [None] + ([counts[:H // 5].clone(), counts[:1].clone()] if H % 5 == 0 and H
                          else [])
        for want in wants:
            for b in (None, bounds):
                ref = HC.header_stats_reference(emax, counts, g, nb, want, b)
                got = HC.header_stats(emax, counts, g, nb, want, b, backend="triton")
                assert torch.equal(got, ref), (sane, want is not None, b is not None, got, ref)
    if H:
        h = random_headers(H, seed=1, sane=True)                  # every rank as wanted
        stats = HC.header_stats(h[:, 0], h[:, 1], g, nb, want=h[:, 1], backend="triton")
        assert stats[2] == 0 and stats[0] == h[:, 1].long().sum()


@pytest.mark.parametrize("dtype", [torch.int64, torch.int16, torch.float32])
def test_header_stats_of_headers_of_another_dtype(dtype):
    """A malformed payload's headers of another dtype: read as int64 (int64 as they are),
    the reference's figures, no error of the kernel's own."""
    from hvd_compress.kernels import header_check as HC
    h = torch.tensor([[3, 10], [200, 5], [-5, 30000]], dtype=dtype, device=DEVICE)
    ref = HC.header_stats_reference(h[:, 0], h[:, 1], 4, 3)
    assert torch.equal(HC.header_stats(h[:, 0], h[:, 1], 4, 3, backend="triton"), ref)
    assert ref.tolist() == [30015, 22515, 1, 0, 0]
