"""PyTorch primitives, codecs family: how values are written on the wire: 2-bit codes
(twobit), range-based floats (rangefloat), the block DCT (dct), fixed point and modular
int32 (coded SGD), 1-bit codes (signsgd, onebit) and low-rank products (powersgd).

May import: torch, :mod:`.core`; lazily, :mod:`hvd_compress.kernels`.
"""
import torch as _torch


# -- 2-bit codes (twobit) ----------------------------------------------------------------

def twobit_pack(flat, t):
    """int32 words, 16 two-bit codes each (+t: 1, -t: 2, else 0)."""
    from ...kernels import twobit
    return twobit.pack(flat, t)


def twobit_unpack(words):
    """float32 signs (+1, -1, 0) of every code, 16 per word."""
    from ...kernels import twobit
    return twobit.unpack(words)


def twobit_decode_sum(words, thresholds, n):
    """Optional fast path of the 2-bit decoder, ``sum_r thresholds[r] * signs_r[:n]``:
    one table lookup per byte, scaled per rank, bit-identical (CPU).  None on CUDA,
    where the decoder's generic unpack-multiply-sum runs the kernel."""
    if words.is_cuda:
        return None
    from ...kernels import twobit
    return twobit.unpack_cpu(words, scale=thresholds, n=n)


# -- range-based float (rangefloat) ------------------------------------------------------

def max_exponent(flat):
    from ...kernels import rangefloat
    return rangefloat.max_exponent(flat)


def rangefloat_encode(flat, emax, e, m):
    from ...kernels import rangefloat
    return rangefloat.encode(flat, emax, e, m)


def rangefloat_decode(data, emax_per_group, e, m):
    from ...kernels import rangefloat
    return rangefloat.decode(data, emax_per_group, e, m)


def rangefloat_decode_ranks(data, emax, counts, e, m):
    """Fast path of the codec's decode: every rank's values, unpadded, decoded rank by
    rank with one exponent each (CPU: a table per exponent; CUDA: one kernel per rank)."""
    from ...kernels import rangefloat
    return rangefloat.decode_ranks(data, emax, counts, e, m)


# -- block DCT (dct) ---------------------------------------------------------------------

def block_dct(flat, block):
    from ...kernels import dct
    return dct.dct(flat, block)


def block_idct(coefs, block):
    from ...kernels import dct
    return dct.idct(coefs, block)


# -- fixed point and modular int32 (coded SGD, hvd_compress.coded) -----------------------

FIXED_MAX = 2 ** 31 - 1


def fixed_encode(t, value_range):
    """int32 ``q = round(t·(2³¹−1)/R)`` of 1-D ``t`` (so 0x7FFFFFFF is R, 0x80000001 is −R)
    and int64 ``[clipped, nonfinite]`` counts: |t| > R saturates, NaN becomes 0, ±Inf
    saturates.  Computed in float64, so every float32 rounds the same on every rank."""
    x = t.reshape(-1).to(_torch.float64)
    finite = _torch.isfinite(x)
    counts = _torch.stack([(finite & (x.abs() > value_range)).sum(), (~finite).sum()])
    x = _torch.nan_to_num(x, nan=0.0, posinf=value_range, neginf=-value_range)
    q = _torch.round(x.clamp(-value_range, value_range) * (FIXED_MAX / value_range))
    return q.clamp(-FIXED_MAX, FIXED_MAX).to(_torch.int32), counts


def fixed_decode(q, value_range):
    """float32 ``q·R/(2³¹−1)`` of integer ``q`` (any width), through float64."""
    return (q.to(_torch.float64) * (value_range / FIXED_MAX)).to(_torch.float32)


def wrap_int32(x):
    """int64 ``x`` modulo 2³² into int32 (two's complement): the wire form of a sum whose
    terms are subtracted again by the receiver, so the wrap-around cancels exactly."""
    return (((x + 2 ** 31) & (2 ** 32 - 1)) - 2 ** 31).to(_torch.int32)


def saturate_int32(x):
    """int64 ``x`` clamped to ±(2³¹−1) as int32, and the int64 count of clamped entries."""
    return x.clamp(-FIXED_MAX, FIXED_MAX).to(_torch.int32), (x.abs() > FIXED_MAX).sum()


def pad_to(t, n):
    """1-D ``t`` followed by zeros up to length ``n``."""
    return t if t.numel() == n else _torch.cat([t, t.new_zeros(n - t.numel())])


# -- 1-bit codes (signsgd, onebit) -------------------------------------------------------

_MAGIC_PACK = 0x8040201008040201 - 2**64   # gathers 8 bytes' low bits into the top byte
_BIT_TABLES = {}


def onebit_pack(bits):
    """uint8 words, 8 booleans each (the first in the high bit); padded with 0.  One
    multiply per 8 values: the 8 bytes (0 or 1) read as one int64, times a constant that
    moves byte i's bit to bit 63 - i without carries."""
    n = bits.numel()
    padded = _torch.zeros(-(-n // 8) * 8, dtype=_torch.uint8, device=bits.device)
    padded[:n] = bits.reshape(-1).to(_torch.uint8)
    return ((padded.view(_torch.int64) * _MAGIC_PACK) >> 56).to(_torch.uint8)


def _bit_table(device):
    """(256, 8) bool: the 8 bits of every byte value, high bit first."""
    if device not in _BIT_TABLES:
        byte = _torch.arange(256, device=device)[:, None]
        shifts = _torch.arange(7, -1, -1, device=device)
        _BIT_TABLES[device] = ((byte >> shifts) & 1).bool()
    return _BIT_TABLES[device]


def onebit_decode_sum(words, scales, n):
    """``sum_r (scales[r, 0] where bit else scales[r, 1])`` over the first ``n`` bits of
    each rank's row of ``words`` (ranks, w) uint8: a table of 256 x 8 values per rank,
    gathered by byte (no per-bit shifts)."""
    words = words.reshape(words.shape[0], -1) if words.dim() > 1 else words.reshape(1, -1)
    ranks = words.shape[0]
    tables = _torch.where(_bit_table(words.device)[None], scales[:, 0, None, None],
                          scales[:, 1, None, None])                      # (ranks, 256, 8)
    rows = _torch.arange(ranks, device=words.device)[:, None]
    values = tables[rows, words.long()].reshape(ranks, -1)[:, :n]         # (ranks, n)
    return values.sum(0)


# -- low-rank products (powersgd) --------------------------------------------------------

def matmul(a, b, transpose_a=False, transpose_b=False):
    """``a @ b`` with either operand transposed (float32 matrices)."""
    return (a.t() if transpose_a else a) @ (b.t() if transpose_b else b)


def orthonormal_columns(m):
    """An orthonormal basis of ``m``'s columns (reduced QR's Q; float32, same shape)."""
    return _torch.linalg.qr(m.float(), mode="reduced").Q
