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
``hvd_compress.hosts``, ``hvd_compress.compressors.dense``, ``hvd_compress.strategies.momentum``; and modules of
its own package.
"""
from contextlib import contextmanager

import horovod.torch as hvd
import torch

from .. import buckets, hosts
from ..horovod_args import passes as _passes, rank_in, ranks_of
from ..exchange import Driver, find_auto
from ..ops import torch_ops
from ..spec import resolve
from ..log import logger
from ..stats import Stats
from . import collectives, horovod_surface as surface
from .amp import GradientUnits
from .compressed_update import LocalUpdates, check as check_update
from ..strategies.momentum import MomentumSchedule, adam_defaults, momentum_from_env
from .momentum import ADAM_FAMILY, AdamMomentum, check_dgc, plain_step, warmup_entries


class CompressedOptimizer:
    """Marks the optimizers made by :func:`DistributedOptimizer` (each is a subclass of
    the wrapped optimizer's class made on the fly, and of this)."""


class _DistributedOptimizer(torch.optim.Optimizer):
    def __init__(self, params, named_parameters, compression, backward_passes_per_step,
                 op, process_set, bucket_mb=None, compressed_momentum=None,
                 gradient_predivide_factor=1.0, groups=None, sparse_as_dense=False,
                 grad_scaler=None, compressed_update=False):
        super(self.__class__, self).__init__(params)
        self.compression = resolve(compression)
        schedule = MomentumSchedule.build(compressed_momentum)
        update = check_update(compressed_update, schedule, grad_scaler, self.compression,
                              op == hvd.Average, self,
                              ranks=ranks_of(process_set), rank_of=rank_in(process_set))
        if schedule is None and not update and isinstance(self, ADAM_FAMILY):
            adam_defaults(self.compression, type(self).__name__)
        check_dgc(self.compression, self, schedule)
        self.op = surface.check_op(op, hvd)
        self.gradient_predivide_factor = surface.predivide_factor(gradient_predivide_factor,
                                                                  op, hvd)
        self.sparse_as_dense = bool(sparse_as_dense)
        self._units = GradientUnits(grad_scaler, self.gradient_predivide_factor)
        self.process_set = process_set
        self.backward_passes_per_step = _passes(backward_passes_per_step)
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
        self._should_synchronize = True
        self._warned = False
        self._was_sparse = set()
        self._step_driver = None
        self._params = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        self._frozen = [p for g in self.param_groups for p in g["params"] if not p.requires_grad]
        # hvd.broadcast_optimizer_state initialises an empty optimizer state with a step on
        # zero gradients; for Horovod's own DistributedOptimizer (recognised by __module__)
        # it takes the wrapped optimizer's plain step, without collectives.  Ours is one
        # too: no compressed exchange, and error feedback untouched.
        self.__module__ = hvd.DistributedOptimizer.__module__
        self._groups = groups
        self.bucket_mb = buckets.bucket_mb(bucket_mb, self.compression) if groups is None \
            else float("inf")
        entries = [(self._names[p], tuple(p.shape), self.compression.for_tensor(self._names[p], p),
                    p.dtype, p.element_size()) for p in self._params]
        planned = warmup_entries(entries, self._params, schedule)
        plan = buckets.plan(planned, self.bucket_mb) if groups is None else \
            surface.plan_groups(groups, self._params, planned)
        self._buckets = [[self._params[i] for i in b] for b in plan]
        self._layouts = [buckets.layout([self._names[p] for p in b], [p.shape for p in b])
                         for b in self._buckets]
        self._bucket_of = {p: i for i, b in enumerate(self._buckets) for p in b}
        transport = collectives.HorovodTorch(process_set)
        self._driver = Driver(transport, self.stats, average=self.op == hvd.Average,
                              auto=find_auto([e[2] for e in entries]),
                              hierarchy=hosts.for_compressors(
                                  hvd, collectives.HorovodTorch, transport,
                                  [e[2] for e in entries], collectives.HOST_ARRAYS)
                              if process_set.included() else None)
        self._waiting = [len(b) for b in self._buckets]   # gradients a bucket still needs
        self._momentum = None
        self._update = LocalUpdates(self._params, self.compression) if update else None
        if schedule is not None:
            self._momentum = AdamMomentum(self, schedule, self.compression,
                                          process_set.rank)
            self._dense = self._momentum.warmup_compressor
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
            if self._delay[p] == 0 and b is not None and self._update is None:
                self._waiting[b] -= 1
                if self._waiting[b] == 0:    # the bucket's last gradient: launch it now
                    self._handles[b] = self._launch(b)
        return hook

    def _check_config(self):
        if self._checked:
            return
        layout = ";".join(f"{self._names[p]}:{tuple(p.shape)}:{p.dtype}" for p in self._params)
        momentum = self._momentum.spec if self._momentum is not None else \
            "compressed_update" if self._update is not None else ""
        plan = buckets.describe(self.bucket_mb, self._buckets) if self._groups is None else \
            surface.describe_groups(self._groups, self._buckets)
        collectives.check_same_config(f"{self.compression.spec} op={self.op} {momentum} "
                                      f"predivide={self.gradient_predivide_factor:g} "
                                      f"{plan} | {layout}", self.process_set)
        self._checked = True

    def _launch(self, b):
        self._check_config()
        self._units.journal_of(self.compression, self._momentum)   # before any state write
        params, layout = self._buckets[b], self._layouts[b]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            elif p.grad.is_sparse:
                if self.sparse_as_dense:
                    self._was_sparse.add(p)
                p.grad = p.grad.to_dense()
            self._units.unscale_(p.grad)     # loss scale and predivide factor out
        driver, compressor = self._driver_now(), None
        if driver is not self._driver:       # compressed momentum: a dense Adam step
            compressor = self._dense.for_tensor(self._names[params[0]], params[0])
        elif self._momentum is not None:     # the momentum goes instead of the gradient
            for p in params:
                self._momentum.to_momentum(p, p.grad)
        if compressor is None:
            compressor = self.compression.for_tensor(self._names[params[0]], params[0])
        if len(params) == 1 and compressor.sends_alone(params[0].grad):   # its own path
            return driver.launch(compressor, layout, inplace=True, tensor=params[0].grad)
        flat = torch.cat([p.grad.reshape(-1) for p in params],     # (out: replay's buffer)
                         out=compressor.bucket_input(layout, params[0].grad))
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
        self._units.abort()
        self._was_sparse.clear()
        self._step_driver = None
        if self._momentum is not None:
            self._momentum.journal.rollback()

    def _check_unfrozen(self):
        thawed = [p for p in self._frozen if p.grad is not None]
        if thawed:                         # as Horovod: only the wrapped-time trainables
            logger.warning("hvd_compress: %d parameter(s) (%s, ...) did not require grad "
                           "when the DistributedOptimizer was built and now have "
                           "gradients: those are not exchanged (each rank keeps its own); "
                           "build the DistributedOptimizer after setting requires_grad",
                           len(thawed), self._names.get(thawed[0], "?"))
            self._frozen = [p for p in self._frozen if p.grad is None]

    # -- Horovod's API ----------------------------------------------------------------
    def synchronize(self):
        """Wait for every bucket's collective and write the aggregates into ``p.grad``
        (with ``compressed_update=True``: nothing; ``step()`` exchanges the updates)."""
        if self._update is not None:
            self._synchronized = True
            return
        self._exchange()

    def _exchange(self):
        if not self.process_set.included():
            self._synchronized = True
            return
        driver = self._driver_now()
        driver.backward_done()
        self._check_unfrozen()
        for b in range(len(self._buckets)):  # buckets with a gradient that did not arrive
            if b not in self._handles:
                self._handles[b] = self._launch(b)
        order = sorted(self._handles)
        outs = driver.finish([self._handles[b] for b in order])
        for b, out in zip(order, outs):
            params = self._buckets[b]
            self._units.rescale_(out)        # the loss scale (and predivide factor) back
            parts = [out] if len(params) == 1 else self._layouts[b].split(out, torch_ops)
            for p, o in zip(params, parts):
                if p.grad.is_sparse:
                    p.grad = o.reshape(p.shape)
                elif o.data_ptr() != p.grad.data_ptr():     # in place already: no copy
                    p.grad.copy_(o.reshape(p.shape))
                if p in self._was_sparse:     # sparse_as_dense: sparse again, as Horovod
                    p.grad = p.grad.to_sparse()
        self._was_sparse.clear()
        # an overflow step (Inf/NaN) with a loss scale: undo its error-feedback writes
        self._units.end(outs, self._units.journal_of(self.compression, self._momentum))
        for p in self._params:
            self._delay[p] = self.backward_passes_per_step
        self._waiting = [len(b) for b in self._buckets]
        self._handles.clear()
        driver.end_step()
        self._synchronized = True

    @contextmanager
    def skip_synchronize(self):
        """A context manager in which ``step()`` does not synchronize (Horovod's)::

            optimizer.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            with optimizer.skip_synchronize():
                optimizer.step()
        """
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def set_backward_passes_per_step(self, passes):
        """Expect ``passes`` backward passes before each ``step()`` from now on."""
        passes = _passes(passes)
        if self._handles:
            raise AssertionError("set_backward_passes_per_step() was called after "
                                 "loss.backward() but before optimizer.step() or "
                                 "optimizer.synchronize(): gradients are in flight")
        self.backward_passes_per_step = passes
        for p in self._params:
            self._delay[p] = passes

    def set_loss_scale(self, scale):
        """The loss scale the coming steps' gradients carry (a number or a one-element
        tensor; None: no scale), for a loss scaler other than a ``torch.amp.GradScaler``
        passed as ``grad_scaler``.  Call it before ``backward()``; see
        :func:`DistributedOptimizer`, "Mixed precision"."""
        if self._update is not None and scale is not None:
            raise ValueError("set_loss_scale: compressed_update=True exchanges updates, "
                             "which carry no loss scale; unscale the gradients before step()")
        self._units.set_loss_scale(scale)

    @property
    def overflow_steps(self):
        """Steps whose aggregate had Inf/NaN under a loss scale (their error-feedback
        writes undone)."""
        return self._units.overflow_steps

    def step(self, closure=None):
        if self._update is not None:         # this rank's step, then its update exchanged
            self._synchronized = False
            return self._update.run(self._wrapped_step, closure, self._exchange,
                                    self.drop_in_flight)
        if self._should_synchronize:
            if self._synchronized and not self._warned:
                logger.warning("optimizer.step() called without optimizer.skip_synchronize() "
                               "context after optimizer.synchronize(): the gradients are "
                               "not exchanged again (compressed gradients and their error "
                               "feedback would be); use optimizer.skip_synchronize()")
                self._warned = True
            if not self._synchronized:
                self.synchronize()
        self._synchronized = False
        dense = self._driver_now() is not self._driver
        self._step_driver = None
        if self._momentum is None:
            return self._wrapped_step(closure)
        if not dense:
            with torch.enable_grad():
                loss = closure() if closure is not None else None
            self._momentum.apply(self._params)
            return loss
        loss = self._wrapped_step(closure)
        self._momentum.after_dense(self._params, self._driver.transport)
        return loss

    def _wrapped_step(self, closure=None):
        """The wrapped optimizer's step without torch's step hooks: they run once, around
        :meth:`step` (:func:`~hvd_compress.torch.momentum.plain_step`)."""
        return plain_step(super(self.__class__, self).step.__func__)(self, closure)

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
        if not self._handles:         # as Horovod: the next backward starts a new step
            self._synchronized = False
            for p in self._params:
                self._delay[p] = self.backward_passes_per_step
            self._waiting = [len(b) for b in self._buckets]
        return super(self.__class__, self).load_state_dict(state_dict)

    def zero_grad(self, *args, **kwargs):
        if self._handles:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() "
                                 "but before optimizer.step() or optimizer.synchronize(). "
                                 "This is prohibited as it can cause a race condition.")
        return super(self.__class__, self).zero_grad(*args, **kwargs)


def DistributedOptimizer(optimizer, named_parameters=None, compression=None,
                         backward_passes_per_step=1, op=hvd.Average,
                         gradient_predivide_factor=1.0, num_groups=0, groups=None,
                         sparse_as_dense=False, process_set=hvd.global_process_set,
                         bucket_mb=None, compressed_momentum=None, grad_scaler=None,
                         compressed_update=False):
    """Wrap ``optimizer`` so that ``step()`` uses compressed, aggregated gradients.

    Arguments follow ``horovod.torch.DistributedOptimizer`` (0.28.1), in its order, and
    so do its methods (``synchronize()``, ``skip_synchronize()``,
    ``set_backward_passes_per_step()``) and its AssertionErrors (``zero_grad()`` or
    another backward while gradients are in flight).  ``compression`` is a hvd_compress
    compressor, a spec string (``"topk:density=0.01"``), Horovod's
    ``hvd.Compression.none``/``hvd.Compression.fp16`` (our ``none``/``fp16``) or None for
    ``$HVD_COMPRESS`` (default ``none``).  ``op`` is ``hvd.Average`` or ``hvd.Sum``
    (``hvd.Adasum``: ValueError).  ``gradient_predivide_factor`` (``op=hvd.Average``
    only): gradients are divided by it before the exchange and the average multiplied by
    it after, as Horovod's ``1/factor`` before the sum and ``factor/size`` after.
    ``groups`` (or its deprecated spelling ``num_groups``): Horovod's explicit groups
    become the buckets: an int splits the parameters into that many buckets, a list of
    lists of parameters makes each list a bucket (a parameter in none is a bucket of its
    own); not together with ``bucket_mb``.  Sparse gradients are exchanged dense (the
    compressors work on dense tensors); ``sparse_as_dense=True`` makes the aggregate
    sparse again before the update, as Horovod does, ``False`` (the default) leaves it
    dense.

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

    ``compressed_update=True`` (any optimizer; measured with AdamW): each rank runs the
    wrapped optimizer on its own gradients and the *parameter update* goes through
    ``compression`` with error feedback, ``p <- p_0 + mean_i C(u_i + e_i)``
    (:mod:`hvd_compress.torch.compressed_update`: formula, paper, what changes).

    **Mixed precision** (Horovod's recipe, with any compressor)::

        scaler = torch.amp.GradScaler("cuda")
        opt = hvd_compress.torch.DistributedOptimizer(opt, model.named_parameters(),
                                                      compression=..., grad_scaler=scaler)
        with torch.autocast("cuda", dtype=torch.float16):
            loss = loss_fn(model(x), y)
        scaler.scale(loss).backward()
        opt.synchronize()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()

    ``grad_scaler``: the ``torch.amp.GradScaler`` whose scale the gradients carry.  Each
    step's gradients are divided by its scale before compression and the aggregate is
    multiplied by it again (exact: the scale is a power of two), so error feedback,
    thresholds and PowerSGD's state are kept in unscaled units and a change of scale
    changes nothing; ``p.grad`` after ``synchronize()`` holds the scaled average, as
    with Horovod.  A step whose aggregate has Inf/NaN (an overflow, which GradScaler
    skips on every rank) leaves every residual and counter as it was before the step
    (``opt.overflow_steps`` counts them).  Without ``grad_scaler`` the gradients are
    compressed as they come (today's behaviour): a scaler that changes its scale then
    mixes residuals of different scales.  Another loss scaler: ``opt.set_loss_scale(s)``
    before each ``backward()`` (or when ``s`` changes) does the same; ``None`` stops.
    """
    if compressed_momentum is None and compressed_update is not True:
        compressed_momentum = momentum_from_env()
    groups = surface.groups_from(num_groups, groups, bucket_mb)
    cls = type(optimizer.__class__.__name__, (optimizer.__class__, CompressedOptimizer),
               dict(_DistributedOptimizer.__dict__))
    return cls(optimizer.param_groups, named_parameters, compression,
               backward_passes_per_step, op, process_set, bucket_mb, compressed_momentum,
               gradient_predivide_factor, groups, sparse_as_dense, grad_scaler,
               compressed_update)


from . import elastic as _elastic  # noqa: E402  (needs CompressedOptimizer, defined above)

_elastic.register()    # Elastic Horovod: TorchState(optimizer=ours) keeps error feedback
