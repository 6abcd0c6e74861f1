"""Shared helpers of the GPU tests (imported by the test modules in tests/gpu/)."""
import os

import pytest
import torch

HAVE_CUDA = torch.cuda.is_available()
NO_CUDA = ("no CUDA device (torch.cuda.is_available() is False); the GPU tests run with "
           "`make gpu-test` on a machine that has one")

# Developer switch: HVD_COMPRESS_GPU_TESTS_ON_CPU=1 runs these tests' logic on CPU tensors,
# the kernels in Triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py).  It
# checks the tests themselves, not the GPU; tests that need CUDA itself still skip.
ON_CPU = os.environ.get("HVD_COMPRESS_GPU_TESTS_ON_CPU") == "1" and not HAVE_CUDA
DEV = "cuda" if not ON_CPU else "cpu"

#: every GPU test module sets ``pytestmark = GPU``
GPU = [pytest.mark.gpu, pytest.mark.skipif(not (HAVE_CUDA or ON_CPU), reason=NO_CUDA)]
#: tests that need CUDA itself (synchronisation counts, device properties)
CUDA_ONLY = pytest.mark.skipif(not HAVE_CUDA, reason=NO_CUDA)

_INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16,
             torch.bfloat16: torch.int16, torch.float64: torch.int64}


def bits(t):
    """``t`` on the CPU, floats reinterpreted as integers (so NaN == NaN, -0 != +0)."""
    t = t.detach().cpu().contiguous()
    if t.dtype.is_floating_point and t.isnan().any():
        # one NaN for all: the sign and payload of a NaN made by an invalid operation differ
        # between devices (x86 makes 0xFFC00000, CUDA 0x7FFFFFFF), and no one can tell them apart
        t = torch.where(t.isnan(), torch.full_like(t, float("nan")), t)
    return t.view(_INT_VIEW[t.dtype]) if t.dtype in _INT_VIEW else t


def same_bits(a, b):
    """Same dtype, shape and bit pattern (device ignored)."""
    return a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape) and torch.equal(bits(a), bits(b))


def assert_same_bits(a, b, what=""):
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} != {b.dtype}"
    assert tuple(a.shape) == tuple(b.shape), f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    ia, ib = bits(a), bits(b)
    if not torch.equal(ia, ib):
        diff = (ia != ib).reshape(-1).nonzero().reshape(-1)
        i = int(diff[0])
        raise AssertionError(f"{what}: {diff.numel()} of {ia.numel()} entries differ; first at "
                             f"flat index {i}: {a.reshape(-1)[i].item()!r} vs "
                             f"{b.reshape(-1)[i].item()!r}")


def assert_same_steps(spec, sizes, want, got):
    """Two runs of a bucket's steps, each step ``(payload tensors, decompressed sum,
    residual of each tensor of ``sizes`` or None, ...)``, hold the same bits."""
    for step, (a_step, b_step) in enumerate(zip(want, got)):
        (pa, ta, ra), (pb, tb, rb) = a_step[:3], b_step[:3]
        what = f"{spec} step {step}"
        assert len(pa) == len(pb), what
        for i, (a, b) in enumerate(zip(pa, pb)):
            assert_same_bits(a, b, f"{what}: payload[{i}]")
        assert_same_bits(ta, tb, f"{what}: decompressed")
        for n, a, b in zip(sizes, ra, rb):
            assert (a is None) == (b is None), f"{what}: residual of the {n}-value tensor"
            if a is not None:
                assert_same_bits(a, b, f"{what}: residual of the {n}-value tensor")


def laplace(n, seed=0, device="cpu", dtype=torch.float32):
    """Laplace(0, 1) samples made on the CPU (same values whatever the device)."""
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(n, generator=g, dtype=torch.float64) - 0.5
    x = -torch.sign(u) * torch.log1p(-2 * u.abs())
    return x.to(dtype).to(device)


def laplace_cuda(n, seed=0, dtype=torch.float32):
    """Laplace(0, 1) samples made on the GPU (for tensors too large to make on the CPU)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    # rand() can return exactly 0 (about 2^-24 of draws: 16 times in 2^28), and u = -0.5
    # would make log1p(-1) = -inf; the smallest draw is kept one step above 0.
    u = torch.rand(n, generator=g, device=DEV).clamp_(min=2.0**-24) - 0.5
    u.copy_(-torch.sign(u) * torch.log1p(-2 * u.abs()))
    return u.to(dtype)


def gib_total():
    return torch.cuda.get_device_properties(0).total_memory / 2**30 if HAVE_CUDA else 0.0
