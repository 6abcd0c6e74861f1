"""The rest of ``horovod.torch.DistributedOptimizer``'s surface (0.28.1) for
:mod:`hvd_compress.torch.optimizer`: the arguments it takes besides ``compression`` and
what they map to here.  The framework-neutral checks and mappings live in
:mod:`hvd_compress.horovod_args` (shared with the TensorFlow and Keras glue) and are
re-exported here; this module adds what is PyTorch's own.

- ``op``: ``hvd.Average`` or ``hvd.Sum``; ``hvd.Adasum`` is a ValueError naming ``op``
  (Adasum combines the ranks' *model deltas* pairwise with a scale-sensitive rule,
  computed by Horovod's own C++ allreduce: no compressed payload can go through it).
- ``gradient_predivide_factor`` (``op=hvd.Average`` only, as Horovod checks): gradients
  are divided by the factor before the exchange (so the compressor and its error
  feedback see ``g / factor``) and the average multiplied by it after, which is
  Horovod's ``1/factor`` before the sum and ``factor/size`` after.
- ``num_groups`` / ``groups``: Horovod's explicit groups of gradients, each reduced by
  one grouped allreduce, become our buckets (:func:`plan_groups`); here the groups are
  lists of ``torch.Tensor`` (:func:`groups_from`).
- ``sparse_as_dense``: sparse gradients are always exchanged dense (compressors work on
  dense tensors); ``True`` turns the aggregate back into a sparse gradient, as Horovod
  does, ``False`` (the default) leaves it dense.

Imports: torch, ``hvd_compress.horovod_args``.
"""
import torch

from ..horovod_args import (check_op, describe_groups, plan_groups,  # noqa: F401
                            predivide_factor)
from .. import horovod_args

__all__ = ["check_op", "predivide_factor", "groups_from", "plan_groups", "describe_groups"]


def groups_from(num_groups, groups, bucket_mb):
    """Horovod's ``groups`` (``num_groups`` is its deprecated spelling, used when
    ``groups`` is None): None, an int > 0, or a list of lists of ``torch.Tensor``.
    ValueError naming the argument otherwise, or when ``bucket_mb`` is given too
    (:func:`hvd_compress.horovod_args.groups_from`)."""
    return horovod_args.groups_from(num_groups, groups, bucket_mb,
                                    lambda t: isinstance(t, torch.Tensor), "torch.Tensor")
