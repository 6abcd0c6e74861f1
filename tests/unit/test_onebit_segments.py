"""1-bit codes of a whole bucket (hvd_compress/kernels/onebit.py: onebit's and signsgd's
bucket path where the kernels run): each kernel against its torch reference (in Triton's
interpreter on the CPU, TRITON_INTERPRET=1 from conftest.py; on CUDA tensors on a GPU),
and the bytes those of ``ops.onebit_pack`` tensor by tensor, the wire format unchanged."""
import numpy as np
import pytest
import torch

from hvd_compress.kernels import onebit as O
from hvd_compress.ops import torch_ops

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
#: none a multiple of 8 or of a block of bytes, a 1-value one
LENGTHS = (5000, 1, 300, 12001, 7, 4096)


def bucket(seed=0, dtype=torch.float32):
    x = torch.randn(sum(LENGTHS), generator=torch.Generator().manual_seed(seed)).to(dtype)
    x[10], x[20], x[5005], x[5006] = float("nan"), -0.0, float("-inf"), 0.0
    return x.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_words", [512, 64])
def test_pack_segments_is_onebit_pack_tensor_by_tensor(dtype, block_words):
    x = bucket(dtype=dtype)
    got = O.pack_segments(x, LENGTHS, backend="triton", block_words=block_words)
    assert got.dtype == torch.uint8 and torch.equal(got, O.pack_segments_reference(x, LENGTHS))
    want = torch.cat([torch_ops.onebit_pack(p >= 0) for p in torch.split(x, LENGTHS)])
    assert torch.equal(got, want)


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_decode_segments_matches_reference_and_onebit_decode_sum(ranks):
    codes = torch.stack([O.pack_segments_reference(bucket(seed=r), LENGTHS) for r in range(ranks)])
    scales = torch.randn(ranks, len(LENGTHS), 2, generator=torch.Generator().manual_seed(9))
    scales[0, 2, 1] = float("nan")                             # a NaN level stays in its tensor
    scales = scales.to(DEVICE)
    got = O.decode_segments(codes, scales, LENGTHS, backend="triton")
    want = O.decode_segments_reference(codes, scales, LENGTHS)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
    at = 0
    for s, (n, part) in enumerate(zip(LENGTHS, torch.split(want, LENGTHS))):
        w = -(-n // 8)
        table = O.decode_segments_reference(codes[:, at:at + w], scales[:, s:s + 1], (n,))
        assert torch.equal(part.nan_to_num(), table.nan_to_num()), s
        assert bool(part.isnan().any()) == (s == 2)
        at += w


def test_no_values():
    x = torch.zeros(0, device=DEVICE)
    assert O.pack_segments(x, (), backend="triton").numel() == 0


@pytest.mark.parametrize("block", [4096, 1024])
def test_segment_sign_sums_matches_reference(block):
    """onebit's levels from one pass: per tensor the count of entries >= 0, their sum and
    the sum of all (-0.0 counts as >= 0, a NaN in the last sum only; +-Inf as they are)."""
    from hvd_compress.kernels import segmented
    x = torch.from_numpy(np.random.default_rng(3).laplace(size=sum(LENGTHS)).astype(np.float32))
    x = x.to(DEVICE)
    x[7], x[5003] = -0.0, float("inf")
    x[5301 + 9] = float("nan")
    got = segmented.segment_sign_sums(x, LENGTHS, backend="triton", block=block)
    want = segmented.segment_sign_sums_reference(x, LENGTHS)
    assert got.shape == (len(LENGTHS), 3)
    assert torch.equal(got[:, 0], want[:, 0])                       # counts: exact
    assert torch.allclose(got.nan_to_num(), want.nan_to_num(), rtol=1e-5, atol=1e-3)
    assert torch.equal(got.isnan(), want.isnan()) and bool(got[3, 2].isnan())
