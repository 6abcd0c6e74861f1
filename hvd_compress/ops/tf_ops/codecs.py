"""TensorFlow primitives, codecs family: how values are written on the wire: 2-bit codes
(twobit), range-based floats (rangefloat), the block DCT (dct), fixed point and modular
int32 (coded SGD), 1-bit codes (signsgd, onebit) and low-rank products (powersgd); the
TensorFlow references of the kernels.

May import: tensorflow, :mod:`.core`; lazily, numpy.  Never torch or
:mod:`hvd_compress.kernels`.
"""
import weakref as _weakref

import tensorflow as _tf

from .core import numel


# -- 2-bit codes (twobit) ----------------------------------------------------------------

def twobit_pack(flat, t):
    """int32 words of the 2-bit codes of ``flat`` against ``t`` (> 0), 16 a word, the last
    padded with code 0; in int32 throughout: the shifted codes share no bit, so their sum
    is their OR and never overflows (code 2 of the last slot is the sign bit)."""
    x = _tf.cast(_tf.reshape(flat, [-1]), _tf.float32)
    n = numel(flat)
    one, two, zero, shifts, _ = _twobit_constants(x)
    code = _tf.pad(_tf.where(x >= t, one, _tf.where(x <= -t, two, zero)),
                   [[0, -(-n // 16) * 16 - n]])
    return _tf.reduce_sum(_tf.bitwise.left_shift(_tf.reshape(code, [-1, 16]), shifts), axis=1)


def twobit_unpack(words):
    """float32 signs (+1, -1, 0) of int32 ``words``' 2-bit codes, 16 a word."""
    one, two, _, shifts, (plus, minus, nought) = _twobit_constants(words)
    code = _tf.bitwise.bitwise_and(_tf.bitwise.right_shift(
        _tf.reshape(_tf.cast(words, _tf.int32), [-1, 1]), shifts), 3)
    return _tf.reshape(_tf.where(code == one, plus, _tf.where(code == two, minus, nought)),
                       [-1])


_CONSTANTS = {}                               # (what, device) -> eager constants
_GRAPH_CONSTANTS = _weakref.WeakKeyDictionary()  # graph -> {what: its constants}


def _constants(what, make, like):
    """``make()``'s constants, made once per device of ``like`` in eager mode (not once
    per tensor of a bucket: converting twobit's was a tenth of a bucket's time) and once
    per graph inside ``tf.function`` (not a Const node per tensor)."""
    if not _tf.executing_eagerly():
        made = _GRAPH_CONSTANTS.setdefault(_tf.compat.v1.get_default_graph(), {})
        if what not in made:
            made[what] = make()
        return made[what]
    key = (what, like.device)
    if key not in _CONSTANTS:
        with _tf.device(like.device):
            _CONSTANTS[key] = make()
    return _CONSTANTS[key]


def _twobit_constants(like):
    return _constants("twobit", _make_twobit_constants, like)


def _make_twobit_constants():
    return (_tf.constant(1, _tf.int32), _tf.constant(2, _tf.int32), _tf.constant(0, _tf.int32),
            2 * _tf.range(16, dtype=_tf.int32),
            tuple(_tf.constant(v, _tf.float32) for v in (1.0, -1.0, 0.0)))


def twobit_decode_sum(words, thresholds, n):
    """No table-lookup fast path in TensorFlow: the 2-bit decoder's generic path runs."""
    return None


def twobit_subtract_own(c, thresholds, numels, inplace):
    """2-bit error feedback's ``c - decode(own payload)`` from float32 ``c`` and the
    thresholds alone (one per tensor of ``numels``): ``sign * t`` with the sign from
    ``c``'s own compares, +1.0, -1.0 or 0.0 as the decoder makes it, so the same bits
    without unpacking the words.  None for other dtypes (the generic decode runs)."""
    if c.dtype != _tf.float32:
        return None
    parts = _tf.split(_tf.reshape(c, [-1]), list(numels))
    ts = _tf.unstack(_tf.cast(_tf.reshape(thresholds, [-1]), _tf.float32), num=len(numels))
    return _tf.concat([p - (_tf.cast(p >= t, _tf.float32) - _tf.cast(p <= -t, _tf.float32)) * t
                       for p, t in zip(parts, ts)], 0)


def rangefloat_decode_sum(data, headers, lengths, e, m, trusted=False, what="rangefloat"):
    """No bucket kernels in TensorFlow: the codec's generic decode runs."""
    return None


#: the codecs whose bucket functions below code a bucket in one call: each tensor as
#: alone, without the generic loop's ops around it (twobit, 160 tensors: 13,046 graph
#: ops, not 29,478; benchmarks/tf_bucket_ops.py, 2026-12-01)
_VECTORISED = frozenset({"twobit"})


def bucket_codec_kernels(flat, codec=None):
    """Is a bucket coded by one call of the bucket functions?  Here for the codecs of
    :data:`_VECTORISED`, asked by name (``codec``); never for
    ``codec=None`` (every codec, and the passes that write in place: PyTorch's kernels)."""
    return codec in _VECTORISED


def _pack_each(flat, layout, t):
    # one pack per tensor, as alone (a handful of ops each): broadcasting the thresholds
    # over the bucket, or gathering them, made a compress and decompress 1.3-1.9x as
    # long on the CPU
    x = _tf.cast(_tf.reshape(flat, [-1]), _tf.float32)
    parts = _tf.split(x, list(layout.numels))
    ts = _tf.unstack(t, num=len(layout.numels))
    return _tf.concat([twobit_pack(p, ts[s]) for s, p in enumerate(parts)], 0)


def twobit_pack_segments(flat, layout, t, residual=False):
    """``(words, bad)`` of a bucket, each tensor against its own ``t[s]`` (> 0), the same
    words as :func:`twobit_pack` tensor by tensor; ``bad`` int32, 1 where a tensor holds
    NaN/Inf.  ``residual``: a third element, None (nothing is written in place here)."""
    from .segments import segment_abs_sum_max
    abs_sum, abs_max = segment_abs_sum_max(flat, layout)
    out = (_pack_each(flat, layout, t), _bad(abs_sum, abs_max))
    return (*out, None) if residual else out


def twobit_pack_fit(flat, layout, abs_sum, abs_max, scale, residual=False):
    """``(words, scales, bad)`` with twobit's adaptive thresholds ``scale * sum|x| / n``
    per tensor (1 where not > 0), the scales NaN where a tensor holds NaN/Inf, as the
    PyTorch kernel's (:func:`hvd_compress.kernels.twobit_segments.pack_fit_reference`).
    ``residual``: as in :func:`twobit_pack_segments`."""
    n = _tf.constant([max(v, 1) for v in layout.numels], _tf.float32)
    t = scale * abs_sum / n
    t = _tf.where(t > 0, t, 0 * t + 1.0)
    bad = _bad(abs_sum, abs_max)
    out = (_pack_each(flat, layout, t), _tf.where(bad > 0, t * float("nan"), t), bad)
    return (*out, None) if residual else out


def _bad(abs_sum, abs_max):
    """int32 per tensor, 1 where it holds NaN (its sum of magnitudes is NaN) or Inf."""
    return _tf.cast(_tf.math.is_nan(abs_sum) | (abs_max == float("inf")), _tf.int32)


def segment_sign_sums(flat, layout):
    """PyTorch only (a Triton kernel); :func:`bucket_codec_kernels` is False here."""
    raise NotImplementedError("segment_sign_sums runs on PyTorch tensors only")


def onebit_pack_segments(flat, layout):
    """PyTorch only (a Triton kernel); :func:`bucket_codec_kernels` is False here."""
    raise NotImplementedError("onebit_pack_segments runs on PyTorch tensors only")


def onebit_decode_segments(codes, scales, lengths):
    """No bucket fast path in TensorFlow: the 1-bit decoder goes tensor by tensor."""
    return None


def uniform_segments(layout, seeds, steps, like):
    """PyTorch only (a Triton kernel); :func:`bucket_codec_kernels` is False here."""
    raise NotImplementedError("uniform_segments runs on PyTorch tensors only")


def segment_sum(values, lengths):
    """float32 sums of consecutive runs of ``values`` of ``lengths``."""
    ids = _tf.repeat(_tf.range(_tf.size(lengths)), _tf.cast(lengths, _tf.int32))
    return _tf.math.segment_sum(_tf.cast(values, _tf.float32), ids)


def twobit_decode_segments(words, scales, lengths):
    """float32 bucket: tensor ``s`` is ``sum_r scales[r, s] * signs_r``, every rank's
    words ``(ranks, words)`` and ``scales`` ``(ranks, T)``: the decoder's arithmetic
    tensor by tensor (the same bits), a handful of ops each (unpacking the bucket at once
    and splitting it took 1.5x as long on the CPU, 2026-12-01)."""
    ranks = _tf.shape(words)[0]
    widths = [-(-n // 16) for n in lengths]
    parts = _tf.split(words, widths, axis=1)
    cols = _tf.split(_tf.cast(scales, _tf.float32), len(lengths), axis=1)
    out = []
    for p, c, n, w in zip(parts, cols, lengths, widths):
        signs = _tf.reshape(twobit_unpack(_tf.reshape(p, [-1])), [ranks, w * 16])
        out.append(_tf.reduce_sum((signs[:, :n] if n < w * 16 else signs) * c, axis=0))
    return _tf.concat(out, 0)


# -- range-based float (rangefloat) ------------------------------------------------------

def max_exponent(flat):
    a = _tf.abs(_tf.cast(_tf.reshape(flat, [-1]), _tf.float32))
    peak = _tf.reduce_max(_tf.concat([a, [0.0]], 0))      # also for empty, dynamic sizes
    k = _constants("max_exponent", _make_max_exponent_constants, a)
    e = _tf.bitwise.bitwise_and(_tf.bitwise.right_shift(_tf.bitcast(peak, _tf.int32), k[23]),
                                k[0xFF]) - k[127]
    return _tf.where(_tf.math.is_finite(peak), e, k[128])


def _make_max_exponent_constants():
    return {v: _tf.constant(v, _tf.int32) for v in (23, 0xFF, 127, 128)}


def _group(bits):
    import math
    lcm = bits * 8 // math.gcd(bits, 8)
    return lcm // bits, lcm // 8


def _make_rangefloat_constants(e, m):
    """int64 constants of :func:`rangefloat_encode` for ``e`` exponent and ``m`` mantissa
    bits, by name (made once per graph or device: not a Const node each per tensor)."""
    g, nb = _group(1 + e + m)
    shift = 23 - m
    values = {"one": 1, "sign_at": 31, "exp_at": 23, "exp_mask": 0xFF, "mant_mask": 0x7FFFFF,
              "shift": shift, "half": 1 << (shift - 1), "m": m, "q_max": (1 << m) - 1,
              "nan_exp": 255, "zero": 0, "bias": 127, "c_max": (1 << e) - 1, "sign_to": e + m}
    k = {name: _tf.constant(v, _tf.int64) for name, v in values.items()}
    k["lanes"] = (1 + e + m) * _tf.range(g, dtype=_tf.int64)
    k["bytes"] = 8 * _tf.range(nb, dtype=_tf.int64)
    return k


def rangefloat_encode(flat, emax, e, m):
    bits_w = 1 + e + m
    g, nb = _group(bits_w)
    x = _tf.cast(_tf.reshape(flat, [-1]), _tf.float32)
    k = _constants(("rangefloat", e, m), lambda: _make_rangefloat_constants(e, m), x)
    n = x.shape[0]
    if n is None:                                  # a dynamic length: pad in the graph
        n = _tf.size(x)
        x = _tf.pad(x, [[0, (n + g - 1) // g * g - n]])
    elif n % g:
        x = _tf.pad(x, [[0, -n % g]])
    b = _tf.cast(_tf.bitcast(x, _tf.int32), _tf.int64)
    sh, band, ls = _tf.bitwise.right_shift, _tf.bitwise.bitwise_and, _tf.bitwise.left_shift
    sign = band(sh(b, k["sign_at"]), k["one"])
    expf, mant = band(sh(b, k["exp_at"]), k["exp_mask"]), band(b, k["mant_mask"])
    q = sh(mant + k["half"], k["shift"])
    carry = sh(q, k["m"])
    q = band(q, k["q_max"])
    q = _tf.where((expf == k["nan_exp"]) & (mant != k["zero"]), k["q_max"], q)
    c = _tf.cast(emax, _tf.int64) - (expf - k["bias"] + carry) + k["one"]
    q = _tf.where(c < k["one"], k["q_max"], q)
    c = _tf.maximum(c, k["one"])
    zero = (expf == k["zero"]) | (c > k["c_max"])
    code = _tf.where(zero, k["zero"],
                     _tf.bitwise.bitwise_or(_tf.bitwise.bitwise_or(ls(sign, k["sign_to"]),
                                                                   ls(c, k["m"])), q))
    word = code if g == 1 else _tf.reduce_sum(ls(_tf.reshape(code, [-1, g]), k["lanes"]),
                                              axis=1)
    if nb == 1:
        return _tf.cast(word, _tf.uint8)        # (the low byte: the code fits in it)
    out = band(sh(_tf.reshape(word, [-1, 1]), k["bytes"]), k["exp_mask"])
    return _tf.cast(_tf.reshape(out, [-1]), _tf.uint8)


def rangefloat_decode(data, emax_per_group, e, m):
    bits_w = 1 + e + m
    g, nb = _group(bits_w)
    sh, band, ls = _tf.bitwise.right_shift, _tf.bitwise.bitwise_and, _tf.bitwise.left_shift
    raw = _tf.cast(_tf.reshape(data, [-1, nb]), _tf.int64)
    word = _tf.reduce_sum(ls(raw, 8 * _tf.range(nb, dtype=_tf.int64)), axis=1)
    code = band(sh(word[:, None], bits_w * _tf.range(g, dtype=_tf.int64)), (1 << bits_w) - 1)
    sign, c, q = band(sh(code, e + m), 1), band(sh(code, m), (1 << e) - 1), band(code, (1 << m) - 1)
    expf = _tf.cast(emax_per_group, _tf.int64)[:, None] - c + 1 + 127
    bits = _tf.bitwise.bitwise_or(_tf.bitwise.bitwise_or(ls(sign, 31), ls(expf, 23)), ls(q, 23 - m))
    bits = _tf.cast(_tf.where(bits >= 2**31, bits - 2**32, bits), _tf.int32)
    value = _tf.where(c == 0, 0.0, _tf.bitcast(bits, _tf.float32))
    return _tf.reshape(value, [-1])


def rangefloat_decode_ranks(data, emax, counts, e, m):
    """No rank-by-rank fast path in TensorFlow: the codec's generic decode runs."""
    return None


def rangefloat_encode_segments(values, counts, lengths, e, m, write=None, add=None,
                               source=None):
    """No bucket fast path in TensorFlow: the codec encodes tensor by tensor."""
    if add is not None or source is not None:   # (error feedback defers it on PyTorch only)
        raise NotImplementedError("rangefloat_encode_segments(add=): PyTorch only")
    return None


def rangefloat_decode_segments(data, emax, counts, e, m, lengths=None, total=None, check=None):
    """No bucket fast path in TensorFlow: the codec's generic decode runs."""
    return None


def _dct_basis(block):
    import math
    import numpy as np
    k = np.arange(block)[:, None]
    i = np.arange(block)[None, :]
    d = np.cos(math.pi * (2 * i + 1) * k / (2 * block)) * math.sqrt(2.0 / block)
    d[0] /= math.sqrt(2.0)
    return _tf.constant(d.astype(np.float32))


# -- block DCT (dct) ---------------------------------------------------------------------

def block_dct(flat, block):
    x = _tf.cast(_tf.reshape(flat, [-1]), _tf.float32)
    x = _tf.pad(x, [[0, -numel(flat) % block]])
    return _tf.reshape(_tf.matmul(_tf.reshape(x, [-1, block]), _dct_basis(block), transpose_b=True), [-1])


def block_idct(coefs, block):
    return _tf.reshape(_tf.matmul(_tf.reshape(_tf.cast(coefs, _tf.float32), [-1, block]),
                                  _dct_basis(block)), [-1])


def dct_blocks(flat, block, inverse=False):
    """The block DCT (``inverse``: its inverse) of each block of ``flat`` (whole blocks)
    on its own (a batched product of one-row matrices)."""
    rows = _tf.reshape(_tf.cast(flat, _tf.float32), [-1, 1, block])
    return _tf.reshape(_tf.matmul(rows, _dct_basis(block), transpose_b=not inverse), [-1])


def dct_segments(flat, numels, block):
    """:func:`block_dct` of each tensor of a bucket (``numels`` end to end), the padded
    coefficients end to end (tensor by tensor in TensorFlow)."""
    if len(numels) == 1:
        return block_dct(flat, block)
    pieces = _tf.split(_tf.reshape(flat, [-1]), [int(n) for n in numels])
    return _tf.concat([block_dct(p, block) for p in pieces], 0)


def idct_segments(coefs, numels, block):
    """Inverse of :func:`dct_segments`: the tensors end to end, padding dropped."""
    padded = [-(-int(n) // block) * block for n in numels]
    pieces = _tf.split(_tf.reshape(coefs, [-1]), padded) if len(numels) > 1 else [coefs]
    return _tf.concat([block_idct(p, block)[:int(n)] for p, n in zip(pieces, numels)], 0)


# -- fixed point and modular int32 (coded SGD, hvd_compress.coded) -----------------------

FIXED_MAX = 2 ** 31 - 1


def fixed_encode(t, value_range):
    x = _tf.cast(_tf.reshape(t, [-1]), _tf.float64)
    finite = _tf.math.is_finite(x)
    clipped = _tf.reduce_sum(_tf.cast(finite & (_tf.abs(x) > value_range), _tf.int64))
    nonfinite = _tf.reduce_sum(_tf.cast(~finite, _tf.int64))
    x = _tf.where(_tf.math.is_nan(x), _tf.zeros_like(x), x)
    q = _tf.round(_tf.clip_by_value(x, -value_range, value_range) * (FIXED_MAX / value_range))
    q = _tf.clip_by_value(q, -FIXED_MAX, FIXED_MAX)
    return _tf.cast(q, _tf.int32), _tf.stack([clipped, nonfinite])


def fixed_decode(q, value_range):
    return _tf.cast(_tf.cast(q, _tf.float64) * (value_range / FIXED_MAX), _tf.float32)


def wrap_int32(x):
    return _tf.cast(_tf.math.floormod(x + 2 ** 31, 2 ** 32) - 2 ** 31, _tf.int32)


def saturate_int32(x):
    big = _tf.constant(FIXED_MAX, _tf.int64)
    return (_tf.cast(_tf.clip_by_value(x, -big, big), _tf.int32),
            _tf.reduce_sum(_tf.cast(_tf.abs(x) > big, _tf.int64)))


def pad_to(t, n):
    m = int(t.shape[0])
    return t if m == n else _tf.concat([t, _tf.zeros([n - m], t.dtype)], 0)


# -- 1-bit codes (signsgd, onebit) -------------------------------------------------------

def onebit_pack(bits):
    """uint8 words, 8 booleans each (the first in the high bit); padded with 0."""
    n = numel(bits)
    padded = pad_to(_tf.cast(_tf.reshape(bits, [-1]), _tf.int32), -(-n // 8) * 8)
    weights = _tf.constant([128, 64, 32, 16, 8, 4, 2, 1], dtype=_tf.int32)
    return _tf.cast(_tf.reduce_sum(_tf.reshape(padded, [-1, 8]) * weights, 1), _tf.uint8)


def onebit_decode_sum(words, scales, n):
    """``sum_r (scales[r, 0] where bit else scales[r, 1])`` over the first ``n`` bits of
    each rank's row of ``words`` (ranks, w) uint8: a table of 256 x 8 values per rank,
    gathered by byte."""
    rows = words if len(words.shape) > 1 else _tf.reshape(words, [1, -1])
    level = _constants("onebit", _make_onebit_levels, rows)
    tables = _tf.gather(scales, level, axis=1)             # (ranks, 256, 8): a or b
    values = _tf.gather(tables, _tf.cast(rows, _tf.int32), batch_dims=1)  # (ranks, w, 8)
    return _tf.reduce_sum(_tf.reshape(values, [_tf.shape(rows)[0], -1])[:, :n], 0)


def _make_onebit_levels():
    """(256, 8) int32: for byte ``v`` and bit ``j`` (the high bit first), 0 where the bit
    is set (the level ``a``) and 1 where it is clear (``b``)."""
    byte = _tf.range(256, dtype=_tf.int32)[:, None]
    return 1 - _tf.bitwise.bitwise_and(
        _tf.bitwise.right_shift(byte, _tf.constant([7, 6, 5, 4, 3, 2, 1, 0])), 1)


# -- low-rank products (powersgd) --------------------------------------------------------

def matmul(a, b, transpose_a=False, transpose_b=False):
    """``a @ b`` with either operand transposed (float32 matrices)."""
    return _tf.linalg.matmul(a, b, transpose_a=transpose_a, transpose_b=transpose_b)


def orthonormal_columns(m):
    """An orthonormal basis of ``m``'s columns (reduced QR's Q; float32, same shape)."""
    q, _ = _tf.linalg.qr(_tf.cast(m, _tf.float32), full_matrices=False)
    return q


def low_rank_products(pairs):
    """The products ``a @ b^T`` of ``pairs`` ((a, b), ...; float32, at least one),
    flattened end to end in one float32 tensor."""
    return _tf.concat([_tf.reshape(_tf.linalg.matmul(a, b, transpose_b=True), [-1])
                       for a, b in pairs], 0)


def subtract_low_rank_products(c, pairs, inplace=False):
    """``c - cast(low_rank_products(pairs), c.dtype)`` for flat ``c`` (``inplace`` is
    ignored: TensorFlow tensors are immutable)."""
    return c - _tf.cast(low_rank_products(pairs), c.dtype)
