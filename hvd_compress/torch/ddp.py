"""hvd_compress compressors inside PyTorch DistributedDataParallel (no Horovod).

    import hvd_compress.ddp
    model = torch.nn.parallel.DistributedDataParallel(model)
    state = hvd_compress.ddp.register(model, compression="topk:density=0.01")
    ...                                        # train as usual
    print(state.stats.as_dict())               # bytes sent vs a dense float32 allreduce
    torch.save({..., "compression": state.state_dict()}, path)   # error-feedback state

A DDP *communication hook*, written like PyTorch's own (``ddp_comm_hooks/
default_hooks.py`` and ``powerSGD_hook.py``): a state object (:class:`CompressionState`)
and a plain function (:func:`compression_hook`) that DDP calls with each gradient
*bucket* (``bucket.buffer()``: the bucket's gradients end to end) as soon as the bucket
is ready in backward; the hook returns a ``torch.futures.Future`` of the bucket's
aggregated flat gradient, which DDP writes into ``p.grad``.  This module holds no
compression algorithm: every compressor (or :class:`~hvd_compress.strategies.policy.Policy`) is
used through the same contract as in the Horovod glue (:mod:`hvd_compress.compressors.base`).

A state made without the model (``CompressionState(compression=...)``, for frameworks
that wrap the model and register the hook themselves: PyTorch Lightning's
``DDPStrategy(ddp_comm_state=..., ddp_comm_hook=...)``, :mod:`hvd_compress.lightning`)
is bound to it at the hook's first bucket (:meth:`CompressionState.bind`,
:func:`~hvd_compress.torch.ddp_bucket.find_ddp_model`), before anything is compressed.

Per bucket:

1. **Compress.**  The bucket's parameters are mapped to their names (from
   ``ddp_model.module.named_parameters()``: error feedback keeps one residual per
   *name*, so DDP rebuilding its buckets after the first step changes nothing) and to
   their compressor, ``compression.for_tensor(name, p)``.  Tensors that share one
   ``segmented`` compressor are compressed in one call (``compress_bucket`` on a copy
   of their gradients end to end, which keeps per-tensor k, thresholds and residuals;
   a copy, because error feedback keeps the buffer it is given as the residuals'
   storage, and DDP refills its bucket buffer every step); any other tensor on its own
   (``compress``), as the Horovod glue does tensor by tensor, or as a bucket of one
   where its exchanges are replayed from CUDA graphs (``Compressor.sends_alone``).
   Empty tensors need nothing.
2. **Exchange** (:mod:`hvd_compress.exchange`, the protocol every glue shares): each
   compress call is an ``Exchange`` started by the state's ``Driver`` over
   :class:`TorchDistributed`: ``dist.all_reduce`` (Sum), or an allgather of payloads
   that differ in length between ranks (``dist.all_gather`` needs equal shapes: every
   payload tensor is packed into one byte buffer, so bfloat16 travels as plain bytes,
   the byte lengths are gathered, each rank pads to the longest, the buffers are
   gathered and cut again), or the two rounds of agg=union/leader/hint and PowerSGD.
3. **Decompress**, divide by the world size for ``op="average"`` (DDP's default), in
   the buffer's dtype.

**Why no collective is started from a Future callback** (as ``powerSGD_hook`` chains
its second allreduce with ``Future.then``).  Gloo and NCCL pair the ranks' collectives
by the order in which each rank *starts* them; a collective started from a callback
starts whenever the first finishes, in a different place on each rank (with one rank's
backward slower, a hook chaining its second allreduce that way aborted in Gloo:
"Received data size doesn't match expected size"; where sizes happen to match, the sums
are silently wrong).  DDP calls the hook in bucket order, on the same thread, on every
rank: the hook starts its bucket's first collective, then moves each earlier bucket one
collective further (``Driver.advance``), and the last bucket's call finishes them all
(the ordering rules of :mod:`hvd_compress.exchange.protocol`).

At the first step every rank checks that the others have the same configuration
(compressor spec, op, world size, parameter names, shapes and dtypes; with ``auto``, its
schedule and choices too, as restored from a checkpoint) with one fixed-shape all_gather
of a sha256; when they differ, every rank raises ValueError listing each rank's, instead
of hanging in mismatched collectives.

**auto** (:class:`~hvd_compress.strategies.auto.Auto`, alone or inside a Policy): the tensors of a
DDP bucket that auto sends are one auto bucket, keyed by their names end to end
(``buckets.layout(...).key``), and each step auto chooses its candidate.  DDP rebuilds
its buckets after the first step: the tensors then form new keys, and the keys they
left are forgotten by auto (a first step's bucket only ever had its first step's
candidate).  Each name remembers its key, and ``state_dict()`` holds that map: a new
DDP model restoring a checkpoint has one bucket at its first step again, which is sent
as the auto buckets it holds (one exchange each, as many as the run that saved it), so
the choices and the bits go on as they would have.  In calibration and check steps
(``auto.blocking``) every exchange is completed inside the hook call that starts it,
before the hook returns its (already completed) Future, so each is timed alone.  The
last bucket's hook call stands for the end of backward (``backward_done``) and, once
every bucket is finished, closes auto's step (``end_step``): its decision broadcast (a
float64 ``dist.broadcast`` from the group's rank 0, on the bucket's device) starts from
the hook thread, in the same place on every rank.

**Compressed updates** (``compressed_update=True`` with ``optimizer``;
:mod:`hvd_compress.torch.compressed_update`): the hook returns each DDP bucket's local
gradient unchanged (no collective), and the optimizer's ``step()`` runs this rank's own
step, then :meth:`CompressionState.exchange_updates` sends the updates through this same
hook (one :class:`~hvd_compress.torch.ddp_bucket.UpdateBucket` per device and dtype,
the last one closing the step), then applies the ranks' mean.

Works on the Gloo backend (CPU) and NCCL (GPU): everything stays on the bucket's
device except the payload byte lengths and the configuration digest, which the host
needs to cut the gathered bytes.
"""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from .. import buckets, hosts
from ..exchange import Driver, find_auto, finish_all
from ..spec import resolve
from ..stats import Stats
from ..strategies.momentum import MomentumSchedule, adam_defaults
from .compressed_update import check as check_update, check_optimizer, update_optimizer
from .ddp_bucket import (TorchDistributed, UpdateBucket, _Bucket, check_config,
                         find_ddp_model, group_rank)
from .momentum import ADAM_FAMILY, check_dgc, momentum_optimizer, restore_step

OPS = ("average", "sum")


class CompressionState:
    """What :func:`compression_hook` needs between buckets and steps.

    ``compression``: the compressor or Policy (it holds the error-feedback residuals,
    per parameter name).  ``stats``: :class:`~hvd_compress.stats.Stats`, as ``opt.stats``
    of the Horovod glue (bytes sent vs a dense float32 allreduce, received; seconds
    compressing, blocked waiting inside the hook, decompressing).  Build it with
    :func:`register`, or, where a framework registers the hook itself (PyTorch
    Lightning's ``DDPStrategy(ddp_comm_state=..., ddp_comm_hook=...)``), without the
    model: ``CompressionState(compression="topk:density=0.01")``.  Such a state is
    *bound* to the model (:meth:`bind`) when the hook sees its first bucket: the DDP
    model that registered it is found then, and the parameter names are its
    ``module.named_parameters()`` names, as with :func:`register`.  With
    ``compressed_update=True`` and ``optimizer``, :attr:`update` is the optimizer's
    :class:`~hvd_compress.torch.compressed_update.LocalUpdates` (:func:`register`).
    """

    def __init__(self, ddp_model=None, compression=None, process_group=None, op="average",
                 optimizer=None, compressed_momentum=None, compressed_update=False):
        if op not in OPS:
            raise ValueError(f"op must be one of {', '.join(OPS)}, got {op!r}")
        if ddp_model is not None and not isinstance(ddp_model, torch.nn.Module):
            raise ValueError("ddp_model must be a DistributedDataParallel model or None (bound "
                             "at the hook's first bucket); for a state without the model "
                             f"pass compression=... by name; got {type(ddp_model).__name__}")
        self.compression = resolve(compression)
        if hosts.wanted(self.compression.compressors()):
            raise ValueError(f"compression={self.compression.spec!r}: 'hier:' (the "
                             "hierarchical exchange) is for Horovod's optimizers, which know "
                             "each worker's host; the DDP hook exchanges flat: drop 'hier:'")
        schedule = MomentumSchedule.build(compressed_momentum)
        #: the world size when made (None before the process group: Lightning's strategy)
        self.ranks = dist.get_world_size(process_group) if dist.is_initialized() else None
        compressed_update = check_update(compressed_update, schedule, None, self.compression,
                                         op == "average", optimizer,
                                         ("op='average'", "op='sum'"), self.ranks,
                                         lambda: group_rank(process_group))
        if compressed_update and optimizer is None and ddp_model is not None:
            raise ValueError("compressed_update=True needs optimizer= (the optimizer that "
                             "steps ddp_model's parameters: its step() exchanges the update)")
        if schedule is None and not compressed_update and isinstance(optimizer, ADAM_FAMILY):
            adam_defaults(self.compression, type(optimizer).__name__)
        if optimizer is not None:
            check_dgc(self.compression, optimizer, schedule)
        self.process_group = process_group
        self.op = op
        self.stats = Stats()
        self.names = None        # bucket.parameters() -> names (id(p) -> name), once bound
        self.description = None
        self.checked = False
        self.in_flight = []      # _Bucket of this step, in launch order
        #: the one :class:`~hvd_compress.strategies.auto.Auto` of the compression (or None)
        self.auto = None
        self.transport = TorchDistributed(process_group)
        #: launches, advances and counts every exchange; drives auto (average: the
        #: hook divides whole DDP buckets, in the buffer's dtype); made by :meth:`bind`
        self.driver = None
        self.auto_key = {}       # auto: tensor name -> key of the auto bucket it is sent in
        self.auto_names = {}     # auto: key -> the names of its tensors
        self._restored_auto = None   # load_state_dict's "ddp_auto" before bind()
        #: compressed-momentum Adam (:mod:`hvd_compress.torch.momentum`), or None
        self.momentum = None
        if schedule is not None:
            if optimizer is None:
                raise ValueError("compressed_momentum needs optimizer= (the Adam or AdamW "
                                 "that steps ddp_model's parameters)")
            self.momentum = momentum_optimizer(optimizer, self, schedule,
                                               lambda: dist.get_rank(self.process_group))
            self.dense_driver = Driver(self.transport, self.stats, average=False)
            self.dense = self.momentum.warmup_compressor
        #: compressed updates (:mod:`hvd_compress.torch.compressed_update`): the
        #: :class:`~hvd_compress.torch.compressed_update.LocalUpdates` of ``optimizer``,
        #: whose ``step()`` exchanges the update; the hook sends nothing (else None)
        self.update = None
        self.optimizer = None        # the optimizer whose step() exchanges the update
        self.compressed_update = compressed_update
        self._update_order = None    # compressed updates: id(p) -> place in the module
        if ddp_model is not None:
            self.bind(ddp_model)
        if compressed_update and optimizer is not None:   # last: nothing above can fail after
            self.take_optimizer(optimizer)                # the swap

    def take_optimizer(self, optimizer):
        """Compressed updates: from now on ``optimizer.step()`` (not LBFGS; it must step
        exactly the DDP model's trainable parameters) runs this rank's step, then
        exchanges the update (:func:`~hvd_compress.torch.compressed_update.
        update_optimizer`).  The constructor calls it with ``optimizer=``; a state made
        before the optimizer (:class:`hvd_compress.lightning.DDPStrategy` calls it once
        Lightning has set up the optimizer) is given it here, before the first backward
        (the hook refuses to train without).  ValueError for a state without compressed
        updates or with an optimizer already.  Returns the ``LocalUpdates``."""
        if not self.compressed_update:
            raise ValueError("take_optimizer: this CompressionState has compressed_update="
                             "False (pass compressed_update=True, or optimizer= to its "
                             "constructor for compressed_momentum)")
        if self.update is not None:
            raise ValueError("take_optimizer: this CompressionState has an optimizer already")
        check_optimizer(optimizer)
        self.update = update_optimizer(optimizer, self.exchange_updates, self.compression)
        self.optimizer = optimizer
        return self.update

    def drop_optimizer(self):
        """Undo :meth:`take_optimizer`: the optimizer's ``step()`` is its own again (a
        framework that makes a new optimizer for another fit gives the state that one)."""
        if self.update is not None:
            restore_step(self.optimizer)
            self.update = self.optimizer = None

    @property
    def bound(self):
        """True once :meth:`bind` has taken the model's parameter names."""
        return self.names is not None

    def bind(self, model):
        """Take the parameter names (and, unless given, the process group) from ``model``:
        the DistributedDataParallel model (names of its ``module``) or the module it
        wraps.  :func:`register` and a constructor given the model call it; a state made
        without the model is bound by the hook at its first bucket, or by whoever calls
        this before (:class:`hvd_compress.lightning.CompressionStats` at ``on_fit_start``).
        Binding again to a model with the same names, shapes and dtypes (a model wrapped
        anew) only updates the parameters; to another, ValueError.  Returns ``self``."""
        if not isinstance(model, torch.nn.Module):
            raise ValueError("bind: model must be a DistributedDataParallel model or the "
                             f"module it wraps, got {type(model).__name__}")
        ddp = model if isinstance(model, DistributedDataParallel) else None
        module = model.module if ddp is not None else model
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if self.process_group is None:
            self.process_group = getattr(ddp, "process_group", None) or dist.group.WORLD
            self.transport.group = self.process_group
        description = (f"{self.compression.spec} op={self.op} "
                       f"world={dist.get_world_size(self.process_group)} | " +
                       ";".join(f"{n}:{tuple(p.shape)}:{p.dtype}" for n, p in named))
        if self.momentum is not None:
            description += f" | {self.momentum.spec}"
        if self.compressed_update:
            description += " | compressed_update"
        if self.names is not None:
            if description != self.description:
                raise ValueError("bind: model has other parameters (names, shapes or dtypes) "
                                 "than the model this CompressionState is bound to:\n  "
                                 f"{description[:300]}\n  was {self.description[:300]}")
            self.names = {id(p): n for n, p in named}
            return self
        self.names = {id(p): n for n, p in named}
        self.description = description
        self.auto = find_auto(self.compression.for_tensor(n, p) for n, p in named)
        self.driver = Driver(self.transport, self.stats, average=False, auto=self.auto)
        if self._restored_auto is not None:
            self._restore_auto(self._restored_auto)
            self._restored_auto = None
        return self

    def exchange_updates(self, params):
        """Compressed updates: every ``p.grad`` of ``params`` (this rank's update) becomes
        the ranks' mean, exchanged as the hook exchanges gradients, in one bucket per
        device and dtype, in the module's order (the optimizer's may differ between ranks;
        the optimizer's ``step()`` calls this).  ValueError, at the first step, unless the
        optimizer steps exactly the DDP model's trainable parameters."""
        if not self.bound:
            raise ValueError("compressed_update=True: optimizer.step() before the DDP "
                             "model's first backward")
        if self._update_order is None:
            self._update_order = {i: at for at, i in enumerate(self.names)}
            mine = {id(p) for p in params}
            missing = [n for i, n in self.names.items() if i not in mine]
            foreign = len(mine - set(self.names))
            if missing or foreign:
                raise ValueError(
                    "compressed_update=True: the optimizer must step every trainable "
                    "parameter of the DDP model and nothing else (one optimizer: each rank "
                    "steps it before the update is exchanged); "
                    f"{len(missing)} of the model's are not in it ({', '.join(missing[:5])}"
                    f"{' ...' if len(missing) > 5 else ''}), {foreign} of its are not the "
                    "model's")
        groups = {}
        for p in sorted(params, key=lambda p: self._update_order[id(p)]):
            groups.setdefault((p.device, p.dtype), []).append(p)
        pending = [UpdateBucket(i, ps, i == len(groups) - 1)
                   for i, ps in enumerate(groups.values())]
        futures = [compression_hook(self, b) for b in pending]
        for b, future in zip(pending, futures):
            mean = future.wait()
            for p, u in zip(b.parameters(), torch.split(mean, [p.numel() for p in
                                                               b.parameters()])):
                p.grad = u.view(p.shape)

    def step_driver(self):
        """This step's driver: the dense one in compressed momentum's dense steps."""
        if self.momentum is not None and self.momentum.dense:
            return self.dense_driver
        return self.driver

    def state_dict(self):
        """The compressor's error-feedback residuals and counters (per parameter name);
        with ``auto``, also which tensors form each auto bucket (``"ddp_auto"``)."""
        out = self.compression.state_dict()
        if self._restored_auto is not None:           # restored, not bound yet
            out = dict(out, ddp_auto=self._restored_auto)
        if self.momentum is not None:
            out = dict(out, ddp_momentum=self.momentum.state_dict())
        if self.auto is not None:
            keys = set(self.auto_key.values())
            out = dict(out, ddp_auto={"key": dict(self.auto_key),
                                      "names": {k: list(v) for k, v in self.auto_names.items()
                                                if k in keys}})
        return out

    def load_state_dict(self, state_dict, strict=True):
        """Restore :meth:`state_dict` (the spec must match; see ``Compressor.load_state_dict``)."""
        state_dict = dict(state_dict)
        mapping = state_dict.pop("ddp_auto", None)
        momentum = state_dict.pop("ddp_momentum", None)
        if self.momentum is not None:
            self.momentum.load_state_dict(momentum, "ddp_momentum")
        self.compression.load_state_dict(state_dict, "torch", strict)
        if mapping is not None and not self.bound:   # auto is known once bound
            self._restored_auto = mapping
        elif mapping is not None:
            self._restore_auto(mapping)

    def _restore_auto(self, mapping):
        if self.auto is not None:
            self.auto_key = dict(mapping["key"])
            self.auto_names = {k: tuple(v) for k, v in mapping["names"].items()}

    def auto_keys(self, names, shapes):
        """``{name: key}`` for the tensors ``names`` (with ``shapes``) of one DDP bucket
        that auto sends.  A name keeps the key it had while every tensor of that key is
        in this bucket and still has it (so a restored model's first bucket, which holds
        everything, is sent as the auto buckets it holds); the others form a new key of
        their names end to end, and the keys they leave are forgotten by auto (DDP
        rebuilt its buckets: they will not come back)."""
        inside = set(names)
        out, left = {}, []
        for n, s in zip(names, shapes):
            k = self.auto_key.get(n)
            if k is not None and all(m in inside and self.auto_key.get(m) == k
                                     for m in self.auto_names[k]):
                out[n] = k
            else:
                left.append((n, s))
        if left:
            lay = buckets.layout([n for n, _ in left], [s for _, s in left])
            gone = {self.auto_key[n] for n, _ in left if n in self.auto_key} - {lay.key}
            self.auto_names[lay.key] = lay.names
            for n, _ in left:
                self.auto_key[n] = out[n] = lay.key
            for k in gone:
                self.driver.forget(k)
            used = set(self.auto_key.values())
            self.auto_names = {k: v for k, v in self.auto_names.items() if k in used}
        return out


def compression_hook(state, bucket):
    """DDP communication hook: compress ``bucket`` with ``state.compression``, start its
    collectives, and return a Future of its aggregated flat gradient (sum or average over
    the ranks, in the buffer's dtype).  Earlier buckets of the step are moved one
    collective further; the step's last bucket finishes every bucket and closes the
    step (module docstring).  With compressed updates a DDP bucket is handed back as it
    is (this rank's gradient); the optimizer's step sends the update through here."""
    if state.compressed_update and state.update is None:
        raise ValueError("compressed_update=True: the CompressionState has no optimizer; "
                         "give it optimizer= or call state.take_optimizer(optimizer) "
                         "before the first backward (each rank would train on its own); "
                         "this DDP model's backward is now broken: build it anew")
    device = bucket.buffer().device
    if state.names is None:
        state.bind(find_ddp_model(state, bucket))
    state.transport.device = device
    if not state.checked:       # the first bucket, also with compressed updates: ranks
        check_config(state, device)     # that differ fail here, before DDP's own collectives
    if state.update is not None and not isinstance(bucket, UpdateBucket):
        future = torch.futures.Future(devices=[device] if device.type == "cuda" else None)
        future.set_result(bucket.buffer())      # the local gradient: the step sends updates
        return future
    driver, last = state.step_driver(), bucket.is_last()
    try:
        if last:
            driver.backward_done()
        flight = _Bucket(state, bucket)
        state.in_flight.append(flight)
        for older in state.in_flight[:-1]:
            older.advance()
        if last:
            finish_all(state.in_flight)     # every bucket, round-robin in launch order
            state.in_flight = []
            driver.end_step()
    except BaseException as e:              # leave no Future unset behind a failed step
        for f in state.in_flight:
            if not f.future.done():
                f.future.set_exception(e)
        state.in_flight = []
        driver.abort()
        raise
    return flight.future


def register(ddp_model, compression=None, process_group=None, op="average", optimizer=None,
             compressed_momentum=None, grad_scaler=None, compressed_update=False):
    """Register :func:`compression_hook` on ``ddp_model`` (a DistributedDataParallel)
    and return its :class:`CompressionState`.

    ``compression``: a compressor, a Policy, a spec string (``"topk:density=0.01"``,
    ``"auto"``) or None for ``$HVD_COMPRESS`` (default ``none``).  ``process_group``: default the
    model's.  ``op``: ``"average"`` (as DDP) or ``"sum"``.

    ``compressed_momentum`` with ``optimizer`` (an Adam or AdamW): dense Adam for a
    warm-up, then the momentum is what the hook compresses
    (:mod:`hvd_compress.strategies.momentum`; values as for the Horovod optimizer).  The
    optimizer object is kept, and its ``step()`` applies the rule: its class becomes a
    subclass of its own made on the fly, as Horovod's DistributedOptimizer does.

    ``grad_scaler`` (a ``torch.amp.GradScaler``): mixed precision, exactly
    :func:`hvd_compress.torch.amp.register_ddp` (error feedback in unscaled units,
    overflow steps undone; the state's ``amp`` counts them).

    ``compressed_update=True`` with ``optimizer`` (any ``torch.optim`` optimizer; measured
    with AdamW): the hook gives DDP each rank's own gradients back, and the optimizer's
    ``step()`` runs this rank's step, then exchanges the update ``p - p_0`` with
    ``compression`` and error feedback, and applies the ranks' mean
    (:mod:`hvd_compress.torch.compressed_update`: formula, paper, what changes; its class
    becomes a subclass of its own).  Not with ``grad_scaler`` (call
    ``scaler.unscale_(opt)``, ``opt.step()``, ``scaler.update()``) nor
    ``compressed_momentum``.
    """
    check_update(compressed_update, None, grad_scaler, resolve("none"))
    if grad_scaler is not None:
        from .amp import register_ddp
        return register_ddp(ddp_model, grad_scaler, compression, process_group, op,
                            optimizer, compressed_momentum)
    if not isinstance(ddp_model, DistributedDataParallel):
        raise ValueError("ddp_model must be a torch.nn.parallel.DistributedDataParallel "
                         f"(register_comm_hook), got {type(ddp_model).__name__}")
    state = CompressionState(ddp_model, compression, process_group, op, optimizer,
                             compressed_momentum, compressed_update)
    try:
        ddp_model.register_comm_hook(state, compression_hook)
    except BaseException:
        if state.update is not None:
            restore_step(optimizer)
        raise
    return state
