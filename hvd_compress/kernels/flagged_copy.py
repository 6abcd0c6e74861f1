"""A copy that happens only where a flag on the device says so, without reading the flag
on the host: error feedback's "no poisoning" rule (a bucket holding NaN/Inf keeps the
residuals it had) with no host synchronisation.

``copy_if_flagged(dst, src, flags)``: ``dst[:] = src`` when any of the integer ``flags`` is
non-zero, else nothing; in place on ``dst``.  The kernel reads the flags in every
program and masks its loads and stores with them, so in the common case (no flag) it
moves no data: one launch, no pass over the buffer; where a flag is set, one read of
``src`` and one write of ``dst``.  Bit-exact (a copy).

Imports: the standard library, torch; on first use, Triton; and modules of its own
package.
"""
import functools

import torch

from ._backend import count_launch, pick_backend
from ._launch import cached

BLOCK = 4096


@functools.lru_cache(maxsize=None)
def _kernels():
    """Import Triton and define the kernel (once, on first launch)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _copy_if_flagged_kernel(dst_ptr, src_ptr, flags_ptr, n, n_flags,
                                FLAGS: tl.constexpr, BLOCK: tl.constexpr):
        f = tl.arange(0, FLAGS)
        flag = tl.max(tl.load(flags_ptr + f, mask=f < n_flags, other=0), axis=0)
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        keep = (offs < n) & (tl.zeros([BLOCK], dtype=tl.int32) + flag != 0)   # a block mask
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=keep), mask=keep)

    return triton, cached(_copy_if_flagged_kernel)


def copy_if_flagged_reference(dst, src, flags):
    """``dst`` (returned), overwritten with ``src`` where ``flags.any()``."""
    return dst.copy_(torch.where(flags.reshape(-1).ne(0).any(), src.reshape(dst.shape), dst))


def copy_if_flagged(dst, src, flags, backend=None, block=BLOCK):
    """:func:`copy_if_flagged_reference` in one launch (kernel on CUDA), ``dst`` and
    ``src`` contiguous, of one dtype and size; ``flags`` int32 or int64, any other dtype
    converted to int32 (a few thousand at most: every program reads them all)."""
    if pick_backend(dst, backend) == "torch":
        return copy_if_flagged_reference(dst, src, flags)
    if src.dtype != dst.dtype or src.numel() != dst.numel():
        raise ValueError(f"copy_if_flagged: src {src.dtype} [{src.numel()}] does not match dst "
                         f"{dst.dtype} [{dst.numel()}]")
    n = dst.numel()
    if n == 0:
        return dst
    triton, kernel = _kernels()
    flags = flags.reshape(-1)
    flags = (flags if flags.dtype == torch.int64 else flags.to(torch.int32)).contiguous()
    count_launch("copy_if_flagged")
    kernel[(triton.cdiv(n, block),)](dst, src.reshape(-1).contiguous(), flags, n, flags.numel(),
                                     FLAGS=triton.next_power_of_2(max(flags.numel(), 1)),
                                     BLOCK=block)
    return dst
