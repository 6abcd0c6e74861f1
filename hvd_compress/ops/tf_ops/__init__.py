"""TensorFlow implementation of the primitives listed in :mod:`hvd_compress.ops`.

Every function works eagerly and inside ``tf.function`` (no Python branching on
tensor values; :func:`cond` is ``tf.cond``).

One module per family, the same families (and the same names) as
:mod:`hvd_compress.ops.torch_ops`: one contract, checked by ``tests/unit/test_ops_contract.py``.

============  ==========================================================================
``core``      dtypes, shapes, index ranges and seeded draws, gather / scatter, casts,
              control flow, error feedback's buffers, small tensor helpers
``checks``    a payload's checks (index range, range-float headers), at once or
              deferred to one readback per step (``deferred_checks``; PyTorch only)
``selection`` top-k, threshold selection and its search, samples and moments,
              convolution kernels as rows, distinct indices
``segments``  buckets: concat / split and per-tensor (segment) statistics and selection
``codecs``    wire encodings: 2-bit, range-based float, block DCT, fixed point, 1-bit,
              low-rank products
============  ==========================================================================

This module re-exports every family's names (``tf_ops.gather``, ...), which is how the
algorithms use them.  May import: its families only; they import tensorflow, ``core``,
lazily numpy and :mod:`hvd_compress.memory`; never torch or :mod:`hvd_compress.kernels`.
"""
from .core import *  # noqa: F401,F403
from .checks import *  # noqa: F401,F403
from .selection import *  # noqa: F401,F403
from .segments import *  # noqa: F401,F403
from .codecs import *  # noqa: F401,F403
