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

Per bucket:

1. **Compress.**  The bucket's parameters are mapped to their names (from
   ``ddp_model.module.named_parameters()``: error feedback keeps one residual per
   *name*, so DDP rebuilding its buckets after the first step changes nothing) and to
   their compressor, ``compression.for_tensor(name, p)``.  Tensors that share one
   ``segmented`` compressor are compressed in one call (``compress_bucket`` on a copy
   of their gradients end to end, which keeps per-tensor k, thresholds and residuals;
   a copy, because error feedback keeps the buffer it is given as the residuals'
   storage, and DDP refills its bucket buffer every step); any other tensor on its own
   (``compress``), as the Horovod glue does tensor by tensor.  Empty tensors need
   nothing.
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

Works on the Gloo backend (CPU) and NCCL (GPU): everything stays on the bucket's
device except the payload byte lengths and the configuration digest, which the host
needs to cut the gathered bytes.
"""
import hashlib

import torch
import torch.distributed as dist

from .. import buckets
from ..exchange import Driver, Transport, Wait, find_auto, finish_all, single_layout
from ..compressors import payload_bytes
from ..ops import torch_ops
from ..spec import resolve
from ..stats import Stats, ring_received
from ..strategies.momentum import MomentumSchedule, adam_defaults
from .momentum import ADAM_FAMILY, check_dgc, momentum_optimizer

OPS = ("average", "sum")


class CompressionState:
    """What :func:`compression_hook` needs between buckets and steps.

    ``compression``: the compressor or Policy (it holds the error-feedback residuals,
    per parameter name).  ``stats``: :class:`~hvd_compress.stats.Stats`, as ``opt.stats``
    of the Horovod glue (bytes sent vs a dense float32 allreduce, received; seconds
    compressing, blocked waiting inside the hook, decompressing).  Build it with
    :func:`register`.
    """

    def __init__(self, ddp_model, compression=None, process_group=None, op="average",
                 optimizer=None, compressed_momentum=None):
        if op not in OPS:
            raise ValueError(f"op must be one of {', '.join(OPS)}, got {op!r}")
        self.compression = resolve(compression)
        schedule = MomentumSchedule.build(compressed_momentum)
        if schedule is None and isinstance(optimizer, ADAM_FAMILY):
            adam_defaults(self.compression, type(optimizer).__name__)
        if optimizer is not None:
            check_dgc(self.compression, optimizer, schedule)
        self.process_group = process_group if process_group is not None else \
            getattr(ddp_model, "process_group", None) or dist.group.WORLD
        self.op = op
        self.stats = Stats()
        named = [(n, p) for n, p in ddp_model.module.named_parameters() if p.requires_grad]
        self.names = {id(p): n for n, p in named}     # bucket.parameters() -> names
        self.description = (f"{self.compression.spec} op={op} "
                            f"world={dist.get_world_size(self.process_group)} | " +
                            ";".join(f"{n}:{tuple(p.shape)}:{p.dtype}" for n, p in named))
        self.checked = False
        self.in_flight = []      # _Bucket of this step, in launch order
        #: the one :class:`~hvd_compress.strategies.auto.Auto` of the compression (or None)
        self.auto = find_auto(self.compression.for_tensor(n, p) for n, p in named)
        self.transport = TorchDistributed(self.process_group)
        #: launches, advances and counts every exchange; drives auto (average: the
        #: hook divides whole DDP buckets, in the buffer's dtype)
        self.driver = Driver(self.transport, self.stats, average=False, auto=self.auto)
        self.auto_key = {}       # auto: tensor name -> key of the auto bucket it is sent in
        self.auto_names = {}     # auto: key -> the names of its tensors
        #: compressed-momentum Adam (:mod:`hvd_compress.torch.momentum`), or None
        self.momentum = None
        if schedule is not None:
            if optimizer is None:
                raise ValueError("compressed_momentum needs optimizer= (the Adam or AdamW "
                                 "that steps ddp_model's parameters)")
            self.momentum = momentum_optimizer(optimizer, self, schedule,
                                               lambda: dist.get_rank(self.process_group))
            self.description += f" | {self.momentum.spec}"
            self.dense_driver = Driver(self.transport, self.stats, average=False)
            self.dense = self.momentum.warmup_compressor

    def step_driver(self):
        """This step's driver: the dense one in compressed momentum's dense steps."""
        if self.momentum is not None and self.momentum.dense:
            return self.dense_driver
        return self.driver

    def state_dict(self):
        """The compressor's error-feedback residuals and counters (per parameter name);
        with ``auto``, also which tensors form each auto bucket (``"ddp_auto"``)."""
        out = self.compression.state_dict()
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
        if self.auto is not None and mapping is not None:
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

    def _full_description(self):
        extra = self.driver.describe()
        return self.description if not extra else \
            f"{self.description} | {extra} buckets={sorted(self.auto_key.items())}"

    def check_config(self, device):
        """ValueError on every rank unless all ranks have the same :attr:`description`:
        one all_gather of its sha256 (fixed shape, so ranks that differ cannot hang),
        then, only if they differ, of the descriptions themselves for the message."""
        group = self.process_group
        description = self._full_description()
        digest = torch.tensor(list(hashlib.sha256(description.encode()).digest()),
                              dtype=torch.uint8, device=device)
        everyone = [torch.empty_like(digest) for _ in range(dist.get_world_size(group))]
        dist.all_gather(everyone, digest, group=group)
        if all(torch.equal(d, everyone[0]) for d in everyone):
            self.checked = True
            return
        texts = [None] * len(everyone)
        dist.all_gather_object(texts, description, group=group)
        # the first 300 characters, or 300 around the first difference if it is further
        at = next((i for i, cs in enumerate(zip(*texts)) if len(set(cs)) > 1),
                  min(len(t) for t in texts))
        lines = "\n".join(f"  rank {r}: {t[:300] if at < 250 else '...' + t[at - 100:at + 200]}"
                          for r, t in enumerate(texts))
        raise ValueError("hvd_compress.ddp: ranks are configured differently (compressor, op, "
                         "parameter names, shapes and dtypes, and auto's state restored from "
                         f"a checkpoint, must match on every rank):\n{lines}")


def compression_hook(state, bucket):
    """DDP communication hook: compress ``bucket`` with ``state.compression``, start its
    collectives, and return a Future of its aggregated flat gradient (sum or average over
    the ranks, in the buffer's dtype).  Earlier buckets of the step are moved one
    collective further; the step's last bucket finishes every bucket and closes the
    step (module docstring)."""
    device = bucket.buffer().device
    state.transport.device = device
    if not state.checked:
        state.check_config(device)
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


class TorchDistributed(Transport):
    """``torch.distributed`` collectives on ``group`` (Gloo or NCCL), started with
    ``async_op=True``; ``device``: where the small tensors of auto's decisions live (the
    hook sets it to its bucket's device)."""

    ops = torch_ops

    def __init__(self, group):
        self.group, self.device = group, None

    @property
    def rank(self):
        return dist.get_rank(self.group)

    @property
    def size(self):
        return dist.get_world_size(self.group)

    def allreduce(self, tensor, name, inplace_of=None):
        """Sum ``tensor`` over the ranks (in place)."""
        work = dist.all_reduce(tensor, group=self.group, async_op=True)
        yield Wait(work.wait)
        nbytes = payload_bytes(tensor, torch_ops)
        return tensor, nbytes, ring_received(nbytes, self.size)

    def allgather(self, tensors, name):
        """Each tensor of ``tensors`` concatenated over the ranks in rank order (first
        dimensions may differ between ranks), as Horovod's allgather: the parts travel as
        one byte buffer, padded to the longest rank's.  Sent and received bytes count
        the padded buffer and the lengths."""
        size, group = self.size, self.group
        parts = [t.contiguous() for t in tensors]
        device = parts[0].device
        raw = [t.reshape(-1).view(torch.uint8) for t in parts]
        lengths = torch.tensor([r.numel() for r in raw], dtype=torch.int64, device=device)
        everyone = [torch.empty_like(lengths) for _ in range(size)]
        yield Wait(dist.all_gather(everyone, lengths, group=group, async_op=True).wait)
        table = torch.stack(everyone).tolist()         # [rank][part] bytes: to the host
        longest = max(sum(row) for row in table)
        own = sum(r.numel() for r in raw)
        mine = torch.cat(raw + [torch.zeros(longest - own, dtype=torch.uint8, device=device)])
        gathered = [torch.empty_like(mine) for _ in range(size)]
        yield Wait(dist.all_gather(gathered, mine, group=group, async_op=True).wait)
        out = []
        for i, t in enumerate(parts):
            pieces = []
            for r in range(size):
                at = sum(table[r][:i])
                pieces.append(gathered[r][at:at + table[r][i]])
            out.append(torch.cat(pieces).view(t.dtype).reshape(-1, *t.shape[1:]))
        sent = longest + lengths.numel() * 8
        return tuple(out), sent, (size - 1) * sent

    def divide(self, out, size):
        return out.div_(size)

    def broadcast_floats(self, values, name):
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.broadcast(t, src=dist.get_global_rank(self.group, 0), group=self.group)
        return t.tolist()

    def allgather_floats(self, values, name):
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        out = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(out, t, group=self.group)
        return [o.tolist() for o in out]


def register(ddp_model, compression=None, process_group=None, op="average", optimizer=None,
             compressed_momentum=None):
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
    """
    state = CompressionState(ddp_model, compression, process_group, op, optimizer,
                             compressed_momentum)
    ddp_model.register_comm_hook(state, compression_hook)
    return state


class _Bucket:
    """One DDP bucket in flight: its exchanges (one per compress call, started by the
    driver), advanced one collective at a time by the hook; sets :attr:`future` when
    all are done."""

    def __init__(self, state, bucket):
        self.state, self.buffer = state, bucket.buffer()
        self.future = torch.futures.Future(
            devices=[self.buffer.device] if self.buffer.is_cuda else None)
        grads = bucket.gradients()
        momentum, dense = state.momentum, state.momentum is not None and state.momentum.dense
        entries, at = [], 0            # (name, gradient view, offset, compressor)
        for p, g in zip(bucket.parameters(), grads):
            if id(p) not in state.names:
                raise ValueError("hvd_compress.ddp: a parameter of a DDP bucket is not in "
                                 "ddp_model.module.named_parameters()")
            name = state.names[id(p)]
            if g.numel():
                if momentum is not None and not dense:   # send the momentum instead
                    momentum.to_momentum(p, g)
                entries.append((name, g, at, state.dense.for_tensor(name, p) if dense else
                                state.compression.for_tensor(name, p)))
            at += g.numel()
        if at != self.buffer.numel():
            raise ValueError(f"hvd_compress.ddp: bucket {bucket.index()} holds {at} gradient "
                             f"values but its buffer {self.buffer.numel()}")
        autos = [e for e in entries if getattr(e[3], "adaptive", False)]
        auto_key = state.auto_keys([e[0] for e in autos], [e[1].shape for e in autos]) \
            if autos else {}
        groups = {}                    # tensors sharing a segmented compressor: one call
        for e in entries:
            if e[0] in auto_key:       # auto: one call per auto bucket
                key = ("auto", auto_key[e[0]])
            else:
                key = id(e[3]) if e[3].segmented else ("alone", e[0])
            groups.setdefault(key, []).append(e)
        for key, g in groups.items():  # an auto bucket's tensors in its key's order
            if isinstance(key, tuple) and key[0] == "auto":
                order = {n: i for i, n in enumerate(state.auto_names[key[1]])}
                g.sort(key=lambda e: order[e[0]])
        self.whole = len(groups) == 1 and [e[0] for g in groups.values() for e in g] == \
            [e[0] for e in entries]
        self.groups, self.exchanges = list(groups.values()), []
        for key, g in groups.items():
            auto_bucket = key[1] if isinstance(key, tuple) and key[0] == "auto" else None
            self.exchanges.append(self._launch(g, auto_bucket))
        self.done = False
        self._finish_if_done()

    def _launch(self, entries, auto_key):
        """One compress call for ``entries``: a bucket of several tensors, or an auto
        bucket, on a copy of their gradients end to end (error feedback keeps the buffer
        it is given as the residuals' storage, and DDP reuses its bucket buffer every
        step); a tensor alone on its own path."""
        driver, compressor = self.state.step_driver(), entries[0][3]
        if len(entries) == 1 and auto_key is None:
            name, grad = entries[0][0], entries[0][1]
            return driver.launch(compressor, single_layout(name, grad.shape), tensor=grad)
        lay = buckets.layout([e[0] for e in entries], [e[1].shape for e in entries])
        flat = torch.cat([g.reshape(-1) for _, g, _, _ in entries])
        if len(entries) == 1:
            return driver.launch(compressor, lay, tensor=flat.view(entries[0][1].shape),
                                 key=auto_key)
        return driver.launch(compressor, lay, flat=flat, key=auto_key)

    def advance(self):
        """Every exchange of the bucket one collective further (waiting for the last)."""
        for ex in self.exchanges:
            if not ex.done:
                self.state.step_driver().advance(ex)
        self._finish_if_done()

    def _finish_if_done(self):
        if self.done or any(not ex.done for ex in self.exchanges):
            return
        if self.whole:
            out = self.exchanges[0].result.reshape(-1)
        else:
            out = torch.zeros_like(self.buffer)
            for g, ex in zip(self.groups, self.exchanges):
                result, at = ex.result.reshape(-1), 0
                for _, grad, offset, _ in g:
                    out[offset:offset + grad.numel()] = result[at:at + grad.numel()]
                    at += grad.numel()
        out = out.to(self.buffer.dtype)
        if self.state.op == "average":
            out = out.div_(dist.get_world_size(self.state.process_group))
        self.done = True
        self.future.set_result(out)
