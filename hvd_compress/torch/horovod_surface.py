"""The rest of ``horovod.torch.DistributedOptimizer``'s surface (0.28.1) for
:mod:`hvd_compress.torch.optimizer`: the arguments it takes besides ``compression`` and
what they map to here.

- ``op``: ``hvd.Average`` or ``hvd.Sum``; ``hvd.Adasum`` is a ValueError naming ``op``
  (Adasum combines the ranks' *model deltas* pairwise with a scale-sensitive rule,
  computed by Horovod's own C++ allreduce: no compressed payload can go through it).
- ``gradient_predivide_factor`` (``op=hvd.Average`` only, as Horovod checks): gradients
  are divided by the factor before the exchange (so the compressor and its error
  feedback see ``g / factor``) and the average multiplied by it after, which is
  Horovod's ``1/factor`` before the sum and ``factor/size`` after.
- ``num_groups`` / ``groups``: Horovod's explicit groups of gradients, each reduced by
  one grouped allreduce, become our buckets (:func:`plan_groups`).
- ``sparse_as_dense``: sparse gradients are always exchanged dense (compressors work on
  dense tensors); ``True`` turns the aggregate back into a sparse gradient, as Horovod
  does, ``False`` (the default) leaves it dense.

Imports: torch, ``hvd_compress.buckets``.
"""
import math

import torch

from .. import buckets

def check_op(op, hvd):
    """``op`` as given, or ValueError naming it (Adasum explained)."""
    if op == getattr(hvd, "Adasum", object()):
        raise ValueError("op=hvd.Adasum is not supported by hvd_compress: Adasum combines "
                         "the ranks' model deltas pairwise inside Horovod's own allreduce, "
                         "which no compressed payload can go through; use op=hvd.Average "
                         "(or hvd.Sum), or horovod.torch.DistributedOptimizer for Adasum")
    if op not in (hvd.Average, hvd.Sum):
        raise ValueError(f"op must be hvd.Average or hvd.Sum, got {_op_name(op, hvd)}")
    return op


def _op_name(op, hvd):
    names = {getattr(hvd, k, None): f"hvd.{k}" for k in ("Average", "Sum", "Adasum")}
    return names.get(op, repr(op))


def predivide_factor(factor, op, hvd):
    """``gradient_predivide_factor`` as a float, or ValueError naming it."""
    try:
        value = float(factor)
    except (TypeError, ValueError):
        raise ValueError("gradient_predivide_factor must be a number > 0, "
                         f"got {factor!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"gradient_predivide_factor must be a finite number > 0, got {factor!r}")
    if value != 1.0 and op != hvd.Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average "
                         f"(gradient_predivide_factor={factor!r}, op={_op_name(op, hvd)}): "
                         "it splits "
                         "the averaging before and after the sum")
    return value


def groups_from(num_groups, groups, bucket_mb):
    """Horovod's ``groups`` (``num_groups`` is its deprecated spelling, used when
    ``groups`` is None): None, an int > 0, or a list of lists of tensors.  ValueError
    naming the argument otherwise, or when ``bucket_mb`` is given too."""
    if num_groups not in (0, None):
        if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 0:
            raise ValueError(f"num_groups must be an int >= 0, got {num_groups!r}")
        if groups is None:
            groups = num_groups
    if groups is None:
        return None
    if isinstance(groups, bool) or not (isinstance(groups, (list, tuple)) or
                                        (isinstance(groups, int) and groups > 0)):
        raise ValueError("groups should be a positive integer or a list of lists of "
                         f"torch.Tensor, got {groups!r}")
    if isinstance(groups, (list, tuple)):
        seen = set()
        for group in groups:
            if isinstance(group, torch.Tensor) or not isinstance(group, (list, tuple)):
                raise ValueError("groups must be a list of lists of torch.Tensor; an item "
                                 f"is a {type(group).__name__}")
            for p in group:
                if not isinstance(p, torch.Tensor):
                    raise ValueError("groups must consist of torch.Tensor, got a "
                                     f"{type(p).__name__}")
                if id(p) in seen:
                    raise ValueError("groups: a parameter can only appear once in groups")
                seen.add(id(p))
        groups = [list(g) for g in groups]
    if bucket_mb is not None:
        raise ValueError("give groups (or num_groups) or bucket_mb, not both: groups are "
                         f"the buckets (groups={groups!r}, bucket_mb={bucket_mb!r})")
    return groups


def plan_groups(groups, params, entries):
    """Buckets (lists of indices into ``params``, in launch order) for Horovod's
    ``groups``: an int ``n`` splits the parameters that need gradients, in the optimizer's
    order, into ``n`` nearly equal runs (``horovod.common.util.split_list``); a list of
    lists makes each list a bucket and every parameter in none a bucket of its own.  A
    group whose tensors cannot share one compress call (a Policy giving them different
    compressors, different dtypes, a compressor that is not ``segmented``) is cut as
    :func:`hvd_compress.buckets.plan` cuts: the group never crosses another's boundary.
    ``entries``: :func:`buckets.plan`'s, one per parameter."""
    index = {id(p): i for i, p in enumerate(params)}
    if isinstance(groups, int):
        d, r = divmod(len(params), groups)
        runs = [list(range(i * d + min(i, r), (i + 1) * d + min(i + 1, r)))
                for i in range(groups)]
    else:
        runs, placed = [], set()
        for group in groups:
            run = [index[id(p)] for p in group if id(p) in index]
            placed.update(run)
            runs.append(sorted(run))
        runs += [[i] for i in range(len(params)) if i not in placed]
    out = []
    for run in filter(None, runs):
        for sub in buckets.plan([entries[i] for i in run], float("inf")):
            out.append([run[j] for j in sub])
    return sorted(out, key=lambda b: -min(b))


def describe_groups(groups, plan):
    """What ranks must agree on: ``groups=2 buckets=[3;2]``."""
    what = groups if isinstance(groups, int) else f"{len(groups)} lists"
    return f"groups={what} buckets=[{';'.join(str(len(b)) for b in plan)}]"
