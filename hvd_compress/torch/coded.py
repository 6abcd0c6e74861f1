"""PyTorch glue for coded synchronous SGD (:mod:`hvd_compress.coded`).

    opt = hvd_compress.coded.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
        batch_size=B, redundancy=2)
    sampler = hvd_compress.coded.CodedBatchSampler(len(data), B, hvd.size(), hvd.rank(), 2)
    for idx in sampler:                     # this worker's parts of one global mini-batch
        opt.zero_grad()
        loss = opt.backward(lambda x, y: F.cross_entropy(model(x), y), x_all[idx], y_all[idx])
        opt.step()                          # coded exchange, then the wrapped step

``backward`` runs one forward/backward per part this worker holds (``C(n−1, r−1)`` of
them, ``B/C(n, r)`` samples each), scaling each part's mean loss by its share of the
global mini-batch, so the exchanged sum is the gradient of the mean loss over ``B``.

Imports: the standard library, torch, Horovod, ``hvd_compress.coded``,
``hvd_compress.ops``.
"""
import time

import horovod.torch as hvd
import torch

from ..coded.collectives import CodedWorker
from ..coded.exchange import DEFAULT_RANGE
from ..ops import torch_ops

class DistributedOptimizer(CodedWorker):
    """Wraps ``optimizer``: :meth:`backward` computes this worker's part gradients,
    :meth:`step` exchanges them (``exchange=`` ``multicast``, ``multicast_alltoall``,
    ``reduce_scatter`` or ``allreduce``; see :mod:`hvd_compress.coded.exchange`), writes
    the global gradient of the mini-batch into ``p.grad`` and steps the wrapped optimizer.
    To change the gradients before the step (clipping), call :meth:`synchronize`, change
    ``p.grad``, then :meth:`step` (it does not exchange again).

    ``batch_size`` is the *global* mini-batch; ``redundancy`` r in [1, hvd.size()];
    ``value_range`` R of the int32 fixed point (entries beyond ±R are clipped and
    counted in :attr:`stats`).  The r replicas of a part must compute the same bits:
    each part's forward/backward runs with torch's RNG seeded from (``seed``, step,
    part), so dropout draws the same masks on every replica; ``verify`` (default on)
    compares a checksum of the decoded total between ranks every step and raises on every
    rank if replicas still differed.  ``opt.stats`` holds bytes sent/received per step,
    what Horovod's ring allreduce would move, clip counts and the seconds spent
    computing, encoding, communicating and decoding.
    """

    def __init__(self, optimizer, named_parameters, batch_size, redundancy,
                 value_range=DEFAULT_RANGE, exchange="multicast", seed=0, verify=True):
        self.optimizer = optimizer
        named = list(named_parameters)
        self._params = [p for _, p in named if p.requires_grad]
        if not self._params:
            raise ValueError("named_parameters has no parameter that requires a gradient")
        numel = sum(p.numel() for p in self._params)
        self._setup(hvd, torch_ops, torch.from_numpy, numel, batch_size, redundancy,
                    value_range, exchange, verify)
        self.seed, self._steps, self._synchronized = int(seed), 0, False
        self._devices = sorted({p.device.index for p in self._params if p.is_cuda})
        self._part_grads = {}

    # the wrapped optimizer's interface
    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none=True):
        self.optimizer.zero_grad(set_to_none=set_to_none)
        self._part_grads, self._synchronized = {}, False

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state):
        self.optimizer.load_state_dict(state)

    def _flat_grad(self):
        return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p))
                          .reshape(-1).float() for p in self._params])

    def backward(self, loss_fn, *tensors):
        """Forward/backward of each of this worker's parts; ``tensors`` are either the
        whole global mini-batch or this worker's samples (a :class:`CodedBatchSampler`
        batch).  Returns the mean loss over this worker's samples (a float)."""
        self._prepare()          # first step: ranks compare configurations before any check
        start = time.perf_counter()
        if self.exchange.is_global_batch([len(t) for t in tensors], self.batch_size):
            tensors = [t[torch.from_numpy(self._positions)] for t in tensors]
        total, at = 0.0, 0
        for q, n in zip(self.exchange.my_parts, self._lengths):
            for p in self._params:
                p.grad = None
            with torch.random.fork_rng(devices=self._devices):
                # the same RNG draws (dropout) on every replica of the part
                torch.manual_seed(hash((self.seed, self._steps, q)) & 0x7FFFFFFF)
                # a fresh copy: the same memory alignment on every replica
                loss = loss_fn(*(t[at:at + n].clone() for t in tensors)) * (n / self.batch_size)
                loss.backward()
            self._part_grads[q] = self._flat_grad()
            total += float(loss.detach())
            at += n
        self.compute_s += time.perf_counter() - start
        return total * self.batch_size / len(self._positions)

    def synchronize(self):
        """Exchange the part gradients and write the global gradient into ``p.grad``."""
        if sorted(self._part_grads) != list(self.exchange.my_parts):
            raise RuntimeError("call opt.backward(loss_fn, ...) before opt.step()")
        part_grads, self._part_grads = self._part_grads, {}
        self._steps += 1
        flat = self.exchange.run(torch_ops, part_grads, self._comm)
        self._synchronized = True
        at = 0
        for p in self._params:
            p.grad = flat[at:at + p.numel()].view_as(p).to(device=p.device, dtype=p.dtype, copy=True)
            at += p.numel()

    def step(self, closure=None):
        if closure is not None:
            raise ValueError("closure is not supported: the gradients come from "
                             "opt.backward(loss_fn, ...) and the coded exchange")
        if not self._synchronized:
            self.synchronize()
        self._synchronized = False
        return self.optimizer.step()
