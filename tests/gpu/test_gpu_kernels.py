"""Every Triton kernel of hvd_compress.kernels on CUDA against its torch reference (on the
same CUDA tensor, and on a CPU copy), bit for bit where the kernel promises it.

Sizes straddle each launcher's block (abs_sum_max 4096 values, count_above 1024 at 16
thresholds, compact_above 2048, twobit 256 words = 4096 values, rangefloat 256 groups,
DCT 32 rows), inputs hold the values where compiled code and Triton's interpreter can
part ways (subnormals, -0, ties, +-Inf, NaN, codes in the sign bit of a word), and the
``gpu_big`` tests run each kernel at 2^28 + 3 elements and over 2^31 elements (the
kernels compute offsets in 64 bits; README "Kernels").
"""
import math

import pytest
import torch

from hvd_compress import kernels as K
from hvd_compress.kernels import dct as D
from hvd_compress.kernels import rangefloat as RF
from hvd_compress.kernels import twobit as TB
from gpu_helpers import DEV, GPU, NO_CUDA, ON_CPU, assert_same_bits, gib_total, laplace, laplace_cuda

pytestmark = GPU

SIZES = [1, 15, 17, 2047, 2049, 4095, 4097, 3 * 4096 + 5, 1_000_003]
FLOATS = [torch.float32, torch.float16, torch.bfloat16]
BIG = 2**28 + 3


def on_dev(t):
    return t.device.type == torch.device(DEV).type


def tricky(n, dtype=torch.float32, seed=0):
    """Laplace data with subnormals (of ``dtype``), signed zeros, exact ties and huge values."""
    x = laplace(n, seed)
    huge = 60000.0 if dtype == torch.float16 else 1e30
    specials = torch.tensor([0.0, -0.0, 1e-40, -3e-39, 0.25, -0.25, 1.0, -1.0, 3.0, huge, -huge,
                             6e-8, -6e-8, 2.0**-130])
    if ON_CPU and dtype == torch.bfloat16:
        # Triton's interpreter (3.9) flushes some bf16 subnormals to 0 when it converts
        # them to float32; compiled code (a shift) does not.  Only in the CPU self-check.
        specials[specials.abs() < 2.0**-126] = 0.5
    x[::7][: specials.numel()] = specials[: x[::7].numel()]
    if n > 100:
        x[-specials.numel():] = specials                 # the last (partial) block too
    return x.to(dtype)


# -- abs_sum_max ----------------------------------------------------------------------------

@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", FLOATS)
def test_abs_sum_max(n, dtype):
    x = tricky(n, dtype)
    xf = x.float()
    s, m = K.abs_sum_max(x.to(DEV), backend="triton")
    rs, rm = K.abs_sum_max_reference(x.to(DEV))
    cs, cm = K.abs_sum_max_reference(x)
    assert on_dev(s) and s.dtype == torch.float32 and m.dtype == torch.float32
    assert m.item() == rm.item() == cm.item() == xf.abs().max().item()
    assert s.item() == pytest.approx(cs.item(), rel=1e-5) and rs.item() == pytest.approx(cs.item(), rel=1e-5)


def test_abs_sum_max_subnormals_and_zeros():
    # Flush-to-zero in compiled code would make max|x| 0 here.
    x = torch.full((5000,), 1e-40)
    x[4321] = -3e-39
    s, m = K.abs_sum_max(x.to(DEV), backend="triton")
    assert m.item() == torch.tensor(-3e-39).abs().item() and s.item() > 0
    assert [v.item() for v in K.abs_sum_max(torch.zeros(4097, device=DEV), backend="triton")] == [0, 0]
    assert [v.item() for v in K.abs_sum_max(torch.zeros(0, device=DEV), backend="triton")] == [0, 0]


def test_abs_sum_max_inf():
    x = laplace(10_001)
    x[10_000] = -float("inf")
    s, m = K.abs_sum_max(x.to(DEV), backend="triton")
    assert math.isinf(s.item()) and math.isinf(m.item())


# -- count_above --------------------------------------------------------------------------

def thresholds(n_thr):
    base = torch.tensor([0.0, 0.25, 1.0, 3.0, 1e-40, -1.0, float("inf")])   # ties, subnormal, <0, inf
    return torch.cat([base, torch.linspace(0.05, 6, max(0, n_thr - base.numel()))])[:n_thr]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("n_thr", [1, 2, 7, 16, 33, 100])
def test_count_above(n, n_thr):
    x = tricky(n)
    x = torch.where(torch.rand(n, generator=torch.Generator().manual_seed(1)) < 0.3,
                    torch.round(x * 4) / 4, x)             # many exact ties with 0.25 steps
    thr = thresholds(n_thr)
    got = K.count_above(x.to(DEV), thr.to(DEV), backend="triton")
    assert on_dev(got) and got.dtype == torch.int64
    want = [(x.abs() > t).sum().item() for t in thr]      # brute force on the CPU
    assert got.tolist() == want
    assert K.count_above_reference(x.to(DEV), thr.to(DEV)).tolist() == want
    assert K.count_above_reference(x, thr).tolist() == want


def test_count_above_nan_never_counts():
    x = laplace(5000)
    x[::3] = float("nan")
    thr = torch.tensor([0.0, 0.5, 2.0])
    got = K.count_above(x.to(DEV), thr.to(DEV), backend="triton")
    assert got.tolist() == K.count_above_reference(x, thr).tolist()


@pytest.mark.parametrize("block", [128, 256, 1024, 8192])
def test_count_above_block_sizes(block):
    x = laplace(100_003)
    thr = thresholds(16)
    got = K.count_above(x.to(DEV), thr.to(DEV), backend="triton", block=block)
    assert got.tolist() == K.count_above_reference(x, thr).tolist()


# -- compact_above ------------------------------------------------------------------------

@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("t", [0.0, 0.75, 3.0, 1e9])
def test_compact_above(n, dtype, t):
    x = tricky(n, dtype)
    v, i = K.compact_above(x.to(DEV), t, backend="triton")
    assert i.dtype == torch.int32 and v.dtype == dtype and on_dev(v) and on_dev(i)
    brute = torch.nonzero(x.float().abs() > t).reshape(-1)          # CPU, index order
    assert_same_bits(i.cpu().long(), brute, "indices")
    assert_same_bits(v, x[brute], "values")
    rv, ri = K.compact_above_reference(x.to(DEV), t)
    assert_same_bits(i, ri, "indices vs reference")
    assert_same_bits(v, rv, "values vs reference")


def test_compact_above_threshold_on_device_and_subnormals():
    x = torch.zeros(9001)
    x[::5] = 1e-40                                   # subnormal: |x| > 0 must hold
    v, i = K.compact_above(x.to(DEV), torch.tensor(0.0, device=DEV), backend="triton")
    assert_same_bits(i.cpu().long(), torch.arange(0, 9001, 5), "indices")
    assert_same_bits(v, x[::5], "values")


# -- twobit -------------------------------------------------------------------------------

@pytest.mark.parametrize("n", SIZES + [16 * 4096, 16 * 4096 + 1])
@pytest.mark.parametrize("t", [1e-40, 0.5, 1.0, 100.0])
def test_twobit_pack_unpack(n, t):
    x = tricky(n)
    x[::11] = t                                       # exactly +t -> code 1, -t -> code 2
    x[5::11] = -t
    x[3::13] = float("nan")
    words = TB.pack(x.to(DEV), torch.tensor(t, device=DEV), backend="triton")
    assert words.dtype == torch.int32 and words.numel() == -(-n // 16)
    assert_same_bits(words, TB.pack_reference(x, t), "words vs CPU reference")
    assert_same_bits(words, TB.pack_reference(x.to(DEV), t), "words vs CUDA reference")
    signs = TB.unpack(words, backend="triton")
    assert_same_bits(signs, TB.unpack_reference(words.cpu()), "signs")


def test_twobit_code_in_sign_bit_and_all_patterns():
    # lane 15 holds bits 30-31: code 2 there sets the sign bit of the int32 word.
    x = torch.zeros(64)
    x[15::16] = -1.0
    words = TB.pack(x.to(DEV), torch.tensor(0.5, device=DEV), backend="triton")
    assert words.cpu().tolist() == [-2**31] * 4
    assert_same_bits(words, TB.pack_reference(x, 0.5), "sign-bit words")
    # every int32 pattern unpacks like the reference (code 3 = 0)
    w = torch.randint(-2**31, 2**31, (70_001,), dtype=torch.int64,
                      generator=torch.Generator().manual_seed(0)).to(torch.int32)
    w[:4] = torch.tensor([-1, -2**31, 2**31 - 1, 0], dtype=torch.int32)
    assert_same_bits(TB.unpack(w.to(DEV), backend="triton"), TB.unpack_reference(w), "unpack")


@pytest.mark.parametrize("block_words", [16, 64, 1024])
def test_twobit_block_sizes(block_words):
    x = laplace(100_003)
    words = TB.pack(x.to(DEV), torch.tensor(0.7, device=DEV), backend="triton",
                    block_words=block_words)
    assert_same_bits(words, TB.pack_reference(x, 0.7), "words")
    assert_same_bits(TB.unpack(words, backend="triton", block_words=block_words),
                     TB.unpack_reference(words.cpu()), "signs")


# -- rangefloat ---------------------------------------------------------------------------

RF_FORMATS = [(b, e, b - 1 - e) for b, (e, _) in RF.SPLITS.items()] + \
             [(8, 3, 4), (16, 8, 7), (4, 1, 2), (12, 8, 3)]


def rf_input(n, seed=0, nonfinite=False):
    x = tricky(n, seed=seed) * torch.exp2(torch.randint(-20, 5, (n,),
                                                        generator=torch.Generator().manual_seed(seed)).float())
    x[::17] = torch.tensor(1.9999999).item()              # mantissa carry into the exponent
    x[1::19] = -0.0
    if nonfinite and n > 10:
        x[2], x[5], x[n - 1] = float("nan"), float("inf"), -float("inf")
    return x


@pytest.mark.parametrize("fmt", RF_FORMATS, ids=lambda f: f"{f[0]}b_e{f[1]}")
@pytest.mark.parametrize("n", [1, 3, 255, 257, 256 * 4 + 1, 256 * 4 * 4 + 3, 300_001])
@pytest.mark.parametrize("nonfinite", [False, True])
def test_rangefloat_encode_decode(fmt, n, nonfinite):
    bits_w, e, m = fmt
    x = rf_input(n, nonfinite=nonfinite)
    emax = RF.max_exponent(x.to(DEV))
    assert on_dev(emax) and emax.item() == RF.max_exponent(x).item()
    data = RF.encode(x.to(DEV), emax, e, m, backend="triton")
    assert data.dtype == torch.uint8
    assert_same_bits(data, RF.encode_reference(x, RF.max_exponent(x), e, m), "bytes vs CPU")
    assert_same_bits(data, RF.encode_reference(x.to(DEV), emax, e, m), "bytes vs CUDA reference")
    g, nb = RF.group(bits_w)
    per_group = torch.full((data.numel() // nb,), int(emax), dtype=torch.int32)
    out = RF.decode(data, per_group.to(DEV), e, m, backend="triton")
    assert_same_bits(out, RF.decode_reference(data.cpu(), per_group, e, m), "decoded vs CPU")


@pytest.mark.parametrize("fmt", RF_FORMATS[:5], ids=lambda f: f"{f[0]}b")
def test_rangefloat_decode_any_bytes(fmt):
    bits_w, e, m = fmt
    g, nb = RF.group(bits_w)
    gen = torch.Generator().manual_seed(bits_w)
    groups = 10_007 if not ON_CPU else 1_007
    data = torch.randint(0, 256, (groups * nb,), dtype=torch.uint8, generator=gen)
    emax = torch.randint(-90, 128, (groups,), dtype=torch.int32, generator=gen)
    out = RF.decode(data.to(DEV), emax.to(DEV), e, m, backend="triton")
    assert_same_bits(out, RF.decode_reference(data, emax, e, m), "decoded")


@pytest.mark.parametrize("block", [1, 16, 1024])
def test_rangefloat_block_sizes(block):
    x = rf_input(100_003 if not ON_CPU else 3_003)
    emax = RF.max_exponent(x)
    data = RF.encode(x.to(DEV), emax.to(DEV), 4, 3, backend="triton", block=block)
    assert_same_bits(data, RF.encode_reference(x, emax, 4, 3), "bytes")
    per_group = torch.full((data.numel(),), int(emax), dtype=torch.int32)
    assert_same_bits(RF.decode(data, per_group.to(DEV), 4, 3, backend="triton", block=block),
                     RF.decode_reference(data.cpu(), per_group, 4, 3), "decoded")


# -- block DCT ----------------------------------------------------------------------------

@pytest.fixture(autouse=True, scope="module")
def _ieee_matmul():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False            # the references in full fp32
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def rel(a, b):
    """||a - b|| / ||b|| in float64 on the CPU."""
    a, b = a.detach().cpu().double(), b.detach().cpu().double()
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("block", D.BLOCKS)
@pytest.mark.parametrize("rows", [1, 31, 33, 1007])
def test_dct_against_float64(block, rows):
    n = block * rows - (block // 3 if rows > 1 else 0)       # partial last block (padded)
    x = laplace(n, seed=block)
    want = (D._pad(x, block).double() @ D.basis(block).double().T).reshape(-1)
    got = D.dct(x.to(DEV), block, backend="triton")
    ref = D.dct_reference(x.to(DEV), block)
    assert rel(got, want) <= 1e-5 and rel(got, ref) <= 1e-5
    back = D.idct(got, block, backend="triton")[:n]
    assert rel(back, x) <= 1e-5                               # README: round trip < 1e-5
    assert rel(back, D.idct_reference(got, block)[:n]) <= 1e-5


# -- at 2^28 + 3 elements -----------------------------------------------------------------

def needs_gib(gib):
    return pytest.mark.skipif(gib_total() < gib, reason=NO_CUDA if not gib_total()
                              else f"needs a GPU with >= {gib} GiB")


@pytest.mark.gpu_big
@needs_gib(40)
@pytest.mark.parametrize("kernel", ["abs_sum_max", "count_above", "compact_above", "twobit",
                                    "rangefloat", "dct"])
def test_kernels_at_2_28_plus_3(kernel, free_cuda_cache, record):
    x = laplace_cuda(BIG, seed=7)
    x[-1] = 1000.0                                            # in the very last block
    if kernel == "abs_sum_max":
        s, m = K.abs_sum_max(x, backend="triton")
        rs, rm = K.abs_sum_max_reference(x)
        assert m.item() == rm.item() == 1000.0
        assert s.item() == pytest.approx(rs.item(), rel=1e-4)
    elif kernel == "count_above":
        thr = torch.tensor([0.0, 1.0, 10.0, 999.0], device=DEV)
        got = K.count_above(x, thr, backend="triton")
        assert got.tolist() == K.count_above_reference(x, thr).tolist()
        assert got[-1].item() == 1
    elif kernel == "compact_above":
        v, i = K.compact_above(x, 12.0, backend="triton")       # ~ 2^28 e^-12: ~1.6k entries
        rv, ri = K.compact_above_reference(x, 12.0)
        assert_same_bits(i, ri, "indices")
        assert_same_bits(v, rv, "values")
        assert i[-1].item() == BIG - 1
    elif kernel == "twobit":
        words = TB.pack(x, torch.tensor(1.0, device=DEV), backend="triton")
        assert_same_bits(words, TB.pack_reference(x, 1.0), "words")
        signs = TB.unpack(words, backend="triton")
        assert_same_bits(signs, TB.unpack_reference(words), "signs")
    elif kernel == "rangefloat":
        emax = RF.max_exponent(x)
        data = RF.encode(x, emax, 4, 3, backend="triton")
        assert_same_bits(data, RF.encode_reference(x, emax, 4, 3), "bytes")
        per_group = emax.to(torch.int32).expand(data.numel()).contiguous()
        out = RF.decode(data, per_group, 4, 3, backend="triton")
        assert_same_bits(out, RF.decode_reference(data, per_group, 4, 3), "decoded")
    else:
        got = D.dct(x, 256, backend="triton")
        ref = D.dct_reference(x, 256)
        assert ((got - ref).norm() / ref.norm()).item() <= 1e-5
        assert got[-256:].abs().max().item() > 0               # the padded last block
    record("kernels_2_28", kernel, "ok")


@pytest.mark.gpu_big
@needs_gib(60)
def test_offsets_beyond_int32(free_cuda_cache):
    """2^31 + 4099 half values: element offsets past 2^31 must not wrap."""
    n = 2**31 + 4099
    x = (torch.rand(n, device=DEV, dtype=torch.float16) * 2 - 1)
    x[2**31 + 1] = -700.0
    x[-1] = 1000.0
    # abs_sum_max: the largest |x| sits past 2^31
    s, m = K.abs_sum_max(x, backend="triton")
    assert m.item() == 1000.0
    rs, _ = K.abs_sum_max_reference(x)
    assert s.item() == pytest.approx(rs.item(), rel=1e-3)
    # count_above: exactly the two planted values exceed 500
    got = K.count_above(x, torch.tensor([500.0, 0.5], device=DEV), backend="triton")
    assert got[0].item() == 2
    want_half = sum(int((x[a:b].float().abs() > 0.5).sum()) for a, b in
                    ((s_, min(s_ + 2**28, n)) for s_ in range(0, n, 2**28)))
    assert got[1].item() == want_half
    # compact_above refuses tensors whose indices do not fit int32
    with pytest.raises(ValueError, match="int32"):
        K.compact_above(x, 0.5, backend="triton")
    # twobit: the last words (values past 2^31) as the reference packs them
    words = TB.pack(x, torch.tensor(0.5, device=DEV), backend="triton")
    tail_w = 4096
    start = (words.numel() - tail_w) * 16
    assert_same_bits(words[-tail_w:], TB.pack_reference(x[start:], 0.5), "tail words")
    assert_same_bits(words[:tail_w], TB.pack_reference(x[:tail_w * 16], 0.5), "head words")
    signs = TB.unpack(words, backend="triton")
    assert_same_bits(signs[-tail_w * 16:], TB.unpack_reference(words[-tail_w:]), "tail signs")
    del signs
    # rangefloat 8 bits (one byte per value): the tail bytes and their decoding
    emax = RF.max_exponent(x[-10:])                           # 1000 -> exponent 9
    data = RF.encode(x, emax, 4, 3, backend="triton")
    assert_same_bits(data[-tail_w:], RF.encode_reference(x[-tail_w:], emax, 4, 3), "tail bytes")
    per_group = emax.to(torch.int32).expand(data.numel()).contiguous()
    out = RF.decode(data, per_group, 4, 3, backend="triton")
    assert_same_bits(out[-tail_w:], RF.decode_reference(data[-tail_w:], per_group[-tail_w:], 4, 3),
                     "tail decoded")
