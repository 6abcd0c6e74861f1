"""Compressed reduction of one TensorFlow tensor over Horovod, eager or in tf.function.

Same contract as ``hvd_compress.torch.collectives``: collectives are named after the
tensor, the compressor decides allreduce or allgather, its ``decompress`` turns the
aggregate into the sum over ranks.
"""
import hashlib
import time

import horovod.tensorflow as hvd
import tensorflow as tf

from ..compressors import payload_bytes
from ..ops import tf_ops
from ..spec import from_spec, resolve
from ..stats import ring_received

PREFIX = "hvd_compress."
_CACHE = {}


def resolve_cached(compression):
    """Like ``spec.resolve`` but one compressor object per spec string, so the
    error-feedback state of a tape that is recreated every step survives."""
    if compression is None or isinstance(compression, str):
        key = compression
        if key not in _CACHE:
            _CACHE[key] = resolve(compression)
        return _CACHE[key]
    return from_spec(compression)


def check_op(op):
    if op not in (hvd.Average, hvd.Sum):
        raise ValueError(f"op must be hvd.Average or hvd.Sum, got {op!r}")
    return op


def _to_wire(t):
    # Gloo rejects bfloat16: move its bits as int16 (allgather only; never summed).
    return tf.bitcast(t, tf.int16) if t.dtype == tf.bfloat16 else t


def _from_wire(t, dtype):
    return tf.bitcast(t, tf.bfloat16) if dtype == tf.bfloat16 else t


def _safe(name):
    # Horovod TF op names must be valid TF names.
    return "".join(c if c.isalnum() or c in "._-/" else "_" for c in name)


def _average(out, op, process_set):
    if op != hvd.Average:
        return out
    size = process_set.size()
    return out / tf.cast(size, out.dtype) if out.dtype.is_floating else out // size


def _traffic(sent, received, received_local=None, union=0, k=0):
    """What the tape's stats count for one tensor or bucket (int64 tensors)."""
    received = tf.cast(received, tf.int64)
    return {"sent": tf.cast(sent, tf.int64), "received": received,
            "received_local": received if received_local is None
            else tf.cast(received_local, tf.int64),
            "union": tf.cast(union, tf.int64), "k": tf.cast(k, tf.int64)}


def _payload_traffic(compressor, payload, aggregate, process_set):
    """Traffic of a one-round exchange: an allreduce receives a ring's share, an
    allgather the other ranks' payloads."""
    sent = payload_bytes(payload, tf_ops)
    if compressor.collective == "allreduce":
        return _traffic(sent, ring_received(tf.cast(sent, tf.int64), process_set.size()))
    return _traffic(sent, payload_bytes(aggregate, tf_ops) - sent)


def _two_rounds(compressor, proposal, rnd, wire, process_set):
    """A two-round exchange (agg=union/leader/hint, PowerSGD): round 1's collective of
    ``compressor.rounds`` (``<wire>.<suffix>``), ``agree``, an allreduce (Sum) of what it
    returns (``<wire>.<suffix>``), ``finish``.  Returns ``(flat or shaped sum, traffic)``."""
    (kind, suffix1), (_, suffix2) = compressor.rounds
    if kind == "allgather":
        gathered = hvd.allgather(proposal, name=f"{wire}.{suffix1}", process_set=process_set)
    else:
        gathered = hvd.allreduce(proposal, op=hvd.Sum, name=f"{wire}.{suffix1}",
                                 process_set=process_set)
    values, rnd = compressor.agree(gathered, rnd)
    summed = hvd.allreduce(values, op=hvd.Sum, name=f"{wire}.{suffix2}", process_set=process_set)
    out = compressor.finish(summed, rnd)
    return out, _traffic(*compressor.traffic(proposal, gathered, values, rnd, process_set.size()))


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
    compressor = compressor.for_tensor(name, tensor)
    wire = PREFIX + _safe(name)
    if compressor.collective == "two_round":
        proposal, rnd = compressor.propose(tensor, name, process_set.rank(), process_set.size())
        out, traffic = _two_rounds(compressor, proposal, rnd, wire, process_set)
        return _average(out, op, process_set), traffic
    payload, ctx = compressor.compress(tensor, name)
    if compressor.collective == "allreduce":
        aggregate = hvd.allreduce(payload, op=hvd.Sum, name=wire, process_set=process_set)
    else:
        aggregate = tuple(
            _from_wire(hvd.allgather(_to_wire(t), name=f"{wire}.{i}", process_set=process_set),
                       t.dtype)
            for i, t in enumerate(payload))
    traffic = _payload_traffic(compressor, payload, aggregate, process_set)
    return _average(compressor.decompress(aggregate, ctx), op, process_set), traffic


@tf.autograph.experimental.do_not_convert
def bucket_allreduce(flat, layout, compressor, op=hvd.Average,
                     process_set=hvd.global_process_set, times=None):
    """Compressed sum/average of a bucket (``flat``: the tensors of ``layout`` end to end)
    with one compress call and one collective (an allreduce, or one grouped allgather of
    every payload tensor; two rounds for agg=union/leader/hint), named after the bucket.
    Returns ``(flat result, traffic)`` as :func:`allreduce`.  ``times`` (eager only, a
    dict): gets ``compress_s``, ``wait_s`` and ``decompress_s`` of a one-round exchange."""
    check_op(op)
    wire = PREFIX + _safe(layout.key)
    if compressor.collective == "two_round":
        proposal, rnd = compressor.propose_bucket(flat, layout, process_set.rank(),
                                                  process_set.size())
        out, traffic = _two_rounds(compressor, proposal, rnd, wire, process_set)
        return _average(out, op, process_set), traffic
    start = time.perf_counter()
    payload, ctx = compressor.compress_bucket(flat, layout)
    compressed = time.perf_counter()
    if compressor.collective == "allreduce":
        aggregate = hvd.allreduce(payload, op=hvd.Sum, name=wire, process_set=process_set)
    else:
        aggregate = _grouped_allgather(payload, wire, process_set)
    waited = time.perf_counter()
    traffic = _payload_traffic(compressor, payload, aggregate, process_set)
    out = _average(compressor.decompress_bucket(aggregate, ctx), op, process_set)
    if times is not None:
        times.update(compress_s=compressed - start, wait_s=waited - compressed,
                     decompress_s=time.perf_counter() - waited)
    return out, traffic


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


class AutoComm:
    """What :meth:`hvd_compress.auto.Auto.end_step` needs (eager): the rank, and a named
    broadcast of a few floats from rank 0 of ``process_set``."""

    def __init__(self, process_set=hvd.global_process_set):
        self.process_set, self.rank = process_set, process_set.rank()

    def broadcast(self, values, name):
        t = tf.constant(values, tf.float64)
        return hvd.broadcast(t, root_rank=0, name=PREFIX + name,
                             process_set=self.process_set).numpy().tolist()

    def allgather(self, values, name):
        t = tf.constant([values], tf.float64)
        return hvd.allgather(t, name=PREFIX + name, process_set=self.process_set).numpy().tolist()


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
