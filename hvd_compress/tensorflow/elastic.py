"""Elastic Horovod for a TensorFlow custom loop with ``DistributedGradientTape``.

    state = hvd_compress.tensorflow.ElasticState(model.variables, compression=spec,
                                                 optimizer=opt, step=0)
    @hvd_compress.tensorflow.elastic.run   # in place of hvd.elastic.run (see run())
    def train(state): ...; state.commit()

Horovod's ``hvd.elastic.TensorFlowState`` fails on Keras 3 model variables and knows
nothing of error feedback; :class:`ElasticState` takes its place:

* ``commit()`` snapshots the variables (tf.Variable or Keras 3), the optimizer's
  variables, and *this rank's* error-feedback residuals and counters (a Keras
  optimizer not built yet is built here, on the trainable ones among ``variables``, so
  that every rank, a joining one too, has the same variables at every sync);
* a restore (after a failure) brings all of them back to the commit, each rank its own
  residuals;
* ``sync`` (after every reset) broadcasts rank 0's variables and the counters that must
  agree (random-k draws, ``agg=leader``'s rotation); residuals stay per rank, a rank that
  joins starts with none; the configuration check runs again in the new world.  With
  ``hvd_compress.keras.DistributedOptimizer(..., compressed_update=True)`` a rank that
  has stepped keeps its own optimizer variables (its moments are its own gradients',
  like its residuals); a rank that joins takes rank 0's.

A lost worker's residual is lost with it (the part of its gradients it had not sent):
every commit shares each rank's residual norm (one small allgather), so after a loss
rank 0 prints the norm of what the lost workers had not sent at the last commit, and
``state.lost_residual_norm`` adds it up.

Imports: numpy, Horovod, ``hvd_compress.elastic``; on first use, TensorFlow; and modules
of its own package.
"""
import horovod.tensorflow as hvd
import numpy as np
from horovod.common.elastic import ObjectState

from ..elastic import CompressionCommit
from . import tape as _tape
from .collectives import resolve_cached


class ElasticState(ObjectState):
    """Elastic state of ``variables`` (and ``optimizer.variables``) plus the compressor's
    per-rank state (:class:`hvd_compress.elastic.CompressionCommit`); ``kwargs`` are plain
    attributes synchronised from rank 0, as in Horovod's states (e.g. ``step=0``)."""

    def __init__(self, variables, compression=None, optimizer=None, **kwargs):
        self._model_variables = list(variables)
        self._optimizer = optimizer
        if optimizer is not None and not getattr(optimizer, "built", True):
            # a Keras optimizer makes its variables at its first step: a rank that joins
            # later would broadcast fewer of them than rank 0 at the sync (measured: the
            # job failed with "Mismatched data types"); so build it here, on every rank
            optimizer.build([v for v in self._model_variables if getattr(v, "trainable", True)])
        self.compression = resolve_cached(compression)
        self._commit = CompressionCommit(self.compression, hvd, "tensorflow")
        self._save_values()
        super().__init__(bcast_object=hvd.broadcast_object, get_rank=hvd.rank, **kwargs)

    @property
    def lost_residual_norm(self):
        """L2 norm of the residuals lost with lost workers (at the last commit), summed."""
        return self._commit.lost_residual_norm

    def _variables(self):
        extra = list(self._optimizer.variables) if self._optimizer is not None else []
        return self._model_variables + extra

    def _save_values(self):
        self._values = [np.array(v.numpy(), copy=True) for v in self._variables()]

    def _own_optimizer_values(self):
        """``(variable, value)`` of the optimizer to keep through ``sync``: this rank's,
        when its optimizer runs compressed updates (its moments are its own gradients')
        and it has stepped; else none (a rank that joins takes rank 0's)."""
        opt = self._optimizer
        if getattr(opt, "_hvd_update", None) is None or int(opt.iterations.numpy()) == 0:
            return []
        return [(v, np.array(v.numpy(), copy=True)) for v in opt.variables]

    def save(self):
        self._save_values()
        self._commit.save()
        super().save()

    def restore(self):
        for v, value in zip(self._variables(), self._values):
            v.assign(value)
        self._commit.restore()
        super().restore()

    def sync(self):
        own = self._own_optimizer_values()
        for i, v in enumerate(self._variables()):
            v.assign(hvd.broadcast(v.value() if hasattr(v, "value") and callable(v.value)
                                   else v, root_rank=0, name=f"hvd_compress.elastic.var{i}"))
        for v, value in own:
            v.assign(value)
        self._commit.sync()
        _tape._CHECKED.pop(self.compression, None)     # check the configuration again
        self._save_values()
        self._commit.snapshot()
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
