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

    def __init__(self, ef=None, threshold=None, scale=1.0):
        super().__init__(ef=ef)
        if threshold is not None and not float(threshold) > 0:
            raise ValueError(f"threshold must be > 0, got {threshold!r}")
        if not float(scale) > 0:
            raise ValueError(f"scale must be > 0, got {scale!r}")
        self.threshold = None if threshold is None else float(threshold)
        self.scale = float(scale)

    def encode(self, flat, ctx, ops, step):
        if self.threshold is not None:
            t = ops.to_float32(ops.scalar(self.threshold, flat))
        else:
            abs_sum, _ = ops.abs_sum_max(flat)
            t = self.scale * abs_sum / max(ctx.numel, 1)
        t = ops.where(t > 0, t, 0 * t + 1.0)       # all-zero tensor: every code is 0
        return ops.twobit_pack(flat, t), ops.reshape(ops.cast(t, ops.float32), [1])

    def decode(self, payload, ctx, ops):
        if len(payload) != 2:
            raise ValueError("twobit: a payload is (words, thresholds)")
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
