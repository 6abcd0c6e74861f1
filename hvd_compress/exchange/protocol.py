"""How one compressor's payload crosses the network: the exchange protocol, written once.

An :class:`Exchange` is one compress call and the collectives it needs, for one tensor
or one bucket (several tensors end to end, :mod:`hvd_compress.buckets`).  It is a
generator underneath: it compresses, *requests* a collective from a
:class:`Transport`, and goes on when the transport's result comes back; the glue (the
Horovod optimizer, the TensorFlow tape, the DDP hook) only decides *when* to move each
exchange one collective further (:meth:`Exchange.advance`).  By the compressor's
``collective`` (:mod:`hvd_compress.compressors.base` states the contract):

- ``allreduce``:  compress -> allreduce (Sum) of the payload -> decompress;
- ``allgather``:  compress -> allgather of every payload tensor (first dimensions may
  differ between ranks; results concatenated in rank order) -> decompress;
- ``two_round`` (agg=union/leader/hint, PowerSGD): propose -> ``rounds[0]``'s collective
  -> agree -> allreduce (Sum) -> finish.

Collectives are named ``<transport.wire(name)>`` (one-round) or ``<...>.<suffix>``
(two rounds, suffixes from ``compressor.rounds``), where ``name`` is the tensor's or the
bucket's key: Horovod pairs operations across ranks by name.

**Ordering rules** (learned the hard way; the glue keeps them by driving every exchange
through :func:`finish_all`):

1. every collective is started in the same order on every rank: exchanges are started
   in bucket order, and :func:`finish_all` advances them round-robin in that order;
2. no collective is started from a future's callback (a collective that needs another's
   result is started by :meth:`Exchange.advance`, called from the glue's own thread:
   started from a callback it would start whenever the first finished, in a different
   place on each rank, and Gloo/NCCL would pair different collectives);
3. two-round exchanges start every round 2 before waiting on any (the round-robin of
   :func:`finish_all` waits round 1 of each and starts its round 2 in one pass), so the
   round-2 allreduces overlap.

A :class:`Transport` is what each glue provides: how to start and wait for one
collective.  Its ``allreduce``/``allgather`` are generators that yield a :class:`Wait`
(something to wait for) and return ``(result, sent bytes, received bytes)``; a
transport whose collectives complete at once (TensorFlow) returns without yielding.
This module imports no framework and no Horovod.
"""
import inspect
import time

PREFIX = "hvd_compress."


class Wait:
    """A started collective: ``wait()`` blocks until it is done and returns what the
    transport's generator receives (``fn(*args)``)."""

    __slots__ = ("fn", "args")

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def wait(self):
        return self.fn(*self.args)


class Transport:
    """The collectives of one glue (Horovod torch, Horovod TensorFlow, torch.distributed).

    ``rank``, ``size``: of the process set / group.  ``ops``: the framework's primitives
    (:mod:`hvd_compress.ops`).  Subclasses implement :meth:`allreduce` and
    :meth:`allgather` (generators, see the module docstring), :meth:`broadcast_floats`
    and :meth:`allgather_floats` (blocking; what ``auto`` decides with), and may
    override :meth:`wire` (collective names) and :meth:`divide` (``op=Average``)."""

    rank = 0
    size = 1
    ops = None

    def wire(self, name):
        """The collective name of tensor or bucket ``name``."""
        return PREFIX + name

    def allreduce(self, tensor, name, inplace_of=None):
        """Sum of ``tensor`` over the ranks.  ``inplace_of``: the gradient the payload
        came from; where ``tensor`` is that very memory, it may be reduced in place."""
        raise NotImplementedError

    def allgather(self, tensors, name):
        """Each tensor of ``tensors`` concatenated over the ranks in rank order."""
        raise NotImplementedError

    def allgather_fixed(self, tensors, name):
        """:meth:`allgather` of tensors whose shapes are the same on every rank (a
        ``fixed_size`` compressor's payload), which a transport may gather without
        first gathering their lengths.  Default: :meth:`allgather`."""
        return (yield from _collective(self.allgather(tensors, name)))

    def reducescatter(self, tensor, name, sizes):
        """This rank's piece of the sum over the ranks of the 1-D ``tensor``, cut into
        contiguous pieces of ``sizes`` (one per rank, in rank order; the hierarchical
        exchange's step 1).  A generator like :meth:`allreduce`, returning ``(piece,
        sent, received)``.  Default: the whole :meth:`allreduce`, then this rank's slice
        (what it moves is counted); a glue with a native reduce-scatter overrides it."""
        out, sent, received = yield from _collective(self.allreduce(tensor, name))
        return self.ops.split(out, list(sizes))[self.rank], sent, received

    def broadcast_floats(self, values, name):
        """Rank 0's list of floats (one named collective)."""
        raise NotImplementedError

    def allgather_floats(self, values, name):
        """Every rank's list of floats, a list per rank (one named collective)."""
        raise NotImplementedError

    def divide(self, out, size):
        """``out / size`` (``op=Average``) in ``out``'s dtype."""
        raise NotImplementedError


class ProcessSetTransport(Transport):
    """A transport over a Horovod process set (either framework): ``rank`` and ``size``
    are asked of it each time, since Elastic Horovod changes the world under a running
    optimizer."""

    def __init__(self, process_set):
        self.process_set = process_set

    @property
    def rank(self):
        return self.process_set.rank()

    @property
    def size(self):
        return self.process_set.size()


class AutoComm:
    """What :meth:`hvd_compress.strategies.auto.Auto.end_step` needs of a transport:
    ``rank``, ``broadcast(values, name)`` and ``allgather(values, name)`` of floats."""

    def __init__(self, transport):
        self.transport, self.rank = transport, transport.rank

    def broadcast(self, values, name):
        return self.transport.broadcast_floats(values, name)

    def allgather(self, values, name):
        return self.transport.allgather_floats(values, name)


def standard_traffic(ops, kind, payload, aggregate, size):
    """``(sent, received)`` bytes of one collective as Horovod moves it: an allreduce
    sends its payload and receives a ring's share ``2 (P-1)/P`` of it; a reduce-scatter
    (a ring's first half) sends and receives ``(P-1)/P`` of it; an allgather receives the
    other ranks' payloads."""
    from ..compressors import payload_bytes
    from ..stats import ring_received
    sent = payload_bytes(payload, ops)
    if kind == "allreduce":
        return sent, ring_received(sent, size)
    if kind == "reducescatter":
        moved = sent * (size - 1) // size
        return moved, moved
    return sent, payload_bytes(aggregate, ops) - sent


class Gathered(tuple):
    """An allgather's result (each payload tensor concatenated over the ranks) that also
    says how many rows (first-dimension entries) of each tensor came from each rank:
    ``rows[i][r]``, host ints, where the transport knows them (the DDP hook gathers
    the lengths first).  A fixed-size payload's are equal; Horovod's allgather does not
    tell them.  The decompress of a sparse aggregate adds rank by rank with them
    (``ops.rank_rows``)."""

    def __new__(cls, parts, rows):
        out = super().__new__(cls, parts)
        try:
            out.rows = tuple(tuple(int(v) for v in r) for r in rows)
        except (TypeError, ValueError):          # (a length only known inside a graph)
            out.rows = None
        return out


def _collective(op):
    """``yield from`` a transport's collective, which may complete without yielding."""
    if inspect.isgenerator(op):
        return (yield from op)
    return op


class Exchange:
    """One compress call and its collectives (module docstring).

    ``compressor``: the one that sends (a Policy's member, auto's candidate).  Either
    ``tensor`` (one tensor: ``compress``/``propose``) or ``flat`` and ``layout`` (a
    bucket: ``compress_bucket``/``propose_bucket``).  ``name``: the tensor's name or the
    bucket's key.  ``inplace``: an uncompressed payload may be reduced in ``tensor``'s
    memory.  ``average``: divide the sum by the number of ranks.  Starting it runs up to
    its first collective (``start=False``: not started; whoever holds it drives
    ``_gen``, as :class:`.hierarchical.HierarchicalExchange` drives its cross exchange).

    When :attr:`done`: :attr:`result` (the sum or average over the ranks: shaped like
    ``tensor``, or flat), :attr:`sent`, :attr:`received`, :attr:`received_local`,
    :attr:`union`, :attr:`k` (see :class:`hvd_compress.stats.Stats`), :attr:`dense`
    (float32 bytes of the gradient) and the seconds :attr:`compress_s` (compressing and
    agreeing), :attr:`wait_s` (blocked on collectives), :attr:`decompress_s`, and
    :attr:`compress_late_s`: the part of ``compress_s`` spent after a collective
    completed (a two-round exchange's second message, ``hier:``'s compress between
    hosts), where the exchange is waited for (``synchronize()``) and not where it was
    launched (backward's hooks).
    """

    hierarchical = False       #: :class:`.hierarchical.HierarchicalExchange` says True

    def __init__(self, compressor, transport, name, tensor=None, flat=None, layout=None,
                 inplace=False, average=False, start=True, checks=None):
        if getattr(compressor, "hierarchical", False) and not self.hierarchical:
            raise ValueError(f"compression {compressor.spec!r}: 'hier:' compressors need the "
                             "hosts' local and cross transports (hvd_compress.exchange.Driver("
                             "hierarchy=...)); this path exchanges flat: drop 'hier:'")
        self.compressor, self.transport, self.name = compressor, transport, name
        self.tensor, self.flat, self.layout = tensor, flat, layout
        self.inplace, self.average = inplace, average
        #: where the decompress's payload checks wait to be read back together
        #: (``ops.deferred_checks``; the driver's, settled once per step); None: at once
        self.checks = checks
        ops = transport.ops
        self.dense = 4 * (layout.total if layout is not None else ops.numel(tensor))
        self.sent = self.received = self.received_local = self.union = self.k = 0
        self.compress_s = self.wait_s = self.decompress_s = self.compress_late_s = 0.0
        self.result, self.done, self.pending = None, False, None
        #: what this rank sent first (the payload, or round 1's message) and the
        #: compressor's state for decompressing (the Ctx, or the two rounds' state)
        self.payload = self.state = None
        #: ``auto``: (the Auto, candidate index, bucket key) that chose the compressor
        self.auto = None
        self._gen = self._steps()
        if start:                      # else the caller drives ``_gen`` (an inner exchange)
            self._resume(None)

    # -- driving ------------------------------------------------------------------------
    def advance(self):
        """Wait for the collective in flight and go on to the next one (or finish)."""
        if self.done:
            return
        start = time.perf_counter()
        value = self.pending.wait()
        self.wait_s += time.perf_counter() - start
        self._resume(value)

    def run(self):
        """Advance until done; returns :attr:`result`."""
        while not self.done:
            self.advance()
        return self.result

    def _resume(self, value):
        start = time.perf_counter()
        try:
            resumed = self.pending is not None          # after a collective completed
            self.pending = self._gen.send(value)
            seconds = time.perf_counter() - start
            self.compress_s += seconds
            if resumed:
                self.compress_late_s += seconds
        except StopIteration as stop:
            self.result, self.pending, self.done = stop.value, None, True
            self.decompress_s += time.perf_counter() - start

    # -- the protocol ---------------------------------------------------------------------
    def _steps(self):
        c, t = self.compressor, self.transport
        wire = t.wire(self.name)
        bucket = self.layout is not None
        if c.collective == "two_round":
            if bucket:
                msg1, rnd = c.propose_bucket(self.flat, self.layout, t.rank, t.size)
            else:
                msg1, rnd = c.propose(self.tensor, self.name, t.rank, t.size)
            self.payload, self.state = msg1, rnd
            (kind, suffix1), (_, suffix2) = c.rounds
            if kind == "allgather":
                (agg1,), sent1, received1 = yield from _collective(
                    t.allgather((msg1,), f"{wire}.{suffix1}"))
            else:
                agg1, sent1, received1 = yield from _collective(
                    t.allreduce(msg1, f"{wire}.{suffix1}"))
            msg2, rnd = c.agree(agg1, rnd)
            self.state = rnd
            agg2, sent2, received2 = yield from _collective(t.allreduce(msg2, f"{wire}.{suffix2}"))
            out = c.finish(agg2, rnd)
            _, _, self.received_local, self.union, self.k = c.traffic(msg1, agg1, msg2, rnd,
                                                                      t.size)
            self.sent, self.received = sent1 + sent2, received1 + received2
        else:
            if bucket:
                payload, ctx = c.compress_bucket(self.flat, self.layout)
            else:
                payload, ctx = c.compress(self.tensor, self.name)
            self.payload, self.state = payload, ctx
            if c.collective == "allreduce":
                agg, self.sent, self.received = yield from _collective(
                    t.allreduce(payload, wire, inplace_of=self.tensor if self.inplace else None))
            else:                          # (shapes equal on every rank: no lengths)
                gather = t.allgather_fixed if c.fixed_size else t.allgather
                agg, self.sent, self.received = yield from _collective(
                    gather(tuple(payload), wire))
            self.received_local = self.received
            # (each rank sends an index once: t.size values at most meet at an index;
            # and each rank's rows of every payload tensor, where they are known)
            rows = getattr(agg, "rows", None)
            with t.ops.deferred_checks(self.checks), t.ops.summing_ranks(
                    t.size, rows, equal=c.collective == "allgather" and c.fixed_size):
                out = c.decompress_bucket(agg, ctx) if bucket else c.decompress(agg, ctx)
        if self.average:
            out = t.divide(out, t.size)
        return out


def finish_all(exchanges):
    """Advance ``exchanges`` (in launch order; anything with ``done`` and ``advance()``,
    e.g. the DDP hook's buckets) round-robin until every one is done:
    each pass waits for each exchange's collective in flight and starts its next, so the
    collectives start in the same order on every rank and every round 2 starts before any
    is waited for (module docstring)."""
    while any(not e.done for e in exchanges):
        for e in exchanges:
            if not e.done:
                e.advance()
