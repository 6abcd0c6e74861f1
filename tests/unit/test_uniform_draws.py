"""The stochastic quantizers' draws where the kernels run (hvd_compress/kernels/
uniform_draws.py): the kernel against its numpy reference (in Triton's interpreter on the
CPU, TRITON_INTERPRET=1 from conftest.py; on CUDA tensors on a GPU), a tensor's draws the
same alone as in a bucket, and QSGD and TernGrad on that path still unbiased."""
import numpy as np
import pytest
import torch

from hvd_compress.kernels import uniform_draws as U
from hvd_compress.spec import from_spec

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LENGTHS = [5000, 1, 300, 12000, 7, 4096]
WORDS = [[0xFFFFFFFF, 0x12345678], [0, 0], [1, 2], [0x80000000, 0x7FFFFFFF], [3, 9],
         [123456789, 987654321]]


@pytest.mark.parametrize("block", [1024, 4096])
def test_kernel_matches_reference_and_each_tensor_alone(block):
    words = torch.tensor(WORDS, dtype=torch.int64, device=DEVICE)
    got = U.uniform_segments(LENGTHS, words, DEVICE, backend="triton", block=block)
    assert got.dtype == torch.float32 and torch.equal(got, U.uniform_segments_reference(LENGTHS, words))
    assert float(got.min()) >= 0.0 and float(got.max()) < 1.0
    assert torch.equal(got * 2 ** 24, torch.floor(got * 2 ** 24))       # 24-bit fractions
    off = sum(LENGTHS[:3])
    alone = U.uniform_segments([LENGTHS[3]], words[3:4], DEVICE, backend="triton")
    assert torch.equal(alone, got[off:off + LENGTHS[3]])


def test_draws_look_uniform_and_differ_between_words():
    words = torch.tensor([[7, 11], [7, 12]], dtype=torch.int64, device=DEVICE)
    u = U.uniform_segments([200000, 200000], words, DEVICE, backend="triton").cpu().numpy()
    a, b = u[:200000], u[200000:]
    assert abs(a.mean() - 0.5) < 0.005 and abs(a.var() - 1 / 12) < 0.002
    counts = np.histogram(a, bins=16, range=(0, 1))[0]
    assert counts.min() > 0.95 * 200000 / 16 and counts.max() < 1.05 * 200000 / 16
    assert abs(np.corrcoef(a, b)[0, 1]) < 0.01 and not np.array_equal(a, b)


def test_bad_lengths_are_refused():
    words = torch.zeros(2, 2, dtype=torch.int64, device=DEVICE)
    for lengths in ([5], [5, 0]):
        with pytest.raises(ValueError, match="lengths"):
            U.uniform_segments(lengths, words, DEVICE, backend="triton")


@pytest.mark.parametrize("spec", ["qsgd:levels=3,block=16", "terngrad"])
def test_stochastic_quantizers_stay_unbiased_on_the_kernel_path(spec, monkeypatch):
    """E[decode(compress(g))] = g: each value is rounded at random to one of two levels
    ``step`` apart (QSGD: its block's norm / levels; TernGrad: max|g|), so the mean of N
    steps' aggregates (one rank) is within 5 standard errors, ``5 (step / 2) / sqrt(N)``,
    of g, for a tensor alone; and the draws change from step to step."""
    monkeypatch.setenv("HVD_COMPRESS_BACKEND", "triton")
    g = torch.from_numpy(np.random.default_rng(0).laplace(size=64).astype(np.float32)).to(DEVICE)
    if spec.startswith("qsgd"):
        step = g.reshape(4, 16).norm(dim=1).repeat_interleave(16) / 3
    else:
        step = g.abs().max().expand(64)
    c, runs = from_spec(spec), []
    for _ in range(300):
        payload, ctx = c.compress(g.clone(), "w")
        runs.append(c.decompress(payload, ctx))
    runs = torch.stack(runs)
    err = (runs.mean(0) - g).abs()
    assert bool((err <= 5 * (step / 2) / 300 ** 0.5).all()), float((err / step).max())
    assert bool((runs.std(0) > 0).float().mean() > 0.5)         # the draws change by step


@pytest.mark.parametrize("full", [True, False])
def test_randomk_hash_keys_kernel_matches_its_int64_torch_ops(full):
    """randomk's draw keys (53-bit, or the 32-bit key of 2j) from the kernel: the bits
    of the int64 torch ops it replaces, for counters up to 2^31 - 1 and words up to
    2^32 - 1."""
    g = torch.Generator().manual_seed(1)
    j = torch.cat([torch.randint(0, 2 ** 31 - 1, (5000,), generator=g),
                   torch.tensor([0, 1, 2 ** 31 - 1])]).to(DEVICE)
    seg = torch.randint(0, len(WORDS), (j.numel(),), generator=g).to(DEVICE)
    words = torch.tensor(WORDS, dtype=torch.int64, device=DEVICE)
    got = U.hash_keys(j, seg, words, full, backend="triton")
    want = U.hash_keys_reference(j, seg, words, full)
    assert got.dtype == torch.int64 and torch.equal(got, want)
    assert int(got.max()) < 2 ** (53 if full else 32) and int(got.min()) >= 0
