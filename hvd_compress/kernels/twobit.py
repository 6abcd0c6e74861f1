"""2-bit threshold quantization, 16 values per 32-bit word (MXNet's ``2bit``).

Code of value ``x`` with threshold ``t``: ``1`` (means ``+t``) if ``x >= t``, ``2``
(``-t``) if ``x <= -t``, else ``0``; value ``i`` of a word sits in bits ``2i..2i+1``.
Packing is bit-exact between the kernel and the reference; words are int32 (the top
code may set the sign bit).  ``t > 0`` is assumed (the compressor sends nothing
quantized for an all-zero tensor).

Buckets (many tensors end to end, each with its own threshold): :mod:`.twobit_segments`.

Imports: the standard library, numpy, torch; on first use, Triton; and modules of its
own package.
"""
import functools

import numpy as np
import torch

from ._backend import chunks, count_launch, pick_backend
from ._launch import cached

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

    return triton, cached(_pack_kernel), cached(_unpack_kernel)


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
