"""The compressor's side of an Elastic Horovod state, written once for both glue layers
(:mod:`hvd_compress.torch.elastic`, :mod:`hvd_compress.tensorflow.elastic`).

* ``save`` (at ``commit()``, every rank): a copy of *this rank's* error-feedback
  residuals and counters, and every rank's residual norm (one small allgather);
* ``restore`` (after a failure): the copy back, each rank its own;
* ``sync`` (after every reset, every rank of the new world): rank 0's counters (random-k
  draws, ``agg=leader``'s rotation) for everyone, and the norm of the residuals that went
  with the lost ranks, printed on rank 0.

Imports: the standard library, ``hvd_compress.log``, ``hvd_compress.memory``.
"""
import copy

from .log import info_rank0
from .memory import lost_residual_norm, residual_norm

COUNTER_PREFIXES = ("step/", "agg/")    #: state keys that must agree between ranks


class CompressionCommit:
    """``hvd``: ``horovod.torch`` or ``horovod.tensorflow`` (rank, allgather_object,
    broadcast_object); ``framework``: "torch" or "tensorflow" (for load_state_dict)."""

    def __init__(self, compression, hvd, framework):
        self.compression, self._hvd, self._framework = compression, hvd, framework
        #: L2 norm of the residuals lost with lost workers (at the last commit), summed
        self.lost_residual_norm = 0.0
        self._norms, self._rank, self._restored = {}, None, False
        self.snapshot()

    def snapshot(self):
        """Copy this rank's state (no collective), without the rank it records: a reset
        may number this process otherwise before :meth:`restore` gives it back."""
        self._saved = _unranked(copy.deepcopy(self.compression.state_dict()))

    def save(self):
        self.snapshot()
        self._rank = self._hvd.rank()
        self._norms = dict(self._hvd.allgather_object((self._rank, residual_norm(self._saved)),
                                                      name="hvd_compress.elastic_norms"))

    def restore(self):
        self.compression.load_state_dict(copy.deepcopy(self._saved), self._framework,
                                         strict=False)
        self._restored = True

    def sync(self):
        """Agree the counters, then account for the lost ranks; returns the lost norm."""
        members = self.compression.compressors()
        states = [c.state_dict() for c in members]
        counters = [{k: v for k, v in s["state"].items() if k.startswith(COUNTER_PREFIXES)}
                    for s in states]
        agreed = self._hvd.broadcast_object(counters, root_rank=0,
                                            name="hvd_compress.elastic_counters")
        for c, state, mine, theirs in zip(members, states, counters, agreed):
            if set(mine) != set(theirs) or any(int(mine[k]) != int(theirs[k]) for k in mine):
                state["state"].update(theirs)
                c.load_state_dict(state, self._framework, strict=False)
        here = self._hvd.allgather_object(self._rank if self._restored else None,
                                          name="hvd_compress.elastic_survivors")
        lost = 0.0
        if self._restored and self._norms:
            lost = lost_residual_norm(self._norms, here)
            self.lost_residual_norm += lost
            if lost:
                gone = len(self._norms) - len([r for r in here if r is not None])
                # (what the residuals hold: gradients, or updates where the optimizer
                # exchanges them, compressed_update=True)
                info_rank0(self._hvd.rank(), f"hvd_compress: {gone} worker(s) lost; what "
                           "they had not sent yet (their error-feedback residuals at the "
                           f"last commit) had L2 norm {lost:.6g}")
        self._restored = False
        return lost


def _unranked(state_dict):
    """``state_dict`` (a compressor's, a Policy's of its members') without ``"rank"``."""
    out = {k: v for k, v in state_dict.items() if k != "rank"}
    if isinstance(out.get("state"), list):
        out["state"] = [_unranked(s) for s in out["state"]]
    return out
