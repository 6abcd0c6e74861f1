"""Elastic Horovod with hvd_compress: the user's code stays Horovod's.

    state = hvd.elastic.TorchState(model=model, optimizer=opt, epoch=0)   # opt: ours
    @hvd.elastic.run
    def train(state): ...; state.commit()

``import hvd_compress.torch`` registers :class:`CompressedOptimizerStateHandler` in
Horovod's elastic handler registry (``horovod.torch.elastic.state.set_handler_registry``,
Horovod's own extension point) for optimizers made by
``hvd_compress.torch.DistributedOptimizer``.  What it does beyond Horovod's optimizer
handler:

* ``commit()`` (``save``) also snapshots *this rank's* error-feedback residuals and
  counters (``compression.state_dict()``, a copy);
* a restore (after a failure, on every surviving rank) drops the collectives still in
  flight from the failed step, and brings the residuals and counters back to the
  commit: each rank its own, never another rank's.  A residual that was updated by the
  failed step would otherwise count that step's unsent gradient twice, once restored
  parameters replay it;
* ``sync`` (after every reset, for the new world) agrees the counters that must be equal
  on every rank (random-k draws, the leader rotation of ``agg=leader``): rank 0's are
  broadcast; residuals stay per rank, and a rank that joins starts with none (zero);
  the configuration check runs again at the next step.

A lost worker's residual is lost with it, like its in-flight gradient: that part of its
past gradients was never sent.  Every commit shares each rank's residual norm (one small
allgather), so after a loss rank 0 prints the norm of what the lost workers had not sent
at the last commit, and ``opt.stats.lost_residual_norm`` adds it up.  ``opt.stats`` go
on counting across resets.
"""
import horovod.torch as hvd
from horovod.torch.elastic.state import (OptimizerStateHandler, get_handler_registry,
                                         set_handler_registry)

from ..elastic import CompressionCommit


class CompressedOptimizerStateHandler(OptimizerStateHandler):
    """Horovod's optimizer state handler plus the compressor's per-rank state
    (:class:`hvd_compress.elastic.CompressionCommit`)."""

    def __init__(self, optimizer):
        super().__init__(optimizer)
        self._commit = CompressionCommit(optimizer.compression, hvd, "torch")

    def save(self):
        super().save()
        self._commit.save()

    def restore(self):
        self.value.drop_in_flight()
        super().restore()
        self._commit.restore()

    def sync(self):
        self.value.drop_in_flight()
        super().sync()              # rank 0's optimizer state (no compressed step: see
        #                             DistributedOptimizer, broadcast_optimizer_state)
        self.value.stats.lost_residual_norm += self._commit.sync()


def register():
    """Put the handler first in Horovod's registry (idempotent)."""
    from .optimizer import CompressedOptimizer
    registry = [(t, h) for t, h in get_handler_registry() if h is not CompressedOptimizerStateHandler]
    set_handler_registry([(CompressedOptimizer, CompressedOptimizerStateHandler)] + registry)
