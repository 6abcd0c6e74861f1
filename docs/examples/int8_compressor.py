"""An example compressor written against hvd_compress's contract: absmax int8.

Each rank sends its (error-compensated) gradient rounded to 8-bit integers, ``q =
round(127 c / max|c|)``, and its scale ``max|c| / 127``: 4x fewer bytes than float32.
The ranks' scales differ, so the payloads cannot be summed by an allreduce: they are
allgathered, and ``decode`` sums ``q_r * scale_r`` over the ranks.  Rounding loses
information, so the compressor is biased and error feedback is on by default.

Written once, on the framework primitives (``ops``), so it runs on PyTorch and
TensorFlow tensors.  See docs/custom-compressor.md; tests/unit/test_docs.py runs it.
"""
from hvd_compress.compressors.base import Compressor, register


@register                                     # from_spec("int8_example") now builds it
class AbsmaxInt8(Compressor):
    name = "int8_example"                     # the spec name
    collective = "allgather"                  # per-rank scales: gather, then sum
    biased = True                             # rounding: error feedback on by default

    def encode(self, flat, ctx, ops, step):
        x = ops.to_float32(flat)
        _, amax = ops.abs_sum_max(x)          # NaN/Inf here makes the scale non-finite
        scale = ops.reshape(ops.where(amax > 0, amax, amax * 0 + 1.0) / 127.0, [1])
        shifted = ops.cast(x / scale + 127.5, ops.int16)       # floor(v + 0.5) + 127
        return ops.cast(shifted - 127, ops.int8), scale        # payload: (codes, scale)

    def decode(self, payload, ctx, ops):
        codes, scales = payload               # every rank's, concatenated in rank order
        n, ranks = ctx.numel, ops.length(scales)
        if isinstance(ranks, int) and ops.length(codes) != ranks * n:
            raise ValueError(f"{self.name} ({ctx.name}): {ops.length(codes)} codes for "
                             f"{ranks} ranks of {n} values; the payload is malformed")
        rows = ops.reshape(ops.to_float32(codes), [-1, n]) * ops.reshape(scales, [-1, 1])
        return ops.sum_rows(ops.reshape(rows, [-1]), n)        # the sum over ranks
