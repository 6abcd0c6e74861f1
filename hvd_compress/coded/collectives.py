"""The collectives the coded exchange needs, over Horovod, for either framework (the
``comm`` of :meth:`hvd_compress.coded.CodedExchange.run`).  Every one is named
``hvd_compress.coded.<what>``; :attr:`HorovodComm.sent_bytes` counts what is handed to
Horovod.

Imports: numpy; and modules of its own package.
"""
import numpy as np

from .process_sets import group_sets

PREFIX = "hvd_compress.coded."


class HorovodComm:
    """``hvd``: ``horovod.torch`` or ``horovod.tensorflow``; ``o``: the framework's
    :mod:`hvd_compress.ops` module; ``tensor``: numpy array -> framework tensor."""

    def __init__(self, hvd, o, tensor):
        self.hvd, self.o, self.tensor = hvd, o, tensor
        self.sets, self.sent_bytes = {}, 0

    def _count(self, t):
        self.sent_bytes += int(self.o.size_bytes(t))

    def allgather_ints(self, vec, what):
        """Every rank's int64 ``vec`` as rows (the configuration, the step's checksum)."""
        return np.asarray(self.hvd.allgather(self.tensor(vec.reshape(1, -1)),
                                             name=PREFIX + what))

    def register_groups(self, groups, mine):
        sets = group_sets(self.hvd, groups)
        self.sets = {g: sets[g] for g in mine}

    def group_allgather(self, packets):
        names = [PREFIX + "g" + "-".join(map(str, g)) for g, _ in packets]
        for _, p in packets:
            self._count(p)
        if hasattr(self.hvd, "allgather_async"):      # PyTorch: all groups in flight at once
            handles = [self.hvd.allgather_async(p, name=name, process_set=self.sets[g])
                       for (g, p), name in zip(packets, names)]
            return [self.hvd.synchronize(h) for h in handles]
        # TensorFlow (eager) ops block; every rank walks the groups in the same global
        # order, so the smallest pending group always has all its members: no deadlock.
        return [self.hvd.allgather(p, name=name, process_set=self.sets[g])
                for (g, p), name in zip(packets, names)]

    def alltoall(self, chunks, splits):
        o = self.o
        buf = o.concat(chunks) if chunks else o.zeros(0, o.int32)
        self._count(buf)
        out, _ = self.hvd.alltoall(buf, splits=self.tensor(np.asarray(splits, np.int32)),
                                   name=PREFIX + "scatter")
        return out

    def allgather(self, t):
        self._count(t)
        return self.hvd.allgather(t, name=PREFIX + "slices")

    def allreduce_sum(self, t):
        self._count(t)
        return self.hvd.allreduce(t, op=self.hvd.Sum, name=PREFIX + "allreduce")


class CodedWorker:
    """What both frameworks' entry points share: this worker's :class:`CodedExchange`,
    its samples of a global mini-batch, the Horovod comm and the counters."""

    def _setup(self, hvd, o, tensor, numel, batch_size, redundancy, value_range, exchange,
               verify):
        from .exchange import CodedExchange
        self.exchange = CodedExchange(hvd.size(), hvd.rank(), redundancy, numel,
                                      value_range, exchange, verify)
        self.placement = self.exchange.placement
        self.placement.part_slices(batch_size)                      # checks batch_size
        self.batch_size = int(batch_size)
        self._positions, self._lengths = self.placement.worker_indices(hvd.rank(),
                                                                       self.batch_size)
        self._comm, self._ops = HorovodComm(hvd, o, tensor), o
        self._prepared, self.compute_s = False, 0.0

    def _prepare(self):
        """First step: the ranks compare configurations (before any local check)."""
        if not self._prepared:
            self.exchange.prepare(self._comm, self.batch_size)
            self._prepared = True

    @property
    def stats(self):
        """Bytes, clip counts and seconds (see :meth:`CodedExchange.stats`)."""
        return self.exchange.stats(self.compute_s, self._comm.sent_bytes)
