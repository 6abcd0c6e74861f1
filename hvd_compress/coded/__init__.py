"""Coded synchronous SGD (CSSGD, seed 003): trade computation for communication.

Li, Xie, Mao, Xu, Zhu, Zhang, "Coded synchronous stochastic gradient descent"
(Hohai University).  With ``n`` workers and redundancy ``r`` every mini-batch is cut
into ``C(n, r)`` parts, each computed on ``r`` workers (:mod:`.placement`); the part
gradients travel as exact int32 fixed point, coded so that one packet serves ``r``
receivers (:mod:`.exchange`).  The paper models a batch's time as
``r·T_calc + T_comm/r``; on point-to-point TCP (no multicast) the bytes on the wire
grow as ``C(n−1, r)`` instead (see the README and benchmarks/cssgd.py).

- :func:`placement`, :class:`CodedBatchSampler`: who computes what.
- :class:`CodedExchange`: the exchange, written once (``multicast``: the paper's
  algorithms 3 and 4, one process set per group; ``multicast_alltoall``: the same
  packets in one alltoall; ``reduce_scatter``: the coding idea on Gloo's point-to-point
  transport; ``allreduce``: uncoded SSGD).
- ``DistributedOptimizer`` (PyTorch, :mod:`hvd_compress.torch.coded`) and
  ``CodedGradients`` (TensorFlow, :mod:`hvd_compress.tensorflow.coded`), imported on
  first use so that this package needs neither framework.
- :func:`process_sets`: the Horovod process sets of the groups, for ``hvd.init``.
"""
from .exchange import DEFAULT_RANGE, EXCHANGES, CodedExchange
from .placement import CodedBatchSampler, Placement, placement
from .process_sets import process_sets

# (DistributedOptimizer and CodedGradients load a framework: not in ``import *``)
__all__ = ["CodedBatchSampler", "CodedExchange", "DEFAULT_RANGE", "EXCHANGES", "Placement",
           "placement", "process_sets"]


def __getattr__(name):
    if name == "DistributedOptimizer":
        from ..torch.coded import DistributedOptimizer
        return DistributedOptimizer
    if name == "CodedGradients":
        from ..tensorflow.coded import CodedGradients
        return CodedGradients
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
