"""Horovod's optimizer arguments, checked and mapped once for every glue (PyTorch's
``DistributedOptimizer``, TensorFlow's ``DistributedGradientTape``, Keras'
``DistributedOptimizer``); what is particular to a framework stays in its glue
(:mod:`hvd_compress.torch.horovod_surface`, :mod:`hvd_compress.tensorflow.horovod_surface`).

What maps to what (Horovod 0.28.1's argument -> here):

- ``op``: ``hvd.Average`` or ``hvd.Sum`` (the compressed exchange sums, then divides or
  not); ``hvd.Adasum`` is a ValueError naming ``op`` (:func:`check_op`).
- ``gradient_predivide_factor`` (``op=hvd.Average`` only, as Horovod checks): gradients
  are divided by the factor before the exchange (the compressor and its error feedback
  see ``g / factor``) and the average multiplied by it after, which is Horovod's
  ``1/factor`` before the sum and ``factor/size`` after (:func:`predivide_factor`).
- ``num_groups`` / ``groups``: Horovod's explicit groups, each reduced by one grouped
  allreduce, become the buckets (:func:`groups_from`, :func:`plan_groups`); not together
  with ``bucket_mb``.
- ``backward_passes_per_step``: an int >= 1 (:func:`passes`); what the glue does with it
  is its own.
- ``device_dense`` / ``device_sparse``: device strings (:func:`check_device`); the
  exchange runs where the gradients are, so they are checked and otherwise unused.

Every error is a ValueError whose text starts with the argument's name or names it.

Imports: the standard library, ``hvd_compress.buckets``.
"""
import math

from . import buckets

#: where Adasum can be had, per glue (the end of :func:`check_op`'s message)
ADASUM_ELSEWHERE = {
    "torch": ", or horovod.torch.DistributedOptimizer for Adasum",
    "tensorflow": ", or horovod.tensorflow.DistributedGradientTape for Adasum",
    "keras": " (Horovod's own Keras DistributedOptimizer has no Adasum either)",
}


def check_op(op, hvd, glue="torch"):
    """``op`` as given (``hvd.Average`` or ``hvd.Sum`` of the Horovod module ``hvd``), or
    ValueError naming it; Adasum's says why and where it can be had (``glue``: a key of
    :data:`ADASUM_ELSEWHERE`)."""
    if op == getattr(hvd, "Adasum", object()):
        raise ValueError("op=hvd.Adasum is not supported by hvd_compress: Adasum combines "
                         "the ranks' model deltas pairwise inside Horovod's own allreduce, "
                         "which no compressed payload can go through; use op=hvd.Average "
                         f"(or hvd.Sum){ADASUM_ELSEWHERE[glue]}")
    if op not in (hvd.Average, hvd.Sum):
        raise ValueError(f"op must be hvd.Average or hvd.Sum, got {op_name(op, hvd)}")
    return op


def op_name(op, hvd):
    """``hvd.Average``, ``hvd.Sum``, ``hvd.Adasum`` or the repr of ``op``."""
    names = {getattr(hvd, k, None): f"hvd.{k}" for k in ("Average", "Sum", "Adasum")}
    try:
        return names.get(op, repr(op))
    except TypeError:                  # unhashable
        return repr(op)


def predivide_factor(factor, op, hvd):
    """``gradient_predivide_factor`` as a float, or ValueError naming it (not a finite
    number > 0, or != 1 with an ``op`` other than ``hvd.Average``, as Horovod checks)."""
    try:
        value = float(factor)
    except (TypeError, ValueError):
        raise ValueError("gradient_predivide_factor must be a number > 0, "
                         f"got {factor!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"gradient_predivide_factor must be a finite number > 0, got {factor!r}")
    if value != 1.0 and op != hvd.Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average "
                         f"(gradient_predivide_factor={factor!r}, op={op_name(op, hvd)}): "
                         "it splits the averaging before and after the sum")
    return value


def groups_from(num_groups, groups, bucket_mb, is_tensor, kind):
    """Horovod's ``groups`` (``num_groups`` is its deprecated spelling, used when
    ``groups`` is None): None, an int > 0, or a list of lists of tensors (``is_tensor``
    says what counts as one; ``kind`` names it in messages, e.g. ``"torch.Tensor"``).
    ValueError naming the argument otherwise, or when ``bucket_mb`` is given too."""
    if num_groups not in (0, None):
        if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 0:
            raise ValueError(f"num_groups must be an int >= 0, got {num_groups!r}")
        if groups is None:
            groups = num_groups
    if groups is None:
        return None
    if isinstance(groups, bool) or not (isinstance(groups, (list, tuple)) or
                                        (isinstance(groups, int) and groups > 0)):
        raise ValueError(f"groups should be a positive integer or a list of lists of {kind}, "
                         f"got {groups!r}")
    if isinstance(groups, (list, tuple)):
        seen = set()
        for group in groups:
            if is_tensor(group) or not isinstance(group, (list, tuple)):
                raise ValueError(f"groups must be a list of lists of {kind}; an item "
                                 f"is a {type(group).__name__}")
            for p in group:
                if not is_tensor(p):
                    raise ValueError(f"groups must consist of {kind}, got a "
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
    ``groups``: an int ``n`` splits ``params`` (in their order) into ``n`` nearly equal
    runs (``horovod.common.util.split_list``); a list of lists makes each list a bucket
    and every parameter in none a bucket of its own (tensors are matched by identity).
    A group whose tensors cannot share one compress call (a Policy giving them different
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


def passes(value, name="backward_passes_per_step"):
    """``backward_passes_per_step`` as an int >= 1, or ValueError naming it."""
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = 0
    if isinstance(value, bool) or number < 1 or number != value:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return number


def _known(process_set, ask):
    """``ask()`` of ``process_set`` (Horovod's), or None where it cannot be known yet
    (Horovod not initialised, or this rank not in the set)."""
    try:
        return ask() if process_set.included() else None
    except ValueError:                  # "Horovod has not been initialized"
        return None


def ranks_of(process_set):
    """The number of ranks in ``process_set``, or None where it cannot be known yet
    (:func:`_known`): for messages only."""
    return _known(process_set, process_set.size)


def rank_in(process_set):
    """``() -> int or None``: this process's rank in ``process_set``, None while it
    cannot be known (:func:`_known`): what a compressor's checkpoints record
    (``Compressor.bind_rank``)."""
    return lambda: _known(process_set, process_set.rank)


def check_device(value, name, parse=None):
    """``device_dense``/``device_sparse`` (``name``) as given: a string, ``""`` for
    Horovod's default; ``parse`` (e.g. ``tf.DeviceSpec.from_string``) checks its syntax.
    ValueError naming the argument otherwise (e.g. a compressor passed positionally
    where Horovod's signature has the devices)."""
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a device string such as '' or '/gpu:0' (Horovod's "
                         f"argument; compression is a keyword argument), got {value!r}")
    if value and parse is not None:
        try:
            parse(value)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{name} must be a device string such as '' or '/gpu:0' "
                             f"(Horovod's argument; compression is a keyword argument), "
                             f"got {value!r}: {e}") from None
    return value
