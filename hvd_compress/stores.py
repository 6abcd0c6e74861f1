"""Where compressors keep their state: a store of named tensors per framework (a dict
of tensors for PyTorch, of ``tf.Variable`` for TensorFlow, so updates work inside
``tf.function``), and the :class:`Journal` that lets a step's writes be undone.
Error feedback's residuals (:mod:`hvd_compress.memory`) are one kind of what they hold.
``state_dict()`` returns copies; ``load_state_dict()`` restores them bit for bit.

Imports: the standard library, numpy; on first use, torch, TensorFlow.
"""
import operator

import numpy as np

RESIDUAL_PREFIX = "residual/"      #: the keys of error feedback's residuals


def _residual_keys(state):
    return frozenset(k for k in state if k.startswith(RESIDUAL_PREFIX))


class Journal:
    """What a step wrote into state stores, so that the step can be undone.

    A glue that may have to drop a step after its exchange (the aggregate had NaN/Inf:
    compressed-momentum Adam skips the step as a GradScaler would) attaches a journal to
    its compressor (``compressor.attach_journal(journal)``); every store then records,
    the first time a key is written in the step, what it takes to restore it (PyTorch: a
    reference, since stores replace tensors, and a copy of the few written in place:
    :meth:`TorchStore.keep`; TensorFlow: a copy of the variable's value).
    ``rollback()`` puts every key back, bit for bit; ``clear()`` starts the next step.
    """

    def __init__(self):
        self.entries = {}        # (id(store), table, key) -> (store, table, key, token)

    def record(self, store, table, key, token=None):
        """Note what restores ``key`` (``token``: given; else ``store.snapshot``), the
        first time it is written in the step."""
        mark = (id(store), table, key)
        if mark not in self.entries:
            self.entries[mark] = (store, table, key, store.snapshot(table, key)
                                  if token is None else token)

    def recorded(self, store, table, key):
        """Whether ``key`` was written this step (what restores it is noted)."""
        return (id(store), table, key) in self.entries

    def rollback(self):
        """Every recorded key back to the value it had when first written this step."""
        for store, table, key, token in self.entries.values():
            store.restore(table, key, token)
        self.entries = {}

    def clear(self):
        self.entries = {}


class TorchStore:
    """Named state tensors for PyTorch."""

    loaded = frozenset()     #: the residual keys of the last load_state_dict
    journal = None           #: a :class:`Journal` recording this step's writes, or None

    def __init__(self):
        self._tensors = {}
        self._spares = {}
        self.buckets = {}        #: scratch of ResidualMemory: parts -> (keys, views, base)

    def _record(self, table, key):
        if self.journal is not None:
            self.journal.record(self, table, key)

    def snapshot(self, table, key):
        """For a :class:`Journal`: (had it, its tensor)."""
        values = getattr(self, table)
        return key in values, values.get(key)

    def restore(self, table, key, token):
        had, old = token
        values = getattr(self, table)
        if had:
            values[key] = old
        else:
            values.pop(key, None)

    def tables(self):
        """Shallow copies of what the store holds (tensors, spares, bucket scratch), for
        :meth:`set_tables` to put back (a failed CUDA-graph capture: compressors/replay.py)."""
        return dict(self._tensors), dict(self._spares), dict(self.buckets)

    def set_tables(self, tables):
        """Hold what :meth:`tables` returned, again."""
        for mine, held in zip((self._tensors, self._spares, self.buckets), tables):
            mine.clear()
            mine.update(held)

    def get(self, key, init):
        """Current value of ``key``; ``init()`` creates it the first time."""
        if key not in self._tensors:
            self._record("_tensors", key)
            self._tensors[key] = init()
        return self._tensors[key]

    def set(self, key, value):
        self._record("_tensors", key)
        self._tensors[key] = value

    def keep(self, key):
        """Before a write *into* the tensor of ``key`` (the one kind of state kept in place:
        a search's warm brackets, whose address a CUDA graph holds): a journal, if any,
        records a copy of its value, not the tensor.  Returns the tensor (None if absent)."""
        value, journal = self._tensors.get(key), self.journal
        if journal is not None and value is not None and not journal.recorded(
                self, "_tensors", key):
            journal.record(self, "_tensors", key, (True, value.clone()))
        return value

    def pin(self, key, tensor):
        """Hold ``key``'s value in ``tensor`` (a CUDA graph's copy of it), copied there
        where the store holds another tensor (restored, rolled back): the same value."""
        value = self._tensors.get(key)
        if value is not None and value is not tensor:
            tensor.copy_(value)
            self._tensors[key] = tensor

    def set_many(self, keys, values):
        """:meth:`set` for each pair of ``keys`` and ``values``."""
        if self.journal is not None:
            for key in keys:
                self._record("_tensors", key)
        self._tensors.update(zip(keys, values))

    def holds(self, keys, values):
        """Whether ``keys`` hold exactly the objects ``values`` (identity, not equality)."""
        held = self._tensors.get
        return all(map(operator.is_, map(held, keys), values))

    def pop(self, key):
        """Remove ``key``; its value (None if absent)."""
        self._record("_tensors", key)
        self.buckets.clear()
        return self._tensors.pop(key, None)

    def keys(self):
        return list(self._tensors)

    def spare(self, key, like):
        """A reusable buffer shaped like ``like``; scratch space, not state (not saved)."""
        buf = self._spares.get(key)
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype \
                or buf.device != like.device:
            import torch
            self._record("_spares", key)
            buf = self._spares[key] = torch.empty_like(like)
        return buf

    def set_spare(self, key, value):
        self._record("_spares", key)
        self._spares[key] = value

    def next_count(self, key):
        """Return the counter ``key`` (from 0) and increment it.  Held as a Python int (a
        tensor after :meth:`load_state_dict`, read once), so that counting a bucket's
        tensors costs no tensor op per tensor; :meth:`state_dict` gives int64 tensors."""
        return self.next_counts([key])[0]

    def next_counts(self, keys):
        """:meth:`next_count` of each of ``keys``, a list."""
        values = [int(self._tensors.get(key, 0)) for key in keys]
        self.set_many(keys, [v + 1 for v in values])
        return values

    def state_dict(self):
        import torch
        return {k: v.detach().clone() if hasattr(v, "detach")
                else torch.tensor(v, dtype=torch.int64) for k, v in self._tensors.items()}

    def load_state_dict(self, state):
        import torch
        self._tensors = {k: torch.as_tensor(v).clone() for k, v in state.items()}
        self.buckets.clear()
        self.loaded = _residual_keys(state)


class TFStore:
    """Named state ``tf.Variable``s for TensorFlow, created outside any graph."""

    loaded = frozenset()     #: the residual keys of the last load_state_dict
    journal = None           #: a :class:`Journal` recording this step's writes (eager)

    def __init__(self):
        self._vars = {}
        self._inits = {}

    def _record(self, key):
        if self.journal is not None:
            self.journal.record(self, "_vars", key)

    def snapshot(self, table, key):
        """For a :class:`Journal` (eager): a copy of the variable's value, or None."""
        var = self._vars.get(key)
        return None if var is None else var.read_value() + 0

    def restore(self, table, key, token):
        var = self._vars.get(key)
        if var is None:
            return
        var.assign(self._inits[key]() if token is None else token)

    def get(self, key, init):
        import tensorflow as tf
        self._inits.setdefault(key, init)
        if key not in self._vars:
            self._record(key)
            with tf.init_scope():
                self._vars[key] = tf.Variable(init(), trainable=False,
                                              name="hvd_compress_state")
        return self._vars[key]

    def set(self, key, value):
        self._record(key)
        self._vars[key].assign(value)

    def pop(self, key):
        """Remove ``key`` (eager only: a graph that captured it keeps the variable);
        its value (None if absent)."""
        self._inits.pop(key, None)
        var = self._vars.pop(key, None)
        return None if var is None else var.read_value()

    def keys(self):
        return list(self._vars)

    def next_count(self, key):
        """Return the counter ``key`` (from 0) and increment it (graph-safe)."""
        import tensorflow as tf
        var = self.get(key, lambda: tf.zeros((), dtype=tf.int64))
        value = var.read_value()
        self._record(key)
        var.assign_add(1)
        return value

    def next_counts(self, keys):
        """:meth:`next_count` of each of ``keys``, a list."""
        return [self.next_count(key) for key in keys]

    def state_dict(self):
        return {k: v.numpy().copy() for k, v in self._vars.items()}

    def load_state_dict(self, state):
        """Variables keep their identity (graphs that captured them stay valid): values
        are assigned; a variable the state does not have goes back to its initial value."""
        import tensorflow as tf
        self.loaded = _residual_keys(state)
        for k, var in self._vars.items():
            if k not in state and k in self._inits:
                var.assign(self._inits[k]())
        for k, v in state.items():
            value = v.numpy() if hasattr(v, "numpy") else v
            if k in self._vars:
                if tuple(self._vars[k].shape) != tuple(np.shape(value)):
                    raise ValueError(f"state {k!r} has shape {tuple(np.shape(value))}, but this "
                                     f"compressor's is {tuple(self._vars[k].shape)}: the state_dict "
                                     "was saved for another model or configuration")
                self._vars[k].assign(value)
            else:
                with tf.init_scope():
                    self._vars[k] = tf.Variable(value, trainable=False,
                                                name="hvd_compress_state")
