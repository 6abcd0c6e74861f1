"""Compressed-momentum Adam for Keras 3 (``keras.optimizers.Adam``, ``AdamW``): the
tensor side of :mod:`hvd_compress.strategies.momentum` (the rule, its formula and papers
are there) for :func:`hvd_compress.keras.DistributedOptimizer`.  Eager only (Keras:
``model.compile(..., run_eagerly=True)``): the phase is decided in Python between steps.

The optimizer's own variables hold the momentum ``m`` and variance ``v``
(``_momentums``, ``_velocities``; ``_velocity_hats`` with amsgrad) and the step count
(``iterations``), so Keras checkpoints hold them; :meth:`KerasAdamMomentum.state_dict`
is the schedule.  Keras' Adam puts ``eps`` outside the bias correction of ``v``::

    p <- p - lr sqrt(1 - b2^T_v) / (1 - b1^t) * m / (sqrt(v) + eps)

and its weight decay (AdamW, or ``weight_decay=`` on Adam) is decoupled:
``p <- p - p * wd * lr`` before the update; both are kept as Keras does them.

Imports: TensorFlow, Keras, ``hvd_compress.strategies.momentum``.
"""
import keras
import tensorflow as tf

from ..strategies.momentum import MomentumGlue


class KerasAdamMomentum(MomentumGlue):
    """Compressed momentum for a Keras ``optimizer`` of the Adam family under
    ``schedule`` (what ``compressed_momentum=`` accepts); ``compression``: the
    compressor whose state writes a skipped step undoes."""

    framework = "tensorflow"

    def __init__(self, optimizer, schedule, compression, rank=lambda: 0):
        if not isinstance(optimizer, keras.optimizers.Adam):
            raise ValueError("compressed_momentum needs a Keras optimizer of the Adam family "
                             f"(keras.optimizers.Adam or AdamW), got {type(optimizer).__name__}")
        super().__init__(schedule, compression, rank)
        self.opt = optimizer

    def _slots(self, variable):
        i = self.opt._get_variable_index(variable)
        v = self.opt._velocity_hats[i] if self.opt.amsgrad else self.opt._velocities[i]
        return self.opt._momentums[i], v

    def local_momentum(self, grads, variables):
        """``b1 m + (1 - b1) g`` per variable (None stays None): what this rank sends."""
        b1 = self.opt.beta_1
        out = []
        for g, var in zip(grads, variables):
            if g is None:
                out.append(None)
                continue
            m, _ = self._slots(var)
            out.append(tf.convert_to_tensor(g) * (1.0 - b1) + m * b1)
        return out

    def apply(self, means, variables):
        """The update from the mean momentum ``means`` (module docstring).  Returns
        False, leaving everything as it was, when the aggregate has NaN/Inf."""
        present = [(m, v) for m, v in zip(means, variables) if m is not None]
        if present and not all(bool(tf.reduce_all(tf.math.is_finite(m))) for m, _ in present):
            self.skip()
            return False
        opt = self.opt
        step = float(opt.iterations.numpy()) + 1.0
        b1, b2 = opt.beta_1, opt.beta_2
        opt._apply_weight_decay([v for _, v in present])
        for mean, var in present:
            m, v = self._slots(var)
            lr = tf.cast(opt.learning_rate, var.dtype)
            alpha = lr * (1.0 - b2 ** self.schedule.variance_step) ** 0.5 / (1.0 - b1 ** step)
            m.assign(tf.cast(mean, m.dtype))
            var.assign_sub(m * alpha / (tf.sqrt(v) + opt.epsilon))
        opt.iterations.assign_add(1)
        self.compressed_done(step)
        return True

    def after_dense(self, variables, transport):
        """After the wrapped optimizer's own step on the dense average: count it, and in
        the warm-up decide whether the variance freezes now (rank 0's decision, through
        ``transport``)."""
        self.dense_done(float(self.opt.iterations.numpy()), self.opt.beta_2,
                        lambda: float(sum(tf.reduce_sum(tf.cast(self._slots(v)[1], tf.float64))
                                          for v in variables)), transport)
