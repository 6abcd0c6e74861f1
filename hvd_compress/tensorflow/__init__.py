"""TensorFlow glue: DistributedGradientTape and allreduce with hvd_compress compressors.

Needs Horovod built with TensorFlow.  For Keras 3 ``model.fit`` (Horovod 0.28.1's own
Keras ``DistributedOptimizer`` predates Keras 3) use :mod:`hvd_compress.keras`, which
runs the same code as the tape.

Imports: its own modules (TensorFlow and Horovod through them).
"""
from .collectives import allreduce, check_same_config  # noqa: F401
from . import elastic  # noqa: F401
from .elastic import ElasticState  # noqa: F401
from .tape import DistributedGradientTape, TFStats, stats  # noqa: F401
