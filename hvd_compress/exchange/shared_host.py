"""The workers of one host summing and gathering through shared memory (``hier:``'s
dense steps inside the host, on CPU tensors).

Horovod's Gloo collectives inside a host go through TCP on the loopback: every byte is
copied through the kernel, on the cores that also train.  Measured on this machine (2
hosts x 2 workers on 2 cores, 6.3M float32 values in 4 MB buckets): the host's
reduce-scatter took 51-136 ms per step as a Gloo allreduce (54-64 ms as an alltoall,
162-174 ms as Horovod's reducescatter), its allgather 27-51 ms, while the compressed
exchange across hosts took 2-14 ms.  Workers on one host share memory, as MPI's and
NCCL's intra-node transports use it; :class:`SharedHost` does the same:

- every worker owns one file in ``/dev/shm`` (a header of counters, then a data slot)
  and maps its host peers' files read-only;
- collective number q (every worker of the host starts the same collectives in the
  same order: the protocol's ordering rule 1): wait until every peer has finished
  reading collective q - 1 (its ``done`` counter), write this worker's data into its
  slot, publish ``arrived = q``; wait until every peer has arrived; read (a
  reduce-scatter sums shard l of every slot, in local-rank order, so the result does
  not depend on who arrives first; an allgather concatenates the slots in local-rank
  order); publish ``done = q``;
- a slot grows (a new file, a new generation in the header) when a collective needs
  more than it holds; its pages are reserved when it is made, so a full ``/dev/shm``
  (Docker gives 64 MB unless ``--shm-size`` says more) is a RuntimeError saying so, not
  a crash on a later write;
- a peer that does not arrive within ``timeout`` seconds is a RuntimeError naming it
  (a dead or diverged worker must not hang the others).

The counters are plain 8-byte stores and loads on a mapping shared between processes,
ordered by the data written before them: this relies on x86-64's store ordering
(:func:`usable` says no elsewhere, and the glue keeps Horovod's collectives).  Tensors
on a GPU, and anything else :func:`usable` refuses, go through the ``base`` transport
(Horovod's process set of the host).  A worker removes each of its files once every
peer has mapped it (when they have all finished the first collective that used it; the
mappings stay valid), and at close or exit (``atexit``) whatever is left, so a worker
killed after the host's first collectives leaves nothing in ``/dev/shm``.

The transport is synchronous: its collectives complete when started (the protocol
allows it: :func:`.protocol._collective`).  A worker blocks in one only until its host
peers reach the same collective, which they do, since every Horovod collective any of
them waits on earlier in the common order has been started by all its members.

Imports: the standard library, numpy, and :mod:`.protocol`.
"""
import atexit
import mmap
import os
import platform
import time
import weakref

import numpy as np

from .protocol import Transport, _collective, standard_traffic

HEADER = 64                  #: bytes: arrived, done, generation, capacity (int64 each)
DIRECTORY = "/dev/shm"


def usable():
    """Whether shared-memory collectives are used here: Linux on x86-64 (the counters'
    ordering, module docstring) with ``/dev/shm``, and ``$HVD_COMPRESS_SHARED_HOST`` not
    ``0``."""
    return (os.environ.get("HVD_COMPRESS_SHARED_HOST", "1") != "0"
            and platform.system() == "Linux"
            and platform.machine() in ("x86_64", "AMD64")
            and os.path.isdir(DIRECTORY) and os.access(DIRECTORY, os.W_OK))


class _File:
    """One worker's mapping: its header counters and its data slot."""

    def __init__(self, path, size, create):
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                try:   # reserve the pages now: a full /dev/shm is an error here, not a
                    os.posix_fallocate(fd, 0, size)   # SIGBUS on the first write
                except OSError as e:
                    os.close(fd)
                    fd = None
                    os.unlink(path)
                    free = os.statvfs(DIRECTORY)
                    raise RuntimeError(
                        f"hvd_compress shared-memory exchange inside the host: cannot "
                        f"reserve {size / 2**20:.1f} MiB in {DIRECTORY} ({e.strerror}; "
                        f"{free.f_bavail * free.f_frsize / 2**20:.0f} MiB free): enlarge it "
                        "(docker run --shm-size=...), use smaller buckets (bucket_mb=), or "
                        "set HVD_COMPRESS_SHARED_HOST=0 for Horovod's collectives") from None
            elif os.fstat(fd).st_size < size or size < HEADER:
                raise FileNotFoundError(path)        # still being created: try again
            self.map = mmap.mmap(fd, size)
        finally:
            if fd is not None:
                os.close(fd)
        self.path = path
        self.head = np.frombuffer(self.map, np.int64, 4, 0)

    def data(self, dtype, count):
        return np.frombuffer(self.map, dtype, count, HEADER)

    def close(self):
        self.head = None
        try:
            self.map.close()
        except BufferError:          # a view still exported: the GC unmaps it later
            pass


def _remove(paths):
    for p in list(paths):
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass
    paths.clear()


class SharedHost(Transport):
    """The collectives of one host's workers through shared memory (module docstring).

    ``base``: the host's Horovod transport (rank, size, ``ops``, ``divide``, ``wire``;
    every collective on a tensor that :meth:`host_array` refuses); ``token``: a number
    every worker of the host was given (the files' names); ``to_numpy(t)`` (a CPU
    array sharing ``t``'s memory, or None for a tensor this transport does not take)
    and ``from_numpy(a)`` (a tensor owning ``a``); ``timeout``: seconds a worker waits
    for a peer."""

    def __init__(self, base, token, to_numpy, from_numpy, timeout=300.0):
        self.base, self.ops = base, base.ops
        self.to_numpy, self.from_numpy = to_numpy, from_numpy
        self.timeout = float(timeout)
        self.prefix = os.path.join(DIRECTORY, f"hvd_compress_{int(token)}")
        self.q = 0                               #: collectives done
        self._created = []                       #: files this worker made, not yet removed
        self._made_at = {}                       #: file -> the collective that first uses it
        self._gen = 0
        self._mine = self._own(1 << 20)
        self._peers = {}                         #: local rank -> (generation, _File)
        self._closer = weakref.finalize(self, _remove, self._created)
        atexit.register(self._closer)

    @property
    def rank(self):
        return self.base.rank

    @property
    def size(self):
        return self.base.size

    # -- files ----------------------------------------------------------------------------
    def _path(self, rank, gen):
        return f"{self.prefix}_{rank}_{gen}"

    def _own(self, capacity):
        f = _File(self._path(self.rank, self._gen), HEADER + capacity, create=True)
        self._created.append(f.path)
        self._made_at[f.path] = self.q + 1
        f.head[3] = capacity
        return f

    def _unlink_mapped(self, done):
        """Remove this worker's files that every peer has mapped: those first used by a
        collective every peer has finished (``done``).  The mappings stay valid, and a
        worker killed later leaves nothing in ``/dev/shm``."""
        for path in [p for p in self._created if self._made_at[p] <= done]:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            self._created.remove(path)

    def _grow(self, nbytes):
        """A slot of at least ``nbytes``: a new file, counters carried over; the peers
        switch to it when they see the new generation (the old file is kept until then:
        they may still read it for the collective they are in)."""
        if nbytes <= self._mine.head[3]:
            return
        old = self._mine
        self._gen += 1
        new = self._own(max(nbytes, 2 * int(old.head[3])))
        new.head[0], new.head[1], new.head[2] = old.head[0], old.head[1], self._gen
        self._mine = new
        # peers find the new file through the old one's generation field
        old.head[2] = self._gen

    def _peer(self, rank, deadline):
        gen, f = self._peers.get(rank, (0, None))
        while True:
            if f is None:
                try:
                    path = self._path(rank, gen)
                    f = _File(path, os.path.getsize(path), create=False)
                except FileNotFoundError:
                    self._wait_tick(deadline, rank, "create its shared-memory file")
                    continue
            if int(f.head[2]) == gen:
                self._peers[rank] = (gen, f)
                return f
            gen, f = int(f.head[2]), None        # moved on to a bigger file

    def _wait_tick(self, deadline, rank, what):
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"hvd_compress shared-memory exchange inside the host: local rank {rank} "
                f"did not {what} within {self.timeout:.0f} s (collective {self.q + 1} of "
                f"local rank {self.rank}); a worker of this host died or started different "
                "collectives (set HVD_COMPRESS_SHARED_HOST=0 to use Horovod's)")
        time.sleep(0)

    def _wait(self, field, value, deadline, what):
        for rank in range(self.size):
            if rank == self.rank:
                continue
            spins = 0
            while True:
                f = self._peer(rank, deadline)
                if int(f.head[field]) >= value:
                    break
                spins += 1
                if spins > 64:
                    time.sleep(min(1e-3, 1e-5 * (spins - 64)))
                self._wait_tick(deadline, rank, what)

    def _round(self, array):
        """Publish ``array`` as this worker's part of the next collective and return every
        worker's part (views, local-rank order) once all have arrived; the caller reads
        them and then calls :meth:`_done`."""
        deadline = time.monotonic() + self.timeout
        q = self.q + 1
        self._wait(1, q - 1, deadline, f"finish collective {q - 1}")   # slots free again
        if self._created:
            self._unlink_mapped(q - 1)
        self._grow(array.nbytes)
        mine = self._mine
        mine.data(array.dtype, array.size)[:] = array.reshape(-1)
        mine.head[0] = q
        self._wait(0, q, deadline, f"reach collective {q}")
        return [(mine if r == self.rank else self._peer(r, deadline)).data(array.dtype,
                                                                           array.size)
                for r in range(self.size)], q

    def _done(self, q):
        self.q = q
        self._mine.head[1] = q

    def _sum(self, parts, lo, hi):
        """``parts[0][lo:hi] + parts[1][lo:hi] + ...``, in local-rank order (a copy:
        the slots are written again after :meth:`_done`)."""
        out = parts[0][lo:hi].copy()
        for p in parts[1:]:
            out += p[lo:hi]
        return out

    def close(self):
        """Unmap and remove this worker's files (also at exit)."""
        for _, f in self._peers.values():
            f.close()
        self._peers = {}
        self._closer()

    # -- collectives ----------------------------------------------------------------------
    def wire(self, name):
        return self.base.wire(name)

    def divide(self, out, size):
        return self.base.divide(out, size)

    def allreduce(self, tensor, name, inplace_of=None):
        a = self.to_numpy(tensor)
        if a is None:
            return (yield from _collective(self.base.allreduce(tensor, name, inplace_of)))
        parts, q = self._round(a)
        out = self._sum(parts, 0, a.size)
        self._done(q)
        out = self.from_numpy(out.reshape(a.shape))
        return (out,) + standard_traffic(self.ops, "allreduce", tensor, out, self.size)

    def reducescatter(self, tensor, name, sizes):
        a = self.to_numpy(tensor)
        if a is None or a.ndim != 1 or len(sizes) != self.size:
            return (yield from _collective(self.base.reducescatter(tensor, name, sizes)))
        lo = sum(sizes[:self.rank])
        hi = lo + sizes[self.rank]
        parts, q = self._round(a)
        out = self._sum(parts, lo, hi)
        self._done(q)
        out = self.from_numpy(out)
        return (out,) + standard_traffic(self.ops, "reducescatter", tensor, out, self.size)

    def allgather(self, tensors, name):
        return (yield from self._allgather(tensors, name, self.base.allgather))

    def allgather_fixed(self, tensors, name):
        # (shared memory as any allgather; else the base transport's, without lengths)
        return (yield from self._allgather(tensors, name, self.base.allgather_fixed))

    def _allgather(self, tensors, name, fallback):
        arrays = [self.to_numpy(t) for t in tensors]
        if len(tensors) != 1 or arrays[0] is None:
            return (yield from _collective(fallback(tensors, name)))
        a = arrays[0]
        # first dimensions may differ between workers: gather the lengths first
        lengths, q = self._round(np.array([a.shape[0] if a.ndim else 1], np.int64))
        lengths = [int(x[0]) for x in lengths]
        self._done(q)
        row = int(np.prod(a.shape[1:], dtype=np.int64)) if a.ndim > 1 else 1
        width = max(lengths) * row
        buf = np.zeros(width, a.dtype)
        buf[:a.size] = a.reshape(-1)
        parts, q = self._round(buf)
        out = np.concatenate([p[:n * row] for p, n in zip(parts, lengths)])
        self._done(q)
        shape = (sum(lengths),) + tuple(a.shape[1:]) if a.ndim else (sum(lengths),)
        out = (self.from_numpy(out.reshape(shape)),)
        return (out,) + standard_traffic(self.ops, "allgather", tensors, out, self.size)

    def broadcast_floats(self, values, name):
        return self.base.broadcast_floats(values, name)

    def allgather_floats(self, values, name):
        return self.base.allgather_floats(values, name)
