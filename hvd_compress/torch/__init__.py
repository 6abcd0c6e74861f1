"""PyTorch glue: Horovod's DistributedOptimizer and allreduce with hvd_compress compressors.

Needs Horovod built with PyTorch.  The algorithms live in ``hvd_compress.compressors``.
"""
from .collectives import allreduce, allreduce_async, check_same_config, synchronize  # noqa: F401
from .optimizer import DistributedOptimizer  # noqa: F401
from . import elastic

elastic.register()     # Elastic Horovod: TorchState(optimizer=ours) keeps error feedback
