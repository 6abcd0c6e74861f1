"""Aggregation strategies of the density sparsifiers (``agg=local|union|leader|hint``,
hvd_compress/compressors/aggregation.py): how large the aggregate grows with the number
of workers P, what each rank receives, how far the update is from the dense average,
and what that costs on a network, modelled.  One process, no Horovod.

    python benchmarks/aggregation.py                   # everything (about 11 minutes on 2 cores)
    python benchmarks/aggregation.py --quick           # P = 2, 4, 8; 5 steps; hint study at P = 8
    python benchmarks/aggregation.py --workers 2,8 --densities 0.01 --steps 20 --no-hint-study
    python benchmarks/aggregation.py --compressor laplace_topk

Training.  P simulated workers train ONE MNIST-5k CNN (``Net`` of
examples/pytorch_mnist.py), data-parallel: the same weights, worker r draws batches of
32 from its own shard (``load_mnist(r, P)``: the training digits ``[r::P]``; loaded once
and sliced, the same shards), SGD lr 0.02 momentum 0.9 on the aggregate / P.  Every
(strategy, density, P) is its own run from the same initial weights and the same
batches.  Per step and parameter tensor, ``in_process`` runs one exchange of P
compressor objects (one per worker: each holds its own error feedback), and the step
records:

* ``union/k``  = sum over tensors of |U| / sum of k (|U|: distinct indices in the
  aggregate; P for ``local`` and ``union`` when no two workers pick the same index,
  1 for ``leader``);
* the relative error ||aggregate / P - dense_avg|| / ||dense_avg||, with dense_avg the
  plain average of the workers' raw gradients (all tensors end to end);
* bytes received per rank, from the measured sizes (k_r: rank r's proposal length,
  4-byte float32 values and int32 indices; averaged over the ranks ``me``):

      local        sum_{r != me} k_r (4 + 4)                 allgather of (value, index)
      union, hint  sum_{r != me} k_r 4 + 2 (P-1)/P |U| 4     allgather of indices, then
                                                            ring allreduce of c[U]
      leader       k 4 + 2 (P-1)/P k 4                       a non-leader: the leader's k
                                                            indices (the leader gets 0)

Tables report the mean over all steps (step 1 of ``hint`` has no hint yet); the JSON
holds the per-step series.  Test accuracy (the 1,000 held-out digits) after the last
step is measured for P = 2 and the largest P.

Cost model (alpha-beta; alpha = 50 us per message step, beta = 1, 10, 100 Gbit/s),
the whole model as one fused bucket per round:

      ring allgather of m bytes per rank   (P-1) alpha + (P-1) m / beta
      ring allreduce of n bytes            2 (P-1) alpha + 2 (P-1)/P n / beta

i.e. ``time = latency + bytes received per rank / beta`` with latency (P-1) alpha for
``local`` and 3 (P-1) alpha for the two-round strategies; ``dense`` (a ring allreduce of
the whole float32 gradient) is the reference.  For ``leader`` this takes the leader's
block to reach every rank at the bandwidth of one copy (a pipelined broadcast); a plain
ring allgatherv forwards it hop by hop, (P-1)(alpha + 4k/beta).  Beyond the simulated P
(up to 256), ``union/k`` is extrapolated, marked ``*`` in the table and ``extrapolated``
in the JSON: a least-squares line in log2 P through the three largest simulated P, not
below the last measured value, capped at what the tensors allow (sum_t min(n_t, P k_t) /
sum_t k_t); the proposal length per rank is the last measured one.  ``leader`` keeps its
last measured |U|/k and its one proposer's length (exactly 1 and k for topk).  Relative
error and accuracy are not extrapolated.

Hint study (part of the default run; ``--no-hint-study`` skips it): at P = 16 and
density 0.01, ``agg=hint`` with ``hint=top`` and beta 0.5, 1, 2, 4, 8 (the default) and
``hint=union`` with beta 1, 4, 8 against ``local`` and ``union``.

A larger model (``--model-params``, default 25M, about ResNet-50): the same modelled
times with every size scaled by n (k = density n), union/k and the proposals per rank
as measured on the CNN.  Bytes there dominate latency, which on the 80k-parameter CNN
they do not.

Prints markdown tables and writes benchmarks/results/aggregation_<date>.json and .png
(a column per density: union/k against P, then the modelled communication time against P
at each bandwidth).
"""
import sys
from pathlib import Path

# benchmarks/select.py is named like the stdlib module `select`: drop this folder from
# sys.path before anything imports subprocess (see select.py).
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]
import hvd_compress  # noqa: E402
from hvd_compress.compressors.aggregation import in_process  # noqa: E402
from mnist_common import batches, load_mnist, show_progress  # noqa: E402
from pytorch_mnist import Net  # noqa: E402

STRATEGIES = {"local": "", "union": ",agg=union", "leader": ",agg=leader", "hint": ",agg=hint"}
HINT_VARIANTS = {"hint top b=0.5": ",agg=hint,beta=0.5,hint=top",
                 "hint top b=1": ",agg=hint,beta=1,hint=top",
                 "hint top b=2": ",agg=hint,beta=2,hint=top",
                 "hint top b=4": ",agg=hint,beta=4,hint=top",
                 "hint top b=8": ",agg=hint",       # the default: the same run as "hint"
                 "hint union b=1": ",agg=hint,beta=1,hint=union",
                 "hint union b=4": ",agg=hint,beta=4,hint=union",
                 "hint union b=8": ",agg=hint,beta=8,hint=union"}
HINT_DENSITY = 0.01
BATCH, LR, MOMENTUM, SEED = 32, 0.02, 0.9, 42
MODEL_MAX_P = 256


# -- training ------------------------------------------------------------------------

def worker_batches(n, seed):
    """Endless index batches over a shard of ``n`` digits, reshuffled every epoch."""
    epoch = 0
    while True:
        epoch += 1
        yield from batches(n, BATCH, seed, epoch)


def train(spec, shards, test, steps, evaluate, bar):
    """One run: ``steps`` data-parallel steps of len(shards) workers under ``spec``.
    Returns the per-step series and, when ``evaluate``, the final test accuracy."""
    P = len(shards)
    torch.manual_seed(SEED)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    params = list(model.named_parameters())
    compressors = [hvd_compress.from_spec(spec) for _ in range(P)]
    streams = [worker_batches(len(y), SEED) for _, y in shards]
    series = {key: [] for key in ("union", "k", "proposed", "received", "rel_error", "loss")}
    for _ in range(steps):
        grads, losses = [], []
        for (x, y), stream in zip(shards, streams):
            idx = torch.from_numpy(next(stream))
            model.zero_grad()
            loss = F.cross_entropy(model(x[idx]), y[idx])
            loss.backward()
            grads.append([p.grad.detach().clone() for _, p in params])
            losses.append(loss.item())
        union = k = proposed = received = 0
        update = []
        for i, (name, p) in enumerate(params):
            outs, info = in_process(compressors, [g[i] for g in grads], name)
            p.grad = outs[0] / P
            update.append(p.grad.reshape(-1))
            union, k = union + info["union"], k + info["k"]
            proposed += sum(info["proposed"])
            received += received_bytes(strategy_of(spec), P, sum(info["proposed"]), info["union"])
        opt.step()
        dense = torch.stack([torch.cat([t.reshape(-1) for t in g]) for g in grads]).mean(0)
        series["union"].append(union)
        series["k"].append(k)
        series["proposed"].append(proposed)
        series["received"].append(received)
        series["rel_error"].append((torch.cat(update) - dense).norm().item() / dense.norm().item())
        series["loss"].append(float(np.mean(losses)))
        bar.update(P)
    run = {"spec": spec, "P": P, "series": series}
    if evaluate:
        x_test, y_test = test
        with torch.no_grad():
            run["accuracy"] = (model(x_test).argmax(1) == y_test).float().mean().item()
    return run


def strategy_of(spec):
    return next((s for s in ("union", "leader", "hint") if f"agg={s}" in spec), "local")


def summary(run):
    """Means over the steps: union/k, proposals per rank / k, bytes received, error."""
    s, P = run["series"], run["P"]
    k = s["k"][0]
    return {"union_k": float(np.mean(s["union"])) / k,
            "proposed_per_rank_k": float(np.mean(s["proposed"])) / (P * k),
            "received": float(np.mean(s["received"])),
            "rel_error": float(np.mean(s["rel_error"]))}


# -- bytes and the alpha-beta model -------------------------------------------------

def received_bytes(strategy, P, proposed, union):
    """Bytes one rank receives (mean over ranks; ``leader``: a non-leader) given the
    sum of the ranks' proposal lengths and |U| (see the module docstring)."""
    allreduce = 2 * (P - 1) / P * union * 4
    if strategy == "local":
        return (P - 1) / P * proposed * 8
    if strategy == "leader":
        return proposed * 4 + allreduce
    return (P - 1) / P * proposed * 4 + allreduce


def comm_time(strategy, P, received, alpha, gbit):
    """Seconds per step: latency of the ring steps + bytes received / bandwidth."""
    rounds = {"local": 1, "dense": 2}.get(strategy, 3)
    return rounds * (P - 1) * alpha + received * 8 / (gbit * 1e9)


def union_cap(sizes, P):
    """Largest possible union/k with P workers: sum_t min(n_t, P k_t) / sum_t k_t."""
    return sum(min(n, P * k) for n, k in sizes) / sum(k for _, k in sizes)


def extrapolate(strategy, measured, P, sizes):
    """(union/k, proposals per rank / k) at an unsimulated P from ``measured``
    ({P: summary}) by the rule of the module docstring."""
    ps = sorted(measured)[-3:]
    last = measured[ps[-1]]
    if strategy == "leader":           # one proposer: |U| and its length do not grow with P
        return last["union_k"], last["proposed_per_rank_k"] * ps[-1] / P
    ratio = last["union_k"]
    if len(ps) > 1:
        slope, icept = np.polyfit(np.log2(ps), [measured[p]["union_k"] for p in ps], 1)
        ratio = max(ratio, slope * math.log2(P) + icept)
    return min(ratio, union_cap(sizes, P)), last["proposed_per_rank_k"]


def model_rows(strategy, density, measured, sizes, model_ps, alpha, gbits, k=None):
    """The modelled rows of one (strategy, density) for every P of ``model_ps``; ``k``:
    the model's total k (default: the CNN's, ``sizes``); union/k and proposals per rank
    / k as measured on the CNN, or extrapolated."""
    k = k or sum(kt for _, kt in sizes)
    rows = []
    for P in model_ps:
        if P in measured:
            union_k, per_rank = measured[P]["union_k"], measured[P]["proposed_per_rank_k"]
        else:
            union_k, per_rank = extrapolate(strategy, measured, P, sizes)
        received = received_bytes(strategy, P, per_rank * P * k, union_k * k)
        rows.append({"strategy": strategy, "density": density, "P": P,
                     "extrapolated": P not in measured, "union_k": union_k,
                     "received": received,
                     "rel_error": measured[P]["rel_error"] if P in measured else None,
                     "time_s": {str(g): comm_time(strategy, P, received, alpha, g) for g in gbits}})
    return rows


def dense_rows(n, model_ps, alpha, gbits):
    """The reference: a ring allreduce of all ``n`` float32 gradients."""
    rows = []
    for P in model_ps:
        received = 2 * (P - 1) / P * n * 4
        rows.append({"strategy": "dense", "P": P, "received": received,
                     "time_s": {str(g): comm_time("dense", P, received, alpha, g) for g in gbits}})
    return rows


# -- output --------------------------------------------------------------------------

def fmt(x, spec):
    return "–" if x is None else format(x, spec)


def table(rows, accuracy, gbits):
    lines = ["| strategy | P | union/k | MB received / rank | rel. error | "
             + " | ".join(f"ms @ {g} Gbit/s" for g in gbits) + " | test acc. |",
             "|---|---|---|---|---|" + "---|" * len(gbits) + "---|"]
    for r in rows:
        acc = accuracy.get((r["strategy"], r["P"]))
        lines.append(f"| {r['strategy']} | {r['P']}{'*' if r.get('extrapolated') else ''} | "
                     f"{fmt(r.get('union_k'), '.2f')} | {r['received'] / 1e6:.3g} | "
                     f"{fmt(r.get('rel_error'), '.3f')} | "
                     + " | ".join(f"{1e3 * r['time_s'][str(g)]:.2f}" for g in gbits)
                     + f" | {fmt(None if acc is None else 100 * acc, '.1f')} |")
    return "\n".join(lines)


def hint_table(rows, gbit):
    lines = [f"| variant | spec | union/k | × local's | rel. error | MB received / rank | "
             f"ms @ {gbit} Gbit/s |", "|---|---|---|---|---|---|---|"]
    local = next(r["union_k"] for r in rows if r["variant"] == "local")
    for r in rows:
        lines.append(f"| {r['variant']} | `{r['spec']}` | {r['union_k']:.2f} | "
                     f"{r['union_k'] / local:.2f} | {r['rel_error']:.3f} | "
                     f"{r['received'] / 1e6:.3g} | {1e3 * r['time_s']:.2f} |")
    return "\n".join(lines)


def plot(rows, dense, densities, gbits, path, big, big_dense, params):
    """A column per density: union/k against P, then the modelled time per bandwidth
    (the CNN), then the larger model's at 10 Gbit/s."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    g_big = 10 if 10 in gbits else gbits[0]
    fig, axes = plt.subplots(2 + len(gbits), len(densities),
                             figsize=(5.2 * len(densities), 3.4 * (2 + len(gbits))), squeeze=False)
    colors = dict(local="#4c72b0", union="#dd8452", leader="#55a868", hint="#c44e52",
                  dense="#777777")
    panels = [("union_k", "|U| / k", "union/k", rows, dense)] + [
        (str(g), "ms per step", f"modelled communication, {g} Gbit/s", rows, dense)
        for g in gbits] + [(str(g_big), "ms per step", f"{params / 1e6:g}M parameters, "
                            f"{g_big} Gbit/s", big, big_dense)]
    for j, density in enumerate(densities):
        for i, (key, ylabel, title, series, reference) in enumerate(panels):
            ax = axes[i][j]
            value = (lambda r: r["union_k"]) if i == 0 else (lambda r: 1e3 * r["time_s"][key])
            for strategy in STRATEGIES:
                sel = [r for r in series if r["strategy"] == strategy and r["density"] == density]
                meas = [r for r in sel if not r["extrapolated"]]
                extra = meas[-1:] + [r for r in sel if r["extrapolated"]]
                ax.plot([r["P"] for r in meas], [value(r) for r in meas], "o-",
                        color=colors[strategy], label=strategy)
                ax.plot([r["P"] for r in extra], [value(r) for r in extra], "o--",
                        color=colors[strategy], mfc="none")
            if i > 0:
                ax.plot([r["P"] for r in reference], [value(r) for r in reference], "s:",
                        color=colors["dense"], label="dense allreduce")
                ax.set_yscale("log")
            ax.set_title(f"{title}, density {density}", fontsize=9)
            ax.set_ylabel(ylabel)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("workers P")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle("simulated P: solid; extrapolated: dashed", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


# -- main ----------------------------------------------------------------------------

def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers", default="2,4,8,16,32,64", help="simulated P, comma-separated")
    p.add_argument("--densities", default="0.01,0.001")
    p.add_argument("--compressor", default="topk", help="a density sparsifier, e.g. laplace_topk")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--hint-study", action=argparse.BooleanOptionalAction, default=True,
                   help="the hint variants at --hint-workers and density 0.01")
    p.add_argument("--hint-workers", type=int, default=16)
    p.add_argument("--alpha-us", type=float, default=50.0, help="latency per message step")
    p.add_argument("--gbits", default="1,10,100", help="bandwidths in Gbit/s")
    p.add_argument("--quick", action="store_true", help="P = 2, 4, 8; 5 steps; hint study at 8")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--model-params", type=int, default=25_000_000,
                   help="parameters of the larger model the cost model is scaled to")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args()
    if args.quick:
        args.workers, args.steps, args.hint_workers = "2,4,8", 5, 8
    workers = sorted({int(w) for w in args.workers.split(",")})
    densities = [float(d) for d in args.densities.split(",")]
    gbits = [float(g) if "." in g else int(g) for g in args.gbits.split(",")]
    alpha = args.alpha_us * 1e-6
    torch.set_num_threads(1)
    start = time.perf_counter()

    # load_mnist(r, P) is the training digits [r::P]: load once, slice per P
    x, y, x_test, y_test = (torch.from_numpy(a) for a in load_mnist(0, 1))
    test = (x_test, y_test)
    sizes_n = [q.numel() for q in Net().parameters()]
    jobs = [(s, d, P) for d in densities for s in STRATEGIES for P in workers]
    if args.hint_study:
        jobs += [(s, HINT_DENSITY, args.hint_workers)
                 for s in ["local", "union"] + list(HINT_VARIANTS)]
    specs = {}
    for s, d, P in jobs:
        suffix = STRATEGIES.get(s, HINT_VARIANTS.get(s))
        specs.setdefault((f"{args.compressor}:density={d}{suffix}", P), (s, d))
    from tqdm import tqdm
    bar = tqdm(total=args.steps * sum(P for _, P in specs), desc="aggregation",
               unit="grad", disable=not show_progress(not args.no_progress), dynamic_ncols=True)
    runs = []
    for spec, P in specs:
        bar.set_postfix_str(f"P={P} {spec}")
        runs.append(train(spec, [(x[r::P], y[r::P]) for r in range(P)], test, args.steps,
                          P in {2, max(workers)}, bar))
    bar.close()

    measured = {}          # (spec, P) -> summary
    for run in runs:
        measured[run["spec"], run["P"]] = dict(summary(run), accuracy=run.get("accuracy"))
    model_ps = sorted(set(workers) | {2 ** i for i in range(1, int(math.log2(MODEL_MAX_P)) + 1)})
    rows, big, accuracy = [], [], {}
    for d in densities:
        probe = hvd_compress.from_spec(f"{args.compressor}:density={d}")
        sizes = [(n, probe.k(n)) for n in sizes_n]
        accuracy[d] = {}
        for s, suffix in STRATEGIES.items():
            spec = f"{args.compressor}:density={d}{suffix}"
            by_p = {P: measured[spec, P] for P in workers}
            rows += model_rows(s, d, by_p, sizes, model_ps, alpha, gbits)
            big += model_rows(s, d, by_p, sizes, model_ps, alpha, gbits,
                              k=probe.k(args.model_params))
            accuracy[d].update({(s, P): m["accuracy"] for P, m in by_p.items()
                                if m["accuracy"] is not None})
    dense = dense_rows(sum(sizes_n), model_ps, alpha, gbits)
    big_dense = dense_rows(args.model_params, model_ps, alpha, gbits)

    for d in densities:
        print(f"\n### {args.compressor}, density {d}: mean over {args.steps} steps "
              f"(* extrapolated; accuracy at P = 2 and {max(workers)})\n")
        print(table([r for r in rows if r["density"] == d], accuracy[d], gbits))
    print("\n### dense float32 ring allreduce (reference)\n")
    print(table(dense, {}, gbits))
    for d in densities:
        print(f"\n### modelled: a {args.model_params / 1e6:g}M-parameter model, density {d} "
              "(union/k as on the CNN)\n")
        print(table([r for r in big if r["density"] == d] + big_dense, {}, gbits))
    hint_rows = []
    if args.hint_study:
        g = 10 if 10 in gbits else gbits[0]
        for s in ["local", "union"] + list(HINT_VARIANTS):
            suffix = STRATEGIES.get(s, HINT_VARIANTS.get(s))
            spec = f"{args.compressor}:density={HINT_DENSITY}{suffix}"
            m = measured[spec, args.hint_workers]
            hint_rows.append(dict(m, variant=s, spec=spec, P=args.hint_workers,
                                  time_s=comm_time(strategy_of(spec), args.hint_workers,
                                                   m["received"], alpha, g)))
        print(f"\n### hint study: P = {args.hint_workers}, density {HINT_DENSITY}, "
              f"mean over {args.steps} steps\n")
        print(hint_table(hint_rows, g))

    elapsed = time.perf_counter() - start
    info = dict(date=datetime.date.today().isoformat(), torch=torch.__version__,
                cpus=os.cpu_count(), threads=1, compressor=args.compressor, workers=workers,
                densities=densities, steps=args.steps, batch_per_worker=BATCH, lr=LR,
                momentum=MOMENTUM, seed=SEED, alpha_s=alpha, gbits=gbits,
                model_workers=model_ps, elapsed_s=elapsed,
                extrapolation="union/k: least-squares line in log2 P through the three "
                              "largest simulated P, not below the last measured value, capped "
                              "at sum_t min(n_t, P k_t) / sum_t k_t; proposals per rank: last "
                              "measured; leader: last measured |U|/k and one proposer's length",
                runs=[dict(r, strategy=specs[r["spec"], r["P"]][0],
                           density=specs[r["spec"], r["P"]][1],
                           **summary(r)) for r in runs],
                model=rows, dense=dense, hint_study=hint_rows,
                large_model=dict(params=args.model_params, rows=big, dense=big_dense))
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"aggregation_{info['date']}")
    with open(stem + ".json", "w") as f:
        json.dump(info, f, indent=1)
    plot(rows, dense, densities, gbits, stem + ".png", big, big_dense, args.model_params)
    print(f"\nwrote {stem}.json and .png ({elapsed / 60:.1f} minutes)")


if __name__ == "__main__":
    main()
