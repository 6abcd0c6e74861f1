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
* with ``compressed_update=True`` each rank's optimizer state (AdamW's ``m_i, v_i``) is
  its own gradients' (:mod:`hvd_compress.torch.compressed_update`), like its residuals:
  ``sync`` leaves a rank that has one with its own, where Horovod's handler gives every
  rank rank 0's; a rank that joins (no state yet) takes rank 0's.  It logs the learning
  rate measured best for the new number of ranks (``learning_rate_hint``); the
  optimizer's own rate stays as it is (a reset callback may change it).
* an empty optimizer state (a rank that joins; every rank at the first sync) is made by
  Horovod's ``broadcast_optimizer_state`` with a step on zero gradients, which moves the
  parameters just broadcast when the optimizer decays weights (AdamW): the new rank's
  parameters then differed from the others' for the rest of the run.  ``sync`` puts the
  parameters back after that step.

A lost worker's residual is lost with it, like its in-flight gradient: that part of its
past gradients was never sent.  Every commit shares each rank's residual norm (one small
allgather), so after a loss rank 0 prints the norm of what the lost workers had not sent
at the last commit, and ``opt.stats.lost_residual_norm`` adds it up.  ``opt.stats`` go
on counting across resets.
"""
import copy

import horovod.torch as hvd
import torch
from horovod.torch.elastic.state import (OptimizerStateHandler, get_handler_registry,
                                         set_handler_registry)

from ..elastic import CompressionCommit
from ..strategies.momentum import learning_rate_hint


class CompressedOptimizerStateHandler(OptimizerStateHandler):
    """Horovod's optimizer state handler plus the compressor's per-rank state
    (:class:`hvd_compress.elastic.CompressionCommit`)."""

    def __init__(self, optimizer):
        super().__init__(optimizer)
        self._commit = CompressionCommit(optimizer.compression, hvd, "torch")
        self._ranks = hvd.size()        #: the world the learning-rate hint was logged for

    def save(self):
        super().save()
        self._commit.save()

    def restore(self):
        self.value.drop_in_flight()
        super().restore()
        self._commit.restore()

    def sync(self):
        opt = self.value
        opt.drop_in_flight()
        own = _own_state(opt)
        # an empty state is initialised by a step on zero gradients, which moves the
        # parameters that were just broadcast (weight decay): put them back after it
        params = [(p, p.detach().clone()) for p in opt._params] if not opt.state else []
        super().sync()              # rank 0's optimizer state (no compressed step: see
        #                             DistributedOptimizer, broadcast_optimizer_state)
        with torch.no_grad():
            for p, before in params:
                p.copy_(before)
        if own is not None:
            opt.load_state_dict(own)
        if opt._update is not None and hvd.size() != self._ranks:   # the rate measured
            learning_rate_hint(opt.compression, hvd.size())            # best changed too
        self._ranks = hvd.size()
        opt.stats.lost_residual_norm += self._commit.sync()


def _own_state(optimizer):
    """A copy of the optimizer state to keep through ``sync``: this rank's, when it runs
    compressed updates and has one; else None (Horovod's broadcast writes in place)."""
    if optimizer._update is None or not optimizer.state:
        return None
    return copy.deepcopy(optimizer.state_dict())


def register():
    """Put the handler first in Horovod's registry (idempotent)."""
    from .optimizer import CompressedOptimizer
    registry = [(t, h) for t, h in get_handler_registry() if h is not CompressedOptimizerStateHandler]
    set_handler_registry([(CompressedOptimizer, CompressedOptimizerStateHandler)] + registry)
