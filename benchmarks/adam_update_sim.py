"""AdamW with two simulated ranks in one process: what sparsifying the *gradients* and
sparsifying each rank's *update* (``compressed_update=True``'s rule) do to the loss per
step, with exact per-tensor top-k and no Horovod, so the arithmetic alone is compared.

    python benchmarks/adam_update_sim.py                     # ~10 minutes on 2 cores
    python benchmarks/adam_update_sim.py --methods "dense;update@0.01" --steps 100

The model and text are benchmarks/time_to_loss.py's (examples/gpt2_text.py): a small
GPT-2, AdamW (weight decay 0.01), batches of 8 x 64 bytes per rank drawn from the same
seeds as there.  Methods:

- ``dense[@lr]``: AdamW on the mean gradient (the learning rate, default 1e-3);
- ``grad@d``: each rank's gradient through top-k at density ``d`` with error feedback,
  AdamW on the mean of what was sent;
- ``update@d``: each rank's own AdamW step from the shared parameters, its update
  through top-k at density ``d`` with error feedback, the mean of what was sent applied
  (``d = 1``: the updates averaged uncompressed);
- ``grad@d~n``, ``update@d~n``: the same, tensors of fewer than ``n`` values sent whole;
- ``grad=SPEC``, ``update=SPEC``: each rank's gradient or update through its own
  instance of the library's compressor ``SPEC`` (``update=signsgd``,
  ``update=laplace_topk:density=0.01``), its error feedback included (marked as a glue
  marks it, so ``update=`` gets the library's default decay for updates unless the spec
  gives ``ef_decay=``); the mean of the ranks' reconstructions;
- a suffix ``:agg=A,decay=B`` on ``grad``/``update``: ``agg=union`` (every rank's top-k
  indices, their union ``U``, every rank's compensated values at ``U`` averaged: the
  library's ``agg=union``), ``agg=leader`` (rank ``t mod P`` picks the ``k`` indices at
  step ``t``, every rank sends its values there: the library's ``agg=leader``), and
  ``decay=B`` (the residual decays before compensation, ``c = x + B e``, as in
  SparseLoCo's error feedback; ``B = 1``, the default here, is plain error feedback;
  the library's default for updates is ``max(0.9, 1 - 10 d)``); ``norm=count``: each
  index's sum divided by the number of ranks that sent it (``norm=ranks``, the default:
  by P, the library's mean); ``norm=distinct``: the mean times ``sqrt(|U| / k)``, ``U``
  the union of the ranks' ``k``-index picks (``sqrt(P)`` when they are disjoint: it
  undoes what averaging P disjoint sparse updates does to the norm, which is what a
  ``sqrt(P)`` times higher learning rate also undoes); ``vcorr=1`` (``update`` only):
  each rank's AdamW step rescaled per coordinate by ``sqrt(v / v_g)``,
  ``v_g = v - (1 - 1/P) s2`` an estimate of the mean gradient's second moment, where ``s2 = (a - m^2) / (1 - c)`` is this
  rank's gradient noise from ``a`` (an EMA of ``g^2`` at AdamW's ``beta1``), its
  bias-corrected ``m``, and ``c`` (the share of the noise variance an EMA of that
  length keeps); ``v_g`` is clamped to ``[v/P, v]`` (tried against the shrinking of
  the ranks' mean update; it did not help).

``--seed 0`` (the default) uses benchmarks/time_to_loss.py's initial weights and batches;
another seed other batches and GPT-2's N(0, 0.02) initial weights anew.  One seed is
not enough to rank methods whose losses differ by less than ~0.2
(docs/adam-adamw.md).

Prints validation loss every ``--eval-every`` steps and a table.  For ``update`` methods
also four ratios, averaged over the steps since the last print: the norm of the update
applied over that of the mean of the ranks' uncompressed updates; that mean's norm over
dense AdamW's step from the same parameters on the mean gradient (its own moments kept
along the run); the same ratio as the two second moments alone predict it (the mean
update scaled per coordinate by ``sqrt(v_0 / v_dense)``, rank 0's ``v`` over dense
AdamW's); and the part of the mean the applied update delivers, ``<applied, mean> /
|mean|^2``.  Writes
benchmarks/results/adam_update_sim_<date>.json and .png (loss against step).
"""
import sys
from pathlib import Path

sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT / "benchmarks"))      # last: benchmarks/select.py is no stdlib
sys.path.append(str(ROOT / "examples"))        # gpt2_text
from gpt2_text import corpus, make_model, train_batch, validation_loss, windows  # noqa: E402

METHODS = "dense;dense@3e-3;grad@0.01;update@1;update@0.01;update@0.001"


def top_indices(c, density):
    """The ``k = ceil(density n)`` largest |c| of a flat tensor, as the library's ``topk``
    (``int()`` instead sends a 256-value LayerNorm 2 values a step, not 3: with updates at
    1% that alone left the loss at step 100 at 2.93, not 2.44)."""
    return c.abs().topk(max(1, math.ceil(density * c.numel()))).indices


def sparse_mean(xs, errors, density, step, whole_below=0, agg="local", decay=1.0,
                norm="ranks"):
    """(mean of what the ranks sent, their new residuals, bytes each rank sent: a float32
    value and an int32 index per value; ``union``: its k indices and a value per index of
    the union; ``leader``: a value per index, the indices once in P steps; 4 per value of a
    tensor sent whole; and, unless sent whole, ``(distinct indices sent, indices sent,
    sum over ranks of |sent|^2)``) for one
    tensor whose value on rank r is ``xs[r]``: each rank compensates
    ``c_r = x_r + decay e_r``, sends ``c_r`` at its indices (its own top-k; the union of
    all ranks' top-k; or the leader's top-k), and keeps the rest as its residual.
    ``norm="count"``: each index's sum divided by the number of ranks that sent it, not
    by P (the mean over the senders); ``norm="distinct"``: the mean times
    ``sqrt(|U| / k)``, ``U`` the union of the ranks' picks."""
    cs = [(x + decay * e).reshape(-1) for x, e in zip(xs, errors)]
    if density >= 1 or cs[0].numel() < whole_below:
        mean = 0
        for c in cs:             # this order: the recorded runs' rounding
            mean = mean + c / len(cs)
        return (mean.view_as(xs[0]), [torch.zeros_like(x) for x in xs], 4 * cs[0].numel(),
                None)
    if agg == "local":
        picks = [top_indices(c, density) for c in cs]
    elif agg == "union":
        picks = [torch.cat([top_indices(c, density) for c in cs]).unique()] * len(cs)
    elif agg == "leader":
        picks = [top_indices(cs[step % len(cs)], density)] * len(cs)
    else:
        raise ValueError(f"agg={agg!r}: local, union or leader")
    mean, residuals = torch.zeros_like(cs[0]), []
    count = torch.zeros_like(cs[0]) if norm == "count" else None
    for c, idx in zip(cs, picks):
        if count is None:
            mean[idx] += c[idx] / len(cs)
        else:
            mean[idx] += c[idx]
            count[idx] += 1
        r = c.clone()
        r[idx] = 0
        residuals.append(r.view_as(xs[0]))
    if count is not None:
        mean /= count.clamp_min(1)
    k = max(1, math.ceil(density * cs[0].numel()))
    union = torch.cat(picks).unique().numel()
    if norm == "distinct":       # P disjoint picks: |mean| = |sent| / sqrt(P); undone
        mean *= math.sqrt(union / k)
    index_bytes = {"local": 4 * k, "union": 4 * k, "leader": 4 * k / len(cs)}[agg]
    spread = (union, sum(i.numel() for i in picks),
              sum(float(c[i].square().sum()) for c, i in zip(cs, picks)))
    return mean.view_as(xs[0]), residuals, 4 * picks[0].numel() + index_bytes, spread


def library_mean(compressors, xs, name):
    """(mean of the ranks' reconstructions, bytes each rank sent) of one tensor through
    each rank's own compressor (error feedback in it)."""
    mean = 0
    for c, x in zip(compressors, xs):
        payload, ctx = c.for_tensor(name, x).compress(x, name)
        mean = mean + c.for_tensor(name, x).decompress(payload, ctx) / len(xs)
    tensors = payload if isinstance(payload, (tuple, list)) else (payload,)
    return mean.view_as(xs[0]), sum(t.numel() * t.element_size() for t in tensors)


def parse(label):
    """What ``label`` asks for: ``(kind, spec, lr or None, density, whole, agg, decay,
    norm, vcorr)``;
    ValueError for a bad one (main checks every label before the first run)."""
    kind, _, spec = label.partition("=")
    spec = spec if kind in ("grad", "update") else ""
    method = kind + "@1" if spec else label
    if spec:
        from hvd_compress import from_spec
        first = from_spec(spec)
        if first.rounds or first.name == "hier":
            raise ValueError(f"{label}: one-round compressors only here (not agg=, "
                             "powersgd or hier:)")
    method_, _, options = method.partition(":")
    kind, _, value = method_.partition("@")
    if kind not in ("dense", "grad", "update"):
        raise ValueError(f"unknown method {label!r}: dense[@lr], grad@density, "
                         "update@density, grad=SPEC, update=SPEC")
    value, _, whole = value.partition("~")
    options = dict(o.split("=", 1) for o in options.split(",") if o)
    agg, decay = options.pop("agg", "local"), float(options.pop("decay", 1.0))
    norm, vcorr = options.pop("norm", "ranks"), options.pop("vcorr", "0") == "1"
    if options:
        raise ValueError(f"{method}: unknown option(s) {sorted(options)} (agg=, decay=, "
                         "norm=, vcorr=)")
    if vcorr and kind != "update":
        raise ValueError(f"{method}: vcorr=1 rescales AdamW updates: update@ only")
    if norm not in ("ranks", "count", "distinct"):
        raise ValueError(f"{method}: norm={norm!r}: ranks, count or distinct")
    lr = float(value) if kind == "dense" and value else None
    density = float(value) if kind != "dense" else 1.0
    return kind, spec, lr, density, int(whole or 0), agg, decay, norm, vcorr


def noise_corrected(update, p0, grad, state, short, group, ranks):
    """One rank's AdamW ``update`` of ``p0`` with its Adam part rescaled per coordinate
    by ``sqrt(v / v_g)`` (``vcorr=1``; the module docstring states the estimate), and the
    new EMA of ``grad^2`` (``short``, at ``beta1``); ``state`` and ``group``: the
    parameter's AdamW state and its param group."""
    (b1, b2), t = group["betas"], float(state["step"])
    short = b1 * short + (1 - b1) * grad.square()
    a, m2 = short / (1 - b1 ** t), state["exp_avg"].square() / (1 - b1 ** t) ** 2
    kept = (1 - b1) * (1 + b1 ** t) / ((1 + b1) * (1 - b1 ** t))   # Var(m) / Var(g)
    noise = (a - m2).clamp_min(0) / (1 - kept) if t > 1 else torch.zeros_like(a)
    v = state["exp_avg_sq"] / (1 - b2 ** t) + 1e-30
    share = (1 - (1 - 1 / ranks) * noise / v).clamp(1 / ranks, 1)  # v_g / v
    decay = -group["lr"] * group["weight_decay"] * p0
    return (update - decay) / share.sqrt() + decay, short


def run(label, args, train, val_batch):
    kind, spec, lr, density, whole, agg, decay, norm, vcorr = parse(label)
    lr = lr or args.lr
    if spec:
        from hvd_compress import from_spec
        compressors = [from_spec(spec) for _ in range(args.ranks)]
        for c in compressors:            # as a glue marks them: the updates' default decay
            c.mark_residuals("updates" if kind == "update" else "gradients")
    models = [make_model(args, args.seed) for _ in range(args.ranks)]
    def adamw(parameters):
        return torch.optim.AdamW(parameters, lr=lr, weight_decay=0.01)
    opts = [adamw(m.parameters()) for m in models]
    params = [list(m.parameters()) for m in models]
    errors = [[torch.zeros_like(p) for p in params[0]] for _ in models]
    shorts = [[torch.zeros_like(p) for p in params[0]] for _ in models] if vcorr else None
    sent = 0                     # bytes per rank, all steps

    def exchange(i, xs, step):
        """The mean of tensor ``i``'s ``xs`` (one per rank) as the method sends it, and
        sparse_mean's spread (None when sent whole or by the library); its residuals and
        bytes counted."""
        nonlocal sent
        spread = None
        if spec:
            mean, n = library_mean(compressors, xs, str(i))
        else:
            mean, res, n, spread = sparse_mean(xs, [e[i] for e in errors], density, step,
                                               whole, agg, decay, norm)
            for r in range(len(models)):
                errors[r][i] = res[r]
        sent += n
        return mean, spread

    def validate():
        return validation_loss(models[0], val_batch)

    curve, t0 = [(0, validate())], time.perf_counter()
    ratios, norms = [], []       # update methods: the four ratios (module docstring)
    if kind == "update":         # dense AdamW's step from the same point, on the mean gradient
        shadow = make_model(args, args.seed)
        shadow_params = list(shadow.parameters())
        shadow_opt = adamw(shadow_params)
    for step in range(1, args.steps + 1):
        grads = []
        for r, m in enumerate(models):
            batch = train_batch(train, step, r, args.batch, args.seq, args.seed)
            m.zero_grad()
            m(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss.backward()
            grads.append([p.grad.clone() for p in params[r]])
        with torch.no_grad():
            if kind in ("dense", "grad"):
                for i in range(len(params[0])):
                    mean, _ = exchange(i, [g[i] for g in grads], step)
                    for r in range(len(models)):
                        params[r][i].grad = mean.clone()
                for o in opts:
                    o.step()
            else:
                start = [p.clone() for p in params[0]]
                for r, o in enumerate(opts):
                    o.step()
                for i, (q, p0) in enumerate(zip(shadow_params, start)):
                    q.copy_(p0)
                    q.grad = sum(g[i] for g in grads) / len(grads)
                shadow_opt.step()
                applied = full = dense = by_v = along = 0.0
                spread = [0, 0, 0.0, 0.0]    # over the sparsified tensors: sparse_mean's
                                             # spread, and |mean|^2
                for i, p0 in enumerate(start):
                    updates = [p[i] - p0 for p in params]
                    for r in range(len(models) if vcorr else 0):
                        updates[r], shorts[r][i] = noise_corrected(
                            updates[r], p0, grads[r][i], opts[r].state[params[r][i]],
                            shorts[r][i], opts[r].param_groups[0], len(models))
                    uncompressed = sum(updates) / len(updates)
                    square = uncompressed.square()
                    full += float(square.sum())
                    dense += float((shadow_params[i] - p0).square().sum())
                    v_dense = shadow_opt.state[shadow_params[i]]["exp_avg_sq"]
                    by_v += float((square * opts[0].state[params[0][i]]["exp_avg_sq"]
                                   / (v_dense + 1e-30)).sum())
                    mean, s = exchange(i, updates, step)
                    length = float(mean.square().sum())
                    applied += length
                    for j, v in enumerate((*s, length) if s else ()):
                        spread[j] += v
                    along += float((mean * uncompressed).sum())
                    for r in range(len(models)):
                        params[r][i].copy_(p0 + mean)
                distinct = spread[0] / spread[1] if spread[1] else math.nan
                disjoint = (math.sqrt(spread[3] / spread[2]) * len(models)
                            if spread[2] else math.nan)
                ratios.append((math.sqrt(applied / full), math.sqrt(full / dense),
                               math.sqrt(full / by_v), along / full, distinct, disjoint,
                               math.sqrt(applied / dense)))
        if step % args.eval_every == 0 or step == args.steps:
            curve.append((step, validate()))
            shown = ""
            if ratios:
                norms.append((step, *(sum(r) / len(ratios) for r in zip(*ratios))))
                shown = (f", update norm: applied/uncompressed {norms[-1][1]:.3f}, "
                         f"uncompressed/dense AdamW {norms[-1][2]:.3f} "
                         f"(by the second moments: {norms[-1][3]:.3f}); applied along "
                         f"uncompressed {norms[-1][4]:.3f}; indices distinct "
                         f"{norms[-1][5]:.3f}, applied/disjoint {norms[-1][6]:.3f}, "
                         f"applied/dense AdamW {norms[-1][7]:.3f} (x sqrt(P) "
                         f"{norms[-1][7] * math.sqrt(len(models)):.3f})")
                ratios[:] = []
            print(f"{label}: step {step} val loss {curve[-1][1]:.4f}{shown} "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
    sizes = [p.numel() for p in params[0]]
    sent = round(sent / args.steps)         # agg=union, laplace_topk: vary with the step
    if spec:                                 # the compressor's own: in its spec
        density = whole = agg = decay = norm = vcorr = None
    return dict(method=label, kind=kind, spec=spec or None, lr=lr, density=density,
                whole_below=whole, agg=agg, decay=decay, norm=norm, vcorr=vcorr,
                update_norm_ratio=norms,
                update_norm_ratio_columns=["step", "applied/uncompressed",
                                           "uncompressed/dense AdamW",
                                           "uncompressed/dense AdamW by v",
                                           "applied along uncompressed",
                                           "distinct indices / indices sent",
                                           "applied / (sqrt(sum |sent_r|^2) / P)",
                                           "applied/dense AdamW"],
                bytes_sent_per_rank_step=sent, values=sum(sizes), curve=curve)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--methods", default=METHODS, help="separated by ';'")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--seed", type=int, default=0,
                   help="0: time_to_loss.py's batches and weights; others: other batches and "
                        "initial weights")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--name", default="adam_update_sim")
    args = p.parse_args()
    for m in args.methods.split(";"):          # every label checked before the first run
        try:
            if m:
                parse(m)
        except ValueError as e:
            p.error(str(e))
    train, val = corpus()
    g = torch.Generator().manual_seed(12345)
    val_batch = windows(val, torch.randint(0, val.numel() - args.seq - 1, (32,), generator=g),
                        args.seq)
    rows = [run(m, args, train, val_batch) for m in args.methods.split(";") if m]
    dense = rows[0]["curve"][-1][1]
    print(f"\n| method | val loss at step {args.steps} | x first row | bytes sent per rank "
          "and step (x fewer) |\n|---|---|---|---|")
    for r in rows:
        n, sent = 4 * r["values"], r["bytes_sent_per_rank_step"]
        print(f"| {r['method']} | {r['curve'][-1][1]:.4f} | {r['curve'][-1][1] / dense:.3f} | "
              f"{sent:,} ({n / sent:.1f}x) |")
    date = datetime.date.today().isoformat()
    stem = os.path.join(args.out, f"{args.name}_{date}")
    os.makedirs(args.out, exist_ok=True)
    with open(stem + ".json", "w") as f:
        json.dump(dict(date=date, torch=torch.__version__, threads=torch.get_num_threads(),
                       args=vars(args), rows=rows), f, indent=1)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        steps, loss = zip(*r["curve"])
        ax.plot(steps, loss, marker=".", label=r["method"])
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss")
    ax.set_title(f"AdamW, {args.ranks} simulated ranks, exact top-k")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(stem + ".png", dpi=110)
    print(f"\nwrote {stem}.json and .png")


if __name__ == "__main__":
    main()
