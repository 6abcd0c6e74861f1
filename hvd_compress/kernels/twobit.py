"""2-bit threshold quantization, 16 values per 32-bit word (MXNet's ``2bit``).

Code of value ``x`` with threshold ``t``: ``1`` (means ``+t``) if ``x >= t``, ``2``
(``-t``) if ``x <= -t``, else ``0``; value ``i`` of a word sits in bits ``2i..2i+1``.
Packing is bit-exact between the kernel and the reference; words are int32 (the top
code may set the sign bit).  ``t > 0`` is assumed (the compressor sends nothing
quantized for an all-zero tensor).

Buckets (many tensors end to end, each with its own threshold): ``pack_segments`` and
``decode_segments`` cover every tensor in one launch each.  Their programs walk blocks of
*words* that never straddle two tensors (``segmented.block_table`` over the
tensors' word counts ``ceil(n_s / 16)``), so a program reads its tensor's threshold (or
every rank's scale of it) once; tensor ``s``'s words start at ``sum_{j<s} ceil(n_j/16)``,
its values at ``sum_{j<s} n_j``: the same words as packing each tensor alone, end to
end.  ``pack_segments`` also flags each tensor holding NaN/Inf (an int32 atomic max,
exact); ``decode_segments`` sums ``scale[r, s] * sign`` over the ranks ``r`` in rank order
(for one or two ranks the same bits as the per-tensor decoders); ``subtract_segments`` is
error feedback's residual ``c - q`` in place, from ``c``'s own codes (the bits of
decoding the own payload and subtracting it, in one pass instead of three).

Imports: the standard library, numpy, torch; on first use, Triton; and modules of its
own package.
"""
import functools

import numpy as np
import torch

from ._backend import chunks, count_launch, pick_backend

PER_WORD = 16


@functools.lru_cache(maxsize=None)
def _kernels():
    """Import Triton and define the kernels (once, on first launch)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _pack_kernel(x_ptr, t_ptr, words_ptr, n, n_words, BLOCK_W: tl.constexpr):
        pid = tl.program_id(0)
        w = pid.to(tl.int64) * BLOCK_W + tl.arange(0, BLOCK_W)               # word ids
        lane = tl.arange(0, 16)
        idx = w[:, None] * 16 + lane[None, :]
        x = tl.load(x_ptr + idx, mask=idx < n, other=0.0).to(tl.float32)
        t = tl.load(t_ptr)
        code = tl.where(x >= t, 1, tl.where(x <= -t, 2, 0))
        word = tl.sum(code << (2 * lane[None, :]), axis=1)                     # disjoint bits
        tl.store(words_ptr + w, word.to(tl.int32), mask=w < n_words)

    @triton.jit
    def _unpack_kernel(words_ptr, out_ptr, n_words, BLOCK_W: tl.constexpr):
        pid = tl.program_id(0)
        w = pid.to(tl.int64) * BLOCK_W + tl.arange(0, BLOCK_W)
        lane = tl.arange(0, 16)
        word = tl.load(words_ptr + w, mask=w < n_words, other=0)
        code = (word[:, None] >> (2 * lane[None, :])) & 3
        sign = tl.where(code == 1, 1.0, tl.where(code == 2, -1.0, 0.0))
        idx = w[:, None] * 16 + lane[None, :]
        tl.store(out_ptr + idx, sign, mask=(w < n_words)[:, None])

    @triton.jit
    def _pack_segments_kernel(x_ptr, starts_ptr, stops_ptr, segs_ptr, xoff_ptr, woff_ptr,
                              n_ptr, t_ptr, words_ptr, bad_ptr, sum_ptr, max_ptr, first_ptr,
                              scale, BLOCK_W: tl.constexpr, FIT: tl.constexpr,
                              ALIGN: tl.constexpr):
        # ALIGN divides every tensor's offset and length in the bucket (the word table's
        # alignment): a row of 16 values is then read 16 bytes at a time
        pid = tl.program_id(0)
        stop = tl.load(stops_ptr + pid)                                      # word ids
        w = tl.load(starts_ptr + pid) + tl.arange(0, BLOCK_W)
        s = tl.load(segs_ptr + pid)
        lane = tl.arange(0, 16)
        local = (w - tl.load(woff_ptr + s))[:, None] * 16 + lane[None, :]   # in the tensor
        valid = (w < stop)[:, None] & (local < tl.multiple_of(tl.load(n_ptr + s), ALIGN))
        x = tl.load(x_ptr + tl.multiple_of(tl.load(xoff_ptr + s), ALIGN) + local, mask=valid,
                    other=0.0).to(tl.float32)
        if FIT:
            # t = scale * sum|x| / n (IEEE, as torch divides), 0 * t + 1 where not > 0 (an
            # all-zero tensor: 1; NaN stays); the tensor's first block writes its scale: t,
            # or NaN where sum|x| is NaN or max|x| infinite (a NaN/Inf in the tensor)
            a_sum = tl.load(sum_ptr + s)
            t = tl.math.div_rn(scale * a_sum, tl.load(n_ptr + s).to(tl.float32))
            t = tl.where(t > 0, t, t * 0.0 + 1.0)
            bad_fit = (a_sum != a_sum) | (tl.load(max_ptr + s) == float("inf"))
            tl.store(t_ptr + s, tl.where(bad_fit, float("nan"), t), mask=pid == tl.load(first_ptr + s))
        else:
            t = tl.load(t_ptr + s)
        code = tl.where(x >= t, 1, tl.where(x <= -t, 2, 0))
        word = tl.sum(code << (2 * lane[None, :]), axis=1)                     # disjoint bits
        tl.store(words_ptr + w, word.to(tl.int32), mask=w < stop)
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

    return (triton, _pack_kernel, _unpack_kernel, _pack_segments_kernel, _decode_segments_kernel,
            _subtract_segments_kernel)


def _shifts(device):
    return 2 * torch.arange(PER_WORD, dtype=torch.int64, device=device)


def pack_reference(x, t):
    """int32 words (``ceil(n/16)``) of the codes of flat ``x`` against threshold ``t``."""
    xf = x.reshape(-1).float()
    n_words = -(-xf.numel() // PER_WORD)
    t = torch.as_tensor(t, dtype=torch.float32, device=x.device)
    code = torch.where(xf >= t, 1, torch.where(xf <= -t, 2, 0)).to(torch.int64)
    code = torch.nn.functional.pad(code, (0, n_words * PER_WORD - xf.numel()))
    words = (code.view(-1, PER_WORD) << _shifts(x.device)).sum(1)           # < 2^32
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # wrap to int32


def unpack_reference(words):
    """float32 signs (+1, -1, 0), 16 per word."""
    code = (words.to(torch.int64)[:, None] >> _shifts(words.device)) & 3
    return torch.where(code == 1, 1.0, torch.where(code == 2, -1.0, 0.0)).reshape(-1)


# -- CPU path: vectorised, bit-identical to the references -------------------------------
# Word layout is little endian: byte j of a word holds codes 4j..4j+3 at bits 2i, so a
# word is four independently packed bytes and the byte view of an int32 tensor is the
# packed stream.  (Every platform torch supports on the CPU is little endian.)

@functools.lru_cache(maxsize=None)
def _byte_signs():
    """(256, 4) float32: the signs of the four codes in every possible byte."""
    code = (torch.arange(256)[:, None] >> (2 * torch.arange(4))) & 3
    return torch.where(code == 1, 1.0, torch.where(code == 2, -1.0, 0.0)).float().numpy()


def pack_cpu(x, t):
    """:func:`pack_reference`, about 30x faster: codes as bytes, four per byte, no int64.

    The codes come from numpy's compares in 64K-value chunks (``NUMPY_CHUNK``): torch's
    ``ge``/``le`` against a scalar took 7.2-7.4 ms each for 6.3M float32 values on one
    core here (2026-11-25), numpy's about 1 ms."""
    from .compact import NUMPY_CHUNK
    xf = x.detach().reshape(-1)
    xn = (xf if xf.dtype == torch.float32 else xf.float()).numpy()
    n = xn.size
    tn = np.float32(torch.as_tensor(t, dtype=torch.float32).reshape(-1)[0])
    code = torch.zeros(-(-n // PER_WORD) * PER_WORD, dtype=torch.uint8, device=x.device)
    head = code.numpy()[:n]
    le = np.empty(min(n, NUMPY_CHUNK), dtype=bool)
    for start, stop in chunks(n, NUMPY_CHUNK):
        part, h, lo = xn[start:stop], head[start:stop], le[:stop - start]
        np.greater_equal(part, tn, out=h.view(bool))                 # 1 where x >= t
        np.less_equal(part, -tn, out=lo)                              # 2 where x <= -t
        h += lo.view(np.uint8) << np.uint8(1)
    q = code.view(-1, 4)
    byte = q[:, 3] << 6
    byte |= q[:, 2] << 4
    byte |= q[:, 1] << 2
    byte |= q[:, 0]
    return byte.view(torch.int32)


def subtract_own_cpu(c, thresholds, numels, inplace=False):
    """``c - q`` for float32 CPU ``c`` holding ``numels`` tensors end to end, ``q`` their
    own 2-bit quantization against ``thresholds`` (one per tensor), ``q = t * s`` with
    ``s`` = +1 where ``c >= t``, -1 where ``c <= -t``, else 0; in place when ``inplace``.

    The bits of ``c - decode(pack(c, t))``, which error feedback computed before (the
    decoder's product is the same ``sign * t``), without the table lookup and the decoded
    copy: numpy compares, the sign as int8, one product and one subtraction, in 64K-value
    chunks."""
    from .compact import NUMPY_CHUNK
    out = c if inplace else c.clone()
    o = out.detach().reshape(-1).numpy()
    ts = thresholds.detach().float().reshape(-1).numpy()
    size = min(o.size, NUMPY_CHUNK)
    ge, le = np.empty((2, size), dtype=bool)
    q = np.empty(size, dtype=np.float32)
    off = 0
    for n, t in zip(numels, ts):
        for start, stop in chunks(n, NUMPY_CHUNK):
            part = o[off + start:off + stop]
            m = part.size
            np.greater_equal(part, t, out=ge[:m])
            np.less_equal(part, -t, out=le[:m])
            sign = ge[:m].view(np.int8) - le[:m].view(np.int8)
            with np.errstate(invalid="ignore"):     # 0 * NaN/Inf: that tensor is not kept
                np.multiply(sign, t, out=q[:m])
            np.subtract(part, q[:m], out=part)
        off += n
    return out


#: bytes per rank from which the two-rank pair table pays for its construction: a
#: MNIST CNN step's 8 tensors (80k values) took 5.7 ms to decode with it for every
#: tensor, 2026-11-22, more than the rows path's lookups and sum
PAIR_TABLE_FROM = 1 << 16


def unpack_cpu(words, scale=None, n=None):
    """:func:`unpack_reference` through a 256-entry table of bytes (CPU tensors).

    With ``scale`` (one float per *row* of ``words`` viewed as ``(len(scale), -1)``):
    ``sum_r scale[r] * signs_r[:n]``, the 2-bit decoder of ``len(scale)`` ranks'
    payloads.  Bit-identical to the reference multiply-then-sum: the products are the
    same, and the rows are summed by ``torch.sum`` over a contiguous ``(rows, n)``
    tensor (its order of additions depends on the row count), except for one or two
    rows of positive scales, where ``a`` and ``a + b`` are the same bits and cheaper (two
    rows: one lookup per pair of bytes in a table of every ``s0 * a + s1 * b``).
    """
    table = _byte_signs()
    raw = words.contiguous().view(torch.uint8).numpy()
    if scale is None:
        return torch.from_numpy(np.take(table, raw, axis=0).reshape(-1))
    scale = scale.float().reshape(-1)
    rows = raw.reshape(scale.numel(), -1)
    positive = bool((scale > 0).all())                     # then no -0.0 anywhere
    if rows.shape[0] == 2 and positive and rows.shape[1] >= PAIR_TABLE_FROM:
        # two ranks: one lookup per byte pair in a 65536 x 4 table of s0*a + s1*b (built
        # per call: 0.3 ms, so only where there are enough bytes to pay for it)
        s0, s1 = (np.float32(s) for s in scale.tolist())
        pair_table = ((table * s0)[None, :, :] + (table * s1)[:, None, :]).reshape(-1, 4)
        pair = rows[0].astype(np.uint16) | (rows[1].astype(np.uint16) << np.uint16(8))
        return torch.from_numpy(np.take(pair_table, pair, axis=0).reshape(-1)[:n])
    scaled = np.empty((rows.shape[0], rows.shape[1] * 4), dtype=np.float32)
    for r, s in enumerate(scale.tolist()):
        np.take(table * np.float32(s), rows[r], axis=0, out=scaled[r].reshape(-1, 4))
    if rows.shape[0] == 1 and positive:
        return torch.from_numpy(scaled[0, :n])
    return torch.sum(torch.from_numpy(np.ascontiguousarray(scaled[:, :n])), 0)


def pack(x, t, backend=None, block_words=256):
    """Quantize flat ``x`` with threshold ``t`` and pack 16 codes per int32 word."""
    if pick_backend(x, backend) == "torch" or x.numel() == 0:
        return pack_cpu(x, t) if x.device.type == "cpu" else pack_reference(x, t)
    triton, pack_kernel = _kernels()[:2]
    x = x.reshape(-1).contiguous()
    n = x.numel()
    n_words = -(-n // PER_WORD)
    t = torch.as_tensor(t, dtype=torch.float32, device=x.device).reshape(1)
    words = torch.empty(n_words, dtype=torch.int32, device=x.device)
    count_launch("twobit_pack")
    pack_kernel[(triton.cdiv(n_words, block_words),)](x, t, words, n, n_words, BLOCK_W=block_words)
    return words


def unpack(words, backend=None, block_words=256):
    """float32 signs of every code in ``words`` (``16 * len(words)`` values)."""
    if pick_backend(words, backend) == "torch" or words.numel() == 0:
        return unpack_cpu(words) if words.device.type == "cpu" else unpack_reference(words)
    triton, _, unpack_kernel = _kernels()[:3]
    words = words.contiguous()
    out = torch.empty(words.numel() * PER_WORD, dtype=torch.float32, device=words.device)
    count_launch("twobit_unpack")
    unpack_kernel[(triton.cdiv(words.numel(), block_words),)](words, out, words.numel(),
                                                              BLOCK_W=block_words)
    return out


# -- buckets: every tensor in one launch -------------------------------------------------

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


def pack_segments(x, lengths, t, backend=None, block_words=256):
    """``(words, bad)`` of :func:`pack_segments_reference` in one launch (kernel on
    CUDA): the bucket's words against a threshold per tensor (``t`` float32 ``[T]``)."""
    lengths = tuple(int(n) for n in lengths)
    if pick_backend(x, backend) == "torch":
        return pack_segments_reference(x, lengths, t)
    triton, kernel = _kernels()[0], _kernels()[3]
    x = x.reshape(-1).contiguous()
    blocks, xoff, woff, n, total, align = _segment_table(lengths, x.device, block_words)
    words = torch.empty(total, dtype=torch.int32, device=x.device)
    bad = torch.zeros(len(lengths), dtype=torch.int32, device=x.device)
    t = t.float().reshape(-1).contiguous()
    count_launch("twobit_pack_segments")
    kernel[(blocks.starts.numel(),)](x, blocks.starts, blocks.stops, blocks.segs, xoff, woff, n,
                                     t, words, bad, t, t, blocks.first, 1.0,
                                     BLOCK_W=block_words, FIT=False, ALIGN=align)
    return words, bad


def pack_fit_reference(x, lengths, abs_sum, abs_max, scale):
    """:func:`pack_fit`, in torch: the thresholds as twobit computes them, then
    :func:`pack_segments_reference`."""
    n = torch.tensor(list(lengths), dtype=torch.float32, device=x.device)
    t = scale * abs_sum.float() / n
    t = torch.where(t > 0, t, 0 * t + 1.0)
    words, bad = pack_segments_reference(x, lengths, t)
    nonfinite = torch.isnan(abs_sum) | (abs_max == float("inf"))
    return words, torch.where(nonfinite, torch.full_like(t, float("nan")), t), bad


def pack_fit(x, lengths, abs_sum, abs_max, scale, backend=None, block_words=256):
    """``(words, scales, bad)`` of a bucket with twobit's adaptive thresholds, computed in
    the pack kernel itself: ``t[s] = scale * sum|x_s| / n_s`` (``abs_sum``, ``abs_max``:
    float32 ``[T]``, a segmented pass's), 1 where not > 0, packed as
    :func:`pack_segments`; ``scales`` is ``t``, NaN where the tensor holds NaN/Inf.  One
    launch where some ten framework ops computed ``t`` and the scales before."""
    lengths = tuple(int(n) for n in lengths)
    if pick_backend(x, backend) == "torch":
        return pack_fit_reference(x, lengths, abs_sum, abs_max, scale)
    kernel = _kernels()[3]
    x = x.reshape(-1).contiguous()
    blocks, xoff, woff, n, total, align = _segment_table(lengths, x.device, block_words)
    words = torch.empty(total, dtype=torch.int32, device=x.device)
    bad = torch.zeros(len(lengths), dtype=torch.int32, device=x.device)
    scales = torch.empty(len(lengths), dtype=torch.float32, device=x.device)
    count_launch("twobit_pack_segments")
    kernel[(blocks.starts.numel(),)](x, blocks.starts, blocks.stops, blocks.segs, xoff, woff, n,
                                     scales, words, bad, abs_sum.float().contiguous(),
                                     abs_max.float().contiguous(), blocks.first, float(scale),
                                     BLOCK_W=block_words, FIT=True, ALIGN=align)
    return words, scales, bad


def decode_segments(words, scales, lengths, backend=None, block_words=256):
    """:func:`decode_segments_reference` in one launch (kernel on CUDA): every rank's
    2-bit codes of every tensor of a bucket (``words``: ranks x the bucket's words,
    ``scales`` float32 ``(ranks, T)``), scaled and summed over the ranks."""
    lengths = tuple(int(n) for n in lengths)
    if pick_backend(words, backend) == "torch":
        return decode_segments_reference(words, scales, lengths)
    triton, kernel = _kernels()[0], _kernels()[4]
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
        raise TypeError(f"twobit.subtract_segments: c must be one of {SUBTRACT_DTYPES}, "
                        f"got {c.dtype}")
    if pick_backend(c, backend) == "torch":
        return c.copy_(subtract_segments_reference(c, lengths, t))
    triton, kernel = _kernels()[0], _kernels()[5]
    blocks, xoff, woff, n, _, align = _segment_table(lengths, c.device, block_words)
    count_launch("twobit_subtract_segments")
    t = t.float().reshape(-1).contiguous()
    kernel[(blocks.starts.numel(),)](c, blocks.starts, blocks.stops, blocks.segs, xoff, woff, n,
                                     t, t.to(c.dtype), BLOCK_W=block_words, ALIGN=align)
    return c
