"""Range-based float: encode float32 into ``bits = 1 + e + m``-bit codes whose exponent
range is taken from the data, bit-packed into bytes (seed 002).

Code of ``x`` (``E`` = exponent of ``max|x|``): sign bit, exponent code
``c = E - exponent(x) + 1`` in ``1 .. 2^e - 1`` (``c = 0`` means zero), and the
mantissa rounded to ``m`` bits (half up; a carry raises the exponent; above ``E`` it
clamps to the largest code).  Values whose exponent is below ``E - 2^e + 2``, zeros and
subnormals encode as 0.  Non-finite values keep ``E = 128`` so Inf/NaN decode as
Inf/NaN.  Everything is integer bit manipulation of the float32 pattern, so kernel and
reference agree bit for bit.

Packing: ``g = lcm(bits, 8) / bits`` codes fill ``lcm(bits, 8) / 8`` bytes, little
endian (4 bits: 2 codes/byte; 6: 4 codes/3 bytes; 8: 1/byte; 12: 2/3 bytes;
16: 1/2 bytes).  Codes are padded to whole groups.

This module holds the format, the torch references, the CPU path (table lookups) and the
launchers for one tensor.  The Triton kernels live in :mod:`.rangefloat_segments`, which
codes many segments with an exponent each (a bucket's tensors, the gathered ranks'
tensors) in a fixed number of launches; one tensor is the same kernels without a block
table (``TABLE=False``).

Imports: the standard library, numpy, torch; and modules of its own package (which
import Triton on first launch).
"""
import functools
import math

import numpy as np
import torch

from ._backend import count_launch, pick_backend

SPLITS = {4: (2, 1), 6: (3, 2), 8: (4, 3), 12: (5, 6), 16: (5, 10)}   # bits: (e, m)


def group(bits):
    """``(codes per group, bytes per group)`` for a code width."""
    lcm = bits * 8 // math.gcd(bits, 8)
    return lcm // bits, lcm // 8


def max_exponent(x):
    """int32 0-d tensor: the float32 exponent of ``max|x|`` (128 if non-finite)."""
    xf = x.reshape(-1).float()
    if xf.numel():
        lo, hi = torch.aminmax(xf)                       # one pass, no |x| tensor
        peak = torch.maximum(-lo, hi)                    # NaN propagates
    else:
        peak = torch.zeros((), device=x.device)
    e = ((peak.reshape(1).view(torch.int32) >> 23) & 0xFF)[0] - 127
    return torch.where(torch.isfinite(peak), e, torch.full_like(e, 128))   # no host sync


def _codes_reference(xf, emax, e, m):
    """int64 code of every float32 in ``xf`` (not packed)."""
    b = xf.view(torch.int32).to(torch.int64)
    sign, expf, mant = (b >> 31) & 1, (b >> 23) & 0xFF, b & 0x7FFFFF
    shift = 23 - m
    q = (mant + (1 << (shift - 1))) >> shift
    carry = q >> m
    q = q & ((1 << m) - 1)
    q = torch.where((expf == 255) & (mant != 0), (1 << m) - 1, q)
    c = torch.as_tensor(emax, device=xf.device).to(torch.int64) - (expf - 127 + carry) + 1
    q = torch.where(c < 1, (1 << m) - 1, q)
    c = torch.clamp(c, min=1)
    zero = (expf == 0) | (c > (1 << e) - 1)
    return torch.where(zero, 0, (sign << (e + m)) | (c << m) | q)


def encode_reference(x, emax, e, m):
    """uint8 bytes of the codes of flat ``x`` (padded to whole groups)."""
    bits_w = 1 + e + m
    g, nb = group(bits_w)
    xf = x.reshape(-1).float()
    n_groups = -(-xf.numel() // g)
    xf = torch.nn.functional.pad(xf, (0, n_groups * g - xf.numel()))
    code = _codes_reference(xf, emax, e, m)
    lanes = bits_w * torch.arange(g, device=x.device)
    word = (code.view(-1, g) << lanes).sum(1)
    out = (word[:, None] >> (8 * torch.arange(nb, device=x.device))) & 0xFF
    return out.reshape(-1).to(torch.uint8)


def decode_reference(data, emax_per_group, e, m):
    """float32 values (``g`` per group) of packed codes; ``emax_per_group`` int32."""
    bits_w = 1 + e + m
    g, nb = group(bits_w)
    raw = data.reshape(-1, nb).to(torch.int64)
    word = (raw << (8 * torch.arange(nb, device=data.device))).sum(1)
    code = (word[:, None] >> (bits_w * torch.arange(g, device=data.device))) & ((1 << bits_w) - 1)
    sign, c, q = (code >> (e + m)) & 1, (code >> m) & ((1 << e) - 1), code & ((1 << m) - 1)
    expf = emax_per_group.to(torch.int64)[:, None] - c + 1 + 127
    bits = (sign << 31) | (expf << 23) | (q << (23 - m))
    bits = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)
    value = torch.where(c == 0, 0.0, bits.view(torch.float32))
    return value.reshape(-1)


# -- CPU path: table lookups, bit-identical to the references ---------------------------
# Encoding: the code of a float32 depends only on its top ``m + 10`` bits (sign, exponent,
# the ``m`` kept mantissa bits and the one below them, which decides the rounding:
# ``(mant + 2^(s-1)) >> s == ((mant >> (s-1)) + 1) >> 1``), except that a NaN whose top
# mantissa bits are zero looks like Inf -- and the two get different codes only when
# ``E >= 128`` (a non-finite tensor), where the reference runs instead.  So one lookup in
# a table of ``2^(m+10)`` codes, built by the reference itself for each ``E``, encodes a
# value.  Decoding: one lookup in a table of the ``2^bits`` values for the group's ``E``.

@functools.lru_cache(maxsize=512)
def _encode_table(emax, e, m):
    low = 23 - m - 1
    pattern = torch.arange(1 << (32 - low), dtype=torch.int64) << low
    floats = torch.where(pattern >= 2**31, pattern - 2**32, pattern).to(torch.int32)
    codes = _codes_reference(floats.view(torch.float32), emax, e, m).numpy()
    return codes.astype(np.uint8 if 1 + e + m <= 8 else np.uint16)


@functools.lru_cache(maxsize=512)
def _decode_table(emax, e, m):
    bits = 1 + e + m
    g, _ = group(bits)
    codes = np.arange(1 << bits, dtype=np.uint32)
    data = torch.from_numpy(_pack_codes(codes, bits))
    per_group = torch.full((codes.size // g,), emax, dtype=torch.int32)
    return decode_reference(data, per_group, e, m).numpy()


def _pack_codes(codes, bits):
    """numpy codes (a whole number of groups) -> the reference's packed bytes."""
    g, nb = group(bits)
    if bits == 8:
        return codes.astype(np.uint8, copy=False)
    if bits == 16:
        return codes.astype(np.uint16, copy=False).view(np.uint8)     # little endian
    if bits == 4:                                  # pairs as uint16 (c0 | c1 << 8): one byte
        w = codes.astype(np.uint8, copy=False).view(np.uint16)
        return (w | (w >> np.uint16(4))).astype(np.uint8)
    c = codes.reshape(-1, g).astype(np.uint32)
    word = c[:, 0].copy()
    for j in range(1, g):
        word |= c[:, j] << np.uint32(bits * j)
    return np.ascontiguousarray(word.view(np.uint8).reshape(-1, 4)[:, :nb]).reshape(-1)


def _unpack_codes(data, bits):
    """Inverse of :func:`_pack_codes`: numpy codes, ``g`` per group."""
    g, nb = group(bits)
    if bits == 8:
        return data
    if bits == 16:
        return data.view(np.uint16)
    if bits == 4:                                  # byte -> (low nibble, high nibble)
        b = data.astype(np.uint16)
        return ((b & np.uint16(0xF)) | ((b << np.uint16(4)) & np.uint16(0xF00))).view(np.uint8)
    raw = data.reshape(-1, nb).astype(np.uint32)
    word = raw[:, 0].copy()
    for j in range(1, nb):
        word |= raw[:, j] << np.uint32(8 * j)
    codes = np.empty((word.size, g), dtype=np.uint16)
    for j in range(g):
        codes[:, j] = (word >> np.uint32(bits * j)) & np.uint32((1 << bits) - 1)
    return codes.reshape(-1)


def encode_cpu(x, emax, e, m):
    """:func:`encode_reference` by table lookup (CPU tensors; ``E >= 128``: the reference)."""
    emax_int = int(emax)
    if emax_int >= 128 or x.device.type != "cpu":
        return encode_reference(x, emax, e, m)
    bits = 1 + e + m
    g, _ = group(bits)
    xf = x.reshape(-1)
    xf = (xf if xf.dtype == torch.float32 else xf.float()).contiguous()
    n = xf.numel()
    table = _encode_table(emax_int, e, m)
    idx = np.zeros(-(-n // g) * g, dtype=np.uint32)            # padding: +0.0, code 0
    np.right_shift(xf.numpy().view(np.uint32), np.uint32(23 - m - 1), out=idx[:n])
    return torch.from_numpy(_pack_codes(table[idx], bits))      # (fancy indexing beats np.take)


def decode_cpu(data, emax_per_group, e, m, max_runs=64):
    """:func:`decode_reference` by table lookup, one table per run of equal ``E``."""
    if data.device.type != "cpu":
        return decode_reference(data, emax_per_group, e, m)
    bits = 1 + e + m
    g, _ = group(bits)
    em = emax_per_group.to(torch.int32).numpy()
    if em.size == 0:
        return torch.zeros(0, dtype=torch.float32)
    starts = np.flatnonzero(em[1:] != em[:-1]) + 1
    if starts.size >= max_runs:
        return decode_reference(data, emax_per_group, e, m)
    codes = _unpack_codes(data.contiguous().numpy(), bits)
    out = np.empty(codes.size, dtype=np.float32)
    bounds = [0, *starts.tolist(), em.size]
    for a, b in zip(bounds[:-1], bounds[1:]):
        out[a * g:b * g] = _decode_table(int(em[a]), e, m)[codes[a * g:b * g]]
    return torch.from_numpy(out)


def decode_ranks_cpu(data, emax, counts, e, m):
    """The first ``counts[r]`` values of each rank's segment of ``data`` (rank ``r``'s
    codes padded to whole groups, exponent ``emax[r]``), concatenated: what the codec's
    generic decode computes with per-group exponents and a mask, without either."""
    bits = 1 + e + m
    g, nb = group(bits)
    counts, emax = counts.tolist(), emax.tolist()
    raw = data.contiguous().numpy()
    out = np.empty(sum(counts), dtype=np.float32)
    start = pos = 0
    for em, count in zip(emax, counts):
        size = -(-count // g) * nb
        codes = _unpack_codes(raw[start:start + size], bits)[:count]
        out[pos:pos + count] = _decode_table(int(em), e, m)[codes]
        start, pos = start + size, pos + count
    return torch.from_numpy(out)


def encode(x, emax, e, m, backend=None, block=256):
    """Pack the rangefloat codes of flat ``x`` into bytes (kernel on CUDA)."""
    if pick_backend(x, backend) == "torch" or x.numel() == 0:
        return encode_cpu(x, emax, e, m)
    # one launch of the bucket encode kernel, one segment, no table (``block`` groups a
    # program)
    from .rangefloat_segments import _kernels
    triton, _, kernel, _ = _kernels()
    x, (g, nb) = x.reshape(-1).contiguous(), group(1 + e + m)
    emax = torch.as_tensor(emax, dtype=torch.int32, device=x.device).reshape(1)
    n_groups = -(-x.numel() // g)
    out = torch.empty(n_groups * nb, dtype=torch.uint8, device=x.device)
    count_launch("rangefloat_encode")
    kernel[(triton.cdiv(n_groups, block),)](x, x, x, x, x, x, emax, out, x, x.numel(), E_BITS=e,
                                            M_BITS=m, G=g, NB=nb, BLOCK=block * g, TABLE=False,
                                            DECODED=False, MINUS=False)
    return out


def decode(data, emax_per_group, e, m, backend=None, block=256, out=None):
    """float32 values of packed codes (``g`` per group; kernel on CUDA).

    ``emax_per_group``: int32, one exponent per group, or a single one (0-d or 1 element)
    for all groups.  ``out``: where to write (at least groups * g floats), else new."""
    if pick_backend(data, backend) == "torch" or data.numel() == 0:
        if emax_per_group.numel() == 1:
            emax_per_group = emax_per_group.reshape(1).expand(data.numel() // group(1 + e + m)[1])
        got = decode_cpu(data, emax_per_group, e, m)
        return got if out is None else out[:got.numel()].copy_(got)
    # one launch of the bucket decode kernel, one segment (an exponent, or one per group)
    from .rangefloat_segments import _kernels
    triton, _, _, kernel = _kernels()
    g, nb = group(1 + e + m)
    if out is None:
        out = torch.empty(data.numel() // nb * g, dtype=torch.float32, device=data.device)
    emax = emax_per_group.to(torch.int32).reshape(-1).contiguous()
    n_groups = data.numel() // nb
    data = data.contiguous()
    count_launch("rangefloat_decode")
    kernel[(triton.cdiv(n_groups, block),)](data, data, data, data, data, data, emax, 1, out,
                                            n_groups * g, n_groups * nb, 0, E_BITS=e, M_BITS=m,
                                            G=g, NB=nb, BLOCK=block * g, TABLE=False,
                                            PER_GROUP=emax.numel() != 1, RANKS=1)
    return out


def decode_ranks(data, emax, counts, e, m, backend=None):
    """Every rank's values, unpadded and concatenated: rank ``r``'s segment of ``data``
    holds ``counts[r]`` codes padded to whole groups, all with exponent ``emax[r]``.

    On CUDA one host synchronisation (the total, to size the output), then one launch for
    every rank (:func:`.rangefloat_segments.decode_segments`; a generic decode of
    repeat_interleave + nonzero took 13 ms for 2 ranks of 25M values on an H100,
    2026-11-22).  On the CPU: ``decode_ranks_cpu``."""
    if pick_backend(data, backend) == "torch":
        return decode_ranks_cpu(data, emax, counts, e, m)
    from .rangefloat_segments import decode_segments
    counts = counts.to(torch.int64)
    return decode_segments(data, emax, counts, e, m, total=int(counts.sum()), backend=backend)
