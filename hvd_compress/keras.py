"""``hvd_compress.keras``: the public path of the Keras 3 glue, which lives in
:mod:`hvd_compress.tensorflow.keras`.

Imports: ``hvd_compress.tensorflow.keras`` (TensorFlow, Keras and Horovod through it).
"""
from .tensorflow.keras import (BroadcastGlobalVariablesCallback,  # noqa: F401
                               DistributedOptimizer, broadcast_variables)

__all__ = ["DistributedOptimizer", "BroadcastGlobalVariablesCallback", "broadcast_variables"]
