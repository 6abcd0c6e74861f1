"""PyTorch glue: Horovod's DistributedOptimizer and allreduce with hvd_compress
compressors (:mod:`.optimizer`, :mod:`.collectives`, :mod:`.elastic`, :mod:`.coded`),
and the DDP communication hook for training without Horovod (:mod:`.ddp`, also
``hvd_compress.ddp``).

The Horovod parts are imported on first use (``hvd_compress.torch.DistributedOptimizer``
imports ``horovod.torch``), so ``hvd_compress.torch.ddp`` works where Horovod is not
installed.  The algorithms live in ``hvd_compress.compressors``, the exchange protocol
in ``hvd_compress.exchange``.
"""
import importlib

#: public name -> the submodule that defines it (imported on first access)
_LAZY = {"DistributedOptimizer": "optimizer", "allreduce": "collectives",
         "allreduce_async": "collectives", "synchronize": "collectives",
         "check_same_config": "collectives"}
_SUBMODULES = ("collectives", "optimizer", "elastic", "coded", "ddp")


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = list(_LAZY)
