"""The compressor contract that every method implements, and the spec registry.

A compressor turns one gradient into a *payload* that crosses the network, and turns
the *aggregate* of all ranks' payloads back into the sum of their gradients::

    payload, ctx = c.compress(tensor, name)     # on every rank
    aggregate    = <collective>(payload)        # c.collective: "allreduce" or "allgather"
    total        = c.decompress(aggregate, ctx) # sum over ranks of what each sent

``collective == "allreduce"``: the payload is one tensor, and payloads of different
ranks can be summed element-wise (none, fp16).  ``collective == "allgather"``: the
payload is a tuple of tensors; each is gathered separately (first dimensions may
differ between ranks) and ``decompress`` receives their concatenations in rank order.

``collective == "two_round"``: two collectives in sequence, the second an allreduce (Sum)
that depends on the first's result; ``rounds`` names them, e.g.
``(("allgather", "idx"), ("allreduce", "val"))``.  The glue runs::

    msg1, rnd = c.propose(tensor, name, rank, size)    # or propose_bucket(flat, layout, ...)
    agg1      = <rounds[0][0]>(msg1)                   # named <name>.<rounds[0][1]>
    msg2, rnd = c.agree(agg1, rnd)
    agg2      = allreduce_sum(msg2)                    # named <name>.<rounds[1][1]>
    total     = c.finish(agg2, rnd)                    # shaped like the tensor (bucket: flat)
    sent, received, received_local, union, k = c.traffic(msg1, agg1, msg2, rnd, size)

Aggregation-aware selection (``agg=union|leader|hint``, :mod:`.aggregation`) and
PowerSGD (:mod:`.lowrank`) are two-round exchanges.

Subclasses implement :meth:`encode` and :meth:`decode` on flat tensors through the
framework primitives of :mod:`hvd_compress.ops`, so each algorithm is written once
for PyTorch and TensorFlow.  Error feedback (:mod:`hvd_compress.memory`) is applied
here, around ``encode``, when ``ef`` is on (the default for biased compressors).

What travels beside a payload (:class:`Ctx`, :class:`OwnPayload`, :func:`payload_bytes`)
is in :mod:`.payload`, imported here too.

Imports: the standard library, ``hvd_compress.memory``, ``hvd_compress.ops``; and
modules of its own package.
"""
import inspect
import numbers

from ..memory import ResidualMemory, check_rank_of, check_residuals_of, other_residuals
from ..ops import ops_for
from . import replay
from .payload import (Ctx, OwnPayload, _wire, check_wire, first_tensor,  # noqa: F401
                      payload_bytes)                   # (Ctx etc. live here too)

REGISTRY = {}


def same_spec(saved, spec):
    """Whether a checkpoint's ``saved`` spec is ``spec``'s; an explicit ``ef_decay=1``
    (plain error feedback, as checkpoints before it existed were written) matches none."""
    plain = ",ef_decay=1.0"
    return str(saved).replace(plain, "") == str(spec).replace(plain, "")


def leaves(compression, into_auto=True):
    """The compressors of ``compression`` that keep residuals themselves, through a
    Policy's members, ``hier:``'s inner and (``into_auto``) auto's candidates."""
    held = compression.holds() if hasattr(compression, "holds") else []
    if not into_auto and getattr(compression, "adaptive", False):
        held = []
    return [c for h in held for c in leaves(h, into_auto)] if held else [compression]


def register(cls):
    """Class decorator: make ``cls`` buildable from a spec string by ``cls.name``."""
    REGISTRY[cls.name] = cls
    return cls


class Compressor:
    """Base class; see the module docstring for the contract."""

    name = "base"              #: spec name, e.g. ``"topk"``
    collective = "allreduce"   #: which collective the payload needs
    rounds = ()                #: two_round: ((collective, name suffix), ("allreduce", suffix))
    biased = False             #: biased compressors default to error feedback
    uses_step = False          #: needs a per-tensor step counter (e.g. random-k)
    payload_is_copy = True     #: the payload never aliases encode's input (so error
                               #: feedback may reuse that buffer in place)
    segmented = False          #: can compress a bucket of tensors in one call with
                               #: per-tensor semantics (:meth:`compress_bucket`)
    finds_nonfinite = False    #: :meth:`encode_checked` finds NaN/Inf itself, in the host
                               #: synchronisation it needs anyway (no separate check)
    fixed_size = False         #: the payload's shapes depend only on the spec and the
                               #: tensor's shape (a bucket's layout), never on its values:
                               #: the same on every rank, so an allgather needs no
                               #: lengths first (``Transport.allgather_fixed``)
    residuals_of = None        #: what error feedback's residuals hold, ``"gradients"`` or
                               #: ``"updates"``: set by the glue that takes the compressor
                               #: (:meth:`mark_residuals`); None before (checkpoints then
                               #: say ``"gradients"``)
    loaded_residuals_of = None  #: what a checkpoint restored before any glue took it held
    rank_of = None             #: ``() -> int or None``: this process's rank (:meth:`bind_rank`)
    loaded_rank = None         #: the rank of a checkpoint restored before any glue took it
    ef_decay = 1.0             #: error feedback keeps ``ef_decay * (c - sent)``: the
                               #: spec's (:meth:`decay_residuals`), else, once a glue has
                               #: marked the residuals, :meth:`default_ef_decay`'s
    ef_decay_given = False     #: ``ef_decay`` came from the spec (or decay_residuals)
    replayable = False         #: bucket exchanges replayed from CUDA graphs (:mod:`.replay`)

    def __init__(self, ef=None):
        self.ef = self.biased if ef is None else bool(ef)
        self._store = None
        self._ops = None
        self.min_size = None       #: tensors of fewer values are sent whole (send_whole_below)
        self._whole = None

    # -- what subclasses implement ---------------------------------------------------
    def encode(self, flat, ctx, ops, step):
        """Payload for the flat (1-D) gradient ``flat``."""
        raise NotImplementedError

    def decode(self, payload, ctx, ops):
        """Flat float32 *sum over ranks* from the aggregated payload."""
        raise NotImplementedError

    def encode_checked(self, flat, ctx, ops, step):
        """``(payload, finite)`` for compressors with ``finds_nonfinite``: ``finite`` (a
        Python bool) says whether ``flat`` held no NaN/Inf; where it did, the payload is
        what :meth:`encode` sends for a non-finite input."""
        raise NotImplementedError

    # -- the contract ------------------------------------------------------------------
    def for_tensor(self, name, tensor):
        """The compressor to use for ``tensor``: integer tensors go uncompressed, and so
        do tensors of fewer than :attr:`min_size` values (one shared ``none``)."""
        ops = ops_for(tensor)
        if not ops.is_floating(tensor) or (self.min_size and ops.numel(tensor) < self.min_size):
            if getattr(self, "_whole", None) is None:
                from .dense import NoneCompressor
                self._whole = NoneCompressor()
            return self._whole
        return self

    def send_whole_below(self, min_size):
        """Send tensors of fewer than ``min_size`` values uncompressed (spec parameter
        ``min_size=``, any compressor but ``auto``), as Hylo's policy does with its own
        ``min_size`` (measured with compressed AdamW updates: docs/adam-adamw.md).
        Returns ``self``."""
        if isinstance(min_size, bool) or not isinstance(min_size, int) or min_size < 0:
            raise ValueError(f"{self.name}: min_size must be an integer >= 0 (values), got "
                             f"{min_size!r}")
        if getattr(self, "adaptive", False):
            raise ValueError("auto: min_size applies to one compressor; auto chooses per "
                             "bucket (give min_size= to a Policy's or a compressor's spec)")
        self.min_size = min_size or None
        return self

    def mark_residuals(self, kind):
        """What the residuals will hold from now on, ``"gradients"`` or ``"updates"`` (every
        glue calls this, through
        :func:`~hvd_compress.strategies.momentum.check_compressed_update`); ValueError
        when a checkpoint restored before held the other."""
        if self.loaded_residuals_of not in (None, kind):
            raise other_residuals(self.loaded_residuals_of, kind)
        if self.residuals_of not in (None, kind):
            raise ValueError(f"compression {self.spec!r} is taken already by a glue whose "
                             f"error feedback holds {self.residuals_of} (compressed_update="
                             f"{self.residuals_of == 'updates'}); give this one its own "
                             "compressor (the same spec, built anew)")
        self.residuals_of = kind
        held = self.holds()
        for c in held:
            c.mark_residuals(kind)
        if self.ef and not held and not self.ef_decay_given:
            self.ef_decay = self.default_ef_decay(kind)

    def bind_rank(self, rank_of):
        """How the glue numbers this process (``rank_of()``: an int, or None while
        unknown): checkpoints record it; another rank's is refused (``check_rank_of``)."""
        self.rank_of = rank_of
        for c in self.holds():
            c.bind_rank(rank_of)
        if self.loaded_rank is not None:
            check_rank_of(self, {"rank": self.loaded_rank})

    def holds(self):
        """The compressors inside this one that keep residuals of their own (a Policy's
        members, auto's candidates, ``hier:``'s inner); none here."""
        return []

    def default_ef_decay(self, kind):
        """``ef_decay`` when the spec gives none, for residuals of ``kind``
        (:meth:`mark_residuals`): 1, plain error feedback (sparsifiers of a density
        decay compressed updates' residuals: :mod:`hvd_compress.compressors.sparse`)."""
        return 1.0

    def decay_residuals(self, beta):
        """Error feedback keeps ``beta (c - sent)`` instead of ``c - sent`` (spec parameter
        ``ef_decay=``; :mod:`hvd_compress.memory`, after SparseLoCo): what is not sent
        within ~1/(1 - beta) steps fades instead of arriving late.  Measured with
        compressed AdamW updates (docs/adam-adamw.md).  ``0 < beta <= 1``; needs error
        feedback.  Returns ``self``."""
        if isinstance(beta, bool) or not isinstance(beta, numbers.Real) or not 0 < beta <= 1:
            raise ValueError(f"{self.name}: ef_decay must be a number in (0, 1], got {beta!r}")
        if getattr(self, "adaptive", False):
            raise ValueError("auto: ef_decay applies to one compressor's error feedback; auto "
                             "chooses per bucket (give ef_decay= to a compressor's spec)")
        if not self.ef and beta != 1:
            raise ValueError(f"{self.name}: ef_decay={beta} needs error feedback, which this "
                             "compressor has off (ef=0)")
        self.ef_decay, self.ef_decay_given = float(beta), True
        return self

    def compress(self, tensor, name=None):
        """Compress ``tensor`` (any shape/layout); ``name`` keys error-feedback state."""
        ops = ops_for(tensor)
        if not ops.is_floating(tensor) and self.name != "none":
            raise TypeError(f"{self.name}: cannot compress a tensor of dtype {tensor.dtype}; "
                            "integer tensors are sent uncompressed (use for_tensor())")
        if name is None and (self.ef or self.uses_step or self.collective != "allreduce"):
            raise TypeError(
                f"compressor {self.spec!r} needs the tensor's name and an {self.collective} "
                "of its payload; Horovod's stock DistributedOptimizer gives neither. "
                "Use hvd_compress.torch.DistributedOptimizer (or hvd_compress.tensorflow."
                "DistributedGradientTape) instead.")
        ctx = Ctx(ops.shape(tensor), tensor.dtype, ops.numel(tensor), name or "")
        payload = self._compress_flat(ops.flatten(tensor), ctx, ops, self._steps(ops, [name]),
                                      ((name, ctx.numel),))
        return payload, ctx._replace(wire=_wire(payload, ops))

    def compress_bucket(self, flat, layout):
        """One payload for a *bucket*: ``flat`` holds the flattened tensors of ``layout``
        (:class:`~hvd_compress.buckets.Layout`) end to end, all of one dtype; the caller's
        own buffer (it may be overwritten).  Per-tensor semantics: k, thresholds, ranges
        and draws per tensor (``ctx.segments``), a residual per tensor *name* (a
        checkpoint moves between this and :meth:`compress`).  Buckets of several tensors
        need ``segmented``; :meth:`decompress_bucket` decodes the aggregate.  Replayed
        from CUDA graphs where :mod:`.replay` says (on CUDA by default)."""
        if replay.wanted(self, flat):
            return replay.compress_bucket(self, flat, layout)
        return self.compress_bucket_eager(flat, layout)

    def sends_alone(self, like):
        """Whether a bucket of one tensor like ``like`` goes on the tensor's own path
        (:meth:`compress`), as the glue sends it; not where bucket exchanges are replayed
        (:func:`.replay.wanted`): a bucket of one then, whose payload is the same."""
        return not replay.wanted(self, like)

    def bucket_input(self, layout, like):
        """Where to write the next ``flat`` of ``layout`` (of ``like``'s dtype), or None: a
        replayed bucket's own buffer (:func:`.replay.input_buffer`)."""
        return replay.input_buffer(self, layout, like) if replay.wanted(self, like) else None

    def compress_bucket_eager(self, flat, layout, in_buffer=False, into=None):
        """:meth:`compress_bucket`, its launches issued now (never replayed).  Error
        feedback keeps a bucket's residuals in ``flat``; a bucket of one keeps its own in
        a buffer of its own, as a tensor alone does (``flat`` may be a view of more: a
        shard of hier:'s sum, which a view would keep alive), unless ``in_buffer``
        (:mod:`.replay`'s graphs need it in ``flat``).  ``into``: where
        :meth:`residual_buffer` names one, the buffer ``c = T(g) + r`` is written into,
        which then holds the residuals (:mod:`.replay`'s)."""
        if len(layout.names) > 1 and not self.segmented:
            raise TypeError(f"compressor {self.spec!r} compresses one tensor at a time; "
                            "it cannot take a bucket of several")
        ops = ops_for(flat)
        ctx = Ctx((layout.total,), flat.dtype, layout.total, layout.key, segments=layout)
        own = len(layout.names) > 1 or in_buffer
        payload = self._compress_flat(flat, ctx, ops, self._steps(ops, layout.names),
                                      tuple(zip(layout.names, layout.numels)), own=own,
                                      **({} if into is None else {"into": into}))
        return payload, ctx._replace(wire=_wire(payload, ops))

    def residual_buffer(self, layout, ops):
        """``(parts, numel, dtype)`` of the one buffer a bucket's error feedback keeps the
        residuals of ``layout`` in, where that is not the input's own (``parts``: ((name,
        numel), ...) of the residuals end to end): a compressor that transforms first
        (dct's coefficients).  None here: ``c = g + r`` is written over the input, which
        then holds them (:mod:`.replay` swaps two such buffers)."""
        return None

    def _steps(self, ops, names):
        """Per-tensor step counters (``uses_step``): one count, a list for a bucket, or None."""
        if not self.uses_step:
            return None
        state = self._state(ops)
        steps = state.next_counts(["step/" + n for n in names])
        return steps[0] if len(steps) == 1 else steps

    def _compress_flat(self, flat, ctx, ops, step, parts, own=False):
        """``encode`` with error feedback around it; ``parts``: (name, numel) of the
        tensors ``flat`` holds end to end (one for a single tensor)."""
        if not self.ef:
            return self.encode(flat, ctx, ops, step)
        memory = self.error_feedback(ops)
        # (only an encode that checks its own input can add r first: finds_nonfinite)
        add = memory.residuals_to_add(parts, flat, own) \
            if self.finds_nonfinite and self.adds_residual(flat, ctx, ops) else None
        if add is not None:                   # c = g + r written by encode's first pass
            compensated = add[1]              # (flat, or a tensor alone's spare buffer)
            ctx = ctx._replace(add=add[0], source=None if compensated is flat else flat)
        else:
            compensated = memory.compensate_parts(parts, flat, own=own)
        if self.finds_nonfinite:
            payload, finite = self.encode_checked(compensated, ctx, ops, step)
        else:
            finite = ops.all_finite(compensated)          # one pass, shared with encode
            payload = self.encode(compensated, ctx._replace(finite=finite), ops, step)
        # an encode writes the residual over c only where residuals are updated in place
        # (payload_is_copy, hence memory.reuse): c is then the residual, whatever inplace
        written = getattr(payload, "residual", None) is compensated

        def subtract(c, inplace):
            return c if written else self.subtract_sent(c, payload, ctx, ops, inplace)
        memory.update_parts(parts, compensated, subtract, finite, own)
        return payload

    def adds_residual(self, flat, ctx, ops):
        """Does :meth:`encode_checked` (``finds_nonfinite``) add error feedback's
        residuals ``ctx.add`` in its first pass, ``c = g + r`` written over ``flat`` (or
        ``ctx.source + r`` into it: :meth:`.ResidualMemory.residuals_to_add`)?  No."""
        return False

    def subtract_sent(self, compensated, payload, ctx, ops, inplace):
        """``c - D(payload)``: the residual error feedback keeps (in place if asked)."""
        sent = ops.cast(self.decode(payload, ctx, ops), compensated.dtype)
        return ops.subtract(compensated, sent, inplace)

    def decompress(self, payload, ctx):
        """Tensor of ``ctx.shape`` and ``ctx.dtype``: the sum of what every rank sent."""
        ops = self.check_aggregate(payload, ctx)
        return ops.reshape(ops.cast(self.decode(payload, ctx, ops), ctx.dtype), ctx.shape)

    def check_aggregate(self, payload, ctx):
        """The framework's ops, after checking that ``payload`` has the structure of this
        rank's own (``ctx.wire``; :func:`.payload.check_wire`): as many tensors, the same
        dtypes, and for an allreduce the same length.  ValueError (TypeError for a dtype)
        naming the compressor."""
        what = f"{self.name} ({ctx.name or 'tensor'})"
        ops = ops_for(first_tensor(what, payload))
        check_wire(what, self.collective, payload, ctx.wire, ops)
        return ops

    def decompress_bucket(self, payload, ctx):
        """The flat sum (``ctx.dtype``) over ranks of a bucket: tensor ``i`` of the layout
        is ``out[offsets[i]:offsets[i] + numels[i]]`` (:meth:`Layout.split`).  Replayed
        from CUDA graphs where :mod:`.replay` says (on CUDA by default)."""
        first = payload[0] if isinstance(payload, (tuple, list)) and payload else payload
        if replay.wanted(self, first):
            return replay.decompress_bucket(self, payload, ctx)
        return self.decompress(payload, ctx)

    # -- state (error feedback, counters) --------------------------------------------
    journal = None             #: :class:`hvd_compress.stores.Journal` of the stores, or None

    def _state(self, ops):
        if self._store is None:
            self._store, self._ops = ops.new_store(), ops
            self._store.journal = self.journal
        elif self._ops is not ops:
            raise TypeError(f"compressor {self.spec!r} already holds state for "
                            f"{self._ops.__name__}; use one compressor per framework")
        return self._store

    def compressors(self):
        """The distinct compressors this one stands for: itself (a
        :class:`~hvd_compress.strategies.policy.Policy` lists its members)."""
        return [self]

    def attach_journal(self, journal):
        """Record every state write of this compressor (and of the compressors it holds)
        in ``journal`` (a :class:`~hvd_compress.stores.Journal`; None: stop), so that a
        step can be undone."""
        self.journal = journal
        if self._store is not None:
            self._store.journal = journal
        for value in vars(self).values():
            for c in (value if isinstance(value, (list, tuple)) else (value,)):
                if isinstance(c, Compressor) and c is not self:
                    c.attach_journal(journal)

    def in_place_state(self, lay):
        """Keys of the state that a compress of the bucket ``lay`` writes *into* rather than
        replaces (a CUDA graph holds their tensors: :mod:`.replay`); none here."""
        return ()

    def residual_names(self, lay):
        """The names error feedback keeps the residuals of the tensors of the Layout
        ``lay`` under (their own; dct's say that they hold coefficients)."""
        return list(lay.names)

    def residual(self, name):
        """Flat residual of tensor ``name`` (None before its first compress)."""
        if self._store is None:
            return None
        return ResidualMemory(self._store, self._ops).residual(name)

    def error_feedback(self, ops):
        """The :class:`~hvd_compress.memory.ResidualMemory` of this compressor's residuals
        (in place where its payload never aliases its input; its ``ef_decay``)."""
        return ResidualMemory(self._state(ops), ops, reuse=self.payload_is_copy,
                              decay=self.ef_decay)

    def state_dict(self):
        """Error-feedback residuals and counters, copied: ``{"spec", "residuals_of",
        "state"}``."""
        return dict(self._state_header(),
                    state=self._store.state_dict() if self._store is not None else {})

    def _state_header(self):
        """What every state_dict starts with: the spec, what the residuals hold and,
        where a glue has told it (:meth:`bind_rank`), the rank they are of."""
        head = {"spec": self.spec, "residuals_of": self.residuals_of or "gradients"}
        rank = None if self.rank_of is None else self.rank_of()
        return head if rank is None else dict(head, rank=rank)

    def _check_state_header(self, state_dict):
        """ValueError when ``state_dict`` is another compressor's, holds residuals of
        the other mode (:func:`~hvd_compress.memory.check_residuals_of`) or another
        rank's (:meth:`bind_rank`)."""
        if not same_spec(state_dict.get("spec"), self.spec):
            raise ValueError(f"state_dict is for compressor {state_dict.get('spec')!r}, "
                             f"not {self.spec!r}")
        check_residuals_of(self, state_dict)
        check_rank_of(self, state_dict)

    def load_state_dict(self, state_dict, framework="torch", strict=True):
        """Restore what :meth:`state_dict` returned; the spec must match.  ``strict``: a
        tensor compressed later that has no residual in ``state_dict`` (while others do)
        raises ValueError, as a checkpoint of another model would (Elastic restores pass
        False: a tensor may have had no gradient yet at the commit)."""
        self._check_state_header(state_dict)
        if self._store is None:
            from importlib import import_module
            ops = import_module("hvd_compress.ops." + {"torch": "torch_ops",
                                                       "tensorflow": "tf_ops"}[framework])
            self._state(ops)
        self._store.load_state_dict(state_dict["state"])
        if not strict:
            self._store.loaded = frozenset()

    # -- spec ---------------------------------------------------------------------------
    @classmethod
    def params(cls):
        """``{parameter: default}`` accepted in a spec string for this compressor: those of
        its ``__init__``, and where that takes ``**kwargs``, those of the base classes'."""
        out = {}
        for klass in cls.__mro__:
            if "__init__" not in vars(klass):
                continue
            params = list(inspect.signature(klass.__init__).parameters.values())[1:]
            for p in params:
                if p.kind is p.POSITIONAL_OR_KEYWORD:
                    out.setdefault(p.name, p.default)
            if not any(p.kind is p.VAR_KEYWORD for p in params):
                break
        return out

    @property
    def spec(self):
        """Canonical spec string; ``from_spec(c.spec)`` rebuilds an equal compressor."""
        parts = []
        for p in self.params():
            value = getattr(self, p, None)
            if value is None:
                continue
            parts.append(f"{p}={int(value) if isinstance(value, bool) else value}")
        if self.ef_decay_given:
            parts.append(f"ef_decay={self.ef_decay}")
        if self.min_size and "min_size" not in self.params():
            parts.append(f"min_size={self.min_size}")
        return self.name + (":" + ",".join(parts) if parts else "")

    def __repr__(self):
        return f"<hvd_compress {self.spec}>"
