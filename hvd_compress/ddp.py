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
compression algorithm: every compressor (or :class:`~hvd_compress.policy.Policy`) is
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
2. **Exchange**, by the compressor's ``collective``:
   ``allreduce``: ``dist.all_reduce`` (Sum) of the payload.
   ``allgather``: payloads differ in length between ranks, and ``dist.all_gather`` needs
   equal shapes: every payload tensor of the call is packed into one byte buffer (so
   bfloat16 travels as plain bytes, which Gloo can move), the byte lengths are gathered,
   each rank pads to the longest, the buffers are gathered, and each payload tensor is
   cut out again and concatenated in rank order.
   ``two_round``: ``propose`` → the first collective of ``compressor.rounds`` →
   ``agree`` → all_reduce (Sum) → ``finish``.
3. **Decompress** (``decompress`` / ``decompress_bucket`` / ``finish``), divide by the
   world size for ``op="average"`` (DDP's default), in the buffer's dtype.

**Why no collective is started from a Future callback** (as ``powerSGD_hook`` chains
its second allreduce with ``Future.then``).  Gloo and NCCL pair the ranks' collectives
by the order in which each rank *starts* them.  A collective that needs another's
result (the padded gather after the lengths; round 2 after round 1) started from a
callback starts whenever the first finishes, which on one rank may be before the next
bucket's hook and on another after it: the ranks then pair different collectives (with
one rank's backward slower, a hook chaining its second allreduce that way aborted in
Gloo: "Received data size doesn't match expected size"; where sizes happen to match,
the sums are silently wrong).  DDP calls the hook in bucket order, on the same thread,
on every rank.  So every collective is started *from the hook* with
``async_op=True``: the hook starts its bucket's first collective, then moves each
earlier bucket one collective further (waiting for that bucket's previous collective,
which has usually finished during the backward computation in between), and the last
bucket's call finishes them all.  The order is the same on every rank.

At the first step every rank checks that the others have the same configuration
(compressor spec, op, world size, parameter names, shapes and dtypes) with one
fixed-shape all_gather of a sha256; when they differ, every rank raises ValueError
listing each rank's, instead of hanging in mismatched collectives.

Works on the Gloo backend (CPU) and NCCL (GPU): everything stays on the bucket's
device except the payload byte lengths and the configuration digest, which the host
needs to cut the gathered bytes.
"""
import hashlib
import time

import torch
import torch.distributed as dist

from . import buckets
from .compressors import payload_bytes
from .ops import torch_ops
from .spec import resolve
from .stats import Stats, ring_received

OPS = ("average", "sum")


class CompressionState:
    """What :func:`compression_hook` needs between buckets and steps.

    ``compression``: the compressor or Policy (it holds the error-feedback residuals,
    per parameter name).  ``stats``: :class:`~hvd_compress.stats.Stats`, as ``opt.stats``
    of the Horovod glue (bytes sent vs a dense float32 allreduce, received; seconds
    compressing, blocked waiting inside the hook, decompressing).  Build it with
    :func:`register`.
    """

    def __init__(self, ddp_model, compression=None, process_group=None, op="average"):
        if op not in OPS:
            raise ValueError(f"op must be one of {', '.join(OPS)}, got {op!r}")
        self.compression = resolve(compression)
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

    def state_dict(self):
        """The compressor's error-feedback residuals and counters (per parameter name)."""
        return self.compression.state_dict()

    def load_state_dict(self, state_dict, strict=True):
        """Restore :meth:`state_dict` (the spec must match; see ``Compressor.load_state_dict``)."""
        self.compression.load_state_dict(state_dict, "torch", strict)

    def check_config(self, device):
        """ValueError on every rank unless all ranks have the same :attr:`description`:
        one all_gather of its sha256 (fixed shape, so ranks that differ cannot hang),
        then, only if they differ, of the descriptions themselves for the message."""
        group = self.process_group
        digest = torch.tensor(list(hashlib.sha256(self.description.encode()).digest()),
                              dtype=torch.uint8, device=device)
        everyone = [torch.empty_like(digest) for _ in range(dist.get_world_size(group))]
        dist.all_gather(everyone, digest, group=group)
        if all(torch.equal(d, everyone[0]) for d in everyone):
            self.checked = True
            return
        texts = [None] * len(everyone)
        dist.all_gather_object(texts, self.description, group=group)
        lines = "\n".join(f"  rank {r}: {t[:300]}" for r, t in enumerate(texts))
        raise ValueError("hvd_compress.ddp: ranks are configured differently (compressor, op, "
                         f"parameter names, shapes and dtypes must match on every rank):\n{lines}")


def compression_hook(state, bucket):
    """DDP communication hook: compress ``bucket`` with ``state.compression``, start its
    collectives, and return a Future of its aggregated flat gradient (sum or average over
    the ranks, in the buffer's dtype).  Earlier buckets of the step are moved one
    collective further; the step's last bucket finishes every bucket (module docstring)."""
    if not state.checked:
        state.check_config(bucket.buffer().device)
    try:
        flight = _Bucket(state, bucket)
        state.in_flight.append(flight)
        for older in state.in_flight[:-1]:
            older.advance()
        if bucket.is_last():
            while any(not f.done for f in state.in_flight):
                for f in state.in_flight:
                    f.advance()
            state.in_flight = []
            state.stats.end_step()
    except BaseException as e:              # leave no Future unset behind a failed step
        for f in state.in_flight:
            if not f.future.done():
                f.future.set_exception(e)
        state.in_flight = []
        raise
    return flight.future


def register(ddp_model, compression=None, process_group=None, op="average"):
    """Register :func:`compression_hook` on ``ddp_model`` (a DistributedDataParallel)
    and return its :class:`CompressionState`.

    ``compression``: a compressor, a Policy, a spec string (``"topk:density=0.01"``) or
    None for ``$HVD_COMPRESS`` (default ``none``).  ``process_group``: default the
    model's.  ``op``: ``"average"`` (as DDP) or ``"sum"``.
    """
    state = CompressionState(ddp_model, compression, process_group, op)
    ddp_model.register_comm_hook(state, compression_hook)
    return state


class _Bucket:
    """One DDP bucket in flight: its compress calls (``_Exchange``), advanced one
    collective at a time by the hook; sets :attr:`future` when all are done."""

    def __init__(self, state, bucket):
        self.state, self.buffer = state, bucket.buffer()
        self.future = torch.futures.Future(
            devices=[self.buffer.device] if self.buffer.is_cuda else None)
        grads = bucket.gradients()
        entries, at = [], 0            # (name, gradient view, offset, compressor)
        for p, g in zip(bucket.parameters(), grads):
            if id(p) not in state.names:
                raise ValueError("hvd_compress.ddp: a parameter of a DDP bucket is not in "
                                 "ddp_model.module.named_parameters()")
            name = state.names[id(p)]
            if g.numel():
                entries.append((name, g, at, state.compression.for_tensor(name, p)))
            at += g.numel()
        if at != self.buffer.numel():
            raise ValueError(f"hvd_compress.ddp: bucket {bucket.index()} holds {at} gradient "
                             f"values but its buffer {self.buffer.numel()}")
        groups = {}                    # tensors sharing a segmented compressor: one call
        for e in entries:
            key = id(e[3]) if e[3].segmented else ("alone", e[0])
            groups.setdefault(key, []).append(e)
        whole = len(groups) == 1
        self.exchanges = [_Exchange(state, g, whole) for g in groups.values()]
        self.done = False
        self._finish_if_done()

    def advance(self):
        """Every exchange of the bucket one collective further (waiting for the last)."""
        for ex in self.exchanges:
            if not ex.done:
                ex.advance()
        self._finish_if_done()

    def _finish_if_done(self):
        if self.done or any(not ex.done for ex in self.exchanges):
            return
        if len(self.exchanges) == 1 and self.exchanges[0].whole:
            out = self.exchanges[0].result
        else:
            out = torch.zeros_like(self.buffer)
            for ex in self.exchanges:
                at = 0
                for _, g, offset, _ in ex.entries:
                    out[offset:offset + g.numel()] = ex.result[at:at + g.numel()]
                    at += g.numel()
        out = out.to(self.buffer.dtype)
        if self.state.op == "average":
            out = out.div_(dist.get_world_size(self.state.process_group))
        stats = self.state.stats
        for ex in self.exchanges:
            stats.add(ex.sent, ex.dense, ex.received, ex.received_local, ex.union, ex.k)
            stats.add_time(ex.compress_s, ex.wait_s, ex.decompress_s)
        self.done = True
        self.future.set_result(out)


class _Exchange:
    """One compress call and its collectives.  :meth:`_steps` is a generator: it yields
    each collective it starts (an async ``Work``) and, resumed by :meth:`advance` once
    that collective has finished, goes on; it returns the flat sum over the ranks."""

    def __init__(self, state, entries, whole):
        self.state, self.entries = state, entries
        self.compressor = entries[0][3]
        self.whole = whole              # the tensors are the whole bucket, end to end
        self.group = state.process_group
        self.size = dist.get_world_size(self.group)
        self.dense = 4 * sum(g.numel() for _, g, _, _ in entries)
        self.sent = self.received = self.received_local = self.union = self.k = 0
        self.compress_s = self.wait_s = self.decompress_s = 0.0
        if len(entries) > 1:
            # a copy the compressor may keep: error feedback turns the buffer it is given
            # into the residuals' storage, and DDP reuses its bucket buffer every step
            self.layout = buckets.layout([e[0] for e in entries], [e[1].shape for e in entries])
            self.flat = torch.cat([g.reshape(-1) for _, g, _, _ in entries])
        else:
            self.layout, self.flat = None, None
        self.work, self.result, self.done = None, None, False
        self._gen = self._steps()
        self._resume()

    def advance(self):
        start = time.perf_counter()
        self.work.wait()
        self.wait_s += time.perf_counter() - start
        self._resume()

    def _resume(self):
        start = time.perf_counter()
        try:
            self.work = next(self._gen)
            self.compress_s += time.perf_counter() - start
        except StopIteration as stop:
            self.result, self.work, self.done = stop.value.reshape(-1), None, True
            self.decompress_s += time.perf_counter() - start

    def _steps(self):
        c, name, grad = self.compressor, self.entries[0][0], self.entries[0][1]
        if c.collective == "two_round":
            rank = dist.get_rank(self.group)
            if self.layout is not None:
                msg1, rnd = c.propose_bucket(self.flat, self.layout, rank, self.size)
            else:
                msg1, rnd = c.propose(grad, name, rank, self.size)
            if c.rounds[0][0] == "allgather":
                (agg1,), sent1, received1 = yield from _allgather((msg1,), self.group, self.size)
            else:
                agg1, sent1, received1 = yield from _allreduce(msg1, self.group, self.size)
            msg2, rnd = c.agree(agg1, rnd)
            agg2, sent2, received2 = yield from _allreduce(msg2, self.group, self.size)
            out = c.finish(agg2, rnd)
            _, _, self.received_local, self.union, self.k = c.traffic(msg1, agg1, msg2, rnd,
                                                                      self.size)
            self.sent, self.received = sent1 + sent2, received1 + received2
            return out
        if self.layout is not None:
            payload, ctx = c.compress_bucket(self.flat, self.layout)
        else:
            payload, ctx = c.compress(grad, name)
        if c.collective == "allreduce":
            agg, self.sent, self.received = yield from _allreduce(payload, self.group, self.size)
        else:
            agg, self.sent, self.received = yield from _allgather(payload, self.group, self.size)
        self.received_local = self.received
        if self.layout is not None:
            return c.decompress_bucket(agg, ctx)
        return c.decompress(agg, ctx)


def _allreduce(tensor, group, size):
    """Sum ``tensor`` over the ranks (in place); returns it, bytes sent and received."""
    yield dist.all_reduce(tensor, group=group, async_op=True)
    nbytes = payload_bytes(tensor, torch_ops)
    return tensor, nbytes, ring_received(nbytes, size)


def _allgather(parts, group, size):
    """Each tensor of ``parts`` concatenated over the ranks in rank order (first
    dimensions may differ between ranks), as Horovod's allgather: the parts travel as
    one byte buffer, padded to the longest rank's.  Returns (tuple, bytes this rank
    sent, bytes it received): the padded buffer and the lengths, both counted."""
    parts = [t.contiguous() for t in parts]
    device = parts[0].device
    raw = [t.reshape(-1).view(torch.uint8) for t in parts]
    lengths = torch.tensor([r.numel() for r in raw], dtype=torch.int64, device=device)
    everyone = [torch.empty_like(lengths) for _ in range(size)]
    yield dist.all_gather(everyone, lengths, group=group, async_op=True)
    table = torch.stack(everyone).tolist()         # [rank][part] bytes: to the host
    longest = max(sum(row) for row in table)
    own = sum(r.numel() for r in raw)
    mine = torch.cat(raw + [torch.zeros(longest - own, dtype=torch.uint8, device=device)])
    gathered = [torch.empty_like(mine) for _ in range(size)]
    yield dist.all_gather(gathered, mine, group=group, async_op=True)
    out = []
    for i, t in enumerate(parts):
        pieces = []
        for r in range(size):
            at = sum(table[r][:i])
            pieces.append(gathered[r][at:at + table[r][i]])
        out.append(torch.cat(pieces).view(t.dtype).reshape(-1, *t.shape[1:]))
    sent = longest + lengths.numel() * 8
    return tuple(out), sent, (size - 1) * sent
