"""Dense baselines: no compression, fp16 and bf16 casts.

=========  ===========  ==============================================================
spec       collective   payload
=========  ===========  ==============================================================
``none``   allreduce    the gradient itself (bf16 gradients travel as float32: Horovod's
                        Gloo collectives reject bfloat16)
``fp16``   allreduce    ``g.half()``: 2 bytes/value, summed in fp16 by the collective
                        (values beyond ±65504 overflow to ±Inf, as with Horovod's fp16)
``bf16``   allgather    ``g.bfloat16()`` bits as int16 (Gloo cannot sum bfloat16), so
                        each rank's values are gathered and summed after decoding
=========  ===========  ==============================================================

Imports: nothing at import time; and modules of its own package.
"""
from .base import Compressor, register


@register
class NoneCompressor(Compressor):
    """Send the gradient as it is (Horovod's ``Compression.none``)."""

    name = "none"
    payload_is_copy = False    # the payload is the gradient itself
    segmented = True           # element-wise: a bucket is compressed as one tensor

    def encode(self, flat, ctx, ops, step):
        return ops.cast(flat, ops.float32) if flat.dtype == ops.bfloat16 else flat

    def decode(self, payload, ctx, ops):
        return payload


@register
class FP16(Compressor):
    """Cast to IEEE half precision for the allreduce (Horovod's ``Compression.fp16``)."""

    name = "fp16"
    payload_is_copy = False    # an fp16 gradient is its own payload
    segmented = True

    def encode(self, flat, ctx, ops, step):
        return ops.cast(flat, ops.float16)

    def decode(self, payload, ctx, ops):
        return ops.cast(payload, ops.float32)


@register
class BF16(Compressor):
    """Cast to bfloat16 (8-bit exponent, 7-bit mantissa), moved as int16 bits."""

    name = "bf16"
    collective = "allgather"
    payload_is_copy = False    # a bf16 gradient's payload is a view of it
    segmented = True
    fixed_size = True

    def encode(self, flat, ctx, ops, step):
        return (ops.bitcast(ops.cast(flat, ops.bfloat16), ops.int16),)

    def decode(self, payload, ctx, ops):
        (bits,) = payload
        n = ctx.numel
        length = ops.length(bits)
        if isinstance(length, int) and (n == 0 or length == 0 or length % n):
            raise ValueError(f"bf16: payload of {length} values is not a whole number of "
                             f"tensors of {n} values; the payload is malformed")
        return ops.sum_rows(ops.cast(ops.bitcast(bits, ops.bfloat16), ops.float32), n)
