"""What a CUDA graph must keep alive: the cached device tables its launches read.

The launchers cache small device tensors per bucket layout (block tables, offsets,
per-tensor constants) in bounded caches that drop everything when full.  A CUDA graph
captured by :mod:`hvd_compress.compressors.replay` reads them at the addresses they had
at the capture, so a table the cache drops must stay allocated while the graph does:
every cache hands its tables out through :func:`used`, and inside :func:`recording`
(a capture) they are collected, for the graph to hold.

Imports: the standard library.
"""
import contextlib
import threading

_LOCAL = threading.local()


def used(table):
    """``table`` (a cached device tensor, or a tuple of them), noted where a capture is
    being recorded on this thread."""
    held = getattr(_LOCAL, "held", None)
    if held is not None:
        held.append(table)
    return table


@contextlib.contextmanager
def recording():
    """A list of every table :func:`used` on this thread inside the block."""
    before, _LOCAL.held = getattr(_LOCAL, "held", None), []
    try:
        yield _LOCAL.held
    finally:
        _LOCAL.held = before
