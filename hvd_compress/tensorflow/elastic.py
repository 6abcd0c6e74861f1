"""Elastic Horovod for a TensorFlow custom loop with ``DistributedGradientTape``.

    state = hvd_compress.tensorflow.ElasticState(model.variables, compression=spec,
                                                 optimizer=opt, step=0)
    @hvd_compress.tensorflow.elastic.run   # in place of hvd.elastic.run (see run())
    def train(state): ...; state.commit()

Horovod's ``hvd.elastic.TensorFlowState`` fails on Keras 3 model variables and knows
nothing of error feedback; :class:`ElasticState` takes its place:

* ``commit()`` snapshots the variables (tf.Variable or Keras 3), the optimizer's
  variables, and *this rank's* error-feedback residuals and counters;
* a restore (after a failure) brings all of them back to the commit, each rank its own
  residuals;
* ``sync`` (after every reset) broadcasts rank 0's variables and the counters that must
  agree (random-k draws, ``agg=leader``'s rotation); residuals stay per rank, a rank that
  joins starts with none; the configuration check runs again in the new world.

A lost worker's residual is lost with it (the part of its gradients it had not sent):
every commit shares each rank's residual norm (one small allgather), so after a loss
rank 0 prints the norm of what the lost workers had not sent at the last commit, and
``state.lost_residual_norm`` adds it up.
"""
import copy

import horovod.tensorflow as hvd
import numpy as np
from horovod.common.elastic import ObjectState

from ..memory import lost_residual_norm, residual_norm
from . import tape as _tape
from .collectives import resolve_cached

COUNTER_PREFIXES = ("step/", "agg/")


def _members(compression):
    return compression.compressors() if hasattr(compression, "compressors") else [compression]


class ElasticState(ObjectState):
    """Elastic state of ``variables`` (and ``optimizer.variables``) plus the compressor's
    per-rank state; ``kwargs`` are plain attributes synchronised from rank 0, as in
    Horovod's states (e.g. ``step=0``)."""

    def __init__(self, variables, compression=None, optimizer=None, **kwargs):
        self._model_variables = list(variables)
        self._optimizer = optimizer
        self.compression = resolve_cached(compression)
        #: L2 norm of the residuals lost with lost workers (at the last commit), summed
        self.lost_residual_norm = 0.0
        self._norms, self._rank, self._restored = {}, None, False
        self._save_tensors()
        super().__init__(bcast_object=hvd.broadcast_object, get_rank=hvd.rank, **kwargs)

    def _variables(self):
        extra = list(self._optimizer.variables) if self._optimizer is not None else []
        return self._model_variables + extra

    def _save_tensors(self):
        self._values = [np.array(v.numpy(), copy=True) for v in self._variables()]
        self._compression_state = copy.deepcopy(self.compression.state_dict())

    def save(self):
        """At ``commit()`` (every rank): copies, and every rank's residual norm (one small
        allgather), so that a lost rank's can be reported."""
        self._save_tensors()
        self._rank = hvd.rank()
        self._norms = dict(hvd.allgather_object((self._rank, residual_norm(self._compression_state)),
                                                name="hvd_compress.elastic_norms"))
        super().save()

    def restore(self):
        for v, value in zip(self._variables(), self._values):
            v.assign(value)
        self.compression.load_state_dict(copy.deepcopy(self._compression_state), "tensorflow",
                                         strict=False)
        self._restored = True
        super().restore()

    def sync(self):
        for i, v in enumerate(self._variables()):
            v.assign(hvd.broadcast(v.value() if hasattr(v, "value") and callable(v.value)
                                   else v, root_rank=0, name=f"hvd_compress.elastic.var{i}"))
        members = _members(self.compression)
        states = [c.state_dict() for c in members]
        counters = [{k: np.asarray(v) for k, v in s["state"].items()
                     if k.startswith(COUNTER_PREFIXES)} for s in states]
        agreed = hvd.broadcast_object(counters, root_rank=0,
                                      name="hvd_compress.elastic_counters")
        for c, state, mine, theirs in zip(members, states, counters, agreed):
            if set(mine) != set(theirs) or any(int(mine[k]) != int(theirs[k]) for k in mine):
                state["state"].update(theirs)
                c.load_state_dict(state, "tensorflow", strict=False)
        here = hvd.allgather_object(self._rank if self._restored else None,
                                    name="hvd_compress.elastic_survivors")
        if self._restored and self._norms:
            lost = lost_residual_norm(self._norms, here)
            self.lost_residual_norm += lost
            if hvd.rank() == 0 and lost:
                print(f"hvd_compress: {len(self._norms) - len([r for r in here if r is not None])}"
                      " worker(s) lost; the gradient they had not sent yet (their error-feedback"
                      f" residuals at the last commit) had L2 norm {lost:.6g}", flush=True)
        self._restored = False
        _tape._CHECKED.pop(self.compression, None)     # check the configuration again
        self._save_tensors()
        super().sync()


def run(func):
    """``hvd.elastic.run`` for TensorFlow, for hvd_compress's collectives: Horovod's
    decorator turns only errors of its allreduce, allgather and broadcast ops into a
    reset, and *returns silently* on any other UnknownError, such as a failed grouped
    allgather (the bucketed exchange): training would just stop.  Here every error of a
    Horovod op resets, and any other error is raised."""
    from horovod.common.elastic import run_fn
    from horovod.common.exceptions import HorovodInternalError
    from horovod.tensorflow.elastic import _reset
    from tensorflow.python.framework.errors_impl import UnknownError

    def wrapper(state, *args, **kwargs):
        try:
            return func(state, *args, **kwargs)
        except UnknownError as e:
            if "Horovod" in (e.message or ""):
                raise HorovodInternalError(e) from e
            raise
    return run_fn(wrapper, _reset)
