"""One module per method family; every compressor registers its spec name here.

Imports: its own modules only.
"""
from .base import REGISTRY, Compressor, Ctx, payload_bytes  # noqa: F401
from .dense import BF16, FP16, NoneCompressor  # noqa: F401
from .sparse import RandomK, Threshold, TopK  # noqa: F401
from .laplace import LaplaceTopK  # noqa: F401
from .estimated_threshold import DGC, GaussianK, SIDCoExp  # noqa: F401
from .quantize import TwoBit  # noqa: F401
from .kernel_select import KernelSelect  # noqa: F401
from .rangefloat import RangeFloat  # noqa: F401
from .dct import DCTSparse  # noqa: F401
from .stochastic import QSGD, TernGrad  # noqa: F401
from .sign import OneBit, SignSGD  # noqa: F401
from .lowrank import PowerSGD  # noqa: F401
