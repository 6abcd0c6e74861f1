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

from .. import buckets
from ..spec import resolve
from . import collectives
from . import tape as _tape
from ..strategies.momentum import MomentumSchedule, adam_defaults
from .momentum import KerasAdamMomentum

# Horovod's keras.DistributedOptimizer arguments that hvd_compress does not implement,
# with the values that mean "off": code written for horovod.keras that passes them
# unchanged still runs; any other value raises ValueError rather than being ignored.
_HOROVOD_DEFAULTS = {"device_dense": ("",), "device_sparse": ("",),
                     "sparse_as_dense": (False, True),   # gradients are always made dense
                     "gradient_predivide_factor": (1.0,), "backward_passes_per_step": (1,),
                     "average_aggregated_gradients": (False,), "num_groups": (0,),
                     "groups": (None,), "scale_local_gradients": (True,)}
_CLASSES = {}


def DistributedOptimizer(optimizer, name=None, compression=None, op=hvd.Average,
                         process_set=hvd.global_process_set, bucket_mb=None,
                         compressed_momentum=None, **horovod_kwargs):
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

    Arguments as in ``horovod.keras.DistributedOptimizer`` and
    ``hvd_compress.tensorflow.DistributedGradientTape``: ``compression`` (a compressor,
    a spec string such as ``"topk:density=0.01"``, or None for ``$HVD_COMPRESS``), ``op``
    (``hvd.Average`` or ``hvd.Sum``), ``process_set``, ``bucket_mb`` (see
    :mod:`hvd_compress.buckets`), ``name`` (the optimizer's name, default the wrapped
    one's).  Horovod's other arguments are accepted at their defaults only.

    The optimizer gets ``compression`` (its own compressor object: a spec string is
    resolved anew, so error feedback is not shared with other optimizers or tapes;
    checkpoint this rank's residuals with ``opt.compression.state_dict()`` and restore
    them with ``opt.compression.load_state_dict(state, framework="tensorflow")``) and
    ``stats`` (bytes sent vs a dense float32 allreduce, as ``tape.stats``).

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
    """
    for key, value in horovod_kwargs.items():
        if key not in _HOROVOD_DEFAULTS:
            raise TypeError(f"DistributedOptimizer() got an unexpected keyword argument {key!r}")
        if value not in _HOROVOD_DEFAULTS[key]:
            hint = (" (Keras 3 optimizers take gradient_accumulation_steps=N)"
                    if key == "backward_passes_per_step" else "")
            raise ValueError(f"hvd_compress.keras.DistributedOptimizer does not implement "
                             f"{key}={value!r}{hint}")
    if keras.backend.backend() != "tensorflow":
        raise ValueError("hvd_compress.keras needs the TensorFlow backend of Keras, "
                         f"not {keras.backend.backend()!r}")
    if type(optimizer) in _CLASSES.values():
        raise ValueError("this optimizer is already an hvd_compress DistributedOptimizer")
    config = optimizer.get_config()
    if name is not None:
        config["name"] = name
    wrapped = _distributed_class(type(optimizer)).from_config(config)
    wrapped.compression = resolve(compression)
    wrapped.op = collectives.check_op(op)
    wrapped.process_set = process_set
    wrapped.bucket_mb = buckets.bucket_mb(bucket_mb, wrapped.compression)
    wrapped.compressed_momentum = None
    schedule = MomentumSchedule.build(compressed_momentum)
    if schedule is None and isinstance(optimizer, keras.optimizers.Adam):
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
        grads = _tape.reduce_gradients(grads, variables, self.compression, self.op,
                                       self.process_set, self.bucket_mb)
        return base.apply(self, grads, trainable_variables)

    def stats(self):
        """Bytes sent vs a dense float32 allreduce (:class:`hvd_compress.tensorflow.TFStats`)."""
        return _tape.stats(self.compression)

    cls = type(base.__name__, (base,), {"apply": apply, "stats": property(stats),
                                        "__module__": base.__module__,
                                        "__qualname__": base.__qualname__,
                                        "__doc__": base.__doc__})
    _CLASSES[base] = cls
    return cls


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
        grads = _tape.reduce_gradients(grads, variables, self.dense_compression, self.op,
                                       self.process_set, self.bucket_mb, count_as=self.compression)
        out = base.apply(self, grads, trainable_variables)
        mom.after_dense(variables, collectives.HorovodTF(self.process_set))
        return out
    if not self.built:
        self.build(variables)
    means = _tape.reduce_gradients(mom.local_momentum(grads, variables), variables,
                                   self.compression, self.op, self.process_set, self.bucket_mb)
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
