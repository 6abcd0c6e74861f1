"""``hvd_compress.torch.DistributedOptimizer``: Horovod's DistributedOptimizer with
compressors that may need an allgather (sparse, bit-packed payloads).

Structure follows ``horovod/torch/optimizer.py``: the wrapped optimizer's class is
subclassed on the fly; each parameter's collective is launched from a
post-accumulate-grad hook as soon as its gradient is ready (overlapping the rest of
backward), ``synchronize()`` waits for all of them and writes the aggregate into
``p.grad``, and ``step()`` synchronizes first unless already done.  Each bucket's
exchange is an :class:`hvd_compress.exchange.Exchange` started by this optimizer's
:class:`hvd_compress.exchange.Driver` over Horovod (:class:`.collectives.HorovodTorch`);
this module holds only the hooks into backward and Horovod's optimizer API.

Imports: torch, Horovod, ``hvd_compress.exchange``, ``hvd_compress.ops``,
``hvd_compress.spec``, ``hvd_compress.stats``, ``hvd_compress.buckets``,
``hvd_compress.compressors.dense``, ``hvd_compress.strategies.momentum``; and modules of
its own package.
"""
import horovod.torch as hvd
import torch

from .. import buckets
from ..compressors.dense import NoneCompressor
from ..exchange import Driver, find_auto
from ..ops import torch_ops
from ..spec import resolve
from ..stats import Stats
from . import collectives
from ..strategies.momentum import MomentumSchedule, adam_defaults
from .momentum import ADAM_FAMILY, AdamMomentum, check_dgc


class CompressedOptimizer:
    """Marks the optimizers made by :func:`DistributedOptimizer` (each is a subclass of
    the wrapped optimizer's class made on the fly, and of this)."""


class _DistributedOptimizer(torch.optim.Optimizer):
    def __init__(self, params, named_parameters, compression, backward_passes_per_step,
                 op, process_set, bucket_mb=None, compressed_momentum=None):
        super(self.__class__, self).__init__(params)
        self.compression = resolve(compression)
        schedule = MomentumSchedule.build(compressed_momentum)
        if schedule is None and isinstance(self, ADAM_FAMILY):
            adam_defaults(self.compression, type(self).__name__)
        check_dgc(self.compression, self, schedule)
        self.op = collectives.check_op(op)
        self.process_set = process_set
        if int(backward_passes_per_step) < 1:
            raise ValueError("backward_passes_per_step must be >= 1, "
                             f"got {backward_passes_per_step!r}")
        self.backward_passes_per_step = int(backward_passes_per_step)
        self.stats = Stats()

        if named_parameters is not None:
            named_parameters = list(named_parameters)
        else:
            named_parameters = [(f"allreduce.noname.{i}.{j}", v)
                                for i, group in enumerate(self.param_groups)
                                for j, v in enumerate(group["params"])]
        if any(not isinstance(p, tuple) for p in named_parameters):
            raise ValueError("named_parameters should be a sequence of (name, parameter) "
                             "tuples, usually model.named_parameters()")
        names = [k for k, _ in named_parameters]
        dups = sorted({k for k in names if names.count(k) > 1})
        if dups:
            raise ValueError(f"named_parameters has duplicate names: {', '.join(dups)}")
        self._names = {v: k for k, v in named_parameters}
        unnamed = [p for g in self.param_groups for p in g["params"] if p not in self._names]
        if unnamed:
            raise ValueError(f"named_parameters was given but {len(unnamed)} optimizer "
                             "parameters are not in it")

        self._handles = {}                   # bucket index -> Handle
        self._delay = {}
        self._hooks = []
        self._checked = False
        self._synchronized = False
        self._step_driver = None
        self._params = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        # hvd.broadcast_optimizer_state initialises an empty optimizer state with a step on
        # zero gradients; for Horovod's own DistributedOptimizer (recognised by __module__)
        # it takes the wrapped optimizer's plain step, without collectives.  Ours is one
        # too: no compressed exchange, and error feedback untouched.
        self.__module__ = hvd.DistributedOptimizer.__module__
        self.bucket_mb = buckets.bucket_mb(bucket_mb, self.compression)
        entries = [(self._names[p], tuple(p.shape), self.compression.for_tensor(self._names[p], p),
                    p.dtype, p.element_size()) for p in self._params]
        self._buckets = [[self._params[i] for i in b] for b in buckets.plan(entries, self.bucket_mb)]
        self._layouts = [buckets.layout([self._names[p] for p in b], [p.shape for p in b])
                         for b in self._buckets]
        self._bucket_of = {p: i for i, b in enumerate(self._buckets) for p in b}
        self._driver = Driver(collectives.HorovodTorch(process_set), self.stats,
                              average=self.op == hvd.Average,
                              auto=find_auto([e[2] for e in entries]))
        self._waiting = [len(b) for b in self._buckets]   # gradients a bucket still needs
        self._momentum = None
        if schedule is not None:
            self._momentum = AdamMomentum(self, schedule, self.compression,
                                          process_set.rank)
            self._dense = NoneCompressor()
            self._dense_driver = Driver(self._driver.transport, self.stats,
                                        average=self.op == hvd.Average)
        if process_set.included():
            for p in self._params:
                self._delay[p] = self.backward_passes_per_step
                self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook(p)))

    # -- hooks ------------------------------------------------------------------
    def _make_hook(self, p):
        def hook(_):
            if self._delay[p] <= 0:
                raise AssertionError(
                    "Gradients were computed more than backward_passes_per_step times "
                    "before call to step(). Increase backward_passes_per_step to "
                    "accumulate gradients locally.")
            self._delay[p] -= 1
            b = self._bucket_of.get(p)
            if self._delay[p] == 0 and b is not None:
                self._waiting[b] -= 1
                if self._waiting[b] == 0:    # the bucket's last gradient: launch it now
                    self._handles[b] = self._launch(b)
        return hook

    def _check_config(self):
        if self._checked:
            return
        layout = ";".join(f"{self._names[p]}:{tuple(p.shape)}:{p.dtype}" for p in self._params)
        momentum = self._momentum.spec if self._momentum is not None else ""
        collectives.check_same_config(f"{self.compression.spec} op={self.op} {momentum} "
                                      f"{buckets.describe(self.bucket_mb, self._buckets)} | {layout}",
                                      self.process_set)
        self._checked = True

    def _launch(self, b):
        self._check_config()
        params, layout = self._buckets[b], self._layouts[b]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            elif p.grad.is_sparse:
                p.grad = p.grad.to_dense()
        driver, compressor = self._driver_now(), None
        if driver is not self._driver:       # compressed momentum: a dense Adam step
            compressor = self._dense
        elif self._momentum is not None:     # the momentum goes instead of the gradient
            for p in params:
                self._momentum.to_momentum(p, p.grad)
        if compressor is None:
            compressor = self.compression.for_tensor(self._names[params[0]], params[0])
        if len(params) == 1:                 # a bucket of one: the tensor's own path
            return driver.launch(compressor, layout, inplace=True, tensor=params[0].grad)
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        return driver.launch(compressor, layout, flat=flat)

    def _driver_now(self):
        """This step's driver: the dense one in compressed momentum's dense steps."""
        if self._step_driver is None:
            dense = self._momentum is not None and self._momentum.dense
            self._step_driver = self._dense_driver if dense else self._driver
        return self._step_driver

    def drop_in_flight(self):
        """Forget the collectives of a step that will not finish (Elastic Horovod's reset
        after a failure: Horovod was shut down under them) and check the configuration
        again in the new world at the next step.  Error-feedback state is restored by
        :mod:`hvd_compress.torch.elastic`."""
        self._handles.clear()
        for p in self._params:
            self._delay[p] = self.backward_passes_per_step
        self._waiting = [len(b) for b in self._buckets]
        self._synchronized = False
        self._checked = False
        self._driver_now().abort()
        self._step_driver = None
        if self._momentum is not None:
            self._momentum.journal.rollback()

    # -- Horovod's API ----------------------------------------------------------------
    def synchronize(self):
        """Wait for every bucket's collective and write the aggregates into ``p.grad``."""
        if not self.process_set.included():
            self._synchronized = True
            return
        driver = self._driver_now()
        driver.backward_done()
        for b in range(len(self._buckets)):  # buckets with a gradient that did not arrive
            if b not in self._handles:
                self._handles[b] = self._launch(b)
        order = sorted(self._handles)
        outs = driver.finish([self._handles[b] for b in order])
        for b, out in zip(order, outs):
            params = self._buckets[b]
            parts = [out] if len(params) == 1 else self._layouts[b].split(out, torch_ops)
            for p, o in zip(params, parts):
                if p.grad.is_sparse:
                    p.grad = o.reshape(p.shape)
                elif o.data_ptr() != p.grad.data_ptr():     # in place already: no copy
                    p.grad.copy_(o.reshape(p.shape))
        for p in self._params:
            self._delay[p] = self.backward_passes_per_step
        self._waiting = [len(b) for b in self._buckets]
        self._handles.clear()
        driver.end_step()
        self._synchronized = True

    def step(self, closure=None):
        if not self._synchronized:
            self.synchronize()
        self._synchronized = False
        dense = self._driver_now() is not self._driver
        self._step_driver = None
        if self._momentum is None:
            return super(self.__class__, self).step(closure)
        if not dense:
            with torch.enable_grad():
                loss = closure() if closure is not None else None
            self._momentum.apply(self._params)
            return loss
        loss = super(self.__class__, self).step(closure)
        self._momentum.after_dense(self._params, self._driver.transport)
        return loss

    def state_dict(self):
        state = super(self.__class__, self).state_dict()
        if self._momentum is not None:
            state["hvd_compress_momentum"] = self._momentum.state_dict()
        return state

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        momentum = state_dict.pop("hvd_compress_momentum", None)
        if self._momentum is not None:
            self._momentum.load_state_dict(momentum, "hvd_compress_momentum")
        return super(self.__class__, self).load_state_dict(state_dict)

    def zero_grad(self, *args, **kwargs):
        if self._handles:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() "
                                 "but before optimizer.step() or optimizer.synchronize().")
        return super(self.__class__, self).zero_grad(*args, **kwargs)


def DistributedOptimizer(optimizer, named_parameters=None, compression=None,
                         backward_passes_per_step=1, op=hvd.Average,
                         process_set=hvd.global_process_set, bucket_mb=None,
                         compressed_momentum=None):
    """Wrap ``optimizer`` so that ``step()`` uses compressed, aggregated gradients.

    Arguments follow ``horovod.torch.DistributedOptimizer``; ``compression`` is a
    hvd_compress compressor, a spec string (``"topk:density=0.01"``) or None for
    ``$HVD_COMPRESS`` (default ``none``).  ``op`` is ``hvd.Average`` or ``hvd.Sum``.
    ``bucket_mb``: gradients are compressed and sent in buckets of about this many MB
    (default ``$HVD_COMPRESS_BUCKET_MB``, else 25; 0: tensor by tensor; see
    :mod:`hvd_compress.buckets`); a bucket is launched as soon as its last gradient is
    ready.  ``opt.stats`` counts bytes sent vs a dense float32 allreduce;
    ``opt.compression.state_dict()`` holds the error-feedback state to checkpoint (per
    parameter name, whatever the buckets).

    ``compressed_momentum`` (Adam and AdamW only): dense Adam for a warm-up, then the
    variance frozen and the *momentum* sent through ``compression`` with error feedback
    (1-bit Adam / 0/1 Adam; :mod:`hvd_compress.strategies.momentum`).  ``True`` or
    ``"auto"``: the warm-up ends when the variance has settled; an int: that many
    warm-up steps; a dict: :class:`~hvd_compress.strategies.momentum.MomentumSchedule`'s
    arguments (``warmup``, ``refresh``, ``tol``, ...).  Default: ``$HVD_COMPRESS_MOMENTUM``
    (same values), else off.
    """
    if compressed_momentum is None:
        compressed_momentum = _momentum_from_env()
    cls = type(optimizer.__class__.__name__, (optimizer.__class__, CompressedOptimizer),
               dict(_DistributedOptimizer.__dict__))
    return cls(optimizer.param_groups, named_parameters, compression,
               backward_passes_per_step, op, process_set, bucket_mb, compressed_momentum)


def _momentum_from_env():
    import os
    text = os.environ.get("HVD_COMPRESS_MOMENTUM", "").strip().lower()
    if text in ("", "0", "false", "off", "no"):
        return None
    if text in ("1", "true", "on", "yes", "auto"):
        return "auto" if text == "auto" else True
    try:
        return int(text)
    except ValueError:
        raise ValueError("$HVD_COMPRESS_MOMENTUM must be 0/1, 'auto' or a number of warm-up "
                         f"steps, got {text!r}") from None


from . import elastic as _elastic  # noqa: E402  (needs CompressedOptimizer, defined above)

_elastic.register()    # Elastic Horovod: TorchState(optimizer=ours) keeps error feedback
