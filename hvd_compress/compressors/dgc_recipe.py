"""DGC's training recipe for SGD-momentum, as options of every density sparsifier.

Lin et al., "Deep Gradient Compression: Reducing the Communication Bandwidth for
Distributed Training", ICLR 2018, sec. 3: sparsifying SGD-momentum's gradients with
plain error feedback loses accuracy because the momentum is applied *after* the
exchange, to a sparse, delayed sum.  Their recipe, per worker and tensor, step ``t``:

    g   <- g * min(1, clip / ||g||)          local gradient clipping   (clip=)
    u   <- m u + g                           momentum correction       (momentum=)
    c   =  u + r                             error feedback (the accumulation v)
    S   =  top-k(c) at density d_t           (the sparsifier's own selection)
    r   <- c - c[S]                          the residual keeps what was not sent
    u[S] <- 0                                momentum factor masking   (mask=1)
    d_t =  d * (0.25 / d)^(1 - t / W)        density warm-up           (warmup_steps=W)
                                             for t < W (exponential, 25% -> d), then d

and the optimizer applies the aggregate with **no momentum of its own** (``SGD(...,
momentum=0)``: the momentum is inside the exchange; the glue refuses a momentum
optimizer with ``momentum=`` set).  DGC scales the clipping threshold by ``N^-1/2``
for ``N`` workers: pass ``clip = max_norm / sqrt(N)``.  The norm is per tensor (a
bucket keeps per-tensor semantics).  The velocity ``u`` lives in the compressor's store
(``velocity/<name>``), so checkpoints hold it and a skipped step's journal undoes it.

Written once on :mod:`hvd_compress.ops`, so PyTorch, TensorFlow, Keras and the DDP hook
all have it.

Imports: the standard library, ``hvd_compress.buckets``.
"""
from ..buckets import layout as make_layout

PREFIX = "velocity/"
START_DENSITY = 0.25      #: DGC's first warm-up epoch keeps 25%


def check(momentum, clip, mask, warmup_steps, agg):
    """Normalised ``(momentum, clip, mask, warmup_steps)``; ValueError naming the bad
    argument."""
    if momentum is not None:
        momentum = float(momentum)
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum (DGC's momentum correction) must be in [0, 1), "
                             f"got {momentum!r}")
    if clip is not None:
        clip = float(clip)
        if not clip > 0.0 or clip == float("inf"):
            raise ValueError(f"clip (local gradient clipping) must be a finite number > 0, "
                             f"got {clip!r}")
    if warmup_steps is not None:
        if int(warmup_steps) != float(warmup_steps) or int(warmup_steps) < 0:
            raise ValueError(f"warmup_steps (density warm-up) must be an int >= 0, "
                             f"got {warmup_steps!r}")
        warmup_steps = int(warmup_steps)
    if mask is not None:
        if isinstance(mask, str):             # from a spec string
            if mask.lower() not in ("0", "1", "true", "false"):
                raise ValueError(f"mask (momentum factor masking) must be 0/1, got {mask!r}")
            mask = mask.lower() in ("1", "true")
        mask = bool(mask)
        if mask and not momentum:
            raise ValueError("mask=1 (momentum factor masking) needs momentum= set")
    active = bool(momentum or clip or warmup_steps)
    if active and agg not in (None, "local"):
        raise ValueError("DGC's recipe (momentum, clip, warmup_steps) works with agg=local "
                         f"only, got agg={agg!r}")
    return momentum, clip, mask, warmup_steps


def density_at(target, step, warmup_steps):
    """The warm-up density at this tensor's ``step`` (counted from 0)."""
    if not warmup_steps or step >= warmup_steps or target >= START_DENSITY:
        return target
    return target * (START_DENSITY / target) ** (1.0 - step / warmup_steps)


def compress(sp, flat, ctx, ops, step, parts, own, plain):
    """The recipe around ``plain`` (the sparsifier's own ``_compress_flat``: error
    feedback and selection) for ``flat`` holding ``parts`` = ((name, numel), ...)."""
    lay = ctx.segments if ctx.segments is not None else \
        make_layout([parts[0][0]], [(parts[0][1],)])
    g = flat
    if sp.clip:
        sq, _ = ops.segment_abs_sum_max(g * g, lay)
        norms = sq ** 0.5
        scale = ops.where(norms > sp.clip, sp.clip / (norms + 1e-30),
                          ops.ones_like(norms, ops.float32))
        if len(parts) == 1:
            g = g * ops.cast(scale[0], g.dtype)
        else:
            g = g * ops.cast(ops.gather(scale, ops.segment_ids(lay, g)), g.dtype)
    store = sp._state(ops)
    if sp.momentum:
        old = [store.get(PREFIX + name, lambda n=n: ops.zeros(n, g.dtype, g))
               for name, n in parts]
        u_prev = old[0] if len(old) == 1 else ops.concat(old)
        g = u_prev * sp.momentum + g
    density = sp.density
    if sp.warmup_steps:
        first = step[0] if isinstance(step, list) else step
        try:
            first = int(first)
        except TypeError:                   # a symbolic tensor: k must be known in Python
            raise ValueError(f"{sp.name}: warmup_steps (density warm-up) changes k between "
                             "steps and needs eager execution (inside tf.function k would "
                             "be fixed when traced)") from None
        sp.density = density_at(density, first, sp.warmup_steps)
    try:
        payload = plain(g, ctx, ops, step, parts, own=False)   # g is kept: it is u
    finally:
        sp.density = density
    if sp.momentum:
        u = g
        if sp.mask:                         # u[S] <- 0: the payload's own indices
            idx = payload[-1]
            u = ops.subtract_at(u, idx, ops.gather(u, idx), inplace=False)
        values = [u] if len(parts) == 1 else ops.split(u, [n for _, n in parts])
        for (name, _), value in zip(parts, values):
            store.set(PREFIX + name, value)
    return payload
