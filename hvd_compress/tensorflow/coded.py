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
"""
import time

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from ..coded.exchange import DEFAULT_RANGE, CodedExchange
from ..coded.process_sets import group_sets
from ..ops import tf_ops

PREFIX = "hvd_compress.coded."


class _Comm:
    """The collectives the exchange needs, over Horovod (eager); counts bytes handed over."""

    def __init__(self):
        self.sets, self.sent_bytes = {}, 0

    def _count(self, t):
        self.sent_bytes += int(tf.size(t)) * t.dtype.size

    def allgather_config(self, vec):
        return hvd.allgather(tf.constant(vec.reshape(1, -1)), name=PREFIX + "config").numpy()

    def register_groups(self, groups, mine):
        sets = group_sets(hvd, groups)
        self.sets = {g: sets[g] for g in mine}

    def group_allgather(self, packets):
        # Eager Horovod ops block; every rank walks the groups in the same global order,
        # so the smallest pending group always has all its members waiting: no deadlock.
        out = []
        for g, p in packets:
            self._count(p)
            out.append(hvd.allgather(p, name=PREFIX + "g" + "-".join(map(str, g)),
                                     process_set=self.sets[g]))
        return out

    def alltoall(self, chunks, splits):
        buf = tf.concat(chunks, 0) if chunks else tf.zeros([0], tf.int32)
        self._count(buf)
        out, _ = hvd.alltoall(buf, splits=tf.constant(splits, tf.int32), name=PREFIX + "scatter")
        return out

    def allgather(self, t):
        self._count(t)
        return hvd.allgather(t, name=PREFIX + "slices")

    def allreduce_sum(self, t):
        self._count(t)
        return hvd.allreduce(t, op=hvd.Sum, name=PREFIX + "allreduce")


class CodedGradients:
    """Per-part gradients of this worker and their coded exchange (see
    :class:`hvd_compress.torch.coded.DistributedOptimizer` for the arguments)."""

    def __init__(self, variables, batch_size, redundancy, value_range=DEFAULT_RANGE,
                 exchange="multicast"):
        self.variables = list(variables)
        if not self.variables:
            raise ValueError("variables is empty: nothing to train")
        numel = sum(int(np.prod(v.shape)) for v in self.variables)
        self.exchange = CodedExchange(hvd.size(), hvd.rank(), redundancy, numel,
                                      value_range, exchange)
        self.placement = self.exchange.placement
        self.batch_size = int(batch_size)
        self.placement.part_slices(self.batch_size)                     # checks batch_size
        self._positions, self._lengths = self.placement.worker_indices(hvd.rank(), self.batch_size)
        self._comm = _Comm()
        self._prepared = False
        self.compute_s = 0.0

    def part_gradients(self, loss_fn, *tensors):
        """``({part: flat float32 gradient}, mean loss over this worker's samples)``."""
        if not self._prepared:   # first step: ranks compare configurations before any check
            self.exchange.prepare(self._comm, self.batch_size)
            self._prepared = True
        start = time.perf_counter()
        lengths = {int(t.shape[0]) for t in tensors}
        if len(lengths) != 1:
            raise ValueError(f"tensors have different lengths {sorted(lengths)}")
        length = lengths.pop()
        if length == self.batch_size:
            tensors = [tf.gather(t, self._positions) for t in tensors]
        elif length != len(self._positions):
            raise ValueError(f"expected the global mini-batch ({self.batch_size} samples) or "
                             f"this worker's parts ({len(self._positions)}), got {length}")
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

    @property
    def stats(self):
        s = self.exchange.stats()
        s["total_compute_s"] = self.compute_s
        s["total_handed_to_horovod"] = self._comm.sent_bytes
        return s
