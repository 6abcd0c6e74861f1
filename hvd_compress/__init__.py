"""hvd_compress: gradient compression for Horovod, for PyTorch and TensorFlow.

    import hvd_compress
    c = hvd_compress.from_spec("topk:density=0.01")
    opt = hvd_compress.torch.DistributedOptimizer(opt, model.named_parameters(), compression=c)

Importing this package needs neither Horovod, PyTorch nor TensorFlow; the glue
subpackages ``hvd_compress.torch`` and ``hvd_compress.tensorflow`` import theirs.
"""
__version__ = "0.1.0"

from .compressors import (BF16, DGC, FP16, REGISTRY, Compressor, Ctx, GaussianK,  # noqa: F401
                          LaplaceTopK, NoneCompressor, RandomK, SIDCoExp, Threshold, TopK)
from .compressors import DCTSparse, KernelSelect, RangeFloat, TwoBit  # noqa: F401
from .strategies.policy import Hylo, Policy  # noqa: F401
from .strategies.auto import Auto  # noqa: F401
from .spec import ENV_VAR, from_env, from_spec  # noqa: F401

__all__ = ["Compressor", "Ctx", "NoneCompressor", "FP16", "BF16", "TopK", "RandomK",
           "Threshold", "LaplaceTopK", "DGC", "GaussianK", "SIDCoExp", "TwoBit", "KernelSelect",
           "RangeFloat", "DCTSparse", "Policy", "Hylo", "Auto", "REGISTRY", "from_spec", "from_env", "ENV_VAR", "__version__"]
