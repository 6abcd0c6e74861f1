"""Horovod's TensorFlow collectives as an exchange transport (eager or inside
``tf.function``), and compressed allreduce of one tensor (``hvd_compress.tensorflow.
allreduce``).

What crosses the network and in which order is :mod:`hvd_compress.exchange`; this
module only says how to run one Horovod collective (named after the tensor or bucket,
made a valid TF name).  May import Horovod, TensorFlow and the framework-free parts of
hvd_compress.
"""
import hashlib

import horovod.tensorflow as hvd
import tensorflow as tf

from .. import hosts
from ..exchange import PREFIX, Exchange, ProcessSetTransport, standard_traffic
from ..horovod_args import check_op as _check_op
from ..ops import tf_ops
from ..spec import from_horovod, from_spec, resolve
_CACHE = {}


def resolve_cached(compression):
    """Like ``spec.resolve`` but one compressor object per spec string, so the
    error-feedback state of a tape that is recreated every step survives.  Horovod's
    ``hvd.Compression.none``/``fp16`` count as the spec strings ``none``/``fp16``."""
    horovod = from_horovod(compression) if compression is not None else None
    if horovod is not None:
        compression = horovod
    if compression is None or isinstance(compression, str):
        key = compression
        if key not in _CACHE:
            _CACHE[key] = resolve(compression)
        return _CACHE[key]
    return from_spec(compression)


def check_op(op, glue="tensorflow"):
    """``op`` (``hvd.Average`` or ``hvd.Sum``), else ValueError naming it
    (:func:`hvd_compress.horovod_args.check_op`)."""
    return _check_op(op, hvd, glue)


def _to_wire(t):
    # Gloo rejects bfloat16: move its bits as int16 (allgather only; never summed).
    return tf.bitcast(t, tf.int16) if t.dtype == tf.bfloat16 else t


def _from_wire(t, dtype):
    return tf.bitcast(t, tf.bfloat16) if dtype == tf.bfloat16 else t


def _safe(name):
    # Horovod TF op names must be valid TF names.
    return "".join(c if c.isalnum() or c in "._-/" else "_" for c in name)


def _traffic(sent, received, received_local=None, union=0, k=0):
    """What the tape's stats count for one tensor or bucket (int64 tensors)."""
    received = tf.cast(received, tf.int64)
    return {"sent": tf.cast(sent, tf.int64), "received": received,
            "received_local": received if received_local is None
            else tf.cast(received_local, tf.int64),
            "union": tf.cast(union, tf.int64), "k": tf.cast(k, tf.int64)}


class HorovodTF(ProcessSetTransport):
    """Horovod's TensorFlow collectives on ``process_set``, eager or inside
    ``tf.function`` (each completes at once: the generators never yield)."""

    ops = tf_ops

    def __init__(self, process_set=hvd.global_process_set):
        super().__init__(process_set)

    def wire(self, name):
        return PREFIX + _safe(name)     # Horovod TF op names must be valid TF names

    def allreduce(self, tensor, name, inplace_of=None):
        out = hvd.allreduce(tensor, op=hvd.Sum, name=name, process_set=self.process_set)
        return (out,) + standard_traffic(tf_ops, "allreduce", tensor, out, self.size)

    def allgather(self, tensors, name):
        if len(tensors) == 1:
            t = tensors[0]
            out = (_from_wire(hvd.allgather(_to_wire(t), name=name,
                                            process_set=self.process_set), t.dtype),)
        else:
            out = _grouped_allgather(tensors, name, self.process_set)
        return (out,) + standard_traffic(tf_ops, "allgather", tensors, out, self.size)

    def divide(self, out, size):
        return out / tf.cast(size, out.dtype) if out.dtype.is_floating else out // size

    def broadcast_floats(self, values, name):
        t = tf.constant(values, tf.float64)
        return hvd.broadcast(t, root_rank=0, name=PREFIX + name,
                             process_set=self.process_set).numpy().tolist()

    def allgather_floats(self, values, name):
        with tf.init_scope():         # eager, also while a tf.function is traced
            t = tf.constant([values], tf.float64)
            return hvd.allgather(t, name=PREFIX + name,
                                 process_set=self.process_set).numpy().tolist()


def host_array(tensor):
    """A numpy copy of an eager CPU tensor, for the shared-memory collectives inside a
    host (:mod:`hvd_compress.exchange.shared_host`); None inside a traced graph
    (``tf.function``, Keras' compiled step), on a GPU, or for bfloat16: those go through
    Horovod."""
    if not tf.executing_eagerly() or not hasattr(tensor, "numpy") or \
            tensor.dtype == tf.bfloat16 or "GPU" in (tensor.device or "").upper():
        return None
    return tensor.numpy()


#: ``(to_numpy, from_numpy)`` for :func:`hvd_compress.hosts.hierarchy`
HOST_ARRAYS = (host_array, tf.convert_to_tensor)

_HIERARCHY = []


def hierarchy(compressors, process_set):
    """The hosts' local and cross transports when a compressor of ``compressors`` is
    ``hier:`` (:func:`hvd_compress.hosts.hierarchy`, run eagerly once per process:
    the process sets are Horovod's, for the whole job), else None."""
    if not hosts.wanted(compressors):
        return None
    if not _HIERARCHY:
        with tf.init_scope():
            _HIERARCHY.append(hosts.hierarchy(hvd, HorovodTF, HorovodTF(process_set),
                                              HOST_ARRAYS))
    return _HIERARCHY[0]


@tf.autograph.experimental.do_not_convert
def allreduce(tensor, name, compression=None, op=hvd.Average,
              process_set=hvd.global_process_set):
    """Compressed sum/average of ``tensor`` over ranks.

    Returns ``(result, traffic)``: int64 tensors ``sent``, ``received``,
    ``received_local``, ``union``, ``k`` (see :class:`hvd_compress.stats.Stats`).
    """
    check_op(op)
    if not name:
        raise ValueError("name is required: Horovod matches collectives across ranks by name")
    compressor = resolve_cached(compression)
    if isinstance(tensor, tf.IndexedSlices):
        tensor = tf.convert_to_tensor(tensor)
    if tensor.shape.num_elements() == 0:
        return tf.identity(tensor), _traffic(0, 0)
    ex = Exchange(compressor.for_tensor(name, tensor), HorovodTF(process_set), name,
                  tensor=tensor, average=op == hvd.Average)
    return ex.run(), _traffic(ex.sent, ex.received, ex.received_local, ex.union, ex.k)


_SAME_WIDTH = {1: tf.uint8, 2: tf.int16, 4: tf.int32, 8: tf.int64}


def _grouped_allgather(payload, name, process_set):
    """Allgather every tensor of ``payload`` in as few ops as dtypes allow: Horovod's
    TensorFlow ``grouped_allgather`` takes tensors of one dtype, so each tensor travels
    as the integer type of its width (a bit cast, undone on arrival) and tensors of one
    width form one group; (float32 values, int32 indices) is a single op."""
    groups = {}
    for i, t in enumerate(payload):
        width = t.dtype.size
        groups.setdefault(width, []).append(i)
    out = [None] * len(payload)
    for width, members in sorted(groups.items()):
        wire_dtype = _SAME_WIDTH[width]
        tensors = [payload[i] if payload[i].dtype == wire_dtype else tf.bitcast(payload[i], wire_dtype)
                   for i in members]
        suffix = "" if len(groups) == 1 else f".w{width}"
        gathered = hvd.grouped_allgather(tensors, name=name + suffix, process_set=process_set)
        for i, g in zip(members, gathered):
            dtype = payload[i].dtype
            out[i] = g if dtype == wire_dtype else tf.bitcast(g, dtype)
    return tuple(out)


def check_same_config(description, process_set=hvd.global_process_set):
    """Raise ValueError on every rank unless all ranks pass the same ``description``.

    Runs eagerly (also while a tf.function is being traced), once per configuration.
    """
    digest = hashlib.sha256(description.encode()).hexdigest()
    with tf.init_scope():
        everyone = hvd.allgather_object((digest, description), name=PREFIX + "config_check",
                                        process_set=process_set)
    if len({d for d, _ in everyone}) > 1:
        lines = "\n".join(f"  rank {r}: {desc[:300]}" for r, (_, desc) in enumerate(everyone))
        raise ValueError("hvd_compress: ranks are configured differently (compressor, "
                         f"variable names or shapes must match on every rank):\n{lines}")
