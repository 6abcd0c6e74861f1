"""The CPU selection paths in numpy (``ops.topk_indices``: ``np.partition``;
``kernels.compact.abs_above_cpu`` behind the compaction and count references) against
brute force in torch: the same sets, ties by lowest index, NaN and Inf, half precision,
and sizes across numpy's 64K-value chunks."""
import numpy as np
import pytest
import torch

from hvd_compress import kernels as K
from hvd_compress.kernels.compact import NUMPY_CHUNK, abs_above_cpu
from hvd_compress.ops import torch_ops as ops


def lowest_index_topk(scores, k):
    """The k largest by a stable sort: ties by lowest index (the reference)."""
    order = np.argsort(-scores.double().numpy(), kind="stable")
    return np.sort(order[:k])


@pytest.mark.parametrize("n", [1, 5, 1000, NUMPY_CHUNK + 3, 3 * NUMPY_CHUNK + 17])
@pytest.mark.parametrize("ties", [False, True])
def test_topk_indices_are_the_k_largest_ties_by_lowest_index(n, ties):
    x = torch.from_numpy(np.random.default_rng(n).laplace(size=n).astype(np.float32)).abs()
    if ties:
        x = torch.round(x * 2) / 2                    # few distinct values: many ties
    for k in sorted({1, max(1, n // 100), max(1, n // 2), max(1, n - 1), n}):
        got = ops.topk_indices(x, k)
        assert got.dtype == torch.int32 and got.numel() == k
        assert np.array_equal(np.sort(got.numpy()), lowest_index_topk(x, k)), (n, k)


def test_topk_indices_with_nan_ranks_it_highest_as_torch_does():
    x = torch.tensor([0.5, float("nan"), 2.0, 1.0, float("inf"), 0.0])
    for k in (1, 2, 3):
        got = set(ops.topk_indices(x, k).tolist())
        assert got == set(torch.topk(x, k).indices.tolist()), k
    assert set(ops.topk_indices(x, 2).tolist()) == {1, 4}     # NaN, then Inf


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_topk_indices_of_other_float_dtypes(dtype):
    x = torch.from_numpy(np.random.default_rng(1).laplace(size=5000).astype(np.float32))
    x = x.abs().to(dtype)
    got = ops.topk_indices(x, 50)
    assert np.array_equal(np.sort(got.numpy()), lowest_index_topk(x.float(), 50))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_abs_above_across_chunks_with_nan_inf_and_per_entry_thresholds(dtype):
    n = 2 * NUMPY_CHUNK + 11
    x = torch.from_numpy(np.random.default_rng(2).laplace(size=n).astype(np.float32))
    x[[3, NUMPY_CHUNK - 1, NUMPY_CHUNK, n - 1]] = torch.tensor(
        [float("nan"), float("inf"), -float("inf"), float("nan")])
    x = x.to(dtype)
    brute = lambda t: (x.float().abs() > t).numpy()           # noqa: E731 - NaN is never above
    assert np.array_equal(abs_above_cpu(x, 0.5), brute(0.5))
    assert np.array_equal(abs_above_cpu(x, torch.tensor(0.5)), brute(0.5))
    per_entry = torch.linspace(0, 3, n)
    assert np.array_equal(abs_above_cpu(x, per_entry), brute(per_entry))
    v, i = K.compact_above_reference(x, 1.0)
    assert np.array_equal(i.numpy(), np.flatnonzero(brute(1.0)))
    assert torch.equal(v, x[i.long()]) and v.dtype == dtype
    thr = torch.tensor([0.0, 1.0, 2.5])
    assert K.count_above_reference(x, thr).tolist() == [int(brute(t).sum()) for t in thr]
    assert K.count_above_reference(x, thr[1:2]).tolist() == [int(brute(1.0).sum())]
