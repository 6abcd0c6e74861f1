"""One bit per value: 1-bit SGD and scaled signSGD with error feedback (peer baselines).

Both send the sign of the compensated gradient ``c = g + r``, 8 signs per byte, and
two float32 reconstruction values per tensor (``a`` for a set bit, ``b`` for a clear
one): 32x fewer bytes than float32.  Both are biased and use error feedback (on by
default), which is what makes them converge (Karimireddy et al. below).

**1-bit SGD** (Seide, Fu, Droppo, Li & Yu, "1-Bit Stochastic Gradient Descent and its
Application to Data-Parallel Distributed Training of Speech DNNs", Interspeech 2014)::

    bit_i = [c_i >= 0],   a = mean(c_i : c_i >= 0),   b = mean(c_i : c_i < 0)

so each side is rebuilt by its own mean (the paper takes the means per matrix column;
here per tensor, as GRACE does).

**Scaled signSGD with error feedback** (Karimireddy, Rebjock, Stich & Jaggi, "Error
Feedback Fixes SignSGD and other Gradient Compression Schemes", ICML 2019)::

    C(c) = (||c||_1 / d) sign(c),   so a = ||c||_1 / d and b = -a

The aggregate is the sum over ranks of each rank's reconstruction, ``sum_r a_r`` or
``b_r`` per value (not a majority vote).

Imports: nothing at import time; and modules of its own package.
"""
from .base import register
from .quantize import CodesAndScales


@register
class OneBit(CodesAndScales):
    """1-bit SGD: signs and the two means; payload (uint8 sign bytes, float32 [a, b])."""

    name = "onebit"
    biased = True
    replayable = True          #: deterministic, no host synchronisation (compressors/replay.py)

    def sizes(self, n):
        return -(-n // 8), 2

    def levels(self, x, positive, n, ops):
        """``[a, b]``: what a set and a clear bit stand for (float32, shape [2])."""
        ones = ops.to_float32(positive)
        count_pos = ops.sum_rows(ones, 1)                       # shape [1]
        sum_pos = ops.sum_rows(x * ones, 1)
        sum_neg = ops.sum_rows(x, 1) - sum_pos
        count_neg = float(n) - count_pos
        a = sum_pos / ops.where(count_pos > 0, count_pos, count_pos * 0 + 1.0)
        b = sum_neg / ops.where(count_neg > 0, count_neg, count_neg * 0 + 1.0)
        return ops.concat([a, b])

    def encode_one(self, flat, n, ops, step, name):
        x = ops.to_float32(flat)
        positive = x >= 0
        return ops.onebit_pack(positive), self.levels(x, positive, n, ops)

    def decode_one(self, codes, scales, n, ops):
        return ops.onebit_decode_sum(codes, scales, n)

    def bucket_levels(self, x, lay, ops, abs_sum):
        """``[a, b]`` of every tensor of the bucket (float32 ``[T, 2]``) from one pass of
        sums per tensor: :meth:`levels` for all tensors at once."""
        sums = ops.segment_sign_sums(x, lay)                 # [#(x >= 0), sum of them, sum]
        count_pos, sum_pos = sums[:, 0], sums[:, 1]
        sum_neg = sums[:, 2] - sum_pos
        count_neg = ops.layout_constant("numels", lay, lambda: lay.numels, ops.float32,
                                        x) - count_pos
        a = sum_pos / ops.where(count_pos > 0, count_pos, count_pos * 0 + 1.0)
        b = sum_neg / ops.where(count_neg > 0, count_neg, count_neg * 0 + 1.0)
        return ops.stack_cols([a, b])

    def encode_bucket(self, flat, lay, ops, step):
        # where the kernels run: the signs of every tensor in one pack launch, the levels
        # of every tensor by segment sums, NaN/Inf flagged per tensor on the device
        if not ops.bucket_codec_kernels(flat) or min(lay.numels) < 1:
            return None
        x = ops.to_float32(flat)
        abs_sum, _, bad = self.bucket_flags(x, lay, ops)
        levels = self.bucket_levels(x, lay, ops, abs_sum)
        levels = ops.where(ops.reshape(bad, [-1, 1]) > 0, float("nan"), levels)   # one NaN
        return ops.onebit_pack_segments(x, lay), ops.reshape(levels, [-1]), bad

    def decode_bucket(self, codes, scales, numels, ops):
        return ops.onebit_decode_segments(codes, ops.reshape(scales, [ops.length(scales[:, 0]),
                                                                      -1, 2]), numels)


@register
class SignSGD(OneBit):
    """Scaled sign with error feedback: ``(||c||_1 / d) sign(c)``; payload as onebit's."""

    name = "signsgd"

    def levels(self, x, positive, n, ops):
        abs_sum, _ = ops.abs_sum_max(x)
        a = ops.reshape(abs_sum / float(max(n, 1)), [1])
        return ops.concat([a, -a])

    def bucket_levels(self, x, lay, ops, abs_sum):
        a = abs_sum / ops.layout_constant("numels", lay, lambda: lay.numels, ops.float32, x)
        return ops.stack_cols([a, -a])
