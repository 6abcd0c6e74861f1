"""The rest of the surface of ``horovod.tensorflow.DistributedGradientTape`` and
``horovod.keras.DistributedOptimizer`` (0.28.1) for :mod:`hvd_compress.tensorflow.tape`
and :mod:`hvd_compress.tensorflow.keras`: what is TensorFlow's own.  The checks and
mappings common to every glue (``op``, ``gradient_predivide_factor``, ``groups``,
``backward_passes_per_step``, devices) are :mod:`hvd_compress.horovod_args`.

What maps to what (Horovod's argument -> here):

- ``device_dense`` / ``device_sparse``: checked as device strings
  (``tf.DeviceSpec``) and otherwise unused: Horovod places its allreduce there; the
  exchange here runs where the gradients are (:func:`check_devices`).
- ``sparse_as_dense``: IndexedSlices gradients (embeddings) are always exchanged
  dense, since the compressors work on dense tensors.  ``True``: the result is a dense
  tensor, as Horovod's; ``False`` (the default): the result is ``tf.IndexedSlices``
  again, as Horovod's (there: the allgathered slices), holding the rows where the
  aggregate is not zero (:func:`as_slices`).
- ``groups`` / ``num_groups``: lists of ``tf.Variable`` (or Keras variables), matched
  by identity (:func:`groups_from`).
- ``register_local_source`` (tape) / ``register_local_var`` (Keras) with
  ``scale_local_gradients``: those variables' gradients are not exchanged; with
  ``scale_local_gradients=True`` (the default) they are divided by the number of ranks,
  as Horovod does (:class:`LocalSources`).
- ``backward_passes_per_step`` / ``average_aggregated_gradients`` (Keras): gradients
  are summed locally over N ``apply`` calls and exchanged and applied at every N-th,
  as Horovod's ``LocalGradientAggregationHelper`` does (:class:`Accumulation`).

Imports: TensorFlow, ``hvd_compress.horovod_args``.
"""
import tensorflow as tf

from .. import horovod_args


def check_devices(device_dense, device_sparse):
    """``(device_dense, device_sparse)`` as given, or ValueError naming the bad one."""
    return (horovod_args.check_device(device_dense, "device_dense", tf.DeviceSpec.from_string),
            horovod_args.check_device(device_sparse, "device_sparse", tf.DeviceSpec.from_string))


def _is_variable(t):
    return (isinstance(t, tf.Variable) or
            (hasattr(t, "assign") and hasattr(t, "shape") and hasattr(t, "dtype")))


def groups_from(num_groups, groups, bucket_mb):
    """Horovod's ``groups`` (or its deprecated ``num_groups``): None, an int > 0, or a
    list of lists of variables (``tf.Variable`` or Keras 3 variables); ValueError naming
    the argument otherwise, or when ``bucket_mb`` is given too."""
    return horovod_args.groups_from(num_groups, groups, bucket_mb, _is_variable,
                                    "tf.Variable")


def as_slices(dense, like):
    """``dense`` (the aggregate of the ``tf.IndexedSlices`` ``like``) as IndexedSlices of
    its rows that are not all zero (NaN counts as not zero), with ``like``'s index dtype
    and dense shape."""
    rows = tf.reshape(dense, [tf.shape(dense)[0], -1])
    keep = tf.reshape(tf.where(tf.reduce_any(tf.not_equal(rows, 0), axis=1)), [-1])
    return tf.IndexedSlices(tf.gather(dense, keep), tf.cast(keep, like.indices.dtype),
                            like.dense_shape)


class LocalSources:
    """Variables whose gradients are worker-local (Horovod's ``register_local_source`` /
    ``register_local_var``): not exchanged; divided by the number of ranks when
    ``scale_local_gradients`` is True, as Horovod does."""

    def __init__(self, scale_local_gradients=True):
        if not isinstance(scale_local_gradients, bool):
            raise ValueError("scale_local_gradients must be True or False, got "
                             f"{scale_local_gradients!r}")
        self.scale = scale_local_gradients
        self._vars = {}                    # id -> variable (kept alive: ids stay unique)

    def add(self, variable):
        self._vars[id(variable)] = variable

    def __contains__(self, variable):
        return id(variable) in self._vars

    def __len__(self):
        return len(self._vars)

    def reduce(self, reduce, grads, sources, size):
        """``reduce(grads, sources)`` (a list of results) on the non-local gradients;
        the local ones as they are, or divided by ``size``."""
        grads, sources = list(grads), list(sources)
        keep = [i for i, s in enumerate(sources) if s not in self]
        if len(keep) == len(sources):
            return reduce(grads, sources)
        out = list(grads)
        for i, r in zip(keep, reduce([grads[i] for i in keep], [sources[i] for i in keep])):
            out[i] = r
        if self.scale:
            for i, g in enumerate(grads):
                if sources[i] in self and g is not None:
                    out[i] = (tf.IndexedSlices(g.values / size, g.indices, g.dense_shape)
                              if isinstance(g, tf.IndexedSlices) else g / size)
        return out


class Accumulation:
    """Horovod's ``backward_passes_per_step=N`` for a Keras optimizer: each ``apply``
    adds the local gradients to per-variable sums (``tf.Variable``s, dense; made once,
    outside any graph); at every N-th the sums are exchanged (then divided by N when
    ``average_aggregated_gradients``, as Horovod does), applied and zeroed; the other
    calls only count the optimizer's ``iterations``, as Horovod's
    ``LocalGradientAggregationHelper`` does.  Eager or inside ``tf.function`` (one
    ``tf.cond``; every rank takes the same branch).  A variable whose gradient is None
    in a call is left out of that call's sum and, at an exchange, of the update.  The
    sums are not part of the optimizer's variables (nor of its checkpoints): save at an
    exchange step."""

    def __init__(self, passes, average):
        self.passes = horovod_args.passes(passes)
        if not isinstance(average, bool):
            raise ValueError("average_aggregated_gradients must be True or False, got "
                             f"{average!r}")
        self.average = average
        self._sums = {}                    # id(variable) -> tf.Variable
        self._count = None

    def _sum_of(self, variable):
        if id(variable) not in self._sums:
            with tf.init_scope():
                self._sums[id(variable)] = tf.Variable(
                    tf.zeros(tuple(variable.shape), tf.as_dtype(variable.dtype)),
                    trainable=False, name="hvd_compress_accumulated")
        return self._sums[id(variable)]

    def apply(self, grads, variables, reduce, update, count_only):
        """Add ``grads`` to the sums; at the N-th call ``update(reduce(sums,
        variables), variables)`` (the reduced sums divided by N first when
        ``average_aggregated_gradients``; a sum is None where this call's gradient is
        None), else ``count_only()``."""
        if self._count is None:
            with tf.init_scope():
                self._count = tf.Variable(0, dtype=tf.int64, trainable=False,
                                          name="hvd_compress_passes")
        sums = []
        for g, v in zip(grads, variables):
            if g is None:
                sums.append(None)
                continue
            acc = self._sum_of(v)
            acc.assign_add(tf.convert_to_tensor(g))
            sums.append(acc)
        count = self._count.assign_add(1)

        def exchange():
            out = reduce([None if s is None else tf.convert_to_tensor(s) for s in sums],
                         variables)
            if self.average:
                out = [None if g is None else g / tf.cast(self.passes, g.dtype) for g in out]
            update(out, variables)
            for s in sums:
                if s is not None:
                    s.assign(tf.zeros_like(s))
            self._count.assign(0)
            return tf.constant(True)

        def skip():
            count_only()
            return tf.constant(False)

        return tf.cond(tf.equal(count, self.passes), exchange, skip)
