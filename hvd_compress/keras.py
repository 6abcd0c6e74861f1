"""``hvd_compress.keras``: the public path of the Keras 3 glue, which lives in
:mod:`hvd_compress.tensorflow.keras`."""
from .tensorflow.keras import (BroadcastGlobalVariablesCallback,  # noqa: F401
                               DistributedOptimizer, broadcast_variables)

__all__ = ["DistributedOptimizer", "BroadcastGlobalVariablesCallback", "broadcast_variables"]
