"""What a compressor passes around with its payload: :class:`Ctx` (what ``decompress``
needs besides the payload; never sent), :class:`OwnPayload` (a payload with what its
encode already computed of the sender's error feedback) and :func:`payload_bytes` (the
bytes a payload puts on the wire); the check of an aggregate's structure against this
rank's payload (:func:`check_wire`).  The contract itself: :mod:`.base`.

Imports: the standard library and ``hvd_compress.buckets``.
"""
from typing import Any, NamedTuple, Tuple

from ..buckets import layout as _layout


class Ctx(NamedTuple):
    """What ``decompress`` needs besides the payload; never sent."""
    shape: Tuple[int, ...]
    dtype: Any
    numel: int
    name: str
    finite: Any = None   #: known "no NaN/Inf in encode's input" (so encode needn't check)
    segments: Any = None  #: a bucket's :class:`~hvd_compress.buckets.Layout` (else None)
    wire: Any = None      #: this rank's payload: dtypes (and an allreduce's length); the
                          #: aggregate must match (:meth:`~.base.Compressor.check_aggregate`)
    add: Any = None       #: error feedback's residuals, for encode_checked to add to its
                          #: input in its first pass (:meth:`~.base.Compressor.adds_residual`)
    source: Any = None    #: with ``add``: what that pass reads in its input's place, and
                          #: adds ``add`` to, writing the sum into its input (a tensor
                          #: alone's gradient; its input is then the residual's spare buffer)

    @property
    def bucket(self):
        """The Layout when this is a bucket of several tensors, else None (one tensor)."""
        lay = self.segments
        return lay if lay is not None and len(lay.names) > 1 else None

    @property
    def layout(self):
        """The :class:`~hvd_compress.buckets.Layout` this covers: the bucket's, else that
        of one tensor (a tensor compressed on its own), for the bucket kernels."""
        return self.segments if self.segments is not None else \
            _layout((self.name or "tensor",), ((self.numel,),))

    @property
    def numels(self):
        """The sizes of the tensors this covers, end to end: the layout's, else
        ``(numel,)``."""
        return self.segments.numels if self.segments is not None else (self.numel,)


class OwnPayload(tuple):
    """A payload (the tensors sent, a tuple) with what its encode already computed of
    the sender's own error feedback, never sent: ``sent``, the values every rank will
    decode (a sparsifier's, whose indices are the payload's), or ``residual``, ``c -
    D(payload)`` written over encode's input ``c`` (its buffer).  Either way
    :meth:`~.base.Compressor.subtract_sent` decodes nothing."""

    def __new__(cls, tensors, sent=None, residual=None):
        self = super().__new__(cls, tensors)
        self.sent, self.residual = sent, residual
        return self


def _wire(payload, ops):
    """What :meth:`~.base.Compressor.check_aggregate` compares the aggregate with."""
    if isinstance(payload, (tuple, list)):
        return tuple(t.dtype for t in payload)
    return payload.dtype, ops.numel(payload)


def first_tensor(what, payload):
    """``payload``'s first tensor (itself where it is one); ValueError naming ``what``
    for an empty tuple."""
    several = isinstance(payload, (tuple, list))
    if several and not payload:
        raise ValueError(f"{what}: an empty payload; the payload is malformed")
    return payload[0] if several else payload


def check_wire(what, collective, payload, wire, ops):
    """That the aggregate ``payload`` of a ``collective`` has the structure ``wire`` (of
    this rank's payload, :func:`_wire`; None: unknown, not checked) gives: as many
    tensors, the same dtypes, and for an allreduce the same length.  ValueError
    (TypeError for a dtype) naming ``what``."""
    if wire is None:
        return
    several = isinstance(payload, (tuple, list))
    if collective == "allreduce":
        dtype, n = wire
        if several:
            raise ValueError(f"{what}: an allreduce payload is one tensor, got {len(payload)}")
        if payload.dtype != dtype:
            raise TypeError(f"{what}: payload of dtype {payload.dtype}, expected {dtype}")
        if ops.numel(payload) != n:
            raise ValueError(f"{what}: payload of {ops.numel(payload)} values, expected {n}; "
                             "the payload is malformed")
        return
    if not several or len(payload) != len(wire):
        got = len(payload) if several else 1
        raise ValueError(f"{what}: a payload is {len(wire)} tensors, got {got}; "
                         "the payload is malformed")
    for i, (t, dtype) in enumerate(zip(payload, wire)):
        if t.dtype != dtype:
            raise TypeError(f"{what}: payload tensor {i} has dtype {t.dtype}, expected {dtype}")


def payload_bytes(payload, ops):
    """Bytes this rank puts on the wire for ``payload``."""
    if isinstance(payload, (tuple, list)):
        total = 0
        for t in payload:
            total = total + ops.size_bytes(t)
        return total
    return ops.size_bytes(payload)

