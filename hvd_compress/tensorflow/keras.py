"""Keras 3 (TensorFlow backend): ``model.fit`` with compressed gradients.

    import horovod.tensorflow as hvd
    import hvd_compress.keras

    hvd.init()
    opt = hvd_compress.keras.DistributedOptimizer(keras.optimizers.SGD(0.05),
                                                  compression="topk:density=0.01")
    model.compile(optimizer=opt, loss=...)
    model.fit(x, y, callbacks=[hvd_compress.keras.BroadcastGlobalVariablesCallback(0)])

Why this module: Horovod 0.28.1's Keras ``DistributedOptimizer`` predates Keras 3 (it
overrides methods Keras 3 no longer calls) and its ``hvd.broadcast_variables`` fails on
Keras 3 variables (it passes them into a ``tf.function``, where they become tensors
without ``assign``).  This module holds no algorithm: the optimizer hands its local
gradients to :func:`hvd_compress.tensorflow.tape.reduce_gradients`, the very code
behind ``DistributedGradientTape`` (buckets, configuration check, bytes counted,
NaN/Inf passed through), then lets the wrapped optimizer update the weights.

Needs Horovod built with TensorFlow and Keras 3 on the TensorFlow backend.  This module
imports no PyTorch module beyond those ``import hvd_compress`` imports, and not
Horovod's Keras module.
"""
import horovod.tensorflow as hvd
import keras
import tensorflow as tf

from .. import buckets, horovod_args
from ..spec import resolve
from . import collectives, horovod_surface as surface
from . import tape as _tape
from ..strategies.momentum import MomentumSchedule, adam_defaults, check_compressed_update
from .compressed_update import KerasLocalUpdates
from .momentum import KerasAdamMomentum

_CLASSES = {}


def DistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",
                         compression=None, sparse_as_dense=False, gradient_predivide_factor=1.0,
                         op=hvd.Average, backward_passes_per_step=1,
                         average_aggregated_gradients=False, num_groups=0, groups=None,
                         process_set=hvd.global_process_set, scale_local_gradients=True,
                         bucket_mb=None, compressed_momentum=None, compressed_update=False):
    """A copy of the Keras 3 ``optimizer`` whose updates use gradients compressed and
    aggregated over the Horovod ranks.

    As Horovod does, the result is an instance of a subclass of ``optimizer``'s class
    made on the fly, with the same class name and module (so a saved model loads as the
    plain optimizer), built from ``optimizer.get_config()``: wrap an optimizer before it
    is used (state it already holds is not copied).  The subclass overrides ``apply``
    (``apply_gradients`` calls it): local gradients -> ``reduce_gradients`` -> the
    wrapped optimizer's ``apply``.  Works inside ``model.fit``'s compiled train step
    (``tf.function``) and with ``run_eagerly=True``; not with XLA (``jit_compile=True``
    raises ValueError at the first step: Horovod's ops have no XLA kernels; Keras picks
    XLA itself on GPUs, so pass ``jit_compile=False`` to ``compile`` there).

    Arguments follow ``horovod.keras.DistributedOptimizer`` (0.28.1), in its order, then
    ours (``bucket_mb``, ``compressed_momentum``, ``compressed_update``).  Horovod's
    argument -> what it does here:

    - ``compression``: a compressor, a spec string such as ``"topk:density=0.01"``,
      Horovod's ``hvd.Compression.none``/``fp16`` (our ``none``/``fp16``), or None for
      ``$HVD_COMPRESS``.
    - ``op``: ``hvd.Average`` or ``hvd.Sum``; ``hvd.Adasum``: ValueError naming ``op``.
    - ``gradient_predivide_factor`` (``op=hvd.Average`` only): gradients divided by it
      before the exchange, the average multiplied by it after (Horovod's ``1/factor``
      before the sum, ``factor/size`` after).
    - ``groups`` (or ``num_groups``): the buckets (an int: that many; lists of
      variables: one bucket each, a variable in none alone); not with ``bucket_mb``.
    - ``sparse_as_dense``: IndexedSlices gradients (embeddings) are exchanged dense;
      ``True`` applies them dense, ``False`` as IndexedSlices of the non-zero rows.
    - ``backward_passes_per_step=N`` / ``average_aggregated_gradients``: each ``apply``
      adds the local gradients to sums; every N-th exchanges the sums (divided by N after
      the exchange when ``average_aggregated_gradients``) and applies them; the others
      only count ``iterations``, as Horovod's ``LocalGradientAggregationHelper``.  Not
      with Keras' own ``gradient_accumulation_steps`` (which would exchange every
      micro-batch) nor ``compressed_momentum``.
    - ``device_dense``/``device_sparse``: checked device strings, otherwise unused.
    - ``scale_local_gradients``, with ``opt.register_local_var(var)``: ``var``'s gradient
      is not exchanged, and divided by the number of ranks when True, as Horovod's.
    - ``process_set``, ``name`` (the optimizer's name, default the wrapped one's).

    ``bucket_mb``: see :mod:`hvd_compress.buckets`.  The optimizer gets ``compression``
    (its own compressor object: a spec string is resolved anew, so error feedback is not
    shared with other optimizers or tapes; checkpoint this rank's residuals with
    ``opt.compression.state_dict()`` and restore them with
    ``opt.compression.load_state_dict(state, framework="tensorflow")``) and ``stats``
    (bytes sent vs a dense float32 allreduce, as ``tape.stats``).

    Collectives are named after the variables' Keras paths (``"dense/kernel"``; a path
    seen twice gets ``#1``, ...), which are the same on every rank of the same script;
    ranks configured differently (compressor, op, bucket size, variable paths, shapes or
    dtypes) raise ValueError on every rank at the first step.  Every rank must run the
    same number of steps (shard the data evenly), as with any allreduce.

    ``compressed_momentum`` (Keras ``Adam``/``AdamW``; eager only: ``run_eagerly=True``):
    dense Adam for a warm-up, then the variance frozen and the momentum sent through
    ``compression`` (:mod:`hvd_compress.strategies.momentum`; values as for the PyTorch
    optimizer).  ``opt.compressed_momentum`` (not ``opt.momentum``: that is SGD's own
    hyperparameter) holds it; its ``state_dict()`` is the schedule, to checkpoint beside
    the optimizer's variables and ``opt.compression.state_dict()``.

    ``compressed_update=True`` (any Keras optimizer; measured with AdamW in PyTorch):
    each rank applies the wrapped optimizer to its own gradients, and the change of the
    weights goes through ``compression`` with error feedback; every rank applies the
    mean (:mod:`hvd_compress.tensorflow.compressed_update`).  Compiled and eager.  The
    optimizer's variables are this rank's (checkpoint each rank's); a ``register_local_var``
    variable keeps its own update.  Not with ``compressed_momentum``,
    ``backward_passes_per_step > 1``, ``op=hvd.Sum`` or DGC's ``momentum=``.
    """
    if keras.backend.backend() != "tensorflow":
        raise ValueError("hvd_compress.keras needs the TensorFlow backend of Keras, "
                         f"not {keras.backend.backend()!r}")
    if type(optimizer) in _CLASSES.values():
        raise ValueError("this optimizer is already an hvd_compress DistributedOptimizer")
    surface.check_devices(device_dense, device_sparse)
    op = collectives.check_op(op, "keras")
    predivide = horovod_args.predivide_factor(gradient_predivide_factor, op, hvd)
    groups = surface.groups_from(num_groups, groups, bucket_mb)
    accumulation = surface.Accumulation(backward_passes_per_step, average_aggregated_gradients)
    local = surface.LocalSources(scale_local_gradients)
    config = optimizer.get_config()
    if accumulation.passes > 1 and config.get("gradient_accumulation_steps"):
        raise ValueError(f"backward_passes_per_step={backward_passes_per_step} and the "
                         "optimizer's gradient_accumulation_steps="
                         f"{config['gradient_accumulation_steps']} both accumulate "
                         "gradients: use one (backward_passes_per_step exchanges every N-th "
                         "step, gradient_accumulation_steps every step)")
    if name is not None:
        config["name"] = name
    wrapped = _distributed_class(type(optimizer)).from_config(config)
    wrapped.compression = resolve(compression)
    wrapped.op = op
    wrapped.gradient_predivide_factor = predivide
    wrapped.sparse_as_dense = bool(sparse_as_dense)
    wrapped.process_set = process_set
    wrapped.bucket_mb = buckets.bucket_mb(bucket_mb, wrapped.compression) \
        if groups is None else None
    wrapped.compressed_momentum = None
    # Python objects Keras' tracker must not turn into tracked lists (not Keras state)
    object.__setattr__(wrapped, "_hvd_groups", groups)
    object.__setattr__(wrapped, "_hvd_accumulation",
                       accumulation if accumulation.passes > 1 else None)
    object.__setattr__(wrapped, "_hvd_local", local)
    schedule = MomentumSchedule.build(compressed_momentum)
    update = check_compressed_update(compressed_update, schedule, wrapped.compression,
                                     op == hvd.Average, ("op=hvd.Average", "op=hvd.Sum"),
                                     horovod_args.ranks_of(process_set),
                                     horovod_args.rank_in(process_set))
    if update and accumulation.passes > 1:
        raise ValueError("backward_passes_per_step > 1 does not go with compressed_update "
                         "(each step's update is exchanged)")
    object.__setattr__(wrapped, "_hvd_update", KerasLocalUpdates() if update else None)
    if schedule is not None and accumulation.passes > 1:
        raise ValueError("backward_passes_per_step > 1 does not go with compressed_momentum "
                         "(the momentum is exchanged at every step)")
    if schedule is None and not update and isinstance(optimizer, keras.optimizers.Adam):
        adam_defaults(wrapped.compression, type(optimizer).__name__)
    if schedule is not None:
        wrapped.compressed_momentum = KerasAdamMomentum(
            wrapped, schedule, wrapped.compression, process_set.rank)
        wrapped.dense_compression = wrapped.compressed_momentum.warmup_compressor
    return wrapped


def _distributed_class(base):
    """The subclass of the Keras optimizer class ``base`` (one per class)."""
    if base in _CLASSES:
        return _CLASSES[base]

    @tf.autograph.experimental.do_not_convert
    def apply(self, grads, trainable_variables=None):
        """Aggregate the local ``grads`` over the ranks, then update as ``base`` does."""
        grads = list(grads)
        variables = (list(trainable_variables) if trainable_variables is not None
                     else self._trainable_variables if self.built else None)
        if variables is None or len(variables) != len(grads):
            return base.apply(self, grads, trainable_variables)   # Keras raises its error
        _check_not_xla()
        if getattr(self, "compressed_momentum", None) is not None:
            return _apply_momentum(self, base, grads, variables, trainable_variables)
        if getattr(self, "_hvd_update", None) is not None:
            _build(self, variables)
            return self._hvd_update.apply(
                lambda g: base.apply(self, g, trainable_variables), grads, variables,
                lambda u, v: self._hvd_local.reduce(               # local: its own update
                    lambda u, v: _reduce_all(self, u, v), u, v, 1))
        if self._hvd_accumulation is not None:
            _build(self, variables)
            self._hvd_accumulation.apply(
                grads, variables, lambda g, v: _reduce(self, g, v),
                lambda g, v: base.apply(self, g, trainable_variables),
                lambda: self.iterations.assign_add(1))
            return
        return base.apply(self, _reduce(self, grads, variables), trainable_variables)

    def register_local_var(self, var):
        """Horovod's: ``var``'s gradient is worker-local (not exchanged; divided by the
        number of ranks when ``scale_local_gradients``)."""
        self._hvd_local.add(var)

    def stats(self):
        """Bytes sent vs a dense float32 allreduce (:class:`hvd_compress.tensorflow.TFStats`)."""
        return _tape.stats(self.compression)

    cls = type(base.__name__, (base,), {"apply": apply, "stats": property(stats),
                                        "register_local_var": register_local_var,
                                        "__module__": base.__module__,
                                        "__qualname__": base.__qualname__,
                                        "__doc__": base.__doc__})
    _CLASSES[base] = cls
    return cls


def _build(self, variables):
    """Build the optimizer's slots for ``variables`` now (as Keras' ``apply`` would),
    before the step reads or accumulates into them."""
    if not self.built:
        with keras.name_scope(self.name, caller=self):
            self.build(variables)
        self.built = True


def _reduce(self, grads, variables, compression=None, count_as=None):
    """``reduce_gradients`` with this optimizer's Horovod arguments (local variables as
    they are, or scaled)."""
    return self._hvd_local.reduce(lambda g, v: _reduce_all(self, g, v, compression, count_as),
                                  grads, variables, self.process_set.size())


def _reduce_all(self, grads, variables, compression=None, count_as=None):
    return _tape.reduce_gradients(
        grads, variables, compression or self.compression, self.op, self.process_set,
        self.bucket_mb, count_as=count_as, predivide=self.gradient_predivide_factor,
        groups=self._hvd_groups, sparse_as_dense=self.sparse_as_dense)


def _apply_momentum(self, base, grads, variables, trainable_variables):
    """A step of compressed-momentum Adam (:mod:`hvd_compress.tensorflow.momentum`)."""
    mom = self.compressed_momentum
    if not tf.executing_eagerly():
        raise ValueError("compressed_momentum decides between dense and compressed steps "
                         "in Python: it needs eager execution (Keras: model.compile(..., "
                         "run_eagerly=True))")
    if not getattr(self, "_momentum_checked", False):
        collectives.check_same_config(f"{self.compression.spec} {mom.spec}", self.process_set)
        self._momentum_checked = True
    if mom.dense:
        grads = _reduce(self, grads, variables, self.dense_compression, count_as=self.compression)
        out = base.apply(self, grads, trainable_variables)
        mom.after_dense(variables, collectives.HorovodTF(self.process_set))
        return out
    if not self.built:
        self.build(variables)
    means = _reduce(self, mom.local_momentum(grads, variables), variables)
    mom.apply(means, variables)


def _check_not_xla():
    """Horovod's ops have no XLA kernels: say so (on every rank alike, at the first trace)
    rather than let XLA fail on a "HorovodGroupedAllgather" node."""
    from tensorflow.python.framework import ops
    from tensorflow.python.ops import control_flow_util
    if control_flow_util.GraphOrParentsInXlaContext(ops.get_default_graph()):
        raise ValueError("hvd_compress.keras.DistributedOptimizer cannot run under XLA "
                         "(Horovod's collectives have no XLA kernels): compile the model "
                         "with jit_compile=False")


# Horovod's broadcast takes these dtypes; others (uint16, uint32, bfloat16, ...) travel
# as the signed integer of the same width, bit for bit.
_BROADCASTABLE = {tf.uint8, tf.int8, tf.int16, tf.int32, tf.int64, tf.float16, tf.float32,
                  tf.float64, tf.bool}
_SAME_WIDTH = {1: tf.int8, 2: tf.int16, 4: tf.int32, 8: tf.int64}


def broadcast_variables(variables, root_rank=0, process_set=hvd.global_process_set):
    """Set every variable of ``variables`` (Keras 3 or ``tf.Variable``) to its value on
    ``root_rank``, e.g. ``broadcast_variables(model.variables, root_rank=0)``; eager.

    One named broadcast per variable (``hvd_compress.broadcast.<path>``); first, every
    rank checks that all ranks pass the same variables (paths, shapes and dtypes), so a
    mismatch is a ValueError on every rank instead of a hang.
    """
    variables = list(variables)
    if not process_set.included():
        return
    names = _tape.variable_names(variables)
    dtypes = [tf.as_dtype(v.dtype) for v in variables]
    collectives.check_same_config(
        f"broadcast from rank {root_rank} | " + ";".join(
            f"{n}:{tuple(v.shape)}:{d.name}" for n, v, d in zip(names, variables, dtypes)),
        process_set)
    for n, v, dtype in zip(names, variables, dtypes):
        value = tf.convert_to_tensor(v)
        wire = dtype if dtype in _BROADCASTABLE else _SAME_WIDTH[dtype.size]
        if wire != dtype:
            value = tf.bitcast(value, wire)
        value = hvd.broadcast(value, root_rank, name=collectives.PREFIX + "broadcast." +
                              collectives._safe(n), process_set=process_set)
        v.assign(value if wire == dtype else tf.bitcast(value, dtype))


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Keras callback: at the start of ``fit``, every rank takes ``root_rank``'s model and
    optimizer variables (:func:`broadcast_variables`), so all ranks start alike.

    Keras builds what is not built yet (a subclassed model, the optimizer's slots such
    as momentum) in the first train step.  So what exists at ``on_train_begin`` is
    broadcast then (a functional or Sequential model with an ``Input`` is built: the
    first step starts from the same weights everywhere), and if the model or the
    optimizer was not built yet, everything is broadcast again after the first batch,
    as Horovod's callback does (for a model built only then, that first batch started
    from different weights; for standard optimizers the second broadcast changes
    nothing: their slots start at zero and take the same aggregated gradients).
    """

    def __init__(self, root_rank=0, process_set=hvd.global_process_set):
        super().__init__()
        self.root_rank = root_rank
        self.process_set = process_set
        self.broadcast_done = False

    def _broadcast(self):
        optimizer = getattr(self.model, "optimizer", None)
        extra = list(optimizer.variables) if optimizer is not None else []
        broadcast_variables(list(self.model.variables) + extra, self.root_rank,
                            self.process_set)

    def _all_built(self):
        optimizer = getattr(self.model, "optimizer", None)
        return self.model.built and (optimizer is None or optimizer.built)

    def on_train_begin(self, logs=None):
        if not self.broadcast_done:
            self._broadcast()
            self.broadcast_done = self._all_built()

    def on_train_batch_end(self, batch, logs=None):
        if not self.broadcast_done:
            self._broadcast()
            self.broadcast_done = True
