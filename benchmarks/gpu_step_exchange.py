"""How benchmarks/gpu_step.py exchanges the gradient buckets of two ranks in one process
(issue 26), in two ways:

1. **each call alone** (:func:`exchange_buckets`): every bucket of both ranks through the
   package's exchange protocol over the in-process world, the device synchronised after
   every compressor call and collective, so that the exchange's timers hold device
   time: gpu_step.py's compress and decompress figures.  They add up the host's work
   and the device's.
2. **inside backward** (:func:`measure`).  In a real step the host's work and the
   device's overlap: the host issues a bucket's compress while the device still runs the
   backward queued before it, and a host synchronisation inside compress (the
   payload's length) drains that queue, so the device idles while the host issues what
   follows.  Neither shows in (1).  So, on one device:

   - **inline**: rank 0's backward with each bucket's exchange launched from the
     post-accumulate-grad hook of its last gradient, as the glue and DDP's hook do (the
     gradients concatenated into the bucket's buffer, ``compress_bucket``, or
     ``compress`` for a bucket of one tensor, error feedback on), its collective started
     on the in-process world against rank 1's payload; after backward every bucket
     finished in launch order (``finish_all``: the aggregate, decompress, divided by 2)
     and the step's deferred checks settled (the driver's one read-back).  Rank 1's
     payload is its real gradient of the same step compressed *before* the timed pass
     (:class:`Replay` hands it over and skips rank 1's decompress), so only rank 0's
     codec is in the pass; each collective's aggregate is made once, for both ranks
     (:class:`OnceWorld`), as a real collective makes it once.
   - **plain**: the same backward, no hook.

   Both from the start of backward to the end of the last decompress (CUDA events; the
   host's clock on a CPU), the same batch, in alternation, medians over the steps after
   the warm-up.  ``inline - plain`` is what the codec adds to the step's backward on one
   device (no network).  Two-round compressors (PowerSGD) are left out: rank 1's second
   message depends on the first round's aggregate, so it cannot be made beforehand.

Imports torch and hvd_compress; benchmarks/gpu_step.py loads this file by path.
"""
import statistics
import time

import torch

import hvd_compress
from hvd_compress import buckets
from hvd_compress.compressors import payload_bytes
from hvd_compress.exchange import Exchange, finish_all
from hvd_compress.exchange.in_process import LocalTransport, World
from hvd_compress.ops import torch_ops


# -- the exchange of every bucket, two ranks in one process ---------------------------

class Synced:
    """A compressor whose calls end with a device synchronisation (Exchange's timers)."""
    CALLS = {"compress", "compress_bucket", "decompress", "decompress_bucket", "propose",
             "propose_bucket", "agree", "finish"}

    def __init__(self, inner, sync):
        self._inner, self._sync = inner, sync

    def __getattr__(self, name):
        attr = getattr(self._inner, name)
        if name not in self.CALLS:
            return attr

        def call(*a, **k):
            out = attr(*a, **k)
            self._sync()
            return out
        return call


class SyncedWorld(World):
    """The in-process world of hvd_compress.exchange.in_process, device-synchronised
    after each aggregation (so that it is counted in neither compress nor decompress)."""

    def __init__(self, size, sync):
        super().__init__(size, torch_ops)
        self.sync = sync

    def sum(self, values):
        out = super().sum(values)
        self.sync()
        return out

    def concat(self, payloads):
        out = super().concat(payloads)
        self.sync()
        return out

    def transport(self, rank):
        return _Transport(self, rank)


class _Transport(LocalTransport):
    def divide(self, out, size):
        out = super().divide(out, size)
        self.world.sync()
        return out


def collectives(c, ex):
    """[(kind, bytes sent)] of an exchange's collectives, for the link model."""
    if c.collective != "two_round":
        return [(c.collective, int(ex.sent))]
    first = int(payload_bytes(ex.payload, torch_ops))
    return [(c.rounds[0][0], first), (c.rounds[1][0], int(ex.sent) - first)]


def bucket_layouts(comp, names, first, bucket_mb):
    """The buckets the glue makes of the gradients ``first`` (a dict by name) for
    ``comp``: their layouts, in launch order."""
    entries = [(n, tuple(first[n].shape), comp.for_tensor(n, first[n]), first[n].dtype,
                first[n].element_size()) for n in names]
    plan = buckets.plan(entries, buckets.bucket_mb(bucket_mb, comp))
    return [buckets.layout([names[i] for i in b], [entries[i][1] for i in b]) for b in plan]


def exchange_buckets(spec, names, grads, sync, bucket_mb, warmup):
    """Every bucket of every step exchanged between 2 ranks with ``spec``: per bucket
    (launch order) its layout, median compress and decompress seconds of rank 0 over
    the steps after ``warmup``, its collectives [(kind, bytes sent)], and the fastest
    compress and decompress of those steps (a median of two is their mean, which a
    one-off such as a Triton compile of a new specialisation dominates)."""
    comps = [hvd_compress.from_spec(spec) for _ in range(2)]
    lays = bucket_layouts(comps[0], names, grads[0][0], bucket_mb)
    times = [([], []) for _ in lays]
    colls = [None] * len(lays)
    for step, ranks in enumerate(grads):
        world = SyncedWorld(2, sync)
        checks = [[], []]                         # each rank's deferred index checks, as
        for b, lay in enumerate(lays):            # the glue's driver defers them
            last = b == len(lays) - 1
            exs = []
            for r, g in enumerate(ranks):         # the bucket's compressor, as the glue
                c = Synced(comps[r].for_tensor(lay.names[0], g[lay.names[0]]), sync)
                first = g[lay.names[0]]
                if len(lay.names) == 1 and c.sends_alone(first):   # the tensor's own path
                    t = first.clone()
                    sync()
                    exs.append(Exchange(c, world.transport(r), lay.names[0], tensor=t,
                                        inplace=True, average=True, checks=checks[r]))
                else:                             # the glue's flat buffer
                    flat = torch.cat([g[n].reshape(-1) for n in lay.names],
                                     out=c.bucket_input(lay, first))
                    sync()
                    exs.append(Exchange(c, world.transport(r), lay.key, flat=flat,
                                        layout=lay, average=True, checks=checks[r]))
            finish_all(exs)
            settle = 0.0
            if last:                              # the step's one readback of them (the
                start = time.perf_counter()       # driver's settle), with the last bucket
                torch_ops.settle_checks(checks[0])
                settle = time.perf_counter() - start
                torch_ops.settle_checks(checks[1])
            if step >= warmup:
                times[b][0].append(exs[0].compress_s)
                times[b][1].append(exs[0].decompress_s + settle)
            colls[b] = collectives(exs[0].compressor, exs[0])
            del exs
    return [(lay, statistics.median(c), statistics.median(d), k, min(c), min(d))
            for lay, (c, d), k in zip(lays, times, colls)]


# -- the exchange of every bucket inside backward ----------------------------------------


class OnceWorld(World):
    """The in-process world, each collective's aggregate made once and handed to both
    ranks (the plain world makes it once per rank waiting; rank 1's :class:`Replay`
    never reads it), so that the timed pass holds one aggregation per collective."""

    def __init__(self, size, ops):
        super().__init__(size, ops)
        self._made = {}          # (how, ids of the contributions) -> (them, aggregate)

    def _once(self, how, values):
        key = (how, tuple(map(id, values)))
        if key not in self._made:
            self._made[key] = (values, getattr(World, how)(self, values))
        return self._made[key][1]

    def sum(self, values):
        return self._once("sum", values)

    def concat(self, payloads):
        return self._once("concat", payloads)


class Replay:
    """Rank 1's compressor for one bucket: its payload made beforehand, handed over by
    ``compress``/``compress_bucket``; its decompress skipped (``out``, a zero tensor of
    the result's shape, unread).  Everything else is the compressor's own."""

    def __init__(self, inner, payload, ctx, out):
        self._inner, self._payload, self._ctx, self.out = inner, payload, ctx, out

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def compress(self, tensor, name=None):
        return self._payload, self._ctx

    def compress_bucket(self, flat, layout):
        return self._payload, self._ctx

    def decompress(self, agg, ctx):
        return self.out

    def decompress_bucket(self, agg, ctx):
        return self.out


def rank1_replays(comp, lays, grads):
    """Rank 1's :class:`Replay` of every bucket of one step (its gradients ``grads``, a
    dict by name), compressed now, in launch order, as the glue would."""
    out = []
    for lay in lays:
        first = grads[lay.names[0]]
        c = comp.for_tensor(lay.names[0], first)
        if len(lay.names) == 1 and c.sends_alone(first):
            payload, ctx = c.compress(first.clone(), lay.names[0])
            out.append(Replay(c, payload, ctx, torch.zeros_like(first)))
        else:
            flat = torch.cat([grads[n].reshape(-1) for n in lay.names],
                             out=c.bucket_input(lay, first))
            payload, ctx = c.compress_bucket(flat, lay)
            out.append(Replay(c, payload, ctx, torch.zeros_like(flat)))
    return out


class InlineStep:
    """One rank 0 backward with the exchanges launched from its hooks (:meth:`run`)."""

    def __init__(self, model, comp, lays):
        self.params = dict(model.named_parameters())
        self.comp, self.lays = comp, lays
        self.bucket_of = {n: b for b, lay in enumerate(lays) for n in lay.names}
        self.hooks = [self.params[n].register_post_accumulate_grad_hook(
            lambda _, n=n: self._ready(n)) for n in self.bucket_of]
        self.replays = self.world = self.exchanges = self.checks = self.ours = None
        self.waiting, self.from_hooks = [], 0

    def remove(self):
        for h in self.hooks:
            h.remove()

    def _grad(self, name):
        p = self.params[name]
        return p.grad if p.grad is not None else torch.zeros_like(p)

    def _ready(self, name):
        if self.replays is None:          # a backward outside run(): nothing to launch
            return
        b = self.bucket_of[name]
        self.waiting[b] -= 1
        if self.waiting[b] == 0:
            self.from_hooks += 1
            self._launch(b)

    def _launch(self, b):
        lay, replay = self.lays[b], self.replays[b]
        self.waiting[b] = -1                        # launched
        c = self.comp.for_tensor(lay.names[0], self.params[lay.names[0]])
        t0, t1 = self.world.transport(0), self.world.transport(1)
        first = self._grad(lay.names[0])
        if len(lay.names) == 1 and c.sends_alone(first):   # the tensor's own path
            name = lay.names[0]
            ours = Exchange(c, t0, name, tensor=first, inplace=True, average=True,
                            checks=self.checks)
            theirs = Exchange(replay, t1, name, tensor=replay.out, inplace=True)
        else:                                       # the glue's flat buffer
            flat = torch.cat([self._grad(n).reshape(-1) for n in lay.names],
                             out=c.bucket_input(lay, first))
            ours = Exchange(c, t0, lay.key, flat=flat, layout=lay, average=True,
                            checks=self.checks)
            theirs = Exchange(replay, t1, lay.key, flat=replay.out, layout=lay)
        self.exchanges += [ours, theirs]
        self.ours[b] = ours

    def run(self, loss, replays):
        """``loss.backward()`` with the exchanges, then every one finished and the checks
        settled; returns rank 0's results, bucket by bucket."""
        self.replays, self.world = replays, OnceWorld(2, torch_ops)
        self.exchanges, self.checks, self.from_hooks, self.ours = [], [], 0, {}
        self.waiting = [len(lay.names) for lay in self.lays]
        try:
            loss.backward()
            for b, left in enumerate(self.waiting):   # a bucket with a gradient missing
                if left > 0:
                    self._launch(b)
            finish_all(self.exchanges)
            torch_ops.settle_checks(self.checks)
            return [self.ours[b].result for b in range(len(self.lays))]
        finally:
            self.replays = None


def measure(spec, model, make, loss_of, lays, grads, args, clock, autocast):
    """The inline and plain backward of ``spec`` (ms, medians after ``args.warmup``
    steps of the ``len(grads)`` steps; rank 1's gradients are ``grads[step][1]``): the
    row's ``inline_*`` fields, or ``inline_skipped`` with the reason."""
    comps = [hvd_compress.from_spec(spec) for _ in range(2)]
    first = grads[0][0]
    if any(comps[0].for_tensor(lay.names[0], first[lay.names[0]]).collective == "two_round"
           for lay in lays):
        return {"inline_skipped": "two rounds: rank 1's second message needs the first "
                                  "round's aggregate"}
    step = InlineStep(model, comps[0], lays)
    gen = torch.Generator().manual_seed(args.seed + 1)
    inline, plain, from_hooks = [], [], []
    try:
        for s, ranks in enumerate(grads):
            replays = rank1_replays(comps[1], lays, ranks[1])
            x, y = make(gen)
            for hooked in (False, True):
                model.zero_grad(set_to_none=True)
                with autocast():
                    loss = loss_of(model, x, y)
                clock.sync()
                t0 = clock.mark()
                if hooked:
                    step.run(loss, replays)
                else:
                    loss.backward()
                t1 = clock.mark()
                clock.sync()
                if s >= args.warmup or len(grads) <= args.warmup:
                    (inline if hooked else plain).append(clock.seconds(t0, t1))
            from_hooks.append(step.from_hooks)
            del replays
    finally:
        step.remove()
        model.zero_grad(set_to_none=True)
    i, p = 1e3 * statistics.median(inline), 1e3 * statistics.median(plain)
    return {"inline_backward_ms": i, "plain_backward_ms": p, "inline_codec_ms": i - p,
            "inline_codec_over_backward": (i - p) / p,
            "inline_from_hooks": min(from_hooks), "inline_buckets": len(lays)}
