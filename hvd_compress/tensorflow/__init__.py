"""TensorFlow glue: DistributedGradientTape and allreduce with hvd_compress compressors.

Needs Horovod built with TensorFlow.  Keras 3 optimizers (``model.fit`` with
Horovod's ``DistributedOptimizer``) are not supported on Horovod 0.28.1: use
``DistributedGradientTape`` in a custom training loop.
"""
from .collectives import allreduce, check_same_config  # noqa: F401
from . import elastic  # noqa: F401
from .elastic import ElasticState  # noqa: F401
from .tape import DistributedGradientTape, TFStats, stats  # noqa: F401
