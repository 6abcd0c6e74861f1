"""PyTorch primitives, codecs family: how values are written on the wire: 2-bit codes
(twobit), range-based floats (rangefloat), the block DCT (dct), fixed point and modular
int32 (coded SGD), 1-bit codes (signsgd, onebit) and low-rank products (powersgd).

May import: torch, :mod:`.core`, :mod:`.checks`; lazily, :mod:`hvd_compress.kernels`.
"""
import torch as _torch

from .checks import _defer_flag, _deferring
from .core import _add_unless, _flat32, _mix, _word_pairs, subtract as _subtract


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
    on the CPU one table lookup per byte, scaled per rank, bit-identical; where the
    kernels run (CUDA), one launch of the bucket decoder for this one tensor.  None on
    CUDA with the torch backend forced: the decoder's generic unpack-multiply-sum runs."""
    from ...kernels import pick_backend, twobit, twobit_segments
    if pick_backend(words) == "triton":
        return twobit_segments.decode_segments(words, thresholds.reshape(-1, 1), (n,))
    if words.is_cuda:
        return None
    return twobit.unpack_cpu(words, scale=thresholds, n=n)


def twobit_subtract_own(c, thresholds, numels, inplace):
    """Optional fast path of 2-bit error feedback, ``c - decode(own payload)`` from ``c``
    and the thresholds alone (the codes are ``c``'s own compares), bit-identical, no
    decoded copy: where the kernels run (CUDA), one launch for the bucket
    (:func:`hvd_compress.kernels.twobit_segments.subtract_segments`; float32 and float16); float32
    CPU tensors on the torch path (:func:`hvd_compress.kernels.twobit.subtract_own_cpu`).
    None elsewhere (CUDA with ``HVD_COMPRESS_BACKEND=torch``, bfloat16 on the kernel path,
    other dtypes on the CPU, a non-contiguous ``c``): the generic decode-subtract runs."""
    from ...kernels import pick_backend, twobit, twobit_segments as ts
    if (pick_backend(c) == "triton" and c.dim() == 1 and c.is_contiguous()
            and c.dtype in ts.SUBTRACT_DTYPES):
        # where the kernels run: one launch, in place
        return ts.subtract_segments(c if inplace else c.clone(), numels, thresholds)
    if (c.device.type != "cpu" or c.dtype != _torch.float32 or not c.is_contiguous()
            or pick_backend(c) != "torch"):
        return None
    return twobit.subtract_own_cpu(c, thresholds, numels, inplace)


def bucket_codec_kernels(flat, codec=None):
    """Do the codecs' bucket kernels run for ``flat`` (Triton: CUDA tensors, or any with
    ``HVD_COMPRESS_BACKEND=triton``), for every codec (``codec`` is not needed here)?
    Then a bucket's 2-bit or range-float codes take a fixed number of launches
    (:func:`twobit_pack_segments`, :func:`twobit_decode_segments`,
    :func:`rangefloat_encode_segments`, :func:`rangefloat_decode_segments`)."""
    from ...kernels import pick_backend
    return pick_backend(flat) == "triton"


def _over(flat, residual):
    """``flat`` where a pack may write error feedback's residual over it (asked, and
    contiguous 1-D float32), else None."""
    return flat if residual and _flat32(flat) else None


def twobit_pack_segments(flat, layout, t, residual=False):
    """``(words, bad)``: every tensor of the bucket packed against its own threshold
    ``t[s]`` (float32 ``[T]``), words end to end as tensor by tensor, and int32 ``[T]``,
    1 where the tensor holds NaN/Inf (one kernel launch; where
    :func:`bucket_codec_kernels`).  ``residual``: a third element, ``flat``, overwritten
    in the same launch with error feedback's residual ``flat - q`` (None where ``flat``
    is not contiguous float32; then it is left as it is)."""
    from ...kernels import twobit_segments
    over = _over(flat, residual)
    out = twobit_segments.pack_segments(flat, layout.numels, t, residual=over is not None)
    return (*out, over) if residual else out


def twobit_pack_fit(flat, layout, abs_sum, abs_max, scale, residual=False):
    """``(words, scales, bad)``: twobit's adaptive thresholds ``scale * sum|x| / n`` per
    tensor (1 where not > 0) computed in the pack kernel, the scales NaN where a tensor
    holds NaN/Inf (``abs_sum``, ``abs_max`` float32 ``[T]``); one launch, where
    :func:`bucket_codec_kernels`.  ``residual``: as in :func:`twobit_pack_segments`."""
    from ...kernels import twobit_segments
    over = _over(flat, residual)
    out = twobit_segments.pack_fit(flat, layout.numels, abs_sum, abs_max, scale,
                                   residual=over is not None)
    return (*out, over) if residual else out


def uniform_segments(layout, seeds, steps, like):
    """float32 draws in [0, 1) of every entry of the bucket ``layout``, tensor ``s``
    drawing with ``(seeds[s], steps[s])`` (host ints; counter-based, so a tensor draws the
    same alone as in any bucket), one launch (:mod:`hvd_compress.kernels.uniform_draws`);
    where :func:`bucket_codec_kernels`."""
    from ...kernels import uniform_draws
    pairs = _word_pairs([_mix(seed, int(step)) for seed, step in zip(seeds, steps)],
                        like.device)
    return uniform_draws.uniform_segments(layout.numels, pairs, like.device)


def segment_sum(values, lengths):
    """float32 sums of consecutive runs of ``values`` of ``lengths`` (int64 on the
    device, each >= 1, summing to the length of ``values``), in a fixed order.  For short
    runs (QSGD's norm blocks): on CUDA one thread block sums a run."""
    return _torch.segment_reduce(values.float(), "sum", lengths=lengths, unsafe=True)


def twobit_decode_segments(words, scales, lengths):
    """Optional fast path of the 2-bit bucket decoder: every rank's words of a bucket of
    tensors of ``lengths`` (``(ranks, words)``) with ``scales`` ``(ranks, T)``, summed over
    the ranks, in one launch where :func:`bucket_codec_kernels`; None elsewhere (the
    decoder goes tensor by tensor)."""
    from ...kernels import pick_backend, twobit_segments
    if pick_backend(words) != "triton":
        return None
    return twobit_segments.decode_segments(words, scales, lengths)


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
    rank with one exponent each (CPU: a table per exponent; CUDA: one kernel per rank).
    None for a GPU tensor with ``HVD_COMPRESS_BACKEND=torch`` (the CPU path reads numpy):
    the codec's generic decode runs there."""
    from ...kernels import pick_backend, rangefloat
    if pick_backend(data) == "torch" and data.device.type != "cpu":
        return None
    return rangefloat.decode_ranks(data, emax, counts, e, m)


def rangefloat_encode_segments(values, counts, lengths, e, m, write=None, add=None,
                               source=None):
    """Optional fast path of the codec's per-tensor encode of a bucket: ``(bytes,
    headers)`` of ``values`` in tensors of host ``lengths`` (or of device ``counts``, the
    values per tensor) in two launches where :func:`bucket_codec_kernels`; None elsewhere
    (the codec encodes tensor by tensor).  ``write``: a third element, ``values``
    overwritten in the same launch with what the receivers will decode, bit for bit
    (``"decoded"``), or with ``values`` minus that (``"residual"``); None where
    ``values`` are not contiguous float32 (then they are left as they are).  ``add``
    (float32): ``values + add`` written over ``values`` first, by the exponent pass
    where it can, else at once (then None where the kernels do not run: the codec
    encodes ``values``, which hold the sum), and encoded (error feedback's ``c = g + r``);
    ``source``: ``source + add`` written into ``values`` instead (a tensor alone)."""
    from ...kernels import pick_backend, rangefloat_segments
    kernels = pick_backend(values) == "triton"
    values, add, source = _add_unless(kernels, values, add, source)
    if not kernels:
        return None
    out = _over(values, write)
    got = rangefloat_segments.encode_segments(values, counts, e, m, lengths=lengths,
                                              decoded=out, minus=write == "residual", add=add,
                                              source=source)
    return (*got, out) if write else got


def rangefloat_decode_segments(data, emax, counts, e, m, lengths=None, total=None, check=None):
    """Optional fast path of the codec's decode where :func:`bucket_codec_kernels`:
    ``(values, expected bytes, bad headers)``, ``values`` every segment's (header's)
    values unpadded in one launch, or None where the headers do not describe ``data``;
    the headers checked in one host synchronisation, none for host ``lengths`` or a
    host ``total`` (this rank's own payload).  ``check``: an :class:`IndexCheck` whose
    bounds are read back in that same synchronisation (its ``finish`` then needs none).
    Inside :func:`deferred_checks` with a ``check`` and a header, none either: the values
    are as many as the indices (a host number), the headers are checked against it and
    the bytes on the device, deferred, and the decode stays in bounds whatever they say
    (no header at all: checked at once, as outside).  None
    elsewhere (the codec's own decode runs)."""
    from ...kernels import header_check, pick_backend, rangefloat_segments as rs
    if pick_backend(data) != "triton":
        return None
    if lengths is not None:
        return rs.decode_segments(data, emax, counts, e, m, lengths=lengths), data.numel(), False
    if total is not None:
        return rs.decode_segments(data, emax, counts, e, m, total=int(total)), data.numel(), False
    if check is not None and _deferring() and emax.numel():   # (no header: at once)
        total = check.count
        g, nb = rs.group(1 + e + m)
        bad = header_check.header_stats(emax, counts, g, nb, sizes=(total, data.numel()))[2]
        _defer_flag(bad, f"{check.what}: the values' headers do not describe {total} values in "
                         f"{data.numel()} bytes (or hold an exponent outside [-127, 128] or a "
                         "negative count); the payload is malformed")
        return rs.decode_segments(data, emax, counts, e, m, total=total), data.numel(), False
    bounds = None if check is None else check.minmax
    total, expected, bad, more = rs.check_headers(data, emax, counts, e, m, bounds=bounds)
    if bad or expected != data.numel():
        return None, expected, bad
    if more is not None:
        check.read(*more)
    return rs.decode_segments(data, emax, counts, e, m, total=total), expected, False


def rangefloat_decode_sum(data, headers, lengths, e, m, trusted=False, what="rangefloat"):
    """Optional fast path of a dense range-float payload's aggregate where
    :func:`bucket_codec_kernels`: every rank's payload holds the tensors of host
    ``lengths`` (``headers``: ``[E, count]`` per rank and tensor), decoded and summed over
    the ranks in one launch (:func:`hvd_compress.kernels.rangefloat_segments.decode_sum`).
    The headers are checked against ``lengths`` in one host synchronisation (none when
    ``trusted``: this rank's own payload; none inside :func:`deferred_checks`, whose
    settle raises the ValueError naming ``what``: the decode reads only where ``lengths``
    say, so a bad header's sum stays in bounds).  None elsewhere, and for a payload of
    another shape: the codec's generic decode runs then, and raises its errors."""
    from ...kernels import header_check, pick_backend, rangefloat_segments as rs
    segments, words = len(lengths), headers.numel()
    if pick_backend(data) != "triton" or not segments or not words or words % (2 * segments):
        return None
    ranks = words // (2 * segments)
    g, nb = rs.group(1 + e + m)
    known = rs.host_table(lengths, g, data.device)
    if data.numel() != ranks * known.groups * nb:
        return None
    h = headers.reshape(-1, 2)
    if not trusted:
        bad = header_check.header_stats(h[:, 0], h[:, 1], g, nb, want=known.counts)[2]
        if not _defer_flag(bad, f"{what}: a payload header holds an exponent outside "
                                f"[-127, 128] or a count other than its tensor's size; "
                                "the payload is malformed") and bad.item():   # one sync
            return None
    return rs.decode_sum(data, h[:, 0].reshape(ranks, segments), lengths, ranks, e, m)


# -- block DCT (dct) ---------------------------------------------------------------------

def block_dct(flat, block):
    from ...kernels import dct
    return dct.dct(flat, block)


def block_idct(coefs, block):
    from ...kernels import dct
    return dct.idct(coefs, block)


def dct_segments(flat, numels, block):
    """Blocked DCT-II of each tensor of a bucket (``numels`` end to end in ``flat``), each
    zero-padded to whole blocks, the padded coefficients end to end (float32): one launch
    where the kernels run (no padded copy), else :func:`block_dct` tensor by tensor."""
    from ...kernels import dct
    return dct.dct_segments(flat, numels, block)


def idct_segments(coefs, numels, block):
    """Inverse of :func:`dct_segments`: the tensors end to end (float32), padding dropped;
    one launch where the kernels run."""
    from ...kernels import dct
    return dct.idct_segments(coefs, numels, block)


def dct_blocks(flat, block, inverse=False):
    """The block DCT (``inverse``: its inverse) of each block of ``flat`` (whole blocks)
    on its own: the same bits whichever blocks lie beside it (one launch where the
    kernels run)."""
    from ...kernels import dct
    return dct.dct_blocks(flat, block, inverse)


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
    gathered by byte (no per-bit shifts); where the kernels run, one launch of the bucket
    decoder for this one tensor (as a bucket's tensors are decoded)."""
    words = words.reshape(words.shape[0], -1) if words.dim() > 1 else words.reshape(1, -1)
    ranks = words.shape[0]
    fast = onebit_decode_segments(words, scales.reshape(ranks, 1, 2), (n,))
    if fast is not None:
        return fast
    tables = _torch.where(_bit_table(words.device)[None], scales[:, 0, None, None],
                          scales[:, 1, None, None])                      # (ranks, 256, 8)
    rows = _torch.arange(ranks, device=words.device)[:, None]
    values = tables[rows, words.long()].reshape(ranks, -1)[:, :n]         # (ranks, n)
    return values.sum(0)


def segment_sign_sums(flat, layout):
    """float32 ``[T, 3]``: per tensor of the bucket, the count of entries ``>= 0``, their
    sum and the sum of all (one pass; where :func:`bucket_codec_kernels`)."""
    from ...kernels import segmented
    return segmented.segment_sign_sums(flat, layout.numels)


def onebit_pack_segments(flat, layout):
    """uint8 signs (``>= 0``) of every tensor of the bucket, each padded to whole bytes,
    end to end as tensor by tensor (one launch; where :func:`bucket_codec_kernels`)."""
    from ...kernels import onebit
    return onebit.pack_segments(flat, layout.numels)


def onebit_decode_segments(codes, scales, lengths):
    """Optional fast path of the 1-bit bucket decoder: every rank's bytes of a bucket of
    tensors of ``lengths`` (``(ranks, bytes)``), ``scales`` ``(ranks, T, 2)`` (what a set
    and a clear bit stand for), summed over the ranks in one launch where
    :func:`bucket_codec_kernels`; None elsewhere."""
    from ...kernels import onebit, pick_backend
    if pick_backend(codes) != "triton":
        return None
    return onebit.decode_segments(codes, scales, lengths)


# -- low-rank products (powersgd) --------------------------------------------------------

#: on the CPU a product ``a @ b`` whose ``b`` has at most this many columns is computed as
#: ``(b^T a^T)^T`` (see :func:`matmul`)
_FEW_COLUMNS = 16


def matmul(a, b, transpose_a=False, transpose_b=False):
    """``a @ b`` with either operand transposed (float32 matrices).

    On the CPU, a product with few columns (PowerSGD's ``M Q`` and ``M^T P^``: rank-``r``
    columns) is computed as ``(b^T a^T)^T``: torch's CPU matmul is slow for a tall
    product only ``r`` wide, and slower still with ``a`` transposed.  One thread,
    2026-11-28, r = 4, a 1536 x 4096 ``M``: ``M Q`` 7.7 -> 2.5 ms, ``M^T P^`` 26.4 ->
    3.7 ms (5000 x 256: 1.5 -> 0.26 and 3.9 -> 0.24 ms).  The same product up to float32
    rounding (the sums may add in another order)."""
    a = a.t() if transpose_a else a
    b = b.t() if transpose_b else b
    if not a.is_cuda and b.shape[1] <= _FEW_COLUMNS < a.shape[0]:
        return (b.t() @ a.t()).t().contiguous()
    return a @ b


def orthonormal_columns(m):
    """An orthonormal basis of ``m``'s columns (reduced QR's Q; float32, same shape)."""
    return _torch.linalg.qr(m.float(), mode="reduced").Q


def _product_views(flat, pairs):
    """``flat`` split into the ``(rows of a, rows of b)`` matrices of ``pairs``."""
    sizes = [a.shape[0] * b.shape[0] for a, b in pairs]
    return [v.view(a.shape[0], b.shape[0])
            for (a, b), v in zip(pairs, _torch.split(flat, sizes))]


def low_rank_products(pairs):
    """The products ``a @ b^T`` of ``pairs`` ((a, b), ...; float32, at least one),
    flattened end to end in one new float32 tensor: each product is written into its
    place (no product tensors, no concatenation; on the CPU a fresh tensor-sized
    allocation is a page fault per 4 KB)."""
    out = _torch.empty(sum(a.shape[0] * b.shape[0] for a, b in pairs),
                       dtype=_torch.float32, device=pairs[0][0].device)
    for (a, b), view in zip(pairs, _product_views(out, pairs)):
        _torch.matmul(a, b.t(), out=view)
    return out


def subtract_low_rank_products(c, pairs, inplace=False):
    """``c - cast(low_rank_products(pairs), c.dtype)`` for flat ``c``, in place on ``c``
    when ``inplace``.  Float32 ``c``: each product is taken off its own rows by one
    ``addmm`` with no product tensor (equal to subtracting the product up to float32
    rounding: the BLAS may accumulate into ``c``)."""
    if c.dtype != _torch.float32:
        return _subtract(c, low_rank_products(pairs).to(c.dtype), inplace)
    out = c if inplace else c.clone()
    for (a, b), view in zip(pairs, _product_views(out, pairs)):
        view.addmm_(a, b.t(), alpha=-1)
    return out
