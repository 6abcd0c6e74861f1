"""``hvd_compress.tensorflow.DistributedGradientTape``: Horovod's tape with compressors
that may need an allgather.  Works eagerly and inside ``tf.function``.

Error-feedback state and byte counts live in ``tf.Variable``s held by the compressor
(one object per spec string), so a tape created anew each step keeps them.  The work is
done by :func:`reduce_gradients`, which ``hvd_compress.keras.DistributedOptimizer``
shares.

Imports: the standard library, TensorFlow, Horovod, ``hvd_compress.exchange``,
``hvd_compress.ops``, ``hvd_compress.stats``, ``hvd_compress.buckets``,
``hvd_compress.horovod_args``; and modules of its own package.
"""
import weakref

import horovod.tensorflow as hvd
import tensorflow as tf

from .. import buckets, horovod_args
from ..exchange import Driver, find_auto
from ..ops import tf_ops
from ..stats import EXCHANGE, summarize
from . import collectives, horovod_surface as surface

_STATS = weakref.WeakKeyDictionary()
_CHECKED = weakref.WeakKeyDictionary()


class TFStats:
    """Byte counts in int64 ``tf.Variable``s (updated inside tf.function); the same keys
    as :class:`hvd_compress.stats.Stats` less the seconds."""

    KEYS = ("sent", "dense") + EXCHANGE

    def __init__(self):
        with tf.init_scope():
            self._v = {k: tf.Variable(0, dtype=tf.int64, trainable=False, name=f"hvd_compress_{k}")
                       for k in ["steps"] + [f"{w}_{k}" for w in ("last", "total")
                                             for k in self.KEYS]}

        self._step = dict.fromkeys(self.KEYS, 0)

    def add(self, sent, dense, received=0, received_local=0, union=0, k=0):
        """Count one tensor's (or bucket's) exchange in the current step (int64 tensors
        or ints; inside ``tf.function`` the sums are part of the graph)."""
        values = dict(sent=sent, dense=dense, received=received,
                      received_local=received_local, union=union, k=k)
        for key in self.KEYS:
            self._step[key] = self._step[key] + tf.cast(values[key], tf.int64)

    def add_time(self, compress_s, wait_s, decompress_s, compress_late_s):
        """Seconds are not counted in TensorFlow (inside ``tf.function`` they would be
        the trace's)."""

    def end_step(self):
        """Close the step: assign its sums to ``last_*`` and add them to ``total_*``."""
        for k in self.KEYS:
            v = tf.cast(self._step[k], tf.int64)
            self._v["last_" + k].assign(v)
            self._v["total_" + k].assign_add(v)
        self._v["steps"].assign_add(1)
        self._step = dict.fromkeys(self.KEYS, 0)

    #: ``auto``: bucket key -> the spec of the candidate that sends it now
    choices = {}
    #: the last call's buckets: lists of variable names (set when traced in tf.function)
    buckets = []

    def as_dict(self):
        v = {k: int(x.numpy()) for k, x in self._v.items()}
        out = summarize(v["steps"], v["last_sent"], v["last_dense"], v["total_sent"],
                        v["total_dense"], {k: v["last_" + k] for k in EXCHANGE},
                        {k: v["total_" + k] for k in EXCHANGE})
        if self.choices:
            out["choices"] = dict(self.choices)
        return out

    def __repr__(self):
        d = self.as_dict()
        return f"<TFStats steps={d['steps']} ratio={d['ratio']:.1f}x>"


def stats(compression):
    """The :class:`TFStats` of ``compression`` (a compressor or spec string)."""
    compressor = collectives.resolve_cached(compression)
    if compressor not in _STATS:
        _STATS[compressor] = TFStats()
    return _STATS[compressor]


def variable_names(sources):
    """Stable, unique names for ``sources`` (Keras 3 ``path``, else ``name`` less ``:0``)."""
    names = []
    for i, v in enumerate(sources):
        name = getattr(v, "path", None) or getattr(v, "name", None) or f"var{i}"
        names.append(name[:-2] if name.endswith(":0") else name)
    seen = {}
    out = []
    for n in names:
        seen[n] = seen.get(n, -1) + 1
        out.append(n if seen[n] == 0 else f"{n}#{seen[n]}")
    return out


class DistributedGradientTape:
    """Wrap a ``tf.GradientTape``: ``gradient()`` returns compressed, aggregated gradients.

    Arguments follow ``horovod.tensorflow.DistributedGradientTape`` (0.28.1), in its
    order, then ours (``bucket_mb``).  Horovod's argument -> what it does here:

    - ``compression``: a hvd_compress compressor, a spec string (``"topk:density=0.01"``),
      Horovod's ``hvd.Compression.none``/``fp16`` (our ``none``/``fp16``), or None for
      ``$HVD_COMPRESS`` (default ``none``).
    - ``op``: ``hvd.Average`` or ``hvd.Sum``; ``hvd.Adasum`` is a ValueError naming ``op``.
    - ``gradient_predivide_factor`` (``op=hvd.Average`` only): gradients are divided by it
      before the exchange (the compressor and its error feedback see ``g / factor``) and
      the average multiplied by it after: Horovod's ``1/factor`` before the sum and
      ``factor/size`` after.
    - ``groups`` (or its deprecated spelling ``num_groups``): Horovod's explicit groups
      become the buckets: an int splits the sources into that many buckets, a list of
      lists of variables makes each list a bucket (a variable in none is a bucket of its
      own); not together with ``bucket_mb``.
    - ``sparse_as_dense``: IndexedSlices gradients are exchanged dense either way (the
      compressors work on dense tensors); ``True`` returns them dense, ``False`` (the
      default) as ``tf.IndexedSlices`` of the aggregate's non-zero rows, as Horovod
      returns IndexedSlices.
    - ``device_dense``/``device_sparse``: checked device strings, otherwise unused (the
      exchange runs where the gradients are).
    - ``process_set``: as Horovod's.
    - ``scale_local_gradients``, with :meth:`register_local_source`: a registered
      variable's gradient is not exchanged, and divided by the number of ranks when True
      (the default), as Horovod's.

    ``bucket_mb``: gradients are compressed and sent in buckets of about this many MB
    (default ``$HVD_COMPRESS_BUCKET_MB``, else 25; 0: tensor by tensor; see
    :mod:`hvd_compress.buckets`); inside ``tf.function`` a bucket's ops form one group.
    ``tape.stats`` counts bytes sent vs a dense float32 allreduce (``tape.stats.buckets``:
    the last call's buckets, by variable name).
    """

    def __init__(self, gradtape, device_dense="", device_sparse="", compression=None,
                 sparse_as_dense=False, op=hvd.Average, gradient_predivide_factor=1.0,
                 num_groups=0, groups=None, process_set=hvd.global_process_set,
                 scale_local_gradients=True, bucket_mb=None):
        self._tape = gradtape
        self.device_dense, self.device_sparse = surface.check_devices(device_dense,
                                                                      device_sparse)
        self.compression = collectives.resolve_cached(compression)
        self.op = collectives.check_op(op)
        self.gradient_predivide_factor = horovod_args.predivide_factor(
            gradient_predivide_factor, op, hvd)
        self.groups = surface.groups_from(num_groups, groups, bucket_mb)
        self.sparse_as_dense = bool(sparse_as_dense)
        self.process_set = process_set
        self.compression.bind_rank(horovod_args.rank_in(process_set))   # (its checkpoints)
        self.bucket_mb = buckets.bucket_mb(bucket_mb, self.compression) \
            if self.groups is None else None
        self._local = surface.LocalSources(scale_local_gradients)

    def __getattr__(self, item):       # watch(), stop_recording(), reset(), ...
        return getattr(self._tape, item)

    def __enter__(self):
        self._tape.__enter__()
        return self

    def __exit__(self, *exc):
        return self._tape.__exit__(*exc)

    @property
    def stats(self):
        return stats(self.compression)

    @property
    def scale_local_gradients(self):
        return self._local.scale

    def register_local_source(self, source):
        """Horovod's: ``source``'s gradient is worker-local (not exchanged; divided by
        the number of ranks when ``scale_local_gradients``)."""
        self._local.add(source)

    @tf.autograph.experimental.do_not_convert
    def gradient(self, target, sources, output_gradients=None, use_generic_names=False,
                 **kwargs):
        """The aggregated gradients of ``target`` with respect to ``sources`` (as
        ``tf.GradientTape.gradient``; ``use_generic_names`` is Horovod's and changes
        nothing: collectives are named after the variables either way)."""
        flat_sources = tf.nest.flatten(sources)
        grads = tf.nest.flatten(self._tape.gradient(target, sources, output_gradients, **kwargs))
        out = self._local.reduce(self._reduce, grads, flat_sources, self.process_set.size())
        return tf.nest.pack_sequence_as(sources, out)

    def _reduce(self, grads, sources):
        return reduce_gradients(grads, sources, self.compression, self.op, self.process_set,
                                self.bucket_mb, predivide=self.gradient_predivide_factor,
                                groups=self.groups, sparse_as_dense=self.sparse_as_dense)

    def get_local_and_global_gradients(self, target, sources, output_gradients=None,
                                       use_generic_names=False):
        """Horovod's: ``(local, global)`` lists of ``(source, gradient)`` pairs, split by
        :meth:`register_local_source`."""
        grads = self.gradient(target, sources, output_gradients, use_generic_names)
        pairs = list(zip(tf.nest.flatten(sources), tf.nest.flatten(grads)))
        return ([p for p in pairs if p[0] in self._local],
                [p for p in pairs if p[0] not in self._local])


@tf.autograph.experimental.do_not_convert
def reduce_gradients(grads, sources, compression, op, process_set, bucket_mb, count_as=None,
                     predivide=1.0, groups=None, sparse_as_dense=False):
    """Compressed, aggregated ``grads`` (a list, one per variable of the list ``sources``;
    None stays None): what :class:`DistributedGradientTape` and
    :func:`hvd_compress.keras.DistributedOptimizer` both do with local gradients.

    ``compression`` is a compressor object (its error feedback and :func:`stats` are
    updated), ``bucket_mb`` a number (:func:`hvd_compress.buckets.bucket_mb`).  Names
    of the collectives come from :func:`variable_names`.  The first call per compressor
    and configuration checks that every rank has the same configuration (ValueError on
    every rank otherwise).  Eager or inside ``tf.function``.  ``count_as``: the
    compressor whose :func:`stats` count the bytes (default ``compression``).
    Horovod's arguments, checked by the caller
    (:mod:`hvd_compress.tensorflow.horovod_surface`): ``predivide`` (the
    ``gradient_predivide_factor``: ``g / predivide`` is exchanged, the result multiplied
    by it), ``groups`` (None, an int or lists of variables: the buckets instead of
    ``bucket_mb``'s), ``sparse_as_dense`` (False: an IndexedSlices gradient's result is
    IndexedSlices again).
    """
    grads = list(grads)
    names = variable_names(sources)
    if not process_set.included():
        return grads
    # which compressor: asked of the gradient (a Keras 3 variable's dtype is a string)
    likes = [tf.zeros(tuple(v.shape), tf.as_dtype(v.dtype)) if g is None
             else g.values if isinstance(g, tf.IndexedSlices) else g
             for v, g in zip(sources, grads)]
    entries = [(n, tuple(v.shape), compression.for_tensor(n, like), tf.as_dtype(v.dtype).name,
                tf.as_dtype(v.dtype).size) for n, v, like in zip(names, sources, likes)]
    if groups is None:
        plan = buckets.plan(entries, bucket_mb)
        planned = buckets.describe(bucket_mb, plan)
    else:
        plan = horovod_args.plan_groups(groups, list(sources), entries)
        planned = horovod_args.describe_groups(groups, plan)
    counted = stats(count_as or compression)
    counted.buckets = [[names[i] for i in b] for b in plan]
    layout = ";".join(f"{n}:{tuple(v.shape)}:{tf.as_dtype(v.dtype).name}"
                      for n, v in zip(names, sources))
    config = f"{compression.spec} op={op} predivide={predivide:g} {planned} | {layout}"
    checked = _CHECKED.setdefault(compression, set())
    if config not in checked:
        collectives.check_same_config(config, process_set)
        checked.add(config)
    auto = find_auto(e[2] for e in entries)
    if auto is not None and not tf.executing_eagerly():
        raise ValueError(
            f"compression={auto.spec!r} chooses a compressor per bucket between steps, "
            "in Python: it needs eager execution. A tf.function (and Keras' compiled "
            "train step) would fix the choice when traced; run eagerly (Keras: "
            "model.compile(..., run_eagerly=True)) or choose a fixed compressor.")
    driver = Driver(collectives.HorovodTF(process_set), counted,
                    average=op == hvd.Average, auto=auto,
                    hierarchy=collectives.hierarchy([e[2] for e in entries], process_set))
    driver.backward_done()

    def local(i):                      # dense, divided by the predivide factor
        g = _dense(grads[i])
        return g if predivide == 1.0 else g / tf.cast(predivide, g.dtype)

    out = list(grads)
    for bucket in plan:
        present = [i for i in bucket if grads[i] is not None]
        if not present:
            continue
        # a variable without a gradient (None, as Horovod returns it) is left out of
        # its bucket for this step: its residual waits, as tensor by tensor
        compressor = entries[present[0]][2]
        lay = buckets.layout([names[i] for i in present], [entries[i][1] for i in present])
        if len(present) == 1 and auto is None:
            ex = driver.launch(compressor, lay, tensor=local(present[0]))
            out[present[0]] = driver.finish([ex])[0]
            continue
        # auto: every bucket on the bucket path, keyed by the planned bucket's tensors
        key = buckets.layout([names[i] for i in bucket], [entries[i][1] for i in bucket]).key
        flat = tf_ops.concat([tf.reshape(local(i), [-1]) for i in present])
        ex = driver.launch(compressor, lay, flat=flat, key=key)
        for i, r in zip(present, lay.split(driver.finish([ex])[0], tf_ops)):
            out[i] = r
    driver.end_step()
    for i, g in enumerate(grads):
        if g is None:
            continue
        if predivide != 1.0:
            out[i] = out[i] * tf.cast(predivide, out[i].dtype)
        if isinstance(g, tf.IndexedSlices) and not sparse_as_dense:
            out[i] = surface.as_slices(out[i], g)
    return out


def _dense(grad):
    return tf.convert_to_tensor(grad) if isinstance(grad, tf.IndexedSlices) else grad
