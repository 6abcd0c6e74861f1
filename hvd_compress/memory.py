"""Error feedback: a residual per tensor name.

Error feedback (residual / memory compensation; Seide et al. 2014, "1-bit SGD";
Stich et al. 2018; Karimireddy et al. 2019, "Error feedback fixes SignSGD"):

    c_t = g_t + r_t              (compensate: add what was not sent before)
    r_{t+1} = c_t - D(C(c_t))    (update: keep exactly what the receivers will miss)

so that ``sum_t D(C(c_t)) + r_T == sum_t g_t``: nothing is lost, only delayed.

With a decay ``beta`` (spec key ``ef_decay=``; without it 1, the rule above, except for
compressed updates through a sparsifier of a density: ``Compressor.default_ef_decay``),
what is kept fades before it is added back, as in SparseLoCo's error feedback (Sarfi,
Thérien, Lidin & Belilovsky, "Communication Efficient LLM Pre-training with SparseLoCo", 2025,
arXiv:2508.15706; there on the updates of H local AdamW steps, here H = 1)::

    r_{t+1} = beta (c_t - D(C(c_t)))

so a value not sent within ~1/(1 - beta) steps is mostly dropped instead of arriving
late.  ``beta < 1`` loses ``(1 - beta)`` of the unsent residual every step: with
compressed AdamW updates (docs/adam-adamw.md) the updates it drops are stale ones.

State lives in a *store* (:mod:`hvd_compress.stores`): a dict of tensors for PyTorch,
a dict of ``tf.Variable`` for TensorFlow.

A bucket whose input holds NaN/Inf keeps the residuals it had (no poisoning).  Whether
it does is a Python bool, read on the host; or, where an encoder finds NaN/Inf in a
kernel it runs anyway, :class:`NonFinite` flags on the device, which the update obeys
without reading them (no host synchronisation on CUDA).

Imports: the standard library, numpy; on first use, torch, TensorFlow.
"""
from typing import Any, NamedTuple

import numpy as np

from .stores import RESIDUAL_PREFIX
from .stores import Journal, TFStore, TorchStore  # noqa: F401 (here before 2026-11-29)


class NonFinite(NamedTuple):
    """Device flags (int32 or bool, any shape; non-zero: a tensor of the bucket holds
    NaN/Inf) that an encoder returns in place of a host bool ``finite``: the residual
    update keeps the old residuals where any flag is set, in a copy that moves nothing
    when none is (``ops.restore_flagged``)."""
    flags: Any


def _dtype_name(dtype):
    return getattr(dtype, "name", None) or str(dtype).replace("torch.", "")


def check_residuals_of(compressor, state_dict):
    """ValueError when a checkpoint's residuals hold other quantities than ``compressor``'s
    would: gradients' residuals (gradient-sized) restored as ``compressed_update=True``'s
    update residuals would be added to the parameters, and update residuals (learning-rate
    sized) restored as gradients' would all but vanish.  A compressor no glue has taken
    yet accepts either and remembers which (:meth:`~hvd_compress.compressors.base.Compressor.mark_residuals` checks it);
    a checkpoint without the key (before 2026-11-29) is not checked."""
    held = state_dict.get("residuals_of")
    if held is None:
        return
    if compressor.residuals_of is None:
        compressor.loaded_residuals_of = held
    elif held != compressor.residuals_of:
        raise other_residuals(held, compressor.residuals_of)


def check_rank_of(compressor, state_dict):
    """ValueError when ``state_dict`` (a checkpoint's) was saved by another rank than the
    one ``compressor``'s glue says this process is (``Compressor.bind_rank``): error
    feedback's residuals are each rank's own, what it has not sent yet, so a rank given
    another's would send that rank's residual a second time and lose its own.  A
    compressor no glue has taken yet remembers the rank, checked when one does; a
    checkpoint without the key (before 2026-11-30, or saved before any glue) is not
    checked."""
    saved = state_dict.get("rank")
    if saved is None:
        return
    mine = None if compressor.rank_of is None else compressor.rank_of()
    if mine is None:
        compressor.loaded_rank = int(saved)
    elif int(saved) != mine:
        raise ValueError(
            f"state_dict holds the error feedback of rank {int(saved)}, but this is rank "
            f"{mine}: each rank's residuals are its own (what it has not sent yet), so save "
            "state_dict() on every rank, to a file of its own (e.g. "
            "f'compression_rank{rank}.pt'), and load each rank's own file")


def other_residuals(held, mine):
    """The ValueError for residuals of ``held`` (``"gradients"`` or ``"updates"``) where
    ``mine`` are expected."""
    return ValueError(
        f"state_dict holds error feedback of {held} (a run with compressed_update="
        f"{held == 'updates'}); this compressor's is of {mine} (compressed_update="
        f"{mine == 'updates'}): restore it into the same mode, or start the residuals "
        "afresh (do not load it)")


class ResidualMemory:
    """Per-name residuals ``r`` on top of a store (see the module docstring).

    ``reuse=True`` (PyTorch, compressors whose payload never aliases their input):
    ``c = g + r`` is written into a second buffer per tensor and the update is done in
    place on ``c``, which then *becomes* the residual while the old residual's buffer
    holds the next ``c``.  Two buffers per tensor, no allocation per step and one
    pass fewer over the gradient; the values are the same bits as ``c - sent`` computed
    out of place.  So a residual returned by :meth:`residual` is live: copy it to keep
    it (``state_dict()`` copies).
    """

    PREFIX = RESIDUAL_PREFIX
    SPARE = "spare/"

    def __init__(self, store, ops, reuse=False, decay=1.0):
        self.store = store
        self.ops = ops
        self.reuse = reuse and ops.supports_inplace()
        self.decay = decay

    def _kept(self, subtract_sent, compensated, inplace):
        """``decay * (c - sent)``: what is kept for the next step."""
        new = subtract_sent(compensated, inplace)
        return new if self.decay == 1.0 else self.ops.scale(new, self.decay, inplace)

    def _residual(self, name, flat):
        return self._residual_n(name, self.ops.numel(flat), flat)

    def compensate(self, name, flat):
        """``c = g + r`` for the flattened gradient ``flat`` of tensor ``name``."""
        r = self._residual(name, flat)
        if not self.reuse:
            return flat + self.ops.cast(r, flat.dtype)
        spare = self.store.spare(self.SPARE + name, r)
        return self.ops.add_into(flat, self.ops.cast(r, flat.dtype), spare)

    def update(self, name, compensated, subtract_sent, finite):
        """``r = c - sent``; left unchanged where ``finite`` is false (no poisoning).

        ``subtract_sent(c, inplace)`` returns ``c - sent`` (in place on ``c`` when
        ``inplace``): the compressor knows the cheapest way (sparse payloads touch
        only the sent entries).
        """
        old = self._residual(name, compensated)
        if isinstance(finite, NonFinite):
            new = self._restored(self._kept(subtract_sent, compensated, self.reuse), old,
                                 finite)
            self.store.set(self.PREFIX + name, new)
            if self.reuse:
                self.store.set_spare(self.SPARE + name, old)
            return
        if self.reuse:
            if self.ops.host_bool(finite):
                new = self._kept(subtract_sent, compensated, True)
                self.store.set(self.PREFIX + name, new)          # c's buffer is r now
                self.store.set_spare(self.SPARE + name, old)     # and r's the next c
            return
        new = self._kept(subtract_sent, compensated, False)
        self.store.set(self.PREFIX + name, self.ops.select(finite, new, old))

    # -- several tensors end to end (a bucket) ------------------------------------------
    def compensate_parts(self, parts, flat, own=False, into=None):
        """``c = g + r`` for ``flat`` holding the tensors ``parts`` = ((name, numel), ...)
        end to end; each tensor keeps its own residual under its own name.

        PyTorch (``reuse``): after the first step the residuals are views of one bucket
        buffer, so nothing is concatenated; ``own=True`` says ``flat`` is the caller's
        scratch buffer, and ``c`` is written into it (for one tensor too, whose residual
        is then kept in ``flat``, as a bucket's; without ``own``, :meth:`compensate`'s).
        ``into`` (``reuse``, ``own``): ``c`` written into that buffer instead (a CUDA
        graph's, :mod:`hvd_compress.compressors.replay`; not the residuals' own)."""
        if len(parts) == 1 and not (self.reuse and own):
            return self.compensate(parts[0][0], flat)
        ops = self.ops
        r = self._residuals(parts, flat)
        if self.reuse and own:
            if into is not None and r.data_ptr() == into.data_ptr():
                raise ValueError("error feedback: c = g + r cannot be written over the "
                                 "residuals' own buffer")
            return ops.add_into(flat, ops.cast(r, flat.dtype), flat if into is None else into)
        return flat + ops.cast(r, flat.dtype)

    def residuals_to_add(self, parts, flat, own):
        """``(r, c)`` for an encode that adds the residuals ``r`` (float32, end to end) in
        its own first pass, writing ``c = g + r`` into the buffer ``c`` that
        :meth:`compensate_parts` would have written (then ``c`` is what
        :meth:`update_parts` takes); None where it cannot (``reuse`` only, float32).

        A bucket (``parts`` in ``flat``, the caller's scratch buffer: ``own``): ``c`` is
        ``flat``, written over.  A tensor alone (one part, not ``own``): ``c`` is its
        residual's spare buffer, ``flat`` (the caller's gradient) is only read -- the
        encode's first pass reads ``g`` and ``r`` and writes ``c``, where a pass of its own
        wrote ``c`` and the first pass read it again (one read of the tensor fewer)."""
        if not (self.reuse and flat.dtype == self.ops.float32):
            return None
        if own:
            r = self._residuals(parts, flat)
            return (r, flat) if r.dtype == flat.dtype and r.data_ptr() != flat.data_ptr() \
                else None
        if len(parts) != 1 or self.ops.numel(flat) == 0 or not flat.is_contiguous():
            return None
        r = self._residual(parts[0][0], flat)
        spare = self.store.spare(self.SPARE + parts[0][0], r)
        if len({r.data_ptr(), spare.data_ptr(), flat.data_ptr()}) != 3:
            return None
        return r, spare

    def update_parts(self, parts, compensated, subtract_sent, finite, own=False):
        """``r = c - sent`` per tensor of ``parts``; unchanged where ``finite`` is false.
        ``own``: as :meth:`compensate_parts` was given it."""
        if len(parts) == 1 and not (self.reuse and own):
            return self.update(parts[0][0], compensated, subtract_sent, finite)
        ops = self.ops
        if isinstance(finite, NonFinite):
            old = self._residuals(parts, compensated)
            new = self._restored(self._kept(subtract_sent, compensated, self.reuse), old,
                                 finite)
            self._set_parts(parts, new)
            return
        if self.reuse:
            if ops.host_bool(finite):
                # c's buffer is the residual now
                self._set_parts(parts, self._kept(subtract_sent, compensated, True))
            return
        new = self._kept(subtract_sent, compensated, False)
        old = self._residuals(parts, compensated)
        self._set_parts(parts, ops.select(finite, new, old))

    def _set_parts(self, parts, new, views=None):
        """Store ``new``'s consecutive views (``views``, if made before) as the residuals
        of ``parts``, and return them; PyTorch: and remember them, for
        :meth:`_residuals` (a new bucket drops those it replaces, whose buffers would
        stay alive here)."""
        buckets = getattr(self.store, "buckets", None)
        known = buckets.get(parts) if buckets is not None else None
        keys = known[0] if known else tuple(self.PREFIX + name for name, _ in parts)
        if views is None:
            views = tuple(self.ops.split(new, [n for _, n in parts]))
        if buckets is None:
            for key, view in zip(keys, views):
                self.store.set(key, view)
            return views
        self.store.set_many(keys, views)
        if known is None:
            mine = set(keys)
            for other in [p for p, k in buckets.items() if not mine.isdisjoint(k[0])]:
                del buckets[other]
        buckets[parts] = (keys, views, new)
        return views

    def _residuals(self, parts, like):
        """The residuals of ``parts``, end to end in one tensor.  Where residuals are
        updated in place (``reuse``): the buffer :meth:`_set_parts` last stored for
        ``parts`` if the store still holds exactly its views and it has ``like``'s dtype;
        else each residual fetched and checked, and the buffer they are views of, or
        their concatenation."""
        known = self.bucket_buffer(parts, like)
        if known is not None:
            return known
        residuals = [self._residual_n(name, n, like) for name, n in parts]
        r = self._contiguous(residuals) if self.reuse else None
        return self.ops.concat(residuals) if r is None else r

    def bucket_buffer(self, parts, like):
        """The one buffer the residuals of ``parts`` are consecutive views of, as
        :meth:`_set_parts` last stored them (``reuse`` only; the store still holding
        exactly those views, of ``like``'s dtype); else None."""
        buckets = getattr(self.store, "buckets", None) if self.reuse else None
        known = buckets.get(parts) if buckets is not None else None
        if known is not None and known[2].dtype == like.dtype and self.store.holds(*known[:2]):
            return known[2]
        return None

    def take_buffer(self, parts, flat, views=None):
        """Make the residuals of ``parts`` views of ``flat`` end to end (which holds
        them; ``views``: those views, as this returned them before for ``flat``): what
        :meth:`update_parts` leaves where ``c``'s buffer becomes the residual; a
        compress replayed from a CUDA graph (:mod:`hvd_compress.compressors.replay`)
        wrote them there without running the update's Python.  Returns the views."""
        return self._set_parts(parts, flat, views)

    def _restored(self, new, old, finite):
        """``new``, or ``old``'s values where :class:`NonFinite` ``finite`` flags any."""
        return self.ops.restore_flagged(new, self.ops.cast(old, new.dtype), finite.flags)

    def _residual_n(self, name, n, like):
        ops = self.ops
        loaded = self.store.loaded
        if loaded and self.PREFIX + name not in loaded:
            raise ValueError(
                f"the loaded state_dict has error-feedback residuals for {len(loaded)} "
                f"tensors but none for {name!r}: it was saved for another model or "
                "configuration")
        r = self.store.get(self.PREFIX + name, lambda: ops.zeros(n, like.dtype, like))
        if ops.numel(r) != n or r.dtype != like.dtype:
            raise ValueError(
                f"error-feedback residual of {name!r} has {ops.numel(r)} values of "
                f"{_dtype_name(r.dtype)}, but the tensor has {n} of {_dtype_name(like.dtype)}: "
                "the loaded state_dict was saved for another model or configuration")
        return r

    @staticmethod
    def _contiguous(tensors):
        """The one buffer ``tensors`` are consecutive views of, in order, else None."""
        base = tensors[0]._base if getattr(tensors[0], "_base", None) is not None else None
        if base is None or base.dim() != 1 or base.numel() != sum(t.numel() for t in tensors):
            return None
        at = base.data_ptr()
        for t in tensors:
            if t._base is not base or t.data_ptr() != at:
                return None
            at += t.numel() * t.element_size()
        return base

    def residual(self, name):
        """The residual of ``name`` (flat), or None if none was stored yet."""
        key = self.PREFIX + name
        return self.store.get(key, lambda: None) if key in self.store.keys() else None


def residual_norm(state_dict):
    """L2 norm of every error-feedback residual in a compressor's (or a policy's)
    ``state_dict()``: the part of past gradients this rank has not sent yet."""
    state = state_dict["state"]
    if isinstance(state, list):                    # a policy: one state_dict per member
        return float(np.sqrt(sum(residual_norm(s) ** 2 for s in state)))
    total = 0.0
    for key, value in state.items():
        if key.startswith(ResidualMemory.PREFIX):
            a = value.detach().cpu().double().numpy() if hasattr(value, "detach") \
                else np.asarray(value, dtype=np.float64)
            total += float(np.sum(np.square(a.astype(np.float64))))
    return float(np.sqrt(total))


def lost_residual_norm(at_commit, survivors):
    """Norm of the residuals the lost ranks held at the last commit: ``at_commit`` (old
    rank -> norm, from every rank at the commit), ``survivors`` (the old ranks still
    here; None for a rank that joined)."""
    gone = set(at_commit) - {r for r in survivors if r is not None}
    return float(np.sqrt(sum(at_commit[r] ** 2 for r in gone)))
