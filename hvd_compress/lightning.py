"""``hvd_compress.lightning``: the public path of :mod:`hvd_compress.torch.lightning`
(PyTorch Lightning: ``DDPStrategy`` that registers the DDP comm hook on every device,
and the ``CompressionStats`` callback).

Imports: torch; ``lightning`` only when ``DDPStrategy`` or ``CompressionStats`` is first
used (see :mod:`hvd_compress.torch.lightning`); no Horovod.
"""
from .torch import lightning as _impl

__all__ = ["CompressionStats", "DDPStrategy"]


def __getattr__(name):
    if name in __all__:
        return getattr(_impl, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
