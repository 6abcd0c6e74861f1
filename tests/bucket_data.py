"""Data and comparisons shared by the bucket kernel tests (``tests/unit/test_bucket_launches.py``,
``test_rangefloat_segments.py``): Laplace values on the device the kernels run on (CUDA
when there is one, else the CPU, where conftest.py sets ``TRITON_INTERPRET=1``), segment
lengths that no block divides, and a bucket with NaN, Inf, zeros and subnormals in some
segments only; and the ranks' pairs of the aggregate-order tests (``shared_pairs``)."""
import numpy as np
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
#: segment lengths: none a multiple of a block, a 1-value one, an empty one
LENGTHS = (5000, 1, 300, 0, 4099, 7, 1024)
BITS = (4, 6, 8, 12, 16)


def laplace(n, seed=0, dyadic=False):
    x = np.random.default_rng(seed).laplace(size=n)
    if dyadic:                       # multiples of 1/64: every sum of |x| is exact
        x = np.round(x * 64) / 64
    return torch.from_numpy(x.astype(np.float32)).to(DEVICE)


def with_specials(x):
    """NaN, +-Inf, zeros and subnormals in some segments of LENGTHS only."""
    x = x.clone()
    x[10] = float("nan")              # segment 0
    x[5301 + 5] = float("inf")         # segment 4
    x[5301 + 6] = float("-inf")
    x[5000] = 0.0                      # segment 1: the 1-value segment is zero
    x[5001:5301] = 1e-40               # segment 2: subnormals (float32), zeros below
    return x


def same_bits(a, b):
    """Same dtype, shape and bits (floats compared as their int32 patterns)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.is_floating_point:
        a, b = a.view(torch.int32), b.view(torch.int32)
    return torch.equal(a, b)


def same_values(a, b):
    """Equal, NaN where the other is NaN."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


def shared_pairs(ranks, k, n, seed, pad=0):
    """``ranks`` ranks' pairs as an allgather concatenates them: each rank's indices
    distinct, most shared with the other ranks, magnitudes 1e-3 to 1e3 (sums that
    round); ``pad`` more a rank at its first index with 0.0, as ``padded=1`` sends."""
    g = torch.Generator().manual_seed(seed)
    common = torch.randperm(n, generator=g)[:k]
    idx, values = [], []
    for _ in range(ranks):
        own = torch.cat([common[:k - k // 4], torch.randperm(n, generator=g)[:k // 4]])
        own = torch.unique(own)[torch.randperm(torch.unique(own).numel(), generator=g)]
        v = torch.randn(own.numel(), generator=g) * torch.logspace(-3, 3, own.numel())
        idx += [own, own[:1].repeat(pad)]
        values += [v.float(), torch.zeros(pad)]
    lengths = [int(a.numel() + b.numel()) for a, b in zip(idx[::2], idx[1::2])]
    return torch.cat(idx), torch.cat(values), lengths
