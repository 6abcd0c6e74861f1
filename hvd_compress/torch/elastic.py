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
import copy

import horovod.torch as hvd
from horovod.torch.elastic.state import (OptimizerStateHandler, get_handler_registry,
                                         set_handler_registry)

from ..memory import lost_residual_norm, residual_norm

COUNTER_PREFIXES = ("step/", "agg/")    #: state keys that must agree between ranks


class CompressedOptimizerStateHandler(OptimizerStateHandler):
    """Horovod's optimizer state handler plus the compressor's per-rank state."""

    def __init__(self, optimizer):
        super().__init__(optimizer)
        self._saved_compression = copy.deepcopy(optimizer.compression.state_dict())
        self._norms, self._rank, self._restored = {}, None, False

    def save(self):
        """At ``commit()`` (every rank): a copy of the state, and every rank's residual
        norm (one small allgather), so that a lost rank's can be reported."""
        super().save()
        self._saved_compression = copy.deepcopy(self.value.compression.state_dict())
        self._rank = hvd.rank()
        norms = hvd.allgather_object((self._rank, residual_norm(self._saved_compression)),
                                     name="hvd_compress.elastic_norms")
        self._norms = dict(norms)

    def restore(self):
        self.value.drop_in_flight()
        super().restore()
        self.value.compression.load_state_dict(copy.deepcopy(self._saved_compression),
                                               strict=False)
        self._restored = True

    def sync(self):
        self.value.drop_in_flight()
        super().sync()              # rank 0's optimizer state (no compressed step: see
        #                             DistributedOptimizer, broadcast_optimizer_state)
        here = hvd.allgather_object(self._rank if self._restored else None,
                                    name="hvd_compress.elastic_survivors")
        if self._restored and self._norms:
            lost = lost_residual_norm(self._norms, here)
            self.value.stats.lost_residual_norm += lost
            if hvd.rank() == 0 and lost:
                print(f"hvd_compress: {len(self._norms) - len([r for r in here if r is not None])}"
                      f" worker(s) lost; the gradient they had not sent yet (their error-feedback"
                      f" residuals at the last commit) had L2 norm {lost:.6g}", flush=True)
        self._restored = False
        compression = self.value.compression
        members = compression.compressors() if hasattr(compression, "compressors") \
            else [compression]
        states = [c.state_dict() for c in members]
        counters = [{k: v for k, v in s["state"].items() if k.startswith(COUNTER_PREFIXES)}
                    for s in states]
        agreed = hvd.broadcast_object(counters, root_rank=0,
                                      name="hvd_compress.elastic_counters")
        for c, state, mine, theirs in zip(members, states, counters, agreed):
            if set(mine) != set(theirs) or any(int(mine[k]) != int(theirs[k]) for k in mine):
                state["state"].update(theirs)
                c.load_state_dict(state, strict=False)


def register():
    """Put the handler first in Horovod's registry (idempotent)."""
    from .optimizer import CompressedOptimizer
    registry = [(t, h) for t, h in get_handler_registry() if h is not CompressedOptimizerStateHandler]
    set_handler_registry([(CompressedOptimizer, CompressedOptimizerStateHandler)] + registry)
