"""2-bit codes (:mod:`.twobit`) of a *bucket*: many tensors end to end, each with its
own threshold, in one launch per pass whatever the number of tensors.

``pack_segments`` and ``decode_segments`` cover every tensor in one launch each.  Their
programs walk blocks of *words* that never straddle two tensors
(``segmented.word_table`` over the tensors' word counts ``ceil(n_s / 16)``), so a program
reads its tensor's threshold (or every rank's scale of it) once; tensor ``s``'s words
start at ``sum_{j<s} ceil(n_j/16)``, its values at ``sum_{j<s} n_j``: the same words as
packing each tensor alone, end to end.  ``pack_segments`` (and ``pack_fit``, which
computes twobit's adaptive thresholds in the same launch) also flags each tensor holding
NaN/Inf (an int32 atomic max, exact), and with ``residual=True`` writes error feedback's
residual ``x - q`` over a float32 ``x`` in the same pass; ``decode_segments`` sums
``scale[r, s] * sign`` over the ranks ``r`` in rank order (for one or two ranks the same
bits as the per-tensor decoders); ``subtract_segments`` is that residual as a pass of
its own, in place, from ``c``'s own codes (float16 too), the bits of decoding the own
payload and subtracting it.

Imports: the standard library, torch; on first use, Triton; and modules of its own
package.
"""
import functools

import torch

from ._backend import count_launch, pick_backend
from ._launch import cached
from .twobit import PER_WORD, pack_reference, unpack_reference


@functools.lru_cache(maxsize=None)
def _kernels():
    """Import Triton and define the kernels (once, on first launch)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _pack_segments_kernel(x_ptr, starts_ptr, stops_ptr, segs_ptr, xoff_ptr, woff_ptr,
                              n_ptr, t_ptr, words_ptr, bad_ptr, sum_ptr, max_ptr, first_ptr,
                              scale, BLOCK_W: tl.constexpr, FIT: tl.constexpr,
                              ALIGN: tl.constexpr, RESIDUAL: tl.constexpr):
        # ALIGN divides every tensor's offset and length in the bucket (the word table's
        # alignment): a row of 16 values is then read 16 bytes at a time.  RESIDUAL
        # (float32 x): also write x - q over x, q = +t / -t / 0 by the codes (error
        # feedback's residual, _subtract_segments_kernel's bits, in the same pass)
        pid = tl.program_id(0)
        stop = tl.load(stops_ptr + pid)                                      # word ids
        w = tl.load(starts_ptr + pid) + tl.arange(0, BLOCK_W)
        s = tl.load(segs_ptr + pid)
        lane = tl.arange(0, 16)
        local = (w - tl.load(woff_ptr + s))[:, None] * 16 + lane[None, :]   # in the tensor
        valid = (w < stop)[:, None] & (local < tl.multiple_of(tl.load(n_ptr + s), ALIGN))
        x_at = x_ptr + tl.multiple_of(tl.load(xoff_ptr + s), ALIGN) + local
        x = tl.load(x_at, mask=valid, other=0.0).to(tl.float32)
        if FIT:
            # t = scale * sum|x| / n (IEEE, as torch divides), 0 * t + 1 where not > 0 (an
            # all-zero tensor: 1; NaN stays); the tensor's first block writes its scale: t,
            # or NaN where sum|x| is NaN or max|x| infinite (a NaN/Inf in the tensor)
            a_sum = tl.load(sum_ptr + s)
            t = tl.math.div_rn(scale * a_sum, tl.load(n_ptr + s).to(tl.float32))
            t = tl.where(t > 0, t, t * 0.0 + 1.0)
            bad_fit = (a_sum != a_sum) | (tl.load(max_ptr + s) == float("inf"))
            tl.store(t_ptr + s, tl.where(bad_fit, float("nan"), t),
                     mask=pid == tl.load(first_ptr + s))
        else:
            t = tl.load(t_ptr + s)
        code = tl.where(x >= t, 1, tl.where(x <= -t, 2, 0))
        word = tl.sum(code << (2 * lane[None, :]), axis=1)                     # disjoint bits
        tl.store(words_ptr + w, word.to(tl.int32), mask=w < stop)
        if RESIDUAL:
            tl.store(x_at, x - tl.where(code == 1, t, tl.where(code == 2, -t, 0.0)), mask=valid)
        bad = tl.max(tl.max(((x != x) | (tl.abs(x) == float("inf"))).to(tl.int32), axis=1), axis=0)
        tl.atomic_max(bad_ptr + s, bad, mask=bad > 0, sem="relaxed")

    @triton.jit
    def _decode_segments_kernel(words_ptr, scale_ptr, out_ptr, starts_ptr, stops_ptr, segs_ptr,
                                xoff_ptr, woff_ptr, n_ptr, words_per_rank, segments,
                                RANKS: tl.constexpr, BLOCK_W: tl.constexpr,
                                ALIGN: tl.constexpr):
        # RANKS a constexpr: a runtime loop bound fails in Triton 3.6's interpreter
        pid = tl.program_id(0)
        stop = tl.load(stops_ptr + pid)
        w = tl.load(starts_ptr + pid) + tl.arange(0, BLOCK_W)
        s = tl.load(segs_ptr + pid)
        lane = tl.arange(0, 16)
        local = (w - tl.load(woff_ptr + s))[:, None] * 16 + lane[None, :]
        valid = (w < stop)[:, None] & (local < tl.multiple_of(tl.load(n_ptr + s), ALIGN))
        acc = tl.zeros([BLOCK_W, 16], dtype=tl.float32)
        word_ptrs = words_ptr + w                                # rank 0's; then a row on
        scale_at = scale_ptr + s
        for _ in range(RANKS):                                   # rank order, as the rows' sum
            word = tl.load(word_ptrs, mask=w < stop, other=0)
            code = (word[:, None] >> (2 * lane[None, :])) & 3
            sign = tl.where(code == 1, 1.0, tl.where(code == 2, -1.0, 0.0))
            acc += sign * tl.load(scale_at)
            word_ptrs += words_per_rank
            scale_at += segments
        tl.store(out_ptr + tl.multiple_of(tl.load(xoff_ptr + s), ALIGN) + local, acc, mask=valid)

    @triton.jit
    def _subtract_segments_kernel(c_ptr, starts_ptr, stops_ptr, segs_ptr, xoff_ptr, woff_ptr,
                                  n_ptr, t_ptr, tq_ptr, BLOCK_W: tl.constexpr,
                                  ALIGN: tl.constexpr):
        # in place: c -= q, q = +t / -t / 0 by c's own codes (compared with float32 t), of
        # t rounded to c's dtype (tq: as the decoded payload cast to it; rounded by torch,
        # as the interpreter does not round a cast to bfloat16), the difference in float32
        pid = tl.program_id(0)
        stop = tl.load(stops_ptr + pid)
        w = tl.load(starts_ptr + pid) + tl.arange(0, BLOCK_W)
        s = tl.load(segs_ptr + pid)
        lane = tl.arange(0, 16)
        local = (w - tl.load(woff_ptr + s))[:, None] * 16 + lane[None, :]
        valid = (w < stop)[:, None] & (local < tl.multiple_of(tl.load(n_ptr + s), ALIGN))
        ptrs = c_ptr + tl.multiple_of(tl.load(xoff_ptr + s), ALIGN) + local
        raw = tl.load(ptrs, mask=valid, other=0.0)
        x = raw.to(tl.float32)
        t = tl.load(t_ptr + s)
        tq = tl.load(tq_ptr + s).to(tl.float32)
        q = tl.where(x >= t, tq, tl.where(x <= -t, -tq, 0.0))
        tl.store(ptrs, (x - q).to(raw.dtype), mask=valid)

    return (triton, cached(_pack_segments_kernel), cached(_decode_segments_kernel),
            cached(_subtract_segments_kernel))


def _segment_table(lengths, device, block_words):
    """:func:`.segmented.word_table` of 2-bit codes (16 a word)."""
    from .segmented import word_table
    return word_table(lengths, PER_WORD, device, block_words)


def pack_segments_reference(x, lengths, t):
    """``(words, bad)``: :func:`pack_reference` of each tensor of the bucket ``x`` (tensors
    of ``lengths`` end to end) against its own ``t[s]``, end to end; ``bad`` int32 per
    tensor, 1 where it holds NaN/Inf."""
    parts = torch.split(x.reshape(-1), list(lengths))
    words = torch.cat([pack_reference(p, t[s]) for s, p in enumerate(parts)])
    bad = torch.stack([(~torch.isfinite(p.float())).any() for p in parts]).to(torch.int32)
    return words, bad


def decode_segments_reference(words, scales, lengths):
    """float32 bucket: tensor ``s`` is ``sum_r scales[r, s] * signs_r``, ranks added in
    order from 0.0; ``words`` every rank's bucket words (ranks x total words)."""
    ranks = scales.shape[0]
    words = words.reshape(ranks, -1)
    out, at = [], 0
    for s, n in enumerate(lengths):
        w = -(-n // PER_WORD)
        signs = unpack_reference(words[:, at:at + w].reshape(-1)).reshape(ranks, -1)[:, :n]
        acc = torch.zeros(n, dtype=torch.float32, device=words.device)
        for r in range(ranks):
            acc = acc + signs[r] * scales[r, s].float()
        out.append(acc)
        at += w
    return torch.cat(out)


def _residual_here(x, residual):
    """Can the pack write error feedback's residual over ``x`` (float32, 1-D, contiguous)?"""
    if residual:
        from .segmented import check_flat32
        check_flat32("twobit: residual=", x.numel(), x)
    return bool(residual)


def _with_residual(x, lengths, t, residual):
    """The torch path's residual: x - q over ``x`` (:func:`subtract_segments_reference`)."""
    if residual:
        x.copy_(subtract_segments_reference(x, lengths, t))


#: words (16 values each) a pack program covers: 256 (4096 values), 110 registers a thread
#: at 4 warps compiled for sm_90 with Triton 3.6 (16 warps on an SM; 64 registers at 128
#: words, 40 at 64, 2026-11-30); the H200 streamed the pack at about 1.9 TB/s
#: (2026-11-29).  Not timed otherwise: ``benchmarks/gpu_variants.py``'s ``twobit`` rows
#: time 256, 128 and 64
PACK_WORDS = 256


def pack_segments(x, lengths, t, backend=None, block_words=None, residual=False):
    """``(words, bad)`` of :func:`pack_segments_reference` in one launch (kernel on
    CUDA): the bucket's words against a threshold per tensor (``t`` float32 ``[T]``).
    ``residual``: also write ``x - q`` over ``x`` (float32), error feedback's residual
    (:func:`subtract_segments`), in the same launch."""
    lengths = tuple(int(n) for n in lengths)
    residual = _residual_here(x, residual)
    if pick_backend(x, backend) == "torch":
        out = pack_segments_reference(x, lengths, t)
        _with_residual(x, lengths, t, residual)
        return out
    triton, kernel = _kernels()[0], _kernels()[1]
    x = x.reshape(-1).contiguous()
    block_words = block_words or PACK_WORDS
    blocks, xoff, woff, n, total, align = _segment_table(lengths, x.device, block_words)
    words = torch.empty(total, dtype=torch.int32, device=x.device)
    bad = torch.zeros(len(lengths), dtype=torch.int32, device=x.device)
    t = t.float().reshape(-1).contiguous()
    count_launch("twobit_pack_segments")
    kernel[(blocks.starts.numel(),)](x, blocks.starts, blocks.stops, blocks.segs, xoff, woff, n,
                                     t, words, bad, t, t, blocks.first, 1.0,
                                     BLOCK_W=block_words, FIT=False, ALIGN=align,
                                     RESIDUAL=residual)
    return words, bad


def pack_fit_reference(x, lengths, abs_sum, abs_max, scale, residual=False):
    """:func:`pack_fit`, in torch: the thresholds as twobit computes them, then
    :func:`pack_segments_reference` (and the residual over ``x``)."""
    n = torch.tensor(list(lengths), dtype=torch.float32, device=x.device)
    t = scale * abs_sum.float() / n
    t = torch.where(t > 0, t, 0 * t + 1.0)
    words, bad = pack_segments_reference(x, lengths, t)
    _with_residual(x, lengths, t, residual)
    nonfinite = torch.isnan(abs_sum) | (abs_max == float("inf"))
    return words, torch.where(nonfinite, torch.full_like(t, float("nan")), t), bad


def pack_fit(x, lengths, abs_sum, abs_max, scale, backend=None, block_words=None,
             residual=False):
    """``(words, scales, bad)`` of a bucket with twobit's adaptive thresholds, computed in
    the pack kernel itself: ``t[s] = scale * sum|x_s| / n_s`` (``abs_sum``, ``abs_max``:
    float32 ``[T]``, a segmented pass's), 1 where not > 0, packed as
    :func:`pack_segments`; ``scales`` is ``t``, NaN where the tensor holds NaN/Inf.  One
    launch where some ten framework ops computed ``t`` and the scales before.
    ``residual``: as in :func:`pack_segments`, against ``t`` (of a tensor holding
    NaN/Inf too, whose old residual error feedback keeps anyway)."""
    lengths = tuple(int(n) for n in lengths)
    residual = _residual_here(x, residual)
    if pick_backend(x, backend) == "torch":
        return pack_fit_reference(x, lengths, abs_sum, abs_max, scale, residual)
    kernel = _kernels()[1]
    x = x.reshape(-1).contiguous()
    block_words = block_words or PACK_WORDS
    blocks, xoff, woff, n, total, align = _segment_table(lengths, x.device, block_words)
    words = torch.empty(total, dtype=torch.int32, device=x.device)
    bad = torch.zeros(len(lengths), dtype=torch.int32, device=x.device)
    scales = torch.empty(len(lengths), dtype=torch.float32, device=x.device)
    count_launch("twobit_pack_segments")
    kernel[(blocks.starts.numel(),)](x, blocks.starts, blocks.stops, blocks.segs, xoff, woff, n,
                                     scales, words, bad, abs_sum.float().contiguous(),
                                     abs_max.float().contiguous(), blocks.first, float(scale),
                                     BLOCK_W=block_words, FIT=True, ALIGN=align,
                                     RESIDUAL=residual)
    return words, scales, bad


def decode_segments(words, scales, lengths, backend=None, block_words=256):
    """:func:`decode_segments_reference` in one launch (kernel on CUDA): every rank's
    2-bit codes of every tensor of a bucket (``words``: ranks x the bucket's words,
    ``scales`` float32 ``(ranks, T)``), scaled and summed over the ranks."""
    lengths = tuple(int(n) for n in lengths)
    if pick_backend(words, backend) == "torch":
        return decode_segments_reference(words, scales, lengths)
    triton, kernel = _kernels()[0], _kernels()[2]
    blocks, xoff, woff, n, total, align = _segment_table(lengths, words.device, block_words)
    ranks = scales.shape[0]
    out = torch.empty(sum(lengths), dtype=torch.float32, device=words.device)
    count_launch("twobit_decode_segments")
    kernel[(blocks.starts.numel(),)](words.reshape(-1).contiguous(),
                                     scales.float().reshape(-1).contiguous(), out,
                                     blocks.starts, blocks.stops, blocks.segs, xoff, woff, n,
                                     total, len(lengths), RANKS=ranks, BLOCK_W=block_words,
                                     ALIGN=align)
    return out


def subtract_segments_reference(c, lengths, t):
    """``c - q`` (a new tensor of ``c``'s dtype) for a bucket ``c`` of tensors of
    ``lengths``: ``q`` each tensor's own 2-bit quantization against ``t[s]``
    (``+t[s]`` where ``c >= t[s]``, ``-t[s]`` where ``c <= -t[s]``, else 0), rounded to
    ``c``'s dtype: the bits of ``c - decode(pack(c, t))`` (one rank), error feedback's
    residual, without the decoded copy."""
    parts = torch.split(c.reshape(-1), list(lengths))
    out = []
    for s, p in enumerate(parts):
        x, ts = p.float(), t[s].float()
        q = torch.where(x >= ts, ts, torch.where(x <= -ts, -ts, torch.zeros_like(x)))
        out.append(p - q.to(p.dtype))
    return torch.cat(out) if out else c.clone()


#: dtypes :func:`subtract_segments` takes: Triton's interpreter truncates a cast from
#: float32 to bfloat16 where torch and the GPU round to nearest even, so the bits of a
#: bfloat16 kernel could not be checked without a GPU (that error feedback decodes and
#: subtracts instead)
SUBTRACT_DTYPES = (torch.float32, torch.float16)


def subtract_segments(c, lengths, t, backend=None, block_words=256):
    """:func:`subtract_segments_reference` *in place* on contiguous 1-D ``c`` (returned,
    a dtype of :data:`SUBTRACT_DTYPES`), one launch for the bucket (kernel on CUDA): one
    read and one write of ``c``, where decoding the own payload and subtracting it
    wrote, read and wrote it again."""
    lengths = tuple(int(n) for n in lengths)
    if c.dtype not in SUBTRACT_DTYPES:
        raise TypeError(f"twobit_segments.subtract_segments: c must be one of {SUBTRACT_DTYPES}, "
                        f"got {c.dtype}")
    if pick_backend(c, backend) == "torch":
        return c.copy_(subtract_segments_reference(c, lengths, t))
    triton, kernel = _kernels()[0], _kernels()[3]
    blocks, xoff, woff, n, _, align = _segment_table(lengths, c.device, block_words)
    count_launch("twobit_subtract_segments")
    t = t.float().reshape(-1).contiguous()
    kernel[(blocks.starts.numel(),)](c, blocks.starts, blocks.stops, blocks.segs, xoff, woff, n,
                                     t, t.to(c.dtype), BLOCK_W=block_words, ALIGN=align)
    return c
