"""Triton GPU kernels of hvd_compress (``hvd_compress.kernels``, in hvd_compress/kernels/).

Each module holds one kernel family in the Triton-tutorial layout: the ``@triton.jit``
kernel, a torch *reference* with exactly the same semantics, and a *launcher* that
runs the kernel on CUDA tensors and the reference elsewhere.  ``backend="triton"``
forces the kernel (on CPU tensors this needs ``TRITON_INTERPRET=1``, which is how the
tests compare every kernel with its reference on machines without a GPU);
``backend="torch"`` forces the reference.  Every launcher counts its launches
(``LAUNCHES``; ``with counting_launches() as launched:`` for a block of code).

Imports: its own modules (torch through them; Triton on first use).
"""
from ._backend import HAVE_TRITON, LAUNCHES, counting_launches, pick_backend  # noqa: F401
from .abs_stats import abs_sum_max, abs_sum_max_reference  # noqa: F401
from .compact import compact_above, compact_above_reference  # noqa: F401
from .threshold_count import count_above, count_above_reference  # noqa: F401
from . import twobit  # noqa: F401,E402
from . import twobit_segments  # noqa: F401,E402
from . import rangefloat  # noqa: F401,E402
from . import dct  # noqa: F401,E402
from . import segmented  # noqa: F401,E402
from . import histogram_select  # noqa: F401,E402
from . import search_state  # noqa: F401,E402
from . import band_compact  # noqa: F401,E402
from . import rangefloat_segments  # noqa: F401,E402
from . import flagged_copy  # noqa: F401,E402
from . import onebit  # noqa: F401,E402
from . import uniform_draws  # noqa: F401,E402
