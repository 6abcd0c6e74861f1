"""One pass over ``x`` that counts ``|x| > t`` for many thresholds ``t`` at once.

A bisection that counts one threshold per pass reads the tensor once per step; with
``T`` thresholds per pass the bracket shrinks ``T + 1``-fold per read.  Each program
compares its block against all (padded) thresholds and adds its ``T`` counts with
integer atomics (exact, so deterministic).

Imports: the standard library, numpy, torch; on first use, Triton; and modules of its own
package.
"""
import functools

import numpy as np
import torch

from ._backend import count_launch, pick_backend
from ._launch import cached
from .compact import abs_above_cpu


@functools.lru_cache(maxsize=None)
def _kernels():
    """Import Triton and define the kernels (once, on first launch)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _count_above_kernel(x_ptr, thr_ptr, counts_ptr, n, T: tl.constexpr,
                            BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        start = pid.to(tl.int64) * BLOCK
        local = tl.arange(0, BLOCK)
        valid = local < tl.minimum(n - start, BLOCK).to(tl.int32)
        a = tl.abs(tl.load(x_ptr + start + local, mask=valid, other=0.0).to(tl.float32))
        t = tl.load(thr_ptr + tl.arange(0, T))                          # padded with +inf
        above = (a[None, :] > t[:, None]) & valid[None, :]               # [T, BLOCK]
        # a block's counts in int32 (at most BLOCK), added to the int64 totals
        tl.atomic_add(counts_ptr + tl.arange(0, T), tl.sum(above.to(tl.int32), axis=1).to(tl.int64),
                      sem="relaxed")

    return triton, cached(_count_above_kernel)


def count_above_reference(x, thresholds):
    """int64 ``[#{i : |x_i| > t} for t in thresholds]``, in torch (NaN never counts)."""
    xf = x.reshape(-1).float()
    thr = torch.as_tensor(thresholds, dtype=torch.float32, device=x.device).reshape(-1)
    if thr.numel() == 0:
        return torch.zeros(0, dtype=torch.int64, device=x.device)
    if x.device.type == "cpu":   # numpy's compares: 3-7x torch's here (see compact.py)
        if thr.numel() == 1:
            return torch.tensor([int(np.count_nonzero(abs_above_cpu(xf, thr)))])
        a = np.abs(xf.detach().numpy())
        return torch.tensor([int(np.count_nonzero(a > t)) for t in thr.numpy()],
                            dtype=torch.int64)
    if thr.numel() == 1:   # |x| > t  <=>  x > t or x < -t: no |x| materialised
        return torch.count_nonzero((xf > thr[0]) | (xf < -thr[0])).reshape(1)
    a = xf.abs()           # several thresholds: one |x|, then one compare each
    return torch.stack([torch.count_nonzero(a > t) for t in thr])


def count_above(x, thresholds, backend=None, block=None):
    """Counts of ``|x| > t`` for each threshold (int64 tensor, on x's device)."""
    thr = torch.as_tensor(thresholds, dtype=torch.float32, device=x.device).reshape(-1)
    if pick_backend(x, backend) == "torch" or x.numel() == 0 or thr.numel() == 0:
        return count_above_reference(x, thr)
    triton, _count_above_kernel = _kernels()
    x = x.reshape(-1).contiguous()
    n, t = x.numel(), thr.numel()
    t_pad = max(2, triton.next_power_of_2(t))
    padded = torch.full((t_pad,), float("inf"), dtype=torch.float32, device=x.device)
    padded[:t] = thr
    counts = torch.zeros(t_pad, dtype=torch.int64, device=x.device)
    block = block or max(128, 16384 // t_pad)                            # ~16K compares a program
    count_launch("count_above")
    _count_above_kernel[(triton.cdiv(n, block),)](x, padded, counts, n, T=t_pad, BLOCK=block)
    return counts[:t]
