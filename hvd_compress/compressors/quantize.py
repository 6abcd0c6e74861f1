"""2-bit threshold quantization (MXNet's ``2bit``; used by Hylo for fully-connected
layers, seed 004).

With error feedback (on by default) this is exactly MXNet's scheme::

    r += g;  q = +t where r >= t, -t where r <= -t, 0 elsewhere;  r -= q

16 codes are packed per 32-bit word (kernel ``twobit``), so the payload is ``n / 4``
bytes plus the 4-byte threshold: 16x fewer bytes than float32.

A bucket where the kernels run (CUDA): the thresholds of all tensors from one segmented
pass (``sum|r|`` per tensor), one pack launch and one decode launch for every tensor
and rank (kernels ``twobit_segments.pack_segments`` / ``decode_segments``); the same payload as
tensor by tensor.  TensorFlow: one call for the bucket (``tf_ops.twobit_pack_fit``),
each tensor packed and decoded as alone in fewer ops.  Elsewhere (PyTorch CPU) tensor by
tensor.

Threshold: fixed when ``threshold`` is given; otherwise adaptive per layer and step,
``t = scale * mean|r|`` (``r`` the compensated gradient, default ``scale=1``): the
layer's own magnitude, so layers of very different scales each send a useful fraction
(about ``exp(-1)`` = 37% of a Laplace-distributed layer) and the rest waits in ``r``.

Imports: ``hvd_compress.memory``; and modules of its own package.
"""
from ..memory import NonFinite
from .base import Compressor, OwnPayload, register


class CodesAndScales(Compressor):
    """Base of the quantizers whose payload is per tensor a fixed number of code words
    and of float32 scales: ``(codes, scales)``, allgathered, decoded rank by rank.

    Subclasses give :meth:`sizes` (code words and scales for ``n`` values),
    :meth:`encode_one` and :meth:`decode_one`.  A bucket's payload is every tensor's
    codes end to end, then every tensor's scales (one allgather per bucket), decoded
    tensor by tensor with the same arithmetic as alone, so the same bits.  A tensor
    with NaN/Inf sends NaN scales: the aggregate is not finite where uncompressed
    Horovod's would not be, and error feedback keeps the residual it had.
    """

    collective = "allgather"
    segmented = True
    finds_nonfinite = True     #: where the bucket kernels run (encode_bucket); else one check
    fixed_size = True          #: :meth:`sizes` per tensor, NaN/Inf included

    def sizes(self, n):
        """``(code words, scales)`` in the payload of a tensor of ``n`` values."""
        raise NotImplementedError

    def encode_one(self, flat, n, ops, step, name):
        """``(codes, float32 scales)`` of one tensor (flat, ``n`` values)."""
        raise NotImplementedError

    def decode_one(self, codes, scales, n, ops):
        """Flat float32 sum over ranks: ``codes`` (ranks, words), ``scales`` (ranks, s)."""
        raise NotImplementedError

    #: :meth:`encode_bucket` takes ``residual=True`` (error feedback on, its residuals
    #: updated in place): then it writes the residual ``flat - D(payload)`` over
    #: ``flat`` in its own launches where it can, and returns a fourth element, ``flat``
    #: (None where it did not), so that error feedback decodes nothing
    writes_residual = False

    def encode_bucket(self, flat, lay, ops, step):
        """``(codes, scales, bad)`` of a whole bucket (or of one tensor: a one-tensor
        ``lay``) in a fixed number of kernel launches, the same payload as tensor by
        tensor, NaN scales included; ``bad`` device flags of the tensors holding NaN/Inf,
        found by those kernels.  None (the default) where there is no such path.  See
        :attr:`writes_residual`."""
        return None

    def decode_bucket(self, codes, scales, numels, ops):
        """Flat float32 sum over ranks of a whole bucket (``codes`` (ranks, words),
        ``scales`` (ranks, scales)) in a fixed number of launches; None (the default)
        where there is no such path."""
        return None

    @staticmethod
    def bucket_flags(x, lay, ops):
        """``(sum|x|, max|x|, bad)`` per tensor of a bucket, one segmented pass: ``bad``
        (int32) 1 where the tensor holds NaN (its sum of magnitudes is NaN) or Inf (its
        max), left on the device."""
        abs_sum, abs_max = ops.segment_abs_sum_max(x, lay)
        bad = ops.cast((abs_sum != abs_sum) | (abs_max == float("inf")), ops.int32)
        return abs_sum, abs_max, bad

    def encode_checked(self, flat, ctx, ops, step):
        # where the bucket kernels run, their own NaN/Inf flags, left on the device (error
        # feedback obeys them there: memory.NonFinite); elsewhere one check on the host
        more = {"add": ctx.add, "source": ctx.source} if ctx.add is not None else {}
        if self.writes_residual and self.payload_is_copy:     # (residuals updated in place)
            more["residual"] = True
        fast = self.encode_bucket(flat, ctx.layout, ops, step, **more)
        if fast is None and ctx.add is not None:
            raise RuntimeError(f"{self.name}: adds_residual promised a bucket path")
        if fast is not None:
            codes, scales, bad, *written = fast
            if written and written[0] is not None:
                return OwnPayload((codes, scales), residual=written[0]), NonFinite(bad)
            return (codes, scales), NonFinite(bad)
        finite = ops.all_finite(flat)
        return self.encode(flat, ctx._replace(finite=finite), ops, step), finite

    def encode(self, flat, ctx, ops, step):
        fast = self.encode_bucket(flat, ctx.layout, ops, step) if ctx.finite is None else None
        if fast is not None:
            return fast[:2]
        # one finiteness check for the whole input (error feedback has made it already);
        # tensor by tensor only where it fails (or inside TensorFlow, where it is free)
        finite = ctx.finite if ctx.finite is not None else ops.all_finite(flat)
        lay = ctx.bucket
        if lay is None:
            codes, scales = self.encode_one(flat, ctx.numel, ops, step, ctx.name)
            return codes, _nan_unless(finite, scales, ops)
        codes, scales = [], []
        segs = ops.split(flat, lay.numels)             # (one op, not a slice a tensor)
        for i, (name, seg, n) in enumerate(zip(lay.names, segs, lay.numels)):
            c, s = self.encode_one(seg, n, ops, step[i] if isinstance(step, list) else step,
                                   name)
            codes.append(c)
            scales.append(s if finite is True else _nan_unless(ops.all_finite(seg), s, ops))
        return ops.concat(codes), ops.concat(scales)

    def decode(self, payload, ctx, ops):
        if not isinstance(payload, (tuple, list)) or len(payload) != 2:
            raise ValueError(f"{self.name}: a payload is (codes, scales)")
        codes, scales = payload
        lay = ctx.bucket
        numels = ctx.numels
        widths = [self.sizes(n) for n in numels]
        wc, ws = sum(w for w, _ in widths), sum(s for _, s in widths)
        nc, ns = ops.length(codes), ops.length(scales)
        if isinstance(nc, int) and isinstance(ns, int) and (
                (ns % ws or nc != ns // ws * wc) if ws else nc + ns):
            raise ValueError(f"{self.name} ({ctx.name or 'tensor'}): {nc} code words and {ns} "
                             f"scales are not whole ranks of {wc} words and {ws} scales; the "
                             "payload is malformed")
        if wc == 0:                                      # empty tensors only: no code word
            return ops.zeros(0, ops.float32, codes)
        codes, scales = ops.reshape(codes, [-1, wc]), ops.reshape(scales, [-1, ws])
        if lay is not None:
            fast = self.decode_bucket(codes, scales, numels, ops)
            if fast is not None:
                return fast
        if len(numels) > 1:            # each tensor's columns: one split, not two slices
            codes = ops.split_cols(codes, [w for w, _ in widths])
            scales = ops.split_cols(scales, [s for _, s in widths])
        else:
            codes, scales = [codes], [scales]
        out = [self.decode_one(c, s, n, ops) if n else ops.zeros(0, ops.float32, c)
               for c, s, n in zip(codes, scales, numels)]
        return out[0] if len(out) == 1 else ops.concat(out)


@register
class TwoBit(CodesAndScales):
    """2-bit quantization with a fixed or adaptive threshold; payload (words, t)."""

    name = "twobit"
    biased = True
    replayable = True          #: deterministic, no host synchronisation (compressors/replay.py)

    def __init__(self, ef=None, threshold=None, scale=1.0):
        super().__init__(ef=ef)
        if threshold is not None and not float(threshold) > 0:
            raise ValueError(f"threshold must be > 0, got {threshold!r}")
        if not float(scale) > 0:
            raise ValueError(f"scale must be > 0, got {scale!r}")
        self.threshold = None if threshold is None else float(threshold)
        self.scale = float(scale)

    def sizes(self, n):
        return -(-n // 16), 1

    def encode_one(self, flat, n, ops, step, name):
        if self.threshold is not None:
            t = ops.to_float32(ops.scalar(self.threshold, flat))
        else:
            abs_sum, _ = ops.abs_sum_max(flat)
            t = ops.divide(self.scale * abs_sum, max(n, 1))   # as the bucket's
        t = ops.where(t > 0, t, 0 * t + 1.0)       # all-zero tensor: every code is 0
        return ops.twobit_pack(flat, t), ops.reshape(ops.cast(t, ops.float32), [1])

    def decode_one(self, codes, scales, n, ops):
        return decode_twobit(codes, scales, n, ops)

    def subtract_sent(self, compensated, payload, ctx, ops, inplace):
        """``r = c - q``: on PyTorch CPU float32 from ``c`` and the thresholds alone (the
        same bits, no decode); elsewhere ``c - decode(payload)``."""
        fast = ops.twobit_subtract_own(compensated, payload[1], ctx.numels, inplace)
        if fast is None:
            return super().subtract_sent(compensated, payload, ctx, ops, inplace)
        return fast

    writes_residual = True     #: where its pack kernel runs, for float32 buckets

    def adds_residual(self, flat, ctx, ops):
        # adaptive thresholds where the kernels run: their segmented pass adds r
        # (a bucket's or a tensor alone's: encode_bucket takes either)
        return (self.threshold is None and self.payload_is_copy
                and ops.bucket_codec_kernels(flat) and min(ctx.layout.numels) >= 1)

    def encode_bucket(self, flat, lay, ops, step, residual=False, add=None, source=None):
        # where the kernels run: every tensor's threshold from one segmented pass (which
        # adds error feedback's residuals first, given them, to flat or to source into
        # flat: adds_residual), one pack launch for the
        # bucket, which flags NaN/Inf (the thresholds' formula as in encode_one; the sums'
        # order of additions is the segmented pass's) and may write the residual
        # (subtract_sent's bits); TensorFlow: one call for the bucket, no in-place writes
        if not ops.bucket_codec_kernels(flat, self.name) or min(lay.numels) < 1:
            return None
        if self.threshold is None:               # t and the scales in the pack kernel
            abs_sum, abs_max = ops.segment_abs_sum_max(flat, lay, add=add, source=source)
            return ops.twobit_pack_fit(flat, lay, abs_sum, abs_max, self.scale, residual)
        t = ops.layout_constant(f"twobit.t={self.threshold!r}", lay,
                                lambda: [self.threshold] * len(lay.numels), ops.float32, flat)
        words, bad, *written = ops.twobit_pack_segments(flat, lay, t, residual)
        return (words, ops.where(bad > 0, t * float("nan"), t), bad, *written)  # NaN: not finite

    def decode_bucket(self, codes, scales, numels, ops):
        return ops.twobit_decode_segments(codes, scales, numels)


def _nan_unless(finite, scales, ops):
    """``scales``, or NaN in their place where the tensor they scale is not finite."""
    return ops.select(finite, scales, scales * float("nan"))


def decode_twobit(words, scales, n, ops):
    """``sum_r scales[r] * codes_r``: 2-bit codes (+1, -1, 0) of every rank, (ranks, words)
    and (ranks, 1)."""
    words, scales = ops.reshape(words, [-1]), ops.reshape(scales, [-1])
    fast = ops.twobit_decode_sum(words, scales, n)
    if fast is not None:                           # the CPU path: table lookups
        return fast
    signs = ops.reshape(ops.twobit_unpack(words), [-1, -(-n // 16) * 16])[:, :n]
    return ops.sum_rows(ops.reshape(signs * scales[:, None], [-1]), n)
