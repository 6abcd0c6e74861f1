"""One pass over ``x`` for ``sum|x|`` and ``max|x|`` (the Laplace fit needs mean|x|).

Each program reduces one block to a partial sum and max; the partials are combined by
torch in a fixed order, so the result is deterministic (no float atomics).

Imports: the standard library, torch; on first use, Triton; and modules of its own
package.
"""
import functools

import torch

from ._backend import chunks, count_launch, pick_backend
from ._launch import cached


@functools.lru_cache(maxsize=None)
def _kernels():
    """Import Triton and define the kernels (once, on first launch)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _abs_sum_max_kernel(x_ptr, part_sum_ptr, part_max_ptr, n, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)     # 64-bit: n may exceed 2^31
        a = tl.abs(tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32))
        tl.store(part_sum_ptr + pid, tl.sum(a, axis=0))
        tl.store(part_max_ptr + pid, tl.max(a, axis=0))

    return triton, cached(_abs_sum_max_kernel)


def abs_sum_max_reference(x):
    """``(sum|x|, max|x|)`` as float32 0-d tensors, in torch."""
    xf = x.reshape(-1)
    total = torch.zeros((), dtype=torch.float32, device=x.device)
    peak = torch.zeros((), dtype=torch.float32, device=x.device)
    for start, stop in chunks(xf.numel()):   # |x| of a chunk stays in cache
        a = xf[start:stop].float().abs()
        total += a.sum()
        peak = torch.maximum(peak, a.max())
    return total, peak


def abs_sum_max(x, backend=None, block=4096):
    """``(sum|x|, max|x|)`` of the flat tensor ``x``; Triton on CUDA, torch elsewhere."""
    if pick_backend(x, backend) == "torch" or x.numel() == 0:
        return abs_sum_max_reference(x)
    triton, _abs_sum_max_kernel = _kernels()
    x = x.reshape(-1).contiguous()
    n = x.numel()
    programs = triton.cdiv(n, block)
    part_sum = torch.empty(programs, dtype=torch.float32, device=x.device)
    part_max = torch.empty(programs, dtype=torch.float32, device=x.device)
    count_launch("abs_sum_max")
    _abs_sum_max_kernel[(programs,)](x, part_sum, part_max, n, BLOCK=block)
    return part_sum.sum(), part_max.max()
