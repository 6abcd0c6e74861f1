"""``auto``'s residuals across switches: what travels with the gradient when a bucket's
candidate changes.

All candidates share one error-feedback store (keys ``residual/<name>``).  A flat
candidate keys a tensor's residual by the tensor's name on every worker; a ``hier:``
candidate keys the pieces of the shard this worker compresses (``<name>`` for a tensor
wholly inside it, ``<name>/shard<l>`` for a cut one), and only on that worker
(:mod:`hvd_compress.exchange.hierarchical`).  Before candidate ``c`` sends a bucket,
every residual of its tensors that ``c`` will not use itself is added to this worker's
gradient and dropped:

- ``c`` without error feedback (none, fp16): all of them;
- ``c`` flat: the ``hier:`` pieces;
- ``c`` ``hier:``: the flat residuals and pieces outside this worker's shard;
- and residuals in another domain than ``c``'s: ``dct`` keeps its residuals' DCT
  coefficients (:func:`~hvd_compress.compressors.dct.residual_name`), converted back to
  the gradient when moved.

Every exchange (flat or hierarchical) sums over all P workers, so a residual added on
the worker that holds it reaches the aggregate exactly once: with ``e`` every residual
held anywhere, ``sum over steps of the aggregates + sum e`` stays the sum of every
worker's gradients through any sequence of switches (tests/unit/test_hierarchical.py).

Imports: :mod:`hvd_compress.memory`, :mod:`hvd_compress.exchange.hierarchical` and
:mod:`hvd_compress.compressors.dct` (framework-free); tensors go through
:mod:`hvd_compress.ops`.
"""
from ...compressors.dct import coefficient_keys, gradient_residual
from ...exchange.hierarchical import residual_names, residual_places
from ...memory import ResidualMemory


def carry(store, layout, flat, compressor, ops, hosts=None):
    """``flat`` (the tensors of ``layout`` end to end, about to be sent by
    ``compressor``) plus the residuals in ``store`` that ``compressor`` will not use
    (module docstring), which are removed from ``store``.  ``hosts``: ``(local rank, L,
    H)`` of this worker where ``hier:`` candidates exist, else None."""
    keep = residual_names(compressor, layout, hosts)
    places = residual_places(layout, hosts)
    moved = sorted((places[tensor], name) for name, tensor in _held(store, places)
                   if name not in keep)
    if not moved:
        return flat
    parts, at = [], 0
    for (offset, numel), name in moved:    # disjoint: one scheme's names at a time
        if offset < at:
            raise ValueError(f"auto: overlapping residuals for bucket {layout.key!r} "
                             f"({name!r}); the error-feedback store is inconsistent")
        if offset > at:
            parts.append(ops.zeros(offset - at, flat.dtype, flat))
        r = ops.flatten(store.pop(ResidualMemory.PREFIX + name))
        if name not in places:                         # dct's coefficients
            r = gradient_residual(name, r, ops)
        parts.append(ops.cast(r, flat.dtype))
        at = offset + numel
    if at < layout.total:
        parts.append(ops.zeros(layout.total - at, flat.dtype, flat))
    r = parts[0] if len(parts) == 1 else ops.concat(parts)
    if ops.supports_inplace():
        return ops.add_into(flat, r, flat)
    return flat + r


def _held(store, places):
    """``(residual name, tensor or piece name)`` of the residuals in ``store`` of the
    names in ``places``: their own names, and dct's coefficients of them
    (:func:`~hvd_compress.compressors.dct.residual_name`)."""
    prefix = ResidualMemory.PREFIX
    for key in store.keys():
        if key.startswith(prefix) and key[len(prefix):] in places:
            yield key[len(prefix):], key[len(prefix):]
    for key, (_, numel, tensor) in coefficient_keys(store).items():
        if tensor in places:
            if numel != places[tensor][1]:
                raise ValueError(f"auto: the residual {key!r} is of {numel} values, but "
                                 f"{tensor!r} has {places[tensor][1]}; the error-feedback "
                                 "store is inconsistent")
            yield key[len(prefix):], tensor
