"""The headers of range-float payloads (:mod:`.rangefloat_segments`) checked in one
program: what a decompress must know before it decodes another rank's bytes.

A payload's headers are ``[E, count]`` int32 pairs, one per segment (tensor and rank).
Its bytes hold, per segment, ``ceil(count / g)`` groups of ``nb`` bytes (``g`` codes of
``1 + e + m`` bits per group, :func:`.rangefloat.group`).  ``header_stats`` gives, as one
int64 device tensor ``[values, expected bytes, bad, lo, hi]``:

- ``values = sum_s max(count_s, 0)``, the values the headers describe;
- ``expected = nb * sum_s ceil(max(count_s, 0) / g)``, the bytes they describe;
- ``bad = 1`` when a header holds an exponent outside ``[-127, 128]``, a negative count,
  or (given ``want``, the counts every rank's payload must hold, per tensor) a count
  other than ``want[s mod T]``, or (given ``sizes``, the host's ``(values, bytes)``)
  other totals;
- ``lo, hi``: the payload indices' ``(min, max)`` (``bounds``, two 0-d tensors, for
  example of ``torch.aminmax``), copied so that one read-back gets them too; 0 without.

In torch these are some 17 framework ops (20 with the bounds' stack and cast), each a
launch on CUDA; the kernel is one launch of one program, and the caller reads the five
numbers back in its one host synchronisation.

Imports: the standard library, torch; on first use, Triton; and modules of its own
package.
"""
import functools

import torch

from ._backend import count_launch, pick_backend
from ._launch import cached

HB = 1024   #: headers one loop step of the program takes
WIDTHS = (torch.int32, torch.int64)   #: header dtypes the kernel reads as they are


@functools.lru_cache(maxsize=None)
def _kernels():
    """Import Triton and define the kernel (once, on first launch)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _header_stats_kernel(emax_ptr, counts_ptr, H, e_stride, c_stride, want_ptr, T,
                             lo_ptr, hi_ptr, out_ptr, want_values, want_bytes,
                             G: tl.constexpr, NB: tl.constexpr,
                             HB: tl.constexpr, CHUNKS: tl.constexpr, WANT: tl.constexpr,
                             BOUNDS: tl.constexpr):
        # one program; CHUNKS = cdiv(H, HB) is a constexpr (Triton 3.6's interpreter
        # takes no loop over a runtime count).  Per header the headers' own width (int32
        # in a payload), and its groups are count // G plus one for a remainder (no
        # overflow near the largest count)
        zero = tl.sum(tl.zeros([HB], dtype=tl.int64), axis=0)      # an int64 scalar, 0
        values, groups, bad = zero, zero, zero
        for c in range(CHUNKS):
            h = c * HB + tl.arange(0, HB)
            m = h < H
            e = tl.load(emax_ptr + h * e_stride, mask=m, other=0)
            n = tl.load(counts_ptr + h * c_stride, mask=m, other=0)
            odd = (e < -127) | (e > 128) | (n < 0)
            if WANT:
                odd |= n != tl.load(want_ptr + h % T, mask=m, other=0)
            bad = tl.maximum(bad, tl.max((odd & m).to(tl.int64), axis=0))
            n = tl.maximum(n, 0)
            values += tl.sum(n.to(tl.int64), axis=0)
            groups += tl.sum((n // G + (n % G != 0).to(tl.int32)).to(tl.int64), axis=0)
        # the sizes the caller knows (-1: none): other ones are bad too
        bad = tl.maximum(bad, ((want_values >= 0) & (values != want_values)).to(tl.int64))
        bad = tl.maximum(bad, ((want_bytes >= 0) & (groups * NB != want_bytes)).to(tl.int64))
        lo, hi = zero, zero
        if BOUNDS:
            lo = tl.load(lo_ptr).to(tl.int64)
            hi = tl.load(hi_ptr).to(tl.int64)
        col = tl.arange(0, 8)
        got = tl.where(col == 0, values, tl.where(col == 1, groups * NB,
                                                  tl.where(col == 2, bad, 0)))
        got = tl.where(col == 3, lo, tl.where(col == 4, hi, got))
        tl.store(out_ptr + col, got, mask=col < 5)

    return triton, cached(_header_stats_kernel)


def header_stats_reference(emax, counts, g, nb, want=None, bounds=None, sizes=None):
    """:func:`header_stats` in torch."""
    counts = counts.reshape(-1).to(torch.int64)
    emax = emax.reshape(-1)
    odd = (emax < -127) | (emax > 128) | (counts < 0)
    if want is not None and counts.numel():
        want = want.reshape(-1).to(torch.int64)
        odd |= counts != want.repeat(-(-counts.numel() // want.numel()))[:counts.numel()]
    n = counts.clamp(min=0)
    lo_hi = (torch.stack([b.reshape(()) for b in bounds]).to(torch.int64) if bounds is not None
             else torch.zeros(2, dtype=torch.int64, device=counts.device))
    values, expected = n.sum(), ((n + (g - 1)) // g).sum() * nb
    bad = odd.any()
    if sizes is not None:
        bad = bad | (values != sizes[0]) | (expected != sizes[1])
    return torch.cat([torch.stack([values, expected, bad.to(torch.int64)]), lo_hi])


def header_stats(emax, counts, g, nb, want=None, bounds=None, sizes=None, backend=None):
    """int64 ``[values, expected bytes, bad, lo, hi]`` of the headers ``(emax[s],
    counts[s])`` (1-D int32 as a payload holds them, any stride: for example the two
    columns of an ``[S, 2]`` header view; int64 too; other dtypes are copied to int64), in
    one launch of one program (kernel on CUDA), no host synchronisation; see the module
    docstring.  ``want``: int32 counts per tensor (rank ``r``'s headers follow ``r``
    times ``len(want)`` others); ``bounds``: two 0-d integer tensors to copy into
    ``lo, hi``; ``sizes``: host ``(values, bytes)`` the headers must describe (``bad``
    otherwise: a payload whose number of values the host knows from its indices)."""
    if pick_backend(emax, backend) == "torch":
        return header_stats_reference(emax, counts, g, nb, want, bounds, sizes)
    if emax.dim() != 1 or counts.dim() != 1 or emax.numel() != counts.numel():
        raise ValueError(f"header_stats: emax {tuple(emax.shape)} and counts "
                         f"{tuple(counts.shape)} must be 1-D of one length")
    if emax.dtype not in WIDTHS or counts.dtype not in WIDTHS:      # a malformed payload
        emax, counts = emax.to(torch.int64), counts.to(torch.int64)
    triton, kernel = _kernels()
    out = torch.empty(5, dtype=torch.int64, device=emax.device)
    H = emax.numel()
    want_t = out if want is None else want.reshape(-1).to(torch.int32).contiguous()
    lo, hi = (out, out) if bounds is None else bounds
    count_launch("header_stats")
    kernel[(1,)](emax, counts, H, emax.stride(0), counts.stride(0), want_t,
                 max(1, want_t.numel()), lo, hi, out, *(sizes or (-1, -1)), G=g, NB=nb, HB=HB,
                 CHUNKS=max(1, triton.cdiv(H, HB)), WANT=want is not None,
                 BOUNDS=bounds is not None)
    return out
