"""Which implementation a launcher runs.

Imports: the standard library.
"""
import collections
import contextlib
import os

import importlib.util

# Triton is imported only when a kernel is launched: importing it beside TensorFlow
# can abort the process (both register LLVM command-line options), and CPU paths and
# the TensorFlow glue never need it.
HAVE_TRITON = importlib.util.find_spec("triton") is not None


def pick_backend(x, backend=None):
    """``"triton"`` for CUDA tensors when Triton is installed, else ``"torch"``.

    ``$HVD_COMPRESS_BACKEND`` (``triton`` or ``torch``) overrides the automatic choice;
    tests use it to run whole compressors through the kernels under TRITON_INTERPRET=1.
    """
    backend = backend or os.environ.get("HVD_COMPRESS_BACKEND") or None
    if backend is None:
        return "triton" if (HAVE_TRITON and x.is_cuda) else "torch"
    if backend not in ("triton", "torch"):
        raise ValueError(f"backend must be 'triton', 'torch' or None, got {backend!r}")
    if backend == "triton" and not HAVE_TRITON:
        raise RuntimeError("backend='triton' needs the triton package")
    return backend


def program_chunk(chunk, block, x):
    """Entries a kernel's program reads at once, of its ``block``: ``chunk`` (at most the
    block) for CUDA tensors, where a loop over a block in chunks holds fewer registers a
    thread and so fits more programs on an SM; the whole block for CPU tensors (Triton's
    interpreter), where registers do not exist and each iteration of a kernel's loop
    costs its numpy calls again (the fused search's tests ran 2.4x slower in chunks of
    512).  ``$HVD_COMPRESS_CHUNKS_ON_CPU=1`` keeps ``chunk`` there too: the tests of the
    loops, and a compile for the GPU without one (``tests/triton_compile.py``)."""
    if x.is_cuda or os.environ.get("HVD_COMPRESS_CHUNKS_ON_CPU") == "1":
        return min(int(chunk), int(block))
    return int(block)


CHUNK = 1 << 20   #: CPU references work in cache-sized chunks (2x faster than whole-tensor)


def chunks(n, size=CHUNK):
    """``(start, stop)`` pairs covering ``range(n)``."""
    return [(s, min(s + size, n)) for s in range(0, n, size)]


#: Triton kernel launches so far, by kernel (every launcher calls :func:`count_launch`)
LAUNCHES = collections.Counter()


def count_launch(name):
    """Count one launch of kernel ``name`` (called by each launcher before it launches)."""
    LAUNCHES[name] += 1


@contextlib.contextmanager
def counting_launches():
    """``with counting_launches() as launched:`` -- ``launched`` (a Counter) holds the
    Triton launches made inside the block, by kernel."""
    before = collections.Counter(LAUNCHES)
    launched = collections.Counter()
    try:
        yield launched
    finally:
        launched.update(LAUNCHES - before)
