"""2-bit threshold quantization (MXNet's ``2bit``; used by Hylo for fully-connected
layers, seed 004).

With error feedback (on by default) this is exactly MXNet's scheme::

    r += g;  q = +t where r >= t, -t where r <= -t, 0 elsewhere;  r -= q

16 codes are packed per 32-bit word (kernel ``twobit``), so the payload is ``n / 4``
bytes plus the 4-byte threshold: 16x fewer bytes than float32.

Threshold: fixed when ``threshold`` is given; otherwise adaptive per layer and step,
``t = scale * mean|r|`` (``r`` the compensated gradient, default ``scale=1``): the
layer's own magnitude, so layers of very different scales each send a useful fraction
(about ``exp(-1)`` = 37% of a Laplace-distributed layer) and the rest waits in ``r``.
"""
from .base import Compressor, register


@register
class TwoBit(Compressor):
    """2-bit quantization with a fixed or adaptive threshold; payload (words, t)."""

    name = "twobit"
    collective = "allgather"
    biased = True
    segmented = True      #: a bucket: a threshold and whole words per tensor

    def __init__(self, ef=None, threshold=None, scale=1.0):
        super().__init__(ef=ef)
        if threshold is not None and not float(threshold) > 0:
            raise ValueError(f"threshold must be > 0, got {threshold!r}")
        if not float(scale) > 0:
            raise ValueError(f"scale must be > 0, got {scale!r}")
        self.threshold = None if threshold is None else float(threshold)
        self.scale = float(scale)

    def encode(self, flat, ctx, ops, step):
        lay = ctx.bucket
        if lay is not None:
            # each tensor packed on its own (its threshold, its words): the payload of a
            # bucket is the tensors' payloads end to end, (words..., thresholds...)
            parts = [self._encode_one(flat[off:off + n], n, ops)
                     for off, n in zip(lay.offsets, lay.numels)]
            return ops.concat([w for w, _ in parts]), ops.concat([t for _, t in parts])
        return self._encode_one(flat, ctx.numel, ops)

    def _encode_one(self, flat, n, ops):
        if self.threshold is not None:
            t = ops.to_float32(ops.scalar(self.threshold, flat))
        else:
            abs_sum, _ = ops.abs_sum_max(flat)
            t = self.scale * abs_sum / max(n, 1)
        t = ops.where(t > 0, t, 0 * t + 1.0)       # all-zero tensor: every code is 0
        return ops.twobit_pack(flat, t), ops.reshape(ops.cast(t, ops.float32), [1])

    def decode(self, payload, ctx, ops):
        if len(payload) != 2:
            raise ValueError("twobit: a payload is (words, thresholds)")
        lay = ctx.bucket
        if lay is not None:
            return self._decode_bucket(payload, ctx, lay, ops)
        words, thresholds = payload
        n, per_rank = ctx.numel, -(-ctx.numel // 16)
        nw, nt = ops.length(words), ops.length(thresholds)
        if isinstance(nw, int) and isinstance(nt, int) and nw != nt * per_rank:
            raise ValueError(f"twobit: {nw} words for {nt} ranks of {per_rank} words each; "
                             "the payload is malformed")
        fast = ops.twobit_decode_sum(words, thresholds, n)
        if fast is not None:                           # the CPU path: table lookups
            return fast
        signs = ops.reshape(ops.twobit_unpack(words), [-1, per_rank * 16])[:, :n]
        return ops.sum_rows(ops.reshape(signs * thresholds[:, None], [-1]), n)

    def _decode_bucket(self, payload, ctx, lay, ops):
        """Each tensor's words and thresholds of every rank, decoded as tensor by tensor
        (the same arithmetic, so the same bits)."""
        words, thresholds = payload
        per_tensor = [-(-n // 16) for n in lay.numels]
        width, T = sum(per_tensor), len(lay.numels)
        nw, nt = ops.length(words), ops.length(thresholds)
        if isinstance(nw, int) and isinstance(nt, int) and (nt % T or nw != nt // T * width):
            raise ValueError(f"twobit: {nw} words and {nt} thresholds are not whole ranks of "
                             f"{T} tensors ({width} words each); the payload is malformed")
        words, thresholds = ops.reshape(words, [-1, width]), ops.reshape(thresholds, [-1, T])
        out, at = [], 0
        for s, (name, n, w) in enumerate(zip(lay.names, lay.numels, per_tensor)):
            one = (ops.reshape(words[:, at:at + w], [-1]), thresholds[:, s])
            out.append(self.decode(one, ctx._replace(shape=(n,), numel=n, name=name,
                                                     segments=None), ops))
            at += w
        return ops.concat(out)
