"""``hvd_compress.ddp``: the public path of the PyTorch DDP communication hook, which
lives in :mod:`hvd_compress.torch.ddp` (needs no Horovod).

Imports: ``hvd_compress.torch.ddp`` (torch through it; no Horovod).
"""
from .torch.ddp import (CompressionState, TorchDistributed, compression_hook,  # noqa: F401
                        register)

__all__ = ["CompressionState", "compression_hook", "register", "TorchDistributed"]
