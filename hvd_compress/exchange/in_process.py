"""Ranks simulated in one process: the exchange protocol run without any network.

A :class:`World` of ``size`` ranks hands each rank a :class:`LocalTransport`; a
collective is complete once every rank has started it (allreduce: the sum in rank order;
allgather: the concatenation in rank order).  :func:`run` drives one
:class:`~.protocol.Exchange` per rank in lockstep, exactly as the glue drives them
(:func:`~.protocol.finish_all`'s round-robin), so the algorithms' tests and the
benchmarks that simulate many workers use the very protocol the glue runs over Horovod.
The world also keeps a log of the collectives each rank started, in order, which the
tests of the ordering rules read.

Imports: the framework-free parts of hvd_compress; tensors go through :mod:`hvd_compress.ops`.
"""
import threading

from .hierarchical import Hierarchy
from .protocol import Exchange, Gathered, Transport, Wait, finish_all, standard_traffic


class World:
    """``size`` ranks in one process; :meth:`transport` is rank ``r``'s.

    ``timeout``: seconds a rank waits for the others to start a collective.  0 (the
    default) suits one thread driving every rank in lockstep (:func:`run`): waiting for a
    collective some rank has not started is an error at once.  Ranks running in threads
    of their own (each with its own glue or :class:`~.driver.Driver`) need a timeout >
    0; past it the wait is an error ("this rank would hang")."""

    def __init__(self, size, ops, timeout=0.0):
        self.size, self.ops, self.timeout = size, ops, timeout
        self.started = {}              #: collective name -> {rank: what it contributed}
        self.log = [[] for _ in range(size)]   #: per rank: ("start"|"wait", name), in order
        self._cond = threading.Condition()
        self._count, self._waited = {}, {}

    def transport(self, rank):
        return LocalTransport(self, rank)

    def _put(self, rank, name, value):
        """Rank ``rank`` starts collective ``name``; returns its key: the n-th start of a
        name on one rank pairs with the n-th on the others (names repeat every step)."""
        with self._cond:
            n = self._count[(rank, name)] = self._count.get((rank, name), -1) + 1
            self.started.setdefault((name, n), {})[rank] = value
            self.log[rank].append(("start", name))
            self._cond.notify_all()
            return name, n

    def _complete(self, rank, key, combine):
        with self._cond:
            self.log[rank].append(("wait", key[0]))
            self._cond.wait_for(lambda: len(self.started.get(key, {})) == self.size,
                                timeout=self.timeout)
            got = dict(self.started.get(key, {}))
            if len(got) == self.size:
                self._waited[key] = self._waited.get(key, 0) + 1
                if self._waited[key] == self.size:          # everyone has it: forget it
                    del self.started[key], self._waited[key]
        if len(got) != self.size:
            raise RuntimeError(f"collective {key[0]!r} waited for by rank {rank} before every "
                               f"rank started it (started by {sorted(got)}): with real "
                               "collectives this rank would hang")
        return combine([got[r] for r in range(self.size)])

    def sum(self, values):
        """Element-wise sum in rank order."""
        out = values[0]
        for v in values[1:]:
            out = out + v
        return out

    def concat(self, payloads):
        """Each payload tensor concatenated in rank order, with each rank's rows (as the
        DDP hook's transport tells them)."""
        width = range(len(payloads[0]))
        return Gathered([self.ops.concat([p[i] for p in payloads]) for i in width],
                        [[self.ops.length(p[i]) if len(p[i].shape) else 1 for p in payloads]
                         for i in width])


class LocalTransport(Transport):
    """Rank ``rank`` of a :class:`World`: collectives complete when all ranks started them."""

    def __init__(self, world, rank):
        self.world, self.rank, self.size, self.ops = world, rank, world.size, world.ops

    def allreduce(self, tensor, name, inplace_of=None):
        key = self.world._put(self.rank, name, tensor)
        out = yield Wait(self.world._complete, self.rank, key, self.world.sum)
        return (out,) + standard_traffic(self.ops, "allreduce", tensor, out, self.size)

    def allgather(self, tensors, name):
        key = self.world._put(self.rank, name, tuple(tensors))
        out = yield Wait(self.world._complete, self.rank, key, self.world.concat)
        return (out,) + standard_traffic(self.ops, "allgather", tensors, out, self.size)

    def reducescatter(self, tensor, name, sizes):
        """Rank ``rank``'s piece of the sum (in rank order); traffic as a ring
        reduce-scatter moves it: ``(P-1)/P`` of the tensor sent and received."""
        key = self.world._put(self.rank, name, tensor)
        out = yield Wait(self.world._complete, self.rank, key, lambda every: self.ops.split(
            self.world.sum(every), list(sizes))[self.rank])
        return (out,) + standard_traffic(self.ops, "reducescatter", tensor, None, self.size)

    def divide(self, out, size):
        return out / size

    def broadcast_floats(self, values, name):
        key = self.world._put(self.rank, name, list(values))
        return self.world._complete(self.rank, key, lambda every: list(every[0]))

    def allgather_floats(self, values, name):
        key = self.world._put(self.rank, name, list(values))
        return self.world._complete(self.rank, key, lambda every: [list(v) for v in every])


def hosts(sizes, ops, timeout=0.0):
    """Hosts of ``sizes[h]`` workers (global ranks host by host): a global :class:`World`,
    one per host (the local transports) and one per local rank (the cross transports:
    the hosts that have that local rank, in host order).  Returns, per global rank,
    ``(global transport, Hierarchy(local, cross))``; uneven ``sizes`` give what uneven
    hosts would (for :func:`~.hierarchical.check_hosts` to refuse)."""
    world = World(sum(sizes), ops, timeout)
    local = [World(n, ops, timeout) for n in sizes]
    cross = [World(sum(1 for n in sizes if n > lr), ops, timeout) for lr in range(max(sizes))]
    out = []
    for h, n in enumerate(sizes):
        for lr in range(n):
            host_index = sum(1 for m in sizes[:h] if m > lr)
            out.append((world.transport(len(out)),
                        Hierarchy(local[h].transport(lr), cross[lr].transport(host_index))))
    return out


def run(compressors, tensors, name, world=None):
    """One exchange of rank ``r``'s ``tensors[r]`` with ``compressors[r]`` for every rank
    (one tensor each, ``compress``/``propose``); returns the :class:`~.protocol.Exchange`
    of each rank, done (``.result``: the sum over ranks)."""
    from ..ops import ops_for
    world = world or World(len(compressors), ops_for(tensors[0]))
    exchanges = [Exchange(c, world.transport(r), name, tensor=t)
                 for r, (c, t) in enumerate(zip(compressors, tensors))]
    finish_all(exchanges)           # in lockstep: rank by rank, collective by collective
    return exchanges
