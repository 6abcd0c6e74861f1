"""DCT-domain sparsification with range-based float values (seed 002).

    c = DCT-II_blocks(pad(g))          orthonormal, per block of ``block`` values
    S = the ~k largest |c|, k = ceil(density * len(c))   (laplace_topk's selection)
    send  rangefloat_bits(c[S]), S
    g_hat = trim(IDCT_blocks(scatter(S, decode(values))))

Gradients are smooth along their memory layout in places (convolution kernels, rows of
embeddings), so energy concentrates in few low-frequency coefficients there; elsewhere a
DCT spreads it (see benchmarks/dct.py for where it wins).

Error feedback works in the coefficient domain (``agg`` local; since 2026-11-28, before
in the gradient domain, which cost an inverse DCT of the whole bucket per compress)::

    C = DCT(pad(g)) + R                R: the residual's coefficients (per tensor)
    R' = P(C - scatter(S, decode(values)))

The DCT is orthonormal, so ``R = DCT(pad(r))`` with ``r`` the gradient-domain residual
``c - g_hat``: the same algorithm, one transform per compress instead of two.  ``P``
keeps ``R`` a padded vector's transform (zero padding): only a tensor's last block
holds padding, so ``P`` is that block's inverse DCT, its padding zeroed, and its DCT,
for the last blocks of a bucket at once (:func:`project_tails`).  The residual is kept
under the name ``@dct<block>:<numel>/<tensor name>`` (:func:`residual_name`), so a
checkpoint says which domain it holds; :meth:`DCTSparse.residual` and ``auto``'s switches
convert it back, and ``load_state_dict`` converts a gradient-domain checkpoint of an
earlier version.  ``agg=union|leader|hint`` keep the gradient domain.

Buckets (``segmented``, with ``agg`` local): per-tensor semantics.  Each tensor is padded
to whole blocks on its own and the padded tensors lie end to end (the *coefficient
layout*, :func:`padded_layout`); each tensor keeps its own k, selection and exponent range,
and its own residual.  The bucket payload is ``(bytes, headers, indices)``: the tensors'
value codes end to end with one ``[E, count]`` header per tensor (as tensor by tensor),
and int32 indices into the coefficient layout (tensor ``i``'s coefficient ``j`` at its
padded offset + ``j``); it decodes to the tensor-by-tensor aggregate.

Where the kernels run (CUDA; ``HVD_COMPRESS_BACKEND=triton``) a compress is a fixed number
of launches whatever the number of tensors, for one tensor as for a bucket: one DCT launch
reading the unpadded bucket (``ops.dct_segments``), laplace_topk's fused search over the
coefficients of every tensor (:func:`~.fused_search.select_histogram`: one host synchronisation,
which also finds NaN/Inf), the bucket rangefloat codec, and one inverse DCT launch in
decode.  Elsewhere (CPU, TensorFlow) the transform and selection go tensor by tensor as
before (laplace_topk's selection per tensor, the framework's top-k below ``small``).

Imports: the standard library, ``hvd_compress.buckets``, ``hvd_compress.memory``; on
first use, ``hvd_compress.kernels``; and modules of its own package.
"""
import functools
import logging
import re

from ..buckets import layout as _layout
from ..memory import ResidualMemory
from .base import register
from .fused_search import fused_payload
from .laplace import LaplaceTopK
from .sparse import DensitySparsifier

log = logging.getLogger(__name__)


def check_dct_block(block):
    """``block`` as an int, if the block DCT kernels take it (ValueError otherwise)."""
    from ..kernels.dct import BLOCKS     # imported here: the kernels import torch
    try:
        value = int(block)
    except (TypeError, ValueError):
        value = None
    if value not in BLOCKS:
        raise ValueError(f"block must be one of {', '.join(map(str, BLOCKS))}, got {block!r}")
    return value


def residual_name(block, numel, name):
    """The name error feedback keeps the DCT coefficients of tensor ``name``'s residual
    under (``numel``: its values, ``block``: the DCT's)."""
    return f"@dct{block}:{numel}/{name}"


_RESIDUAL_NAME = re.compile(r"@dct(\d+):(\d+)/(.*)", re.DOTALL)


def parse_residual_name(name):
    """``(block, numel, tensor name)`` of a :func:`residual_name`, else None."""
    m = _RESIDUAL_NAME.fullmatch(name)
    return None if m is None else (int(m.group(1)), int(m.group(2)), m.group(3))


def coefficient_keys(store):
    """``{store key: (block, numel, tensor name)}`` of the dct residuals in ``store``."""
    prefix, out = ResidualMemory.PREFIX, {}
    for key in store.keys():
        found = parse_residual_name(key[len(prefix):]) if key.startswith(prefix) else None
        if found is not None:
            out[key] = found
    return out


def gradient_residual(name, coefs, ops):
    """The gradient-domain residual (flat, float32) of the residual ``coefs`` kept under
    the :func:`residual_name` ``name``."""
    block, numel, _ = parse_residual_name(name)
    return ops.idct_segments(coefs, (numel,), block)


def stored_residual(store, ops, name):
    """The gradient-domain residual of tensor ``name`` in ``store``: its own, else dct's
    coefficients of it, converted; None if neither is there."""
    memory = ResidualMemory(store, ops)
    own = memory.residual(name)
    if own is not None:
        return own
    for key, (_, _, tensor) in coefficient_keys(store).items():
        if tensor == name:
            name = key[len(ResidualMemory.PREFIX):]
            return gradient_residual(name, memory.residual(name), ops)
    return None


def project_tails(coefs, lay, block, ops, inplace):
    """``P(coefs)``: the coefficients (tensors of ``lay``, each padded to whole blocks)
    of vectors whose padding is zero.  A tensor's last block, where it has padding:
    ``x = IDCT(c)``, ``c -= DCT(x * pad_mask)``; one gather, two transforms of all such
    blocks (one launch each where the kernels run) and one scatter, whatever the number
    of tensors (none: ``coefs``)."""
    tails = _tails(lay, block)
    if not tails:
        return coefs
    idx = ops.layout_constant(("dct_tail_idx", block), lay, lambda: [
        at + j for at, _ in tails for j in range(block)], ops.int64, coefs)
    pad = ops.layout_constant(("dct_tail_pad", block), lay, lambda: [
        float(j >= keep) for _, keep in tails for j in range(block)], ops.float32, coefs)
    x = ops.dct_blocks(ops.gather(coefs, idx), block, inverse=True)   # (each block apart:
    return ops.subtract_at(coefs, idx, ops.dct_blocks(x * pad, block), inplace)  # same bits)


@functools.lru_cache(maxsize=256)
def _tails(lay, block):
    """``(offset of its last block, values in it)`` of each tensor of ``lay`` that does
    not fill its last block, in the coefficient layout."""
    return tuple((at + whole - block, n % block) for at, n, whole in
                 zip(padded_layout(lay, block).offsets, lay.numels, _padded(lay.numels, block))
                 if n % block)


def _padded(numels, block):
    return [-(-n // block) * block for n in numels]


@functools.lru_cache(maxsize=256)
def padded_layout(lay, block):
    """The coefficient layout of the bucket ``lay``: each tensor padded to whole blocks."""
    return _layout(lay.names, [(m,) for m in _padded(lay.numels, block)])


@register
class DCTSparse(DensitySparsifier):
    """Keep the largest DCT coefficients (``density`` of all, padding included), values
    as ``bits``-bit range-based floats; error feedback on by default.

    ``padded=1`` (PyTorch, ``agg`` local): the selection is laplace_topk's fused search
    with a payload of fixed size on every device (``laplace_topk:padded=1``: each
    tensor's coefficients in ``min(n, k + floor(k / 100))`` slots, padding 0.0 at its
    first coefficient), so compress reads nothing back; a gradient holding NaN/Inf sends
    NaN in every slot.  So on CUDA its bucket exchanges are replayed from CUDA graphs
    (:mod:`.replay`; since 2026-12-02, not yet run on a GPU), error feedback writing
    ``C = DCT(g) + R`` into a coefficient buffer of the bucket's
    (:meth:`residual_buffer`).  Elsewhere the selection's count is read back (one host
    synchronisation where the kernels run)."""

    name = "dct"
    sparse_residual = False   # (agg=union|leader|hint) the residual is in the gradient domain

    def __init__(self, density=0.01, block=256, bits=8, ef=None, agg=None, beta=None, hint=None,
                 padded=None):
        local = agg in (None, "local")   # summed coefficients (agg!=local) travel as floats
        super().__init__(density=density, ef=ef, values=f"rangefloat{bits}" if local else None,
                         agg=agg, beta=beta, hint=hint)
        self.block, self.bits = check_dct_block(block), int(bits)
        self.padded = None if padded is None else bool(int(padded))
        if self.padded and not local:
            raise ValueError(f"padded=1 sends each rank's own pairs (agg=local); got agg={agg}")
        self._select = LaplaceTopK(density=self.density, ef=False, padded=self.padded)
        # (replay: compressors/replay.py; its residuals in a coefficient buffer)
        self.fixed_size = self.replayable = bool(self.padded)
        self._sized = set()        # buckets whose stored sizes _check_sizes has seen

    @property
    def segmented(self):
        """Buckets of several tensors, in the one-round exchange (``agg`` local)."""
        return self.agg is None

    def domain_ctx(self, ctx):
        if ctx.segments is None:
            padded = -(-ctx.numel // self.block) * self.block
            return ctx._replace(numel=padded, shape=(padded,), finite=None)  # may overflow
        lay = padded_layout(ctx.segments, self.block)
        return ctx._replace(numel=lay.total, shape=(lay.total,), finite=None, segments=lay)

    def to_domain(self, flat, ctx, ops):
        return ops.dct_segments(flat, ctx.numels, self.block), self.domain_ctx(ctx)

    def from_domain(self, coefs, ctx, ops):
        return ops.idct_segments(coefs, ctx.numels, self.block)

    def select(self, coefs, cctx, ops, step):
        return self._select.select(coefs, cctx, ops, step)

    def fused_here(self, coefs, ops):
        """Does the fused search select (the kernels run, one-round exchange)?"""
        return (self.agg is None and ops.bucket_codec_kernels(coefs)
                and ops.histogram_search_supported())

    def encode(self, flat, ctx, ops, step):
        """Without error feedback: the payload of ``flat``'s coefficients."""
        return self.encode_checked(flat, ctx, ops, step)[0]

    def encode_checked(self, flat, ctx, ops, step):
        """``(payload, finite)`` of ``flat``'s coefficients (``finite``: they hold no
        NaN/Inf); error feedback does not come through here (:meth:`_compress_flat`)."""
        coefs, cctx = self.to_domain(flat, ctx, ops)
        return self._encode_coefs(coefs, cctx, ops, step)

    def _encode_coefs(self, coefs, cctx, ops, step):
        """``(payload, finite)`` of the coefficients ``coefs``: the fused search where it
        runs, else every coefficient where they hold NaN/Inf (a gradient's, or an
        overflow), the selection where not."""
        if self.padded or self.fused_here(coefs, ops):   # (values, counts from its write)
            return fused_payload(self, self._select, coefs, cctx, ops)[:2]
        finite = ops.all_finite(coefs)
        idx = ops.cond(finite, lambda: self.select(coefs, cctx, ops, step),
                       lambda: ops.arange(cctx.numel, coefs))
        return self._payload(coefs, idx, cctx, ops), finite

    def _compress_flat(self, flat, ctx, ops, step, parts, own=False, into=None):
        """Error feedback in the coefficient domain (module docstring): ``C = DCT(g) +
        R``, the payload of ``C``, ``R' = P(C - sent)`` touching the sent entries and the
        last blocks only; each tensor's ``R`` under :func:`residual_name`, views of the
        buffer ``C`` was written into: the transform's own, or ``into``
        (:meth:`residual_buffer`'s, a CUDA graph's)."""
        if not self.ef:
            return self.encode(flat, ctx, ops, step)
        memory = self.error_feedback(ops)
        self._check_sizes(parts)
        coefs, cctx = self.to_domain(flat, ctx, ops)          # a new tensor: ours to write
        cparts = tuple((residual_name(self.block, n, name), m)
                       for (name, n), m in zip(parts, cctx.numels))
        compensated = memory.compensate_parts(cparts, coefs, own=True, into=into)
        payload, finite = self._encode_coefs(compensated, cctx, ops, step)

        def subtract(c, inplace):
            values, idx = self.own_values(payload, ops)
            return project_tails(ops.subtract_at(c, idx, values, inplace), ctx.layout,
                                 self.block, ops, inplace)
        memory.update_parts(cparts, compensated, subtract, finite, own=True)
        return payload

    def residual_buffer(self, layout, ops):
        """With error feedback (``agg`` local): the residuals' coefficients end to end in
        the coefficient layout (float32), where ``C = DCT(g) + R`` is written; else None."""
        if not self.ef or self.agg is not None:
            return None
        lay = padded_layout(layout, self.block)
        return tuple(zip(self.residual_names(layout), lay.numels)), lay.total, ops.float32

    def residual_names(self, lay):
        """The names error feedback keeps the residuals of the tensors of ``lay`` under."""
        if not self.ef or self.agg is not None:
            return super().residual_names(lay)
        return [residual_name(self.block, n, name) for name, n in zip(lay.names, lay.numels)]

    def residual(self, name):
        """The gradient-domain residual of ``name`` (flat, its own length): the inverse
        DCT of its coefficients, padding dropped; None before its first compress."""
        if self.agg is not None or self._store is None:
            return super().residual(name)
        return stored_residual(self._store, self._ops, name)

    def load_state_dict(self, state_dict, framework="torch", strict=True):
        """As :meth:`Compressor.load_state_dict`; gradient-domain residuals (a checkpoint
        of a version before 2026-11-28) are converted to coefficients (``R = DCT(pad(r))``,
        float32 rounding; not journaled) and logged."""
        super().load_state_dict(state_dict, framework, strict)
        self._sized = set()
        store, prefix = self._store, ResidualMemory.PREFIX
        coefs = coefficient_keys(store)
        old = [] if self.agg is not None else [
            k for k in store.keys() if k.startswith(prefix) and k not in coefs]
        if not old:
            return
        ops, state = self._ops, store.state_dict()
        for key in old:
            r = ops.flatten(ResidualMemory(store, ops).residual(key[len(prefix):]))
            n = ops.numel(r)
            del state[key]
            state[prefix + residual_name(self.block, n, key[len(prefix):])] = \
                ops.dct_segments(ops.cast(r, ops.float32), (n,), self.block)
        journal, store.journal = store.journal, None
        try:
            for key in old:
                store.pop(key)
            super().load_state_dict(dict(state_dict, state=state), framework, strict)
        finally:
            store.journal = journal
        log.info("%s: %d gradient-domain residuals converted to DCT coefficients",
                 self.spec, len(old))

    def _check_sizes(self, parts):
        """ValueError where the store holds coefficients of a tensor of ``parts`` saved
        for another size (a checkpoint of another model; its key names the size, so the
        memory's own check cannot see it); once per bucket after each load."""
        if parts in self._sized:
            return
        sizes = dict(parts)
        for block, m, name in coefficient_keys(self._store).values():
            if name in sizes and (block, m) != (self.block, sizes[name]):
                raise ValueError(
                    f"error-feedback residual of {name!r} has {m} values in {block}-value "
                    f"DCT blocks, but the tensor has {sizes[name]} in {self.block}: the "
                    "loaded state_dict was saved for another model or configuration")
        self._sized.add(parts)

    def decode(self, payload, ctx, ops):
        lay = ctx.bucket
        if lay is not None and len(payload) == 3:
            n = ops.length(payload[1])
            if isinstance(n, int) and n % (2 * len(lay.names)):
                raise ValueError(f"dct ({ctx.name}): {n} header values are not an [E, count] "
                                 f"pair per tensor ({len(lay.names)}) and rank; the payload "
                                 "is malformed")
        return self.from_domain(super().decode(payload, self.domain_ctx(ctx), ops), ctx, ops)
