"""Every Triton kernel against its torch reference (on the CPU under TRITON_INTERPRET=1,
set by conftest.py; on a GPU, on CUDA tensors).  Sizes include ones that are not
multiples of the block size."""
import numpy as np
import pytest
import torch

from hvd_compress import kernels as K

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SIZES = [1, 7, 2047, 2048, 2049, 4097, 50_003]


def data(n, dtype=torch.float32, seed=0, ties=False):
    x = torch.from_numpy(np.random.default_rng(seed).laplace(size=n).astype(np.float32))
    if ties:
        x = torch.round(x * 4) / 4          # many exactly equal magnitudes
    return x.to(dtype).to(DEVICE)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_abs_sum_max(n, dtype):
    x = data(n, dtype)
    s, m = K.abs_sum_max(x, backend="triton")
    rs, rm = K.abs_sum_max_reference(x)
    assert m.item() == rm.item()                                   # max is exact
    assert s.item() == pytest.approx(rs.item(), rel=1e-5)          # sum: order of adds


def test_abs_sum_max_of_empty_and_zero():
    assert [v.item() for v in K.abs_sum_max(torch.zeros(0, device=DEVICE), "triton")] == [0, 0]
    assert [v.item() for v in K.abs_sum_max(torch.zeros(5000, device=DEVICE), "triton")] == [0, 0]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("n_thr", [1, 5, 16, 33])
def test_count_above(n, n_thr):
    x = data(n, ties=True)
    thr = torch.cat([torch.tensor([0.0, 0.25, 1.0]),               # 0.25, 1.0: exact ties
                     torch.linspace(0.1, 5, max(0, n_thr - 3))])[:n_thr].to(DEVICE)
    got = K.count_above(x, thr, backend="triton")
    want = K.count_above_reference(x, thr)
    assert got.dtype == torch.int64
    assert got.tolist() == want.tolist()
    brute = [(x.abs() > t).sum().item() for t in thr]
    assert want.tolist() == brute


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("t", [0.0, 0.75, 3.0, 1e9])
def test_compact_above(n, dtype, t):
    x = data(n, dtype, ties=True)
    v, i = K.compact_above(x, t, backend="triton")
    rv, ri = K.compact_above_reference(x, t)
    assert i.dtype == torch.int32 and v.dtype == dtype
    assert torch.equal(i, ri) and torch.equal(v, rv)             # same order: index order
    brute = torch.nonzero(x.float().abs() > t).reshape(-1)
    assert torch.equal(ri.long(), brute)
    assert torch.equal(rv, x[brute])


def test_compact_above_with_threshold_tensor():
    x = data(10_000)
    v, i = K.compact_above(x, torch.tensor(2.0, device=DEVICE), backend="triton")
    assert torch.equal(i.long(), torch.nonzero(x.abs() > 2.0).reshape(-1))


def test_backend_argument_is_checked():
    with pytest.raises(ValueError, match="backend"):
        K.abs_sum_max(torch.ones(3), backend="cuda")
