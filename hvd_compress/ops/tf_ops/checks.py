"""TensorFlow primitives, checks family: a payload's index range, checked at once
(eager: read back; inside ``tf.function``: an assert).  Nothing is deferred here:
:func:`deferred_checks` and :func:`settle_checks`, the PyTorch family's names, do
nothing.

May import: tensorflow.  Not the other families of this package.
"""
import contextlib as _contextlib

import tensorflow as _tf


def check_indices(idx, n, what):
    msg = (f"{what}: payload index out of range [0, {n}); "
           "the payload is malformed or was produced for another tensor")
    if _tf.executing_eagerly():
        if _tf.size(idx) > 0 and (int(_tf.reduce_min(idx)) < 0 or int(_tf.reduce_max(idx)) >= n):
            raise ValueError(msg)
        return
    # Assert is stateful: tf.function's automatic control dependencies run it.
    _tf.debugging.Assert(_tf.reduce_all(_tf.logical_and(idx >= 0, idx < n)), [msg])


class IndexCheck:
    """:func:`check_indices` when ``finish`` is called (no readback to share here); it
    returns the indices to scatter."""
    stats = None

    def __init__(self, idx, n, what):
        self._args = (idx, n, what)

    def finish(self):
        check_indices(*self._args)
        return self._args[0]


def index_check(idx, n, what):
    return IndexCheck(idx, n, what)


def deferral_sink():
    """None: nothing is deferred here (:func:`deferred_checks`)."""
    return None


def deferred_checks(sink):
    """Nothing is deferred here (eager checks read at once, graph checks are asserts)."""
    return _contextlib.nullcontext()


def settle_checks(sink):
    """Nothing to read back (:func:`deferred_checks`)."""
