"""The hosts of a Horovod job as the hierarchical exchange needs them (``hier:``; shared
by both glue layers): one process set per host (its workers, the *local* group) and one
per local rank (the workers of that local rank on every host, the *cross* group).

Horovod knows each worker's place: ``hvd.local_rank()``/``local_size()`` (inside its
host) and ``hvd.cross_rank()``/``cross_size()`` (among the workers of the same local
rank, one per host).  :func:`hierarchy` gathers them from every rank (one named float
allgather on the global process set), checks that every host has the same number L of
workers (uneven hosts: ValueError on every rank, before any process set is added),
registers the H + L process sets in the same order on every rank and returns this
worker's :class:`~hvd_compress.exchange.hierarchical.Hierarchy` of two transports.

Horovod registers a process set on *every* rank, either at ``hvd.init(process_sets=...)``
or later with ``hvd.add_process_set`` when the job runs with
``HOROVOD_DYNAMIC_PROCESS_SETS=1``.  The glue calls :func:`hierarchy` when the optimizer
(or tape) is built, so the sets are added before any gradient is in flight.  To register
them up front instead, pass ``hvd.init(process_sets=hvd_compress.hosts.process_sets())``
(it reads the layout horovodrun gives each worker: ``HOROVOD_SIZE`` and
``HOROVOD_LOCAL_SIZE``; horovodrun numbers ranks host by host, rank = h L + l).

Imports: the standard library; on first use, Horovod; and modules of its own package.
"""
import os

from .coded.process_sets import group_sets
from .exchange.hierarchical import Hierarchy

HINT = "hvd.init(process_sets=hvd_compress.hosts.process_sets())"


def host_groups(rows):
    """``(local_groups, cross_groups)`` from every rank's ``(local_rank, local_size,
    cross_rank, cross_size)`` (``rows[r]`` is rank r's): ``local_groups[h]`` the ranks
    of host h (cross rank h), ``cross_groups[l]`` the ranks of local rank l, each a
    sorted tuple.  ValueError naming the ranks if hosts are uneven or the places clash."""
    rows = [tuple(int(v) for v in r[:4]) for r in rows]
    size = len(rows)
    local_sizes = sorted({r[1] for r in rows})
    if len(local_sizes) > 1:
        per = ", ".join(f"rank {i}: {r[1]}" for i, r in enumerate(rows))
        raise ValueError("hvd_compress hierarchical exchange (hier:): uneven hosts, the "
                         f"number of workers per host (local size) differs ({per}); 'hier:' "
                         "needs the same number of workers on every host (or drop 'hier:')")
    lsize = local_sizes[0]
    hosts = size // lsize
    places = {(r[2], r[0]) for r in rows}
    if lsize * hosts != size or len(places) != size or \
            any(not (0 <= r[0] < lsize and 0 <= r[2] < hosts) for r in rows) or \
            any(r[3] != hosts for r in rows):
        raise ValueError("hvd_compress hierarchical exchange (hier:): the workers' places "
                         f"are not H hosts x L workers (local size {lsize}, {size} ranks, "
                         f"(local_rank, local_size, cross_rank, cross_size) = {rows})")
    local = [tuple(i for i, r in enumerate(rows) if r[2] == h) for h in range(hosts)]
    cross = [tuple(i for i, r in enumerate(rows) if r[0] == lr) for lr in range(lsize)]
    return local, cross


def process_sets(size=None, local_size=None):
    """``[horovod ProcessSet]`` of the hierarchical exchange for ``hvd.init(process_sets=
    ...)``: one per host and one per local rank, with ranks numbered host by host as
    horovodrun does.  ``size``/``local_size`` default to ``$HOROVOD_SIZE`` and
    ``$HOROVOD_LOCAL_SIZE``.  Sets of one rank or of every rank are left out (they need
    none)."""
    from horovod.common.process_sets import ProcessSet
    size = int(size if size is not None else os.environ["HOROVOD_SIZE"])
    lsize = int(local_size if local_size is not None else os.environ["HOROVOD_LOCAL_SIZE"])
    if lsize < 1 or size % lsize:
        raise ValueError(f"local_size={lsize!r} must divide size={size!r} (hosts of the same "
                         "number of workers)")
    rows = [(r % lsize, lsize, r // lsize, size // lsize) for r in range(size)]
    local, cross = host_groups(rows)
    return [ProcessSet(list(g)) for g in local + cross if 1 < len(g) < size]


class _Alone:
    """The process set of a group of one rank (no Horovod set is needed or made)."""

    def rank(self):
        return 0

    def size(self):
        return 1

    def included(self):
        return True


def hierarchy(hvd, transport_cls, transport, host_arrays=None):
    """This worker's :class:`~hvd_compress.exchange.hierarchical.Hierarchy`: ``local``
    and ``cross`` as ``transport_cls(process_set)``.  Collective: every rank calls it at
    the same point (the glue does so when it is built).  ``transport``: the global
    transport (its ``allgather_floats`` gathers the places).  A group of one rank gets
    a set-free transport (its collectives are never called: the exchange skips a host
    of one worker's local steps and a single host's cross step)."""
    if os.environ.get("HOROVOD_ELASTIC") == "1":
        raise ValueError(
            "compression 'hier:' does not run under Elastic Horovod: it needs process sets "
            "(one per host and per local rank), and Horovod 0.28.1's background loop aborts "
            "the job when a worker is lost while process sets exist (seen here, and "
            "horovod/horovod#4021), so elastic training would lose its fault tolerance; "
            "use the flat exchange (drop 'hier:') with Elastic Horovod")
    if transport.size != hvd.size():
        raise ValueError("compression 'hier:' runs on Horovod's global process set (every "
                         f"worker); this optimizer's process set has {transport.size} of "
                         f"{hvd.size()} workers")
    rows = transport.allgather_floats(
        [float(hvd.local_rank()), float(hvd.local_size()), float(hvd.cross_rank()),
         float(hvd.cross_size())], "hier.hosts")
    local, cross = host_groups(rows)
    wanted = [g for g in local + cross if len(g) > 1]
    sets = group_sets(hvd, wanted, purpose="the hierarchical exchange (hier:)", hint=HINT)
    me = hvd.rank()
    mine = [next(g for g in groups if me in g) for groups in (local, cross)]
    local_t, cross_t = (transport_cls(sets[g] if len(g) > 1 else _Alone()) for g in mine)
    if host_arrays is not None and len(mine[0]) > 1:
        local_t = shared_host(local_t, host_arrays)
    return Hierarchy(local_t, cross_t)


def shared_host(local, host_arrays):
    """``local`` (a host's Horovod transport) as a
    :class:`~hvd_compress.exchange.shared_host.SharedHost` when every worker of the host
    can use shared memory (:func:`~hvd_compress.exchange.shared_host.usable`, and its
    files could be made: two float allgathers on the host's set, so a worker that cannot,
    or was told not to, keeps the whole host on Horovod's collectives), else ``local``
    itself.  ``host_arrays``:
    ``(to_numpy, from_numpy)`` of the glue's framework."""
    import random

    from .exchange import shared_host as sh
    from .log import info_rank0, logger
    mine = [1.0 if sh.usable() else 0.0, float(random.SystemRandom().getrandbits(40))]
    rows = local.allgather_floats(mine, "hier.shared_host")
    if not all(r[0] for r in rows):
        return local
    try:
        shared, why = sh.SharedHost(local, int(rows[0][1]), *host_arrays), ""
    except (OSError, RuntimeError) as e:       # e.g. /dev/shm full: the whole host falls
        shared, why = None, str(e)             # back, not only this worker
    made = local.allgather_floats([0.0 if shared is None else 1.0], "hier.shared_host.made")
    if not all(r[0] for r in made):
        if shared is not None:
            shared.close()
        logger.warning("hvd_compress hierarchical exchange: shared memory inside the host "
                       "is not available on every worker of this host (%s); using "
                       "Horovod's collectives",
                       why or "another worker of the host could not set it up")
        return local
    info_rank0(local.rank, "hierarchical exchange: the workers of a host sum and gather "
               "through shared memory (HVD_COMPRESS_SHARED_HOST=0: Horovod's collectives)")
    return shared


def wanted(compressors):
    """Whether a compressor of ``compressors`` (or a candidate of an ``auto`` among them)
    is ``hier:`` (needs the hosts' sets)."""
    return any(getattr(m, "hierarchical", False)
               for c in compressors for m in [c, *getattr(c, "members", ())])


def for_compressors(hvd, transport_cls, transport, compressors, host_arrays=None):
    """:func:`hierarchy` when a compressor of ``compressors`` is ``hier:``, else None
    (nothing is gathered or added).  Every rank calls it with the same compressors."""
    if not wanted(compressors):
        return None
    return hierarchy(hvd, transport_cls, transport, host_arrays)
