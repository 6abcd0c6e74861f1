"""Aggregation-aware selection (seed 001): choose what to send with the *aggregate* in mind.

Wang, Liu & Wu, "Communication Usage Optimization of Gradient Sparsification with
Aggregation in Deep Learning", ICNCC 2018.  With ``P`` workers each sending ``k``
(value, index) pairs, what every rank must receive is the *aggregated* size: the union
``U`` of the selected indices, which tends to ``P k`` when the workers' choices do not
overlap.  The paper observes that only a few gradients are significantly large, and only
for a short period of time, so workers can be steered toward the same indices.

Every density sparsifier takes the spec key ``agg=``:

``local`` (default)  own top-k; the (value, index) pairs are allgathered: each rank
                     receives ``(P-1) k (4 + w)`` bytes (``w``: value width).
``union``            own top-k; only the int32 indices are allgathered, every rank forms
                     the same sorted union ``U``, and the values of the *compensated*
                     gradient at ``U`` are summed by one allreduce: received
                     ``(P-1) k 4 + 2 (P-1)/P |U| w`` (ring allreduce).  The payload is
                     summable, and error feedback keeps exactly what was not sent
                     (``r = c`` with ``U`` zeroed).
``leader``           ScaleCom's cyclic local top-k (Chen et al., "ScaleCom: Scalable
                     Sparsified Gradient Compression for Communication-Efficient
                     Distributed Training", NeurIPS 2020): at step ``t`` rank
                     ``t mod P`` selects ``k`` indices of its compensated gradient; the
                     others propose none, so the allgather carries the leader's ``k``
                     indices, ``|U| = k`` (the leader's own count for the estimating
                     selectors dgc, gaussian_k, sidco_exp), and bytes received do not
                     grow with ``P``.
``hint``             the seed's idea: a score that favours what the *previous aggregate*
                     (identical on every rank, so free to know) found large,
                     ``score_i = |c_i| (1 + beta [i in H])``, selected by the sparsifier's
                     own rule (on ``c_i (1 + beta [i in H])``, which has that magnitude),
                     then exchanged as in ``union``.  ``hint=top`` (default):
                     ``H`` = the entries of the last union whose aggregate magnitude is at
                     least the tensor's mean over that union; ``hint=union``: ``H`` = the
                     whole last union.  ``beta`` (default 8) trades overlap for fidelity
                     to each rank's own top-k (``beta=0`` is ``union``).  What was tried
                     (benchmarks/aggregation.py, 16 simulated workers training the
                     MNIST CNN at density 0.01): ``hint=top`` with beta 0.5 to 8 cut the
                     union to 0.88x-0.43x of ``local``'s, ``hint=union`` to 0.78x-0.43x;
                     at equal overlap both were as far from the dense average and
                     ``top`` trained better, and beta 8 was the smallest boost that at
                     least halved the union.

The three non-local strategies share a two-round exchange, which the glue layers run:

    indices, rnd = c.propose(tensor, name, rank, size)    # round 1: allgather(indices)
    values, rnd  = c.agree(allgathered_indices, rnd)       # U, c[U]; residual updated
    out          = c.finish(allreduced_values, rnd)        # scatter(U, sum) (+ hint state)

``values=rangefloat*`` needs ``agg=local``: a sum of range-based floats is not a
range-based float (each rank's exponent range differs), so summable payloads travel in
the gradient's own dtype (bfloat16 as float32, which Gloo can sum).  ``dct`` under a
non-local strategy sends its coefficients as float for the same reason.

NaN/Inf: a rank whose compensated gradient is not finite proposes every index, so ``U``
is the whole tensor and the aggregate is non-finite where uncompressed Horovod's would
be; its residual is kept as it was.  A rank with nothing to propose (an all-zero
gradient, or not the leader) still takes part in both collectives: nobody waits.

Imports: the standard library; on first use, ``hvd_compress.ops``,
``hvd_compress.stats``, and ``hvd_compress.exchange`` for the in-process simulator
(:func:`in_process`) only.
"""
from typing import Any, NamedTuple

STRATEGIES = ("local", "union", "leader", "hint")
HINTS = ("top", "union")
HINT_PREFIX = "hint/"
DEFAULT_BETA = 8.0
LEADER_PREFIX = "agg/"


def check_agg(agg, beta, hint, values):
    """Validated ``(agg, beta, hint)``; ValueError naming the bad argument."""
    agg = "local" if agg is None else str(agg)
    if agg not in STRATEGIES:
        raise ValueError(f"agg must be one of {', '.join(STRATEGIES)}, got {agg!r}")
    if agg != "local" and values is not None:
        raise ValueError(f"agg={agg} sums the selected values with an allreduce, and a sum of "
                         f"range-based floats is not a range-based float: values={values} "
                         "needs agg=local")
    if beta is not None:
        try:
            b = float(beta)
        except (TypeError, ValueError):
            b = float("nan")
        if not b >= 0.0 or b == float("inf"):
            raise ValueError(f"beta must be a finite number >= 0, got {beta!r}")
        if agg != "hint":
            raise ValueError(f"beta is the hint boost; it needs agg=hint, not agg={agg}")
        beta = b
    if hint is not None:
        if str(hint) not in HINTS:
            raise ValueError(f"hint must be one of {', '.join(HINTS)}, got {hint!r}")
        if agg != "hint":
            raise ValueError(f"hint needs agg=hint, not agg={agg}")
        hint = str(hint)
    return agg, beta, hint


class Round(NamedTuple):
    """What a rank keeps between the rounds of one exchange; never sent."""
    ctx: Any            #: the gradient's Ctx (``segments`` for a bucket)
    dctx: Any           #: the Ctx of the selection domain (DCT coefficients for dct)
    ops: Any
    domain: Any         #: the compensated gradient in the selection domain
    compensated: Any    #: the compensated gradient (residual update)
    parts: Any          #: ((name, numel), ...) of the tensors end to end
    finite: Any
    memory: Any         #: ResidualMemory, or None without error feedback
    k: int              #: target count: sum of k(n) over the tensors
    union: Any = None   #: the agreed sorted indices U (after ``agree``)


def wire_dtype(dtype, ops):
    """Dtype in which the values at ``U`` are summed: the gradient's own, except
    bfloat16 (Gloo cannot sum it) as float32."""
    return ops.float32 if dtype == ops.bfloat16 else dtype


def propose(sp, flat, ctx, ops, step, parts, own, rank, size):
    """Round 1: compensate, then this rank's int32 proposal (see the module docstring)."""
    memory = None
    compensated = flat
    if sp.ef:
        memory = sp.error_feedback(ops)
        compensated = memory.compensate_parts(parts, flat, own=own and len(parts) > 1)
    finite = ops.all_finite(compensated)
    domain, dctx = sp.to_domain(compensated, ctx, ops)
    score = domain
    if sp.agg == "hint":
        boost = _hint_boost(sp, parts, dctx, ops, domain)
        # signed, so a selector that fits the gradient's distribution (gaussian_k) sees
        # the gradient itself where there is no boost; every selector takes |.| itself
        score = ops.to_float32(domain) * boost

    if sp.agg == "leader":         # counted on every rank and every step, finite or not
        state = sp._state(ops)
        counts = state.next_counts([LEADER_PREFIX + name for name, _ in parts])
        leads = (counts[0] % size) == rank

    def chosen():
        if sp.agg != "leader":
            return sp.select(score, dctx, ops, step)
        return ops.cond(leads, lambda: sp.select(score, dctx, ops, step),
                        lambda: ops.arange(0, domain))

    idx = ops.cond(finite, chosen, lambda: ops.arange(dctx.numel, domain))
    k = sum(sp.k(n) for _, n in _domain_parts(sp, parts, dctx))
    return idx, Round(ctx, dctx, ops, domain, compensated, parts, finite, memory, k)


def agree(sp, gathered, rnd):
    """Round 1's result -> the sorted union ``U`` and this rank's values at ``U`` (to
    be summed); error feedback keeps ``c`` with what was sent at ``U`` removed."""
    ops = rnd.ops
    ops.check_indices(gathered, rnd.dctx.numel, f"{sp.name} agg={sp.agg} ({rnd.ctx.name or 'tensor'})")
    union = ops.unique_sorted(gathered)
    values = ops.cast(ops.gather(rnd.domain, union), wire_dtype(rnd.ctx.dtype, ops))
    if rnd.memory is not None:
        rnd.memory.update_parts(rnd.parts, rnd.compensated,
                                lambda c, inplace: sp.subtract_union(c, union, values, rnd, inplace),
                                rnd.finite)
    return values, rnd._replace(union=union)


def finish(sp, summed, rnd):
    """Round 2's result (the values at ``U`` summed over ranks) -> the flat float32 sum
    over ranks of the gradient; records the hint for the next step (``agg=hint``)."""
    ops = rnd.ops
    n = ops.length(summed)
    if isinstance(n, int) and n != ops.length(rnd.union):
        raise ValueError(f"{sp.name} agg={sp.agg}: {n} summed values for a union of "
                         f"{ops.length(rnd.union)} indices")
    coefs = ops.scatter_sum(rnd.dctx.numel, rnd.union, summed, ops.float32, meeting=1)
    if sp.agg == "hint":
        _record_hint(sp, rnd, ops.abs(ops.to_float32(summed)))
    return sp.from_domain(coefs, rnd.ctx, ops)


def traffic(sp, proposal, gathered, values, rnd, size):
    """``(sent, received, received_local, union, k)`` bytes and counts of one exchange:
    the int32 indices proposed and gathered, then a ring allreduce of the values at U."""
    from ..stats import local_received, union_received
    ops = rnd.ops
    own, union = ops.count64(proposal), ops.count64(values)
    w, w_local = ops.dtype_size(values.dtype), ops.dtype_size(rnd.ctx.dtype)
    return (own * 4 + union * w, union_received(ops.count64(gathered), own, union, w, size),
            local_received(rnd.k, w_local, size), union, rnd.k)


# -- hint state: per tensor (of its selection domain) the boost 1 + beta [i in H] --------

def _domain_parts(sp, parts, dctx):
    """(name, numel) of each tensor in the selection domain."""
    return parts if len(parts) > 1 else ((parts[0][0], dctx.numel),)


def _hint_boost(sp, parts, dctx, ops, like):
    """float32 ``1 + beta [i in H]`` (stored as is: one multiply per step in ``propose``)."""
    state = sp._state(ops)
    boosts = [state.get(HINT_PREFIX + name, lambda n=n: ops.zeros(n, ops.float32, like) + 1.0)
              for name, n in _domain_parts(sp, parts, dctx)]
    return boosts[0] if len(boosts) == 1 else ops.concat(boosts)


def _record_hint(sp, rnd, mags):
    """``H``: the union (``hint=union``) or the union's entries with aggregate magnitude
    at least their tensor's mean over the union (``hint=top``)."""
    ops, union, dparts = rnd.ops, rnd.union, _domain_parts(sp, rnd.parts, rnd.dctx)
    picked = union
    if (sp.hint or "top") == "top":
        # per tensor (segment) sums, the same additions for a tensor alone or in a bucket
        T = len(dparts)
        seg = 0 * union if T == 1 else ops.gather(ops.segment_ids(rnd.ctx.segments, mags), union)
        # (this rank's own hint: no rank needs another's bits, so the fast unordered sum)
        sums = ops.scatter_sum(T, seg, mags, ops.float32, ordered=False)
        counts = ops.scatter_sum(T, seg, ops.ones_like(mags, ops.float32), ops.float32,
                                 ordered=False)
        means = sums / ops.where(counts > 0, counts, 0 * counts + 1)
        picked = ops.gather(union, ops.mask_indices(mags >= ops.gather(means, seg)))
    boost = ops.scatter_sum(rnd.dctx.numel, picked, ops.ones_like(picked, ops.float32)
                            * sp.hint_beta, ops.float32, meeting=1) + 1.0
    state = sp._state(ops)
    pieces = [boost] if len(dparts) == 1 else ops.split(boost, [n for _, n in dparts])
    for (name, n), piece in zip(dparts, pieces):
        key = HINT_PREFIX + name
        state.get(key, lambda n=n: ops.zeros(n, ops.float32, piece) + 1.0)
        state.set(key, piece)


def in_process(compressors, tensors, name):
    """One exchange of ``P`` ranks simulated in one process (no Horovod): rank ``r`` is
    ``compressors[r]`` with gradient ``tensors[r]``, run by the exchange protocol the
    glue runs (:func:`hvd_compress.exchange.in_process.run`: the allgather is the
    concatenation in rank order and the allreduce a sum over ranks; any two-round
    exchange, PowerSGD's too).  Returns ``(outputs per rank, info)`` with
    ``info = {"union", "k", "proposed"}`` (``union``: distinct indices in the aggregate).
    Used by benchmarks/aggregation.py and the tests."""
    from ..exchange.in_process import World, run
    from ..ops import ops_for
    ops = ops_for(tensors[0])
    world = World(len(compressors), ops)
    exchanges = run(compressors, tensors, name, world)
    outs = [e.result for e in exchanges]
    c0, first = compressors[0], exchanges[0]
    if c0.collective == "allreduce":
        return outs, {"union": None, "k": None, "proposed": None}
    proposed = [ops.length(e.payload[-1] if isinstance(e.payload, tuple) else e.payload)
                for e in exchanges]
    if c0.collective != "two_round":
        gathered = world.concat([e.payload for e in exchanges])
        k = c0.k(c0.domain_ctx(first.state).numel) if hasattr(c0, "domain_ctx") else None
        union = ops.length(ops.unique_sorted(gathered[-1]))
        return outs, {"union": union, "k": k, "proposed": proposed}
    union = getattr(first.state, "union", None)
    return outs, {"union": None if union is None else ops.length(union),
                  "k": getattr(first.state, "k", None), "proposed": proposed}
