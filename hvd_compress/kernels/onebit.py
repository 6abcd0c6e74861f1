"""1-bit codes of a whole *bucket* (onebit, signsgd): every tensor's signs packed 8 to a
byte, each tensor padded to whole bytes, and every rank's codes decoded and summed, in
one launch each whatever the number of tensors.

The layout is that of :func:`hvd_compress.ops.onebit_pack` tensor by tensor, end to end:
value ``i`` of a tensor is bit ``7 - i % 8`` (the first in the high bit) of its byte
``i // 8``, set where the value is ``>= 0`` (a NaN's is clear), padding bits clear.

``pack_segments(x, lengths)``
    uint8 bytes of the bucket ``x`` (tensors of ``lengths`` end to end).
``decode_segments(codes, scales, lengths)``
    float32 bucket: value ``i`` of tensor ``s`` is ``sum_r (a[r, s] if bit else
    b[r, s])``, the ranks added in order from 0.0; ``codes`` every rank's bytes (ranks x
    the bucket's bytes), ``scales`` float32 ``(ranks, T, 2)``: ``(a, b)`` per tensor.

Both walk :func:`.segmented.word_table` blocks of bytes.  References in torch beside.

Imports: the standard library, torch; on first use, Triton; and modules of its own
package.
"""
import functools

import torch

from ._backend import count_launch, pick_backend
from ._launch import cached
from .segmented import word_table

PER_BYTE = 8


@functools.lru_cache(maxsize=None)
def _kernels():
    """Import Triton and define the kernels (once, on first launch)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _pack_kernel(x_ptr, starts_ptr, stops_ptr, segs_ptr, xoff_ptr, woff_ptr, n_ptr,
                     out_ptr, BLOCK_W: tl.constexpr, ALIGN: tl.constexpr):
        # ALIGN divides every tensor's offset and length (segmented.word_table): a row of
        # 8 values is read 16 bytes at a time
        pid = tl.program_id(0)
        stop = tl.load(stops_ptr + pid)                                   # byte ids
        w = tl.load(starts_ptr + pid) + tl.arange(0, BLOCK_W)
        s = tl.load(segs_ptr + pid)
        lane = tl.arange(0, 8)
        local = (w - tl.load(woff_ptr + s))[:, None] * 8 + lane[None, :]   # in the tensor
        valid = (w < stop)[:, None] & (local < tl.multiple_of(tl.load(n_ptr + s), ALIGN))
        x = tl.load(x_ptr + tl.multiple_of(tl.load(xoff_ptr + s), ALIGN) + local, mask=valid,
                    other=-1.0)
        bit = (x.to(tl.float32) >= 0).to(tl.int32)
        byte = tl.sum(bit << (7 - lane[None, :]), axis=1)                  # disjoint bits
        tl.store(out_ptr + w, byte.to(tl.uint8), mask=w < stop)

    @triton.jit
    def _decode_kernel(codes_ptr, scale_ptr, out_ptr, starts_ptr, stops_ptr, segs_ptr,
                       xoff_ptr, woff_ptr, n_ptr, bytes_per_rank, segments,
                       RANKS: tl.constexpr, BLOCK_W: tl.constexpr, ALIGN: tl.constexpr):
        # RANKS a constexpr: a runtime loop bound fails in Triton 3.6's interpreter
        pid = tl.program_id(0)
        stop = tl.load(stops_ptr + pid)
        w = tl.load(starts_ptr + pid) + tl.arange(0, BLOCK_W)
        s = tl.load(segs_ptr + pid)
        lane = tl.arange(0, 8)
        local = (w - tl.load(woff_ptr + s))[:, None] * 8 + lane[None, :]
        valid = (w < stop)[:, None] & (local < tl.multiple_of(tl.load(n_ptr + s), ALIGN))
        acc = tl.zeros([BLOCK_W, 8], dtype=tl.float32)
        code_ptrs = codes_ptr + w                              # rank 0's; then a row on
        scale_at = scale_ptr + 2 * s
        for _ in range(RANKS):                                 # rank order
            byte = tl.load(code_ptrs, mask=w < stop, other=0).to(tl.int32)
            bit = (byte[:, None] >> (7 - lane[None, :])) & 1
            acc += tl.where(bit != 0, tl.load(scale_at), tl.load(scale_at + 1))
            code_ptrs += bytes_per_rank
            scale_at += 2 * segments
        tl.store(out_ptr + tl.multiple_of(tl.load(xoff_ptr + s), ALIGN) + local, acc, mask=valid)

    return triton, cached(_pack_kernel), cached(_decode_kernel)


def _bits(codes, n):
    """The first ``n`` bits (high bit first) of uint8 ``codes``, as bools."""
    shifts = torch.arange(7, -1, -1, device=codes.device)
    return ((codes.reshape(-1, 1).to(torch.int32) >> shifts) & 1).reshape(-1)[:n].bool()


def pack_segments_reference(x, lengths):
    """uint8 bytes of every tensor of the bucket ``x``, each padded to whole bytes."""
    out = []
    for p in torch.split(x.reshape(-1), list(lengths)):
        bits = torch.zeros(-(-p.numel() // 8) * 8, dtype=torch.int32, device=x.device)
        bits[:p.numel()] = (p.float() >= 0).to(torch.int32)
        weights = 1 << torch.arange(7, -1, -1, device=x.device, dtype=torch.int32)
        out.append((bits.reshape(-1, 8) * weights).sum(1).to(torch.uint8))
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.uint8, device=x.device)


def decode_segments_reference(codes, scales, lengths):
    """:func:`decode_segments`, in torch."""
    ranks = scales.shape[0]
    codes = codes.reshape(ranks, -1)
    scales = scales.reshape(ranks, -1, 2).float()
    out, at = [], 0
    for s, n in enumerate(lengths):
        w = -(-n // 8)
        acc = torch.zeros(n, dtype=torch.float32, device=codes.device)
        for r in range(ranks):
            acc = acc + torch.where(_bits(codes[r, at:at + w], n), scales[r, s, 0],
                                    scales[r, s, 1])
        out.append(acc)
        at += w
    return torch.cat(out) if out else torch.zeros(0, device=codes.device)


def pack_segments(x, lengths, backend=None, block_words=512):
    """:func:`pack_segments_reference` in one launch (kernel on CUDA)."""
    lengths = tuple(int(n) for n in lengths)
    if pick_backend(x, backend) == "torch":
        return pack_segments_reference(x, lengths)
    _, kernel, _ = _kernels()
    x = x.reshape(-1).contiguous()
    blocks, xoff, woff, n, total, align = word_table(lengths, PER_BYTE, x.device, block_words)
    out = torch.empty(total, dtype=torch.uint8, device=x.device)
    if total:
        count_launch("onebit_pack_segments")
        kernel[(blocks.starts.numel(),)](x, blocks.starts, blocks.stops, blocks.segs, xoff, woff,
                                         n, out, BLOCK_W=block_words, ALIGN=align)
    return out


def decode_segments(codes, scales, lengths, backend=None, block_words=512):
    """Every rank's 1-bit codes of a bucket (``codes``: ranks x the bucket's bytes;
    ``scales`` ``(ranks, T, 2)``), decoded and summed over the ranks in one launch
    (kernel on CUDA); see the module docstring."""
    lengths = tuple(int(n) for n in lengths)
    if pick_backend(codes, backend) == "torch":
        return decode_segments_reference(codes, scales, lengths)
    _, _, kernel = _kernels()
    blocks, xoff, woff, n, total, align = word_table(lengths, PER_BYTE, codes.device, block_words)
    ranks = scales.shape[0]
    out = torch.empty(sum(lengths), dtype=torch.float32, device=codes.device)
    if out.numel():
        count_launch("onebit_decode_segments")
        kernel[(blocks.starts.numel(),)](codes.reshape(-1).contiguous(),
                                         scales.float().reshape(-1).contiguous(), out,
                                         blocks.starts, blocks.stops, blocks.segs, xoff, woff,
                                         n, total, len(lengths), RANKS=ranks,
                                         BLOCK_W=block_words, ALIGN=align)
    return out
