"""Compressed updates for Keras 3 (``compressed_update=True`` of
:func:`hvd_compress.keras.DistributedOptimizer`): the tensor side of the rule that
:mod:`hvd_compress.torch.compressed_update` states (formula, paper, why Adam needs it),
for a Keras optimizer's ``apply``::

    p_0 = p                                  (the same on every rank)
    the wrapped optimizer's own apply(g_i)   (skipped where g_i holds NaN/Inf)
    u_i = p - p_0
    U   = the ranks' mean of u_i, through the gradients' own exchange (compressor, error
          feedback, buckets, configuration check: ``reduce``)
    p   = p_0 + U

Eager and compiled (``tf.function``): in a compiled step the skip is a ``tf.cond``.
When the exchange fails (a malformed payload: every rank raises), an eager step puts
the weights back to ``p_0``; the residuals keep the step's writes (PyTorch's glues
undo those too).  A compiled step is not protected: its weights stay at this rank's
``p_0 + u_i``.  The
optimizer's variables (Adam's ``m``, ``v``, ``iterations``) are this rank's; the model's
weights stay the same on every rank.

Imports: TensorFlow, ``hvd_compress.log``, ``hvd_compress.ops``.
"""
import tensorflow as tf

from ..log import logger
from ..ops import tf_ops


class KerasLocalUpdates:
    """What one optimizer's compressed updates keep: ``skipped`` counts the eager steps
    whose gradients held NaN/Inf on this rank (a compiled step skips without counting)."""

    def __init__(self):
        self.skipped = 0

    def apply(self, base_apply, grads, variables, reduce):
        """One step: ``base_apply(grads)`` is the wrapped optimizer's own apply,
        ``reduce(updates, variables)`` the exchange (returns the ranks' mean)."""
        start = [tf.identity(tf.convert_to_tensor(v)) for v in variables]
        present = [g.values if isinstance(g, tf.IndexedSlices) else g
                   for g in grads if g is not None]
        finite = tf.reduce_all([tf_ops.all_finite(g) for g in present] or [True])
        if tf.executing_eagerly():
            if bool(finite):
                base_apply(grads)
            else:
                self.skipped += 1
                logger.warning("hvd_compress: compressed_update: this rank's gradients hold "
                               "NaN/Inf; its optimizer step is skipped (%d so far) and it "
                               "sends no update of its own this step", self.skipped)
        else:
            def step():
                base_apply(grads)
                return tf.constant(True)
            tf.cond(finite, step, lambda: tf.constant(False))
        updates = [tf.convert_to_tensor(v) - s for v, s in zip(variables, start)]
        try:
            means = reduce(updates, variables)
        except BaseException:         # a failed exchange (every rank's): back to p_0
            if tf.executing_eagerly():
                for v, s in zip(variables, start):
                    v.assign(s)
            raise
        for v, s, u in zip(variables, start, means):
            v.assign(s + tf.cast(u, s.dtype))
