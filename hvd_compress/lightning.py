"""``hvd_compress.lightning``: the public path of :mod:`hvd_compress.torch.lightning`
(PyTorch Lightning: ``DDPStrategy`` that registers the DDP comm hook on every device,
and the ``CompressionStats`` callback).

Imports: ``lightning`` and torch through it; no Horovod.
"""
from .torch.lightning import CompressionStats, DDPStrategy  # noqa: F401

__all__ = ["CompressionStats", "DDPStrategy"]
