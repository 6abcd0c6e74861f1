"""Stochastic, unbiased quantizers: QSGD and TernGrad (peer baselines).

Both round every value at random to one of a few levels, with probabilities chosen so
that the expected value is the value itself: ``E[Q(g)] = g``.  Unbiased, so they need
no error feedback (``ef=1`` turns it on anyway).

**QSGD** (Alistarh, Grubic, Li, Tomioka & Vojnovic, "QSGD: Communication-Efficient SGD
via Gradient Quantization and Encoding", NeurIPS 2017), with ``s`` levels and the
paper's bucketing (a norm per ``block`` consecutive values; the paper used 512)::

    Q_s(v_i) = ||v|| * sign(v_i) * xi_i / s,   l = floor(|v_i| s / ||v||),
    xi_i = l + 1 with probability |v_i| s / ||v|| - l, else l

The payload is one signed int8 level per value (``levels`` <= 127: 4x fewer bytes than
float32; the paper's Elias coding of the levels is not done) and a float32 norm per
block; the variance is at most ``min(block / s^2, sqrt(block) / s) ||v||^2``.

**TernGrad** (Wen, Xu, Yan, Wu, Wang, Chen & Li, "TernGrad: Ternary Gradients to
Reduce Communication in Distributed Deep Learning", NeurIPS 2017), per layer::

    s = max |g|,   Q(g_i) = s * sign(g_i) * b_i,   b_i ~ Bernoulli(|g_i| / s)

sent as 2-bit codes, 16 per 32-bit word (the ``twobit`` kernel), and ``s``: 16x fewer
bytes than float32.  The paper's gradient clipping (to 2.5 standard deviations) is not
done.

Random draws are a pure function of ``(seed, rank, tensor name, step)``: runs repeat
exactly, and ranks draw independently (``rank``: default this process's rank, from
``HOROVOD_RANK``, torchrun's ``RANK``, ``OMPI_COMM_WORLD_RANK`` or ``PMI_RANK``; 0
alone).  The step is counted per tensor and saved in ``state_dict()``.

Imports: the standard library; and modules of its own package.
"""
import os
import types
import zlib

from .base import register
from .quantize import CodesAndScales, decode_twobit

RANK_VARIABLES = ("HOROVOD_RANK", "RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")


def process_rank():
    """This process's rank as the launcher tells it (0 when none does)."""
    for var in RANK_VARIABLES:
        if os.environ.get(var, "").strip().isdigit():
            return int(os.environ[var])
    return 0


class Stochastic(CodesAndScales):
    """A quantizer with per-rank random draws (see the module docstring)."""

    uses_step = True

    def __init__(self, ef=None, seed=0, rank=None):
        super().__init__(ef=ef)
        self.seed = int(seed)
        if rank is not None and int(rank) < 0:
            raise ValueError(f"rank must be >= 0, got {rank!r}")
        self.rank = None if rank is None else int(rank)
        self._keys_cache = {}     # (rank, names) -> the draw keys of a bucket's tensors

    def _key(self, name, rank=None):
        if rank is None:
            rank = process_rank() if self.rank is None else self.rank
        return zlib.crc32(f"{self.seed}/{rank}/{name}".encode())

    def _bucket_keys(self, names):
        """:meth:`_key` of each of ``names``, computed once per bucket and rank."""
        rank = process_rank() if self.rank is None else self.rank
        cache = self._keys_cache
        keys = cache.get((rank, names))
        if keys is None:
            if len(cache) > 256:
                cache.clear()
            keys = cache[rank, names] = [self._key(n, rank) for n in names]
        return keys

    def draws(self, n, ops, step, name, like):
        """``n`` uniform draws for tensor ``name`` at ``step`` on this rank."""
        return ops.uniform(n, self._key(name), step, like)

    def bucket_draws(self, lay, ops, step, like):
        """Uniform draws of every tensor of the bucket ``lay`` (each with its own key and
        step), in one launch where the bucket kernels run: a counter-based hash
        (:mod:`hvd_compress.kernels.uniform_draws`), not the framework's generator that
        :meth:`draws` uses, so these draws differ from the tensor-by-tensor path's."""
        steps = step if isinstance(step, list) else [step] * len(lay.names)
        return ops.uniform_segments(lay, self._bucket_keys(lay.names), steps, like)


@register
class QSGD(Stochastic):
    """QSGD with ``levels`` levels and a norm per ``block`` values; payload (int8 levels,
    float32 norms)."""

    name = "qsgd"

    def __init__(self, levels=127, block=512, ef=None, seed=0, rank=None):
        super().__init__(ef=ef, seed=seed, rank=rank)
        if not 1 <= int(levels) <= 127 or int(levels) != float(levels):
            raise ValueError(f"levels must be an integer in [1, 127] (one int8 per value), "
                             f"got {levels!r}")
        if int(block) < 1 or int(block) != float(block):
            raise ValueError(f"block must be an integer >= 1, got {block!r}")
        self.levels, self.block = int(levels), int(block)

    def _blocks(self, n):
        width = min(self.block, max(n, 1))
        return -(-n // width), width

    def sizes(self, n):
        return n, self._blocks(n)[0]

    def encode_one(self, flat, n, ops, step, name):
        blocks, width = self._blocks(n)
        rows = ops.reshape(ops.pad_to(ops.to_float32(flat), blocks * width), [blocks, width])
        norms = ops.row_norms(rows)
        safe = ops.where(norms > 0, norms, norms * 0 + 1.0)
        u = ops.abs(rows) / safe[:, None] * float(self.levels)        # in [0, s]
        frac = u % 1.0
        rnd = ops.reshape(self.draws(blocks * width, ops, step, name, rows), [blocks, width])
        level = (u - frac) + ops.cast(rnd < frac, ops.float32)
        signed = ops.where(rows < 0, -level, level)
        codes = ops.cast(ops.reshape(signed, [-1])[:n], ops.int8)
        return codes, norms

    def decode_one(self, codes, scales, n, ops):
        blocks, width = self._blocks(n)
        per_value = ops.reshape(scales[:, :, None] + ops.zeros(width, ops.float32, scales),
                                [-1, blocks * width])[:, :n]
        values = ops.to_float32(codes) * per_value / float(self.levels)
        return ops.sum_rows(ops.reshape(values, [-1]), n)

    def _block_lengths(self, numels, ops, like):
        """Every norm block's length, tensor after tensor (the last of a tensor may be
        short), on the device once per layout."""
        def lengths():
            out = []
            for n in numels:
                blocks, width = self._blocks(n)
                if blocks:                                # an empty tensor has none
                    out += [width] * (blocks - 1) + [n - (blocks - 1) * width]
            return out
        sizes = types.SimpleNamespace(key="sizes", numels=tuple(int(n) for n in numels))
        return ops.layout_constant(("qsgd.blocks", self.block), sizes, lengths, ops.int64, like)

    def encode_bucket(self, flat, lay, ops, step):
        # where the kernels run: every tensor's norms, levels and draws in a fixed number
        # of ops (the norms as sums of squares per block; the draws of bucket_draws)
        if not ops.bucket_codec_kernels(flat) or min(lay.numels) < 1:
            return None
        x = ops.to_float32(flat)
        _, _, bad = self.bucket_flags(x, lay, ops)
        lengths = self._block_lengths(lay.numels, ops, x)
        per_tensor = ops.layout_constant(("qsgd.per", self.block), lay,
                                         lambda: [self._blocks(n)[0] for n in lay.numels],
                                         ops.int64, x)
        norms = ops.segment_sum(x * x, lengths) ** 0.5       # (blocks of `block`: short runs)
        norms = ops.where(ops.repeat_interleave(bad, per_tensor, ops.length(lengths)) > 0,
                          float("nan"), norms)
        norm = ops.repeat_interleave(norms, lengths, lay.total)
        u = ops.abs(x) / ops.where(norm > 0, norm, norm * 0 + 1.0) * float(self.levels)
        frac = u % 1.0
        level = (u - frac) + ops.cast(self.bucket_draws(lay, ops, step, x) < frac, ops.float32)
        codes = ops.cast(ops.where(x < 0, -level, level), ops.int8)
        return codes, norms, bad

    def decode_bucket(self, codes, scales, numels, ops):
        if not ops.bucket_codec_kernels(codes) or min(numels) < 1:
            return None
        lengths = self._block_lengths(numels, ops, codes)
        per_value = ops.repeat_interleave(ops.reshape(scales, [-1]), ops.concat(
            [lengths] * ops.length(scales[:, 0])), ops.length(codes[0]) * ops.length(scales[:, 0]))
        values = ops.to_float32(ops.reshape(codes, [-1])) * per_value / float(self.levels)
        return ops.sum_rows(values, ops.length(codes[0]))


@register
class TernGrad(Stochastic):
    """TernGrad: ternary levels {-s, 0, s} per layer, ``s = max|g|``; payload (2-bit
    words, float32 s)."""

    name = "terngrad"

    def sizes(self, n):
        return -(-n // 16), 1

    def encode_one(self, flat, n, ops, step, name):
        x = ops.to_float32(flat)
        _, s = ops.abs_sum_max(x)
        s = ops.where(s > 0, s, 0 * s + 1.0)           # all zero: every code is 0
        keep = self.draws(n, ops, step, name, x) < ops.abs(x) / s
        ternary = ops.where(keep, ops.where(x < 0, x * 0 - 1.0, x * 0 + 1.0), x * 0)
        one = ops.to_float32(ops.scalar(1.0, x))
        return ops.twobit_pack(ternary, one), ops.reshape(s, [1])

    def decode_one(self, codes, scales, n, ops):
        return decode_twobit(codes, scales, n, ops)

    def encode_bucket(self, flat, lay, ops, step):
        # where the kernels run: every tensor's s from one segmented pass, the draws of
        # bucket_draws, one pack launch (twobit's kernel, which flags NaN/Inf)
        if not ops.bucket_codec_kernels(flat) or min(lay.numels) < 1:
            return None
        x = ops.to_float32(flat)
        _, s = ops.segment_abs_sum_max(x, lay)
        s = ops.where(s > 0, s, 0 * s + 1.0)           # all zero: every code is 0
        numels = ops.layout_constant("numels", lay, lambda: lay.numels, ops.int64, x)
        keep = self.bucket_draws(lay, ops, step, x) < ops.abs(x) / ops.repeat_interleave(
            s, numels, lay.total)
        ternary = ops.where(keep, ops.where(x < 0, x * 0 - 1.0, x * 0 + 1.0), x * 0)
        ones = ops.layout_constant("ones", lay, lambda: [1.0] * len(lay.numels), ops.float32, x)
        words, bad = ops.twobit_pack_segments(ternary, lay, ones)
        return words, ops.where(bad > 0, float("nan"), s), bad   # NaN: not finite

    def decode_bucket(self, codes, scales, numels, ops):
        return ops.twobit_decode_segments(codes, scales, numels)
