"""One Horovod process set per exchange group (shared by both glue layers).

Horovod (0.28) registers a process set on *every* rank in the same order, either at
``hvd.init(process_sets=...)`` or later with ``hvd.add_process_set`` when the job runs
with ``HOROVOD_DYNAMIC_PROCESS_SETS=1``.  :func:`group_sets` reuses a set with the same
ranks when one exists (the global set for a group of all workers) and adds the others.
Pass :func:`process_sets` to ``hvd.init`` to register them up front instead.

Imports: nothing at import time; on first use, Horovod; and modules of its own package.
"""


def process_sets(n, redundancy):
    """``[horovod ProcessSet]`` for every exchange group of ``n`` workers with
    ``redundancy`` r (the (r+1)-subsets smaller than the whole job), for
    ``hvd.init(process_sets=...)``."""
    from horovod.common.process_sets import ProcessSet
    from .placement import placement
    return [ProcessSet(list(g)) for g in placement(n, redundancy).groups if len(g) < n]


def group_sets(hvd, groups, purpose="coded SGD",
               hint="hvd.init(process_sets=hvd_compress.coded.process_sets(n, r))"):
    """``{group: ProcessSet}`` for ``groups`` (sorted rank tuples); collective: every rank
    must call it with the same groups in the same order.  ``purpose`` and ``hint`` (the
    static alternative) word the error when Horovod cannot add a set."""
    from horovod.common import process_sets as ps
    existing = {tuple(r): i for i, r in ps._basics._get_process_set_ids_and_ranks().items()}
    out = {}
    for g in groups:
        if existing.get(tuple(g)) == 0:
            out[g] = hvd.global_process_set
        elif tuple(g) in existing:
            s = ps.ProcessSet(list(g))
            s.process_set_id = existing[tuple(g)]
            out[g] = s
        else:
            try:
                out[g] = hvd.add_process_set(list(g))
            except Exception as e:   # Horovod raises RuntimeError/ValueError without dynamic sets
                raise RuntimeError(
                    f"{purpose} needs a Horovod process set for the group {list(g)}: run "
                    f"with HOROVOD_DYNAMIC_PROCESS_SETS=1, or pass {hint} "
                    f"({type(e).__name__}: {e})") from e
    return out
