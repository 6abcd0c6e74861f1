"""Range-based float (seed 002): a small float format whose exponent range is taken from
the data, as a compressor of its own and as the value codec of any sparsifier
(``topk:density=0.01,values=rangefloat8``).

Format (kernel ``rangefloat``): ``bits = 1 + e + m``; sign, ``e`` exponent bits counting
down from the largest exponent ``E`` present in the tensor, ``m`` mantissa bits; default
splits 4 = 1+2+1, 6 = 1+3+2, 8 = 1+4+3, 12 = 1+5+6, 16 = 1+5+10 (``exp_bits`` overrides).

Worst-case error: for ``|x| >= 2^(E - 2^e + 2)`` (the ``2^e - 1`` binades below and
including the largest), rounding the mantissa to nearest gives::

    |x_hat - x| <= 2^-(m+1) * |x|

(8 bits: 6.25%; 12 bits: 0.78%; 16 bits: 0.049%).  Smaller values flush to zero
(absolute error < 2^(E - 2^e + 2)), except those that round up into the range.

Payload per rank: packed bytes (codes padded to whole byte groups) and an int32 header
``[E, count]``.  The ranks' payloads are gathered; the headers say where each rank's
codes start, so they are decoded in one vectorised pass.  A bucket: one header per
tensor, each tensor coded as if alone, end to end; where the kernels run (CUDA) the
bucket is encoded in two launches and every rank's and tensor's segment decoded in one
(:mod:`hvd_compress.kernels.rangefloat_segments`), elsewhere tensor by tensor.

Imports: the standard library, ``hvd_compress.memory``; and modules of its own package.
"""
import math

from ..memory import NonFinite
from .base import Compressor, OwnPayload, register

SPLITS = {4: (2, 1), 6: (3, 2), 8: (4, 3), 12: (5, 6), 16: (5, 10)}
NONFINITE_E = 128   #: the header's E of a tensor holding NaN/Inf (exponent field 255)


class RangeFloatCodec:
    """Encode a flat float tensor to ``(bytes, header)``; decode gathered payloads."""

    def __init__(self, bits=8, exp_bits=None):
        try:
            bits = int(bits)
        except (TypeError, ValueError):
            bits = None
        if bits not in SPLITS:
            raise ValueError(f"rangefloat bits must be one of {', '.join(map(str, SPLITS))}, "
                             f"got {bits!r}")
        e = SPLITS[bits][0] if exp_bits is None else int(exp_bits)
        if not 1 <= e <= 8 or bits - 1 - e < 1:
            raise ValueError(f"exp_bits must leave 1 sign and >= 1 mantissa bit of {bits}, "
                             f"and be in 1..8; got {exp_bits!r}")
        self.bits, self.e, self.m = bits, e, bits - 1 - e
        lcm = bits * 8 // math.gcd(bits, 8)
        self.per_group, self.group_bytes = lcm // bits, lcm // 8

    @classmethod
    def from_name(cls, name):
        """``None``/``"float"`` -> None (values sent as they are); ``"rangefloat8"`` -> codec."""
        if name in (None, "", "float"):
            return None
        if isinstance(name, str) and name.startswith("rangefloat") and name[10:].isdigit():
            return cls(int(name[10:]))
        raise ValueError(f"values must be float or rangefloat{{{','.join(map(str, SPLITS))}}}, "
                         f"got {name!r}")

    def max_error(self):
        """Relative error bound for values inside the range: ``2^-(m+1)``."""
        return 2.0 ** -(self.m + 1)

    def encode(self, values, ops):
        emax = ops.max_exponent(values)
        data = ops.rangefloat_encode(values, emax, self.e, self.m)
        return data, ops.stack_int32([emax, ops.length(values)], data)

    def encode_segments(self, values, seg, segments, ops, lengths=None, counts=None):
        """Encode ``values`` that belong to ``segments`` tensors (``seg``: the tensor of
        each value, ascending; or ``lengths``, the host's counts per tensor) with an
        exponent range *per tensor*: the payload is laid out as if each tensor were a
        rank of its own (codes padded per tensor, one ``[E, count]`` header each), so
        :meth:`decode` reads it unchanged.  Where the kernels run (CUDA): two launches
        for the bucket (``ops.rangefloat_encode_segments``); elsewhere tensor by tensor,
        after one host synchronisation (the counts per tensor) when ``lengths`` is None.
        ``counts``: the device's counts per tensor, where the caller has them (then
        ``seg`` is not read)."""
        return self.encode_segments_own(values, seg, segments, ops, lengths, None,
                                        counts=counts)[0]

    def encode_segments_own(self, values, seg, segments, ops, lengths=None, write="decoded",
                            add=None, counts=None, source=None):
        """``(payload, written)``: :meth:`encode_segments`' payload and what the sender's
        error feedback needs of it, written by the encode's launch over ``values`` where
        the kernels run and ``values`` are float32 (``values`` returned), else None:
        what every rank will decode of it (``write="decoded"``), or ``values`` minus that
        (``"residual"``).  Either way its error feedback decodes nothing.  ``add``: error
        feedback's residuals, added to ``values`` first (by the exponent pass where the
        kernels run; ``RangeFloat.adds_residual``), or to ``source`` and written into
        ``values`` (a tensor alone: its gradient, and its residual's spare buffer)."""
        if lengths is not None:
            counts = None
        elif counts is None:
            counts = ops.segment_counts(seg, segments)
        fast = ops.rangefloat_encode_segments(values, counts, lengths, self.e, self.m, write,
                                              add, source)
        if fast is not None:
            return (fast[:2], fast[2]) if write else (fast, None)
        if lengths is not None:
            pieces = ops.split(values, lengths)
        else:
            pieces = ops.split_sizes(values, counts, segments)
        parts = [self.encode(v, ops) for v in pieces]
        return (ops.concat([p[0] for p in parts]), ops.concat([p[1] for p in parts])), None

    def decode(self, data, headers, ops, lengths=None, total=None, check=None):
        """Every header's values, unpadded, end to end.  ``lengths``: the counts the
        headers hold, known on the host (this rank's own payload), so not checked;
        ``total``: only their sum known on the host (a sparsifier's own payload: its
        number of indices), so not checked either (no host synchronisation).
        ``check``: a sparsifier's ``ops.index_check`` of its indices, whose bounds are
        read back in the headers' host synchronisation where the kernels run (its
        ``finish`` raises, if need be); inside ``ops.deferred_checks`` the headers are
        checked against the indices' number there and read back later, with it."""
        n_words = ops.length(headers)
        if isinstance(n_words, int) and n_words % 2:
            raise ValueError(f"rangefloat: a header of {n_words} int32 values is not a whole "
                             "number of [E, count] pairs; the payload is malformed")
        h = ops.reshape(headers, [-1, 2])
        emax, counts = h[:, 0], ops.cast(h[:, 1], ops.int32)
        n_bytes = ops.length(data)                     # a tensor inside tf.function: no check
        # where the kernels run: every header's segment in one launch, checked in one sync
        fast = ops.rangefloat_decode_segments(data, emax, counts, self.e, self.m, lengths,
                                              total, check)
        if fast is not None:
            values, expected, odd = fast
            if values is None:
                raise _malformed(n_bytes, expected, odd)
            return values
        groups = (counts + self.per_group - 1) // self.per_group
        expected = ops.reduce_sum_int(groups) * self.group_bytes
        odd = ops.reduce_sum_int((emax < -127) | (emax > 128) | (counts < 0))
        if isinstance(n_bytes, int) and ops.host_bool((expected != n_bytes) | (odd > 0)):
            raise _malformed(n_bytes, int(expected), ops.host_bool(odd > 0))
        fast = ops.rangefloat_decode_ranks(data, emax, counts, self.e, self.m)
        if fast is not None:                           # the CPU path: rank by rank
            return fast
        values = ops.rangefloat_decode(data, ops.repeat_interleave(emax, groups), self.e, self.m)
        padded = groups * self.per_group
        starts = ops.cumsum(padded) - padded
        pos = ops.cast(ops.arange(ops.length(values), values), padded.dtype) \
            - ops.repeat_interleave(starts, padded)
        keep = pos < ops.repeat_interleave(counts, padded)
        return ops.gather(values, ops.mask_indices(keep))


def _malformed(n_bytes, expected, odd):
    """The ValueError of a payload whose headers do not describe its bytes."""
    if odd:
        return ValueError("rangefloat: a header holds an exponent outside [-127, 128] or a "
                          "negative count; the payload is malformed")
    return ValueError(f"rangefloat: {n_bytes} bytes where the headers say {expected}; the "
                      "payload is malformed")


@register
class RangeFloat(Compressor):
    """Every value in ``bits``-bit range-based float; error feedback on by default."""

    name = "rangefloat"
    collective = "allgather"
    biased = True
    segmented = True      #: a bucket: an exponent range per tensor (encode_segments)
    finds_nonfinite = True  #: where the bucket kernels run: E = 128 in a header; else a check
    fixed_size = True     #: every value coded, a header per tensor
    replayable = True     #: deterministic, no host synchronisation (compressors/replay.py)

    def __init__(self, bits=8, ef=None, exp_bits=None):
        super().__init__(ef=ef)
        self.codec = RangeFloatCodec(bits, exp_bits)
        self.bits, self.exp_bits = self.codec.bits, exp_bits

    def encode(self, flat, ctx, ops, step):
        return self._encode(flat, ctx, ops, None)

    def _encode(self, flat, ctx, ops, write):
        lay = ctx.bucket
        if lay is None and ctx.numel and ops.bucket_codec_kernels(flat):
            lay = ctx.layout           # a lone tensor too: its header's count on the device
        if lay is None:
            return self.codec.encode(flat, ops)
        # each tensor its own range; decoding reads (rank, tensor) segments in order,
        # which for a dense payload is each rank's bucket in order: the sum of rows
        payload, residual = self.codec.encode_segments_own(flat, None, len(lay.numels), ops,
                                                           lay.numels, write, ctx.add,
                                                           source=ctx.source)
        return payload if residual is None else OwnPayload(payload, residual=residual)

    def adds_residual(self, flat, ctx, ops):
        # where the kernels run, the exponent pass reads the bucket first: it adds r (a
        # tensor alone's too, which _encode then encodes as a bucket of one)
        return (self.payload_is_copy and (ctx.bucket is not None or ctx.numel > 0)
                and ops.bucket_codec_kernels(flat))

    def encode_checked(self, flat, ctx, ops, step):
        # (called with error feedback on, whose residuals are updated in place: the
        # encode's launch may write the residual over the compensated gradient flat)
        payload = self._encode(flat, ctx, ops, "residual" if self.payload_is_copy else None)
        if ops.bucket_codec_kernels(flat):
            # where the kernels run, the exponents found NaN/Inf: a tensor's E is 128 (the
            # float32 exponent field 255) exactly when it holds one; left on the device
            # (error feedback obeys the flags there: memory.NonFinite)
            return payload, NonFinite(ops.reshape(payload[1], [-1, 2])[:, 0] == NONFINITE_E)
        return payload, ops.all_finite(flat)

    def subtract_sent(self, compensated, payload, ctx, ops, inplace):
        # this rank's own payload: the counts are the tensors' sizes, known here, so the
        # decode needs neither the header check nor its host synchronisation
        sent = self._decode_sum(payload, ctx, ops, trusted=True)
        if sent is None:
            sent = ops.sum_rows(self.codec.decode(payload[0], payload[1], ops, ctx.numels),
                                ctx.numel)
        return ops.subtract(compensated, ops.cast(sent, compensated.dtype), inplace)

    def decode(self, payload, ctx, ops):
        if len(payload) != 2:
            raise ValueError("rangefloat: a payload is (bytes, header)")
        fast = self._decode_sum(payload, ctx, ops, what=f"rangefloat ({ctx.name or 'tensor'})")
        if fast is not None:
            return fast
        return ops.sum_rows(self.codec.decode(payload[0], payload[1], ops), ctx.numel)

    def _decode_sum(self, payload, ctx, ops, trusted=False, what="rangefloat"):
        # where the kernels run: every rank's tensors decoded and summed in one launch
        return ops.rangefloat_decode_sum(payload[0], payload[1], ctx.numels, self.codec.e,
                                         self.codec.m, trusted, what)
