"""The parts of :mod:`hvd_compress.torch.ddp` that do not hold state between steps:
:class:`TorchDistributed` (``torch.distributed`` collectives as an exchange transport),
:class:`_Bucket` (one DDP bucket in flight: its names, compress calls, exchanges and
the Future DDP waits on), :class:`UpdateBucket` (compressed updates read as a DDP
bucket), :func:`find_ddp_model` (the model of an unbound state) and
:func:`check_config` (the first step's check that every rank is configured alike).  Split out of
``ddp.py`` so each module stays short; the module docstring there describes the whole
hook.

Imports: torch, ``hvd_compress.buckets``, ``hvd_compress.exchange``,
``hvd_compress.compressors``, ``hvd_compress.ops``, ``hvd_compress.stats``.
"""
import gc
import hashlib
import math

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from .. import buckets
from ..compressors import payload_bytes
from ..exchange import Gathered, Transport, Wait, single_layout
from ..ops import torch_ops
from ..stats import ring_received


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
        one byte buffer, padded to the longest rank's, whose lengths are gathered first
        (and read on the host).  Sent and received bytes count the padded buffer and the
        lengths."""
        return (yield from self._allgather(tensors, fixed=False))

    def allgather_fixed(self, tensors, name):
        """:meth:`allgather` of tensors of the same shapes on every rank (a ``fixed_size``
        compressor's payload): one collective, the byte buffers alone; no lengths
        gathered, nothing read back on the host."""
        return (yield from self._allgather(tensors, fixed=True))

    def _allgather(self, tensors, fixed):
        size, group = self.size, self.group
        parts = [t.contiguous() for t in tensors]
        device = parts[0].device
        raw = [t.reshape(-1).view(torch.uint8) for t in parts]
        if fixed:
            lengths, table = None, [[r.numel() for r in raw]] * size
        else:
            lengths = torch.tensor([r.numel() for r in raw], dtype=torch.int64, device=device)
            everyone = [torch.empty_like(lengths) for _ in range(size)]
            yield Wait(dist.all_gather(everyone, lengths, group=group, async_op=True).wait)
            table = torch.stack(everyone).tolist()     # [rank][part] bytes: to the host
        longest = max(sum(row) for row in table)
        own = sum(r.numel() for r in raw)
        mine = torch.cat(raw + [torch.zeros(longest - own, dtype=torch.uint8, device=device)])
        gathered = [torch.empty_like(mine) for _ in range(size)]
        yield Wait(dist.all_gather(gathered, mine, group=group, async_op=True).wait)
        out, rows = [], []
        for i, t in enumerate(parts):
            pieces = []
            for r in range(size):
                at = sum(table[r][:i])
                pieces.append(gathered[r][at:at + table[r][i]])
            out.append(torch.cat(pieces).view(t.dtype).reshape(-1, *t.shape[1:]))
            row_bytes = math.prod(t.shape[1:]) * t.element_size()
            rows.append([table[r][i] // row_bytes for r in range(size)])
        sent = longest + (0 if lengths is None else lengths.numel() * 8)
        return Gathered(out, rows), sent, (size - 1) * sent

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
        step); a tensor alone on its own path, unless its compressor's bucket exchanges
        are replayed (``sends_alone``: then a bucket of one, in replay's buffer)."""
        driver, compressor = self.state.step_driver(), entries[0][3]
        alone = len(entries) == 1 and compressor.sends_alone(entries[0][1])
        if alone and auto_key is None:
            name, grad = entries[0][0], entries[0][1]
            return driver.launch(compressor, single_layout(name, grad.shape), tensor=grad)
        lay = buckets.layout([e[0] for e in entries], [e[1].shape for e in entries])
        flat = torch.cat([g.reshape(-1) for _, g, _, _ in entries],
                         out=compressor.bucket_input(lay, entries[0][1]))
        if alone:
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


class UpdateBucket:
    """Compressed updates (``compressed_update=True``): the updates in ``p.grad`` of
    ``params`` (one device and dtype) end to end, read as :class:`_Bucket` reads DDP's
    ``GradBucket`` (``buffer``, ``gradients``, ``parameters``, ``index``, ``is_last``), so
    the optimizer's step exchanges them through the hook's own path."""

    def __init__(self, index, params, last):
        self._index, self._params, self._last = index, list(params), last
        self._buffer = torch.cat([p.grad.reshape(-1) for p in self._params])
        self._grads = list(torch.split(self._buffer, [p.numel() for p in self._params]))
        self._grads = [g.view(p.shape) for g, p in zip(self._grads, self._params)]

    def buffer(self):
        return self._buffer

    def gradients(self):
        return self._grads

    def parameters(self):
        return self._params

    def index(self):
        return self._index

    def is_last(self):
        return self._last


def group_rank(process_group):
    """This process's rank in ``process_group`` (None: the default group), or None before
    the process group exists (Lightning makes the hook's state first)."""
    return dist.get_rank(process_group) if dist.is_initialized() else None


def find_ddp_model(state, bucket):
    """The DistributedDataParallel model that called the hook with ``bucket`` for
    ``state`` (an unbound :class:`CompressionState`): the live DDP model that registered
    ``state`` as its hook state (directly, or inside a wrapper state's ``.state``, as
    :func:`hvd_compress.torch.amp.register_ddp`), else the only one holding the bucket's
    parameters.  A scan of the garbage collector's objects, once per state."""
    models = [o for o in gc.get_objects() if isinstance(o, DistributedDataParallel)]
    for m in models:
        if any(s is state or getattr(s, "state", None) is state
               for _, s in getattr(m, "_comm_hooks", ())):
            return m
    ids = {id(p) for p in bucket.parameters()}
    holders = [m for m in models if ids <= {id(p) for p in m.parameters()}]
    if len(holders) == 1:
        return holders[0]
    raise ValueError("hvd_compress.ddp: CompressionState was made without its model and the "
                     f"DDP model of the bucket cannot be told ({len(holders)} hold its "
                     "parameters): call state.bind(ddp_model) before the first step")


def check_config(state, device):
    """ValueError on every rank unless all ranks have the same configuration: the
    state's ``description`` (compressor, op, world size, parameters) and, with ``auto``,
    its schedule, choices and buckets.  One all_gather of its sha256 (fixed shape, so
    ranks that differ cannot hang), then, only if they differ, of the descriptions
    themselves for the message.  Sets ``state.checked``."""
    group = state.process_group
    extra = state.driver.describe()
    description = state.description if not extra else \
        f"{state.description} | {extra} buckets={sorted(state.auto_key.items())}"
    digest = torch.tensor(list(hashlib.sha256(description.encode()).digest()),
                          dtype=torch.uint8, device=device)
    everyone = [torch.empty_like(digest) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, digest, group=group)
    if all(torch.equal(d, everyone[0]) for d in everyone):
        state.checked = True
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
