"""TensorFlow glue for coded synchronous SGD (:mod:`hvd_compress.coded`), eager mode.

    coded = hvd_compress.coded.CodedGradients(model.trainable_variables, batch_size=B,
                                              redundancy=2)
    for idx in hvd_compress.coded.CodedBatchSampler(len(x), B, hvd.size(), hvd.rank(), 2):
        loss, grads = coded.gradient(lambda x, y: loss_fn(y, model(x, training=True)),
                                     x_all[idx], y_all[idx])
        opt.apply_gradients(zip(grads, model.trainable_variables))

:meth:`CodedGradients.gradient` records one ``tf.GradientTape`` per part this worker
holds, scales each part's mean loss by its share of the global mini-batch, exchanges the
part gradients and returns the global gradient of the mean loss, the same on every rank.

Imports: the standard library, numpy, TensorFlow, Horovod, ``hvd_compress.coded``,
``hvd_compress.ops``.
"""
import time

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from ..coded.collectives import CodedWorker
from ..coded.exchange import DEFAULT_RANGE
from ..ops import tf_ops

class CodedGradients(CodedWorker):
    """Per-part gradients of this worker and their coded exchange (see
    :class:`hvd_compress.torch.coded.DistributedOptimizer` for the arguments).  The r
    replicas of a part must compute the same bits: a loss with randomness (dropout in a
    Keras model) draws differently on each replica here, which ``verify`` (default on)
    detects (RuntimeError on every rank); keep such losses deterministic, or use
    ``exchange="reduce_scatter"`` (each part's gradient is used from one replica only)."""

    def __init__(self, variables, batch_size, redundancy, value_range=DEFAULT_RANGE,
                 exchange="multicast", verify=True):
        self.variables = list(variables)
        if not self.variables:
            raise ValueError("variables is empty: nothing to train")
        numel = sum(int(np.prod(v.shape)) for v in self.variables)
        self._setup(hvd, tf_ops, tf.constant, numel, batch_size, redundancy, value_range,
                    exchange, verify)

    def part_gradients(self, loss_fn, *tensors):
        """``({part: flat float32 gradient}, mean loss over this worker's samples)``."""
        self._prepare()          # first step: ranks compare configurations before any check
        start = time.perf_counter()
        if self.exchange.is_global_batch([int(t.shape[0]) for t in tensors], self.batch_size):
            tensors = [tf.gather(t, self._positions) for t in tensors]
        grads, total, at = {}, 0.0, 0
        for q, n in zip(self.exchange.my_parts, self._lengths):
            with tf.GradientTape() as tape:
                loss = loss_fn(*(t[at:at + n] for t in tensors)) * (n / self.batch_size)
            gs = tape.gradient(loss, self.variables)
            grads[q] = tf.concat([tf.reshape(tf.cast(g if g is not None else tf.zeros_like(v),
                                                     tf.float32), [-1])
                                  for g, v in zip(gs, self.variables)], 0)
            total += float(loss)
            at += n
        self.compute_s += time.perf_counter() - start
        return grads, total * self.batch_size / len(self._positions)

    def gradient(self, loss_fn, *tensors):
        """``(loss, [global gradient per variable])``; ``tensors`` are the global
        mini-batch or this worker's samples."""
        grads, loss = self.part_gradients(loss_fn, *tensors)
        flat = self.exchange.run(tf_ops, grads, self._comm)
        out, at = [], 0
        for v in self.variables:
            n = int(np.prod(v.shape))
            out.append(tf.cast(tf.reshape(flat[at:at + n], v.shape), v.dtype))
            at += n
        return loss, out
