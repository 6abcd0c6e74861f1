"""How far each tensor's top-k threshold moves from one step to the next in real
training, and how many passes laplace_topk's fused search reads the bucket for: the
evidence for (or against) starting the search at the previous step's threshold.

A small GPT-2 (Hugging Face ``transformers``, examples/gpt2_text.py: byte-level, real
text) trains with AdamW on one process, dense.  Beside it, each tensor's gradient goes
through error feedback as laplace_topk's would (``c = g + r``; the ``k = density * n``
largest ``|c|`` sent; ``r = c`` with them zeroed), and at each step the exact threshold
``t`` (the k-th largest ``|c|``, what the fused search brackets) and the Laplace fit
``t0 = mean|c| ln(1/density)`` (where the search starts) are recorded per tensor.

Reported: the share of (tensor, step) pairs whose threshold lies within a factor
``1 + w`` of the previous step's, for several ``w`` (a search started in that window
needs no bracket around the Laplace fit), over all steps and after the first 20; the
spread of ``t / t0``; and, every ``--search-every`` steps, the passes of the fused
search (``hvd_compress.compressors.fused_search``, its torch reference on the CPU) that
read the bucket (a tensor still searched) and how close its count lands to k; and the
same for the search started warm at every step (``histogram_search(warm=)``: within a
factor 1.13 of the previous step's warm search's brackets).  Writes
benchmarks/results/threshold_drift_<date>.json and .png (the distribution of
``log2(t_s / t_(s-1))`` per step range).  CPU only; no timing.

    python benchmarks/threshold_drift.py               # 300 steps, ~2 minutes
    python benchmarks/threshold_drift.py --fold        # warm=1's search (~4 minutes)
"""
import sys
from pathlib import Path

sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "examples"))
from gpt2_text import corpus, make_model, train_batch  # noqa: E402

WINDOWS = (0.05, 0.10, 0.13, 0.20, 0.50)


def search_passes(grads, density, warm=None, fold=False):
    """The fused search over the bucket of ``grads`` (name -> flat c), started cold (at
    each tensor's Laplace fit) or ``warm`` (a previous search's brackets): how many of its
    passes read the bucket (some tensor still searched before it), the largest relative
    distance of a tensor's count from k after the search, the tensors, and the brackets
    for the next warm start.  ``fold``: a warm search's first pass counted by the sums
    pass (``laplace_topk:warm=1``'s), not a read of its own."""
    from hvd_compress.buckets import layout
    from hvd_compress.compressors import fused_search as fs
    from hvd_compress.kernels.histogram_select import C_HI, QUOTA
    from hvd_compress.ops import torch_ops as ops
    from hvd_compress.spec import from_spec
    names = list(grads)
    lay = layout(names, [(grads[n].numel(),) for n in names])
    flat = torch.cat([grads[n] for n in names])
    sel = from_spec(f"laplace_topk:density={density},fused=1")
    k_t = fs.bucket_constants(sel, lay, sel.tol, ops, flat)[0]
    reading = []
    state = fs.histogram_search(sel, flat, lay, ops, warm=warm, reading=reading,
                                fold=fold)[1]
    sent = state[C_HI] + state[QUOTA]
    off = ((sent - k_t).abs().float() / k_t.float()).max()
    passes, entries = fs.reads(reading, lay.numels)
    return passes, entries, float(off), len(names), fs.warm_brackets(state)


def warm_summary(rows):
    """The warm searches after the first step (which starts cold): the share of steps by
    passes that read the bucket, their mean, and the worst count off k."""
    later = rows[1:]
    if not later:
        return {}
    passes = sorted({r["reading_passes"] for r in later})
    return {"steps": len(later),
            "share_by_passes": {p: sum(r["reading_passes"] == p for r in later) / len(later)
                                for p in passes},
            "mean_passes": sum(r["reading_passes"] for r in later) / len(later),
            "mean_bucket_reads": sum(r["bucket_reads"] for r in later) / len(later),
            "worst_count_off_k": max(r["worst_count_off_k"] for r in later)}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--min-size", type=int, default=1000,
                   help="tensors of fewer values are left out (laplace_topk sends them "
                        "whole with min_size=)")
    p.add_argument("--search-every", type=int, default=25)
    p.add_argument("--no-warm", dest="warm", action="store_false",
                   help="leave out the search started at the previous step's brackets "
                        "(every step)")
    p.add_argument("--fold", action="store_true",
                   help="the warm search's first pass folded into the sums pass, as "
                        "laplace_topk:warm=1 makes it (default: a pass of its own)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args()
    torch.set_num_threads(1)
    train, _ = corpus()
    model = make_model(args)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    params = {n: q for n, q in model.named_parameters() if q.numel() >= args.min_size}
    residual = {n: torch.zeros(q.numel()) for n, q in params.items()}
    prev, moves, fits, searches, warm_reads, brackets = {}, [], [], [], [], None
    try:
        from tqdm import tqdm
        steps = tqdm(range(args.steps), desc="steps")
    except ImportError:
        steps = range(args.steps)
    for step in steps:
        batch = train_batch(train, step, 0, args.batch, args.seq)
        loss = model(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss
        opt.zero_grad()
        loss.backward()
        compensated = {}
        for n, q in params.items():
            c = q.grad.reshape(-1) + residual[n]
            k = max(1, int(args.density * c.numel()))
            mag = c.abs()
            t = float(torch.topk(mag, k, sorted=False).values.min())
            fit = float(mag.mean()) * math.log(1.0 / args.density)
            fits.append(t / fit if fit > 0 else float("nan"))
            if n in prev and prev[n] > 0 and t > 0:
                moves.append((step, math.log2(t / prev[n])))
            prev[n] = t
            compensated[n] = c
            residual[n] = torch.where(mag >= t, torch.zeros_like(c), c)
        if step % args.search_every == 0:
            reading, entries, off, tensors, _ = search_passes(compensated, args.density)
            searches.append({"step": step, "reading_passes": reading, "bucket_reads": entries,
                             "worst_count_off_k": off, "tensors": tensors})
        if args.warm:          # every step, from the previous step's warm search
            reading, entries, off, _, brackets = search_passes(compensated, args.density,
                                                               brackets, args.fold)
            warm_reads.append({"step": step, "reading_passes": reading,
                               "bucket_reads": entries, "worst_count_off_k": off})
        opt.step()
    rows = []
    for label, lo in (("all steps", 0), ("after step 20", 20)):
        picked = [abs(m) for s, m in moves if s >= lo]
        rows.append({"steps": label, "pairs": len(picked), **{
            f"within_{w:g}": sum(m <= math.log2(1 + w) for m in picked) / max(len(picked), 1)
            for w in WINDOWS}})
    ranked = sorted(f for f in fits if f == f)
    q = {f"t_over_fit_p{c}": ranked[min(len(ranked) - 1, int(c / 100 * len(ranked)))]
         for c in (1, 50, 99)}
    print(f"GPT-2 {args.layers}x{args.width}, AdamW lr {args.lr}, {args.steps} steps, density "
          f"{args.density}, {len(params)} tensors of >= {args.min_size} values")
    print("threshold within a factor 1 + w of the previous step's (share of tensor-steps):")
    print(f"  {'steps':15s} {'pairs':>6s} "
          + " ".join(f"{'w=' + format(w, 'g'):>7s}" for w in WINDOWS))
    for r in rows:
        print(f"  {r['steps']:15s} {r['pairs']:6d} " + " ".join(
            f"{r[f'within_{w:g}']:7.1%}" for w in WINDOWS))
    print("t / Laplace fit: p1 %.2f, median %.2f, p99 %.2f" % tuple(q.values()))
    print("fused search: passes that read the bucket (its entries read) " + ", ".join(
        f"step {s['step']}: {s['reading_passes']} ({s['bucket_reads']:.2f})" for s in searches)
        + f"; worst count off k {max(s['worst_count_off_k'] for s in searches):.2%}")
    warm = warm_summary(warm_reads)
    cold_passes = sum(s["reading_passes"] for s in searches) / len(searches)
    cold_reads = sum(s["bucket_reads"] for s in searches) / len(searches)
    if warm:
        print("warm start (the previous step's brackets widened by a factor 1.13"
              + ("; its first pass folded into the sums pass" if args.fold else "")
              + "): passes that read the bucket, share of steps after the first: " + ", ".join(
                  f"{p}: {share:.1%}" for p, share in warm["share_by_passes"].items())
              + f"; mean {warm['mean_passes']:.2f} (cold: {cold_passes:.2f}); the bucket's "
              f"entries read {warm['mean_bucket_reads']:.2f} times a search (cold: "
              f"{cold_reads:.2f}); worst count off k {warm['worst_count_off_k']:.2%}")
    date = datetime.date.today().isoformat()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"threshold_drift{'_fold' if args.fold else ''}_{date}.json"
    path.write_text(json.dumps({"date": date, "args": vars(args), "windows": rows, **q,
                                "searches": searches, "warm": warm, "warm_steps": warm_reads,
                                "torch": torch.__version__}, indent=1))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7, 4))
        span = 1.5                                   # (moves past it: counted in the label)
        for label, lo, hi in (("steps 1-20", 0, 20), ("after step 20", 20, args.steps)):
            picked = [m for s, m in moves if lo <= s < hi]
            past = sum(abs(m) > span for m in picked)
            ax.hist(picked, bins=120, range=(-span, span), alpha=0.6,
                    label=f"{label} ({past} of {len(picked)} beyond ±{span:g})")
        for w in (0.13,):
            for sign in (-1, 1):
                ax.axvline(sign * math.log2(1 + w), color="k", ls=":", lw=1)
        ax.set_xlabel("log2(t_s / t_(s-1)), per tensor and step (dotted: a factor 1.13)")
        ax.set_ylabel("tensor-steps (log)")
        ax.set_yscale("log")
        ax.set_title(f"top-{args.density:g} threshold's move per step, GPT-2 + AdamW")
        ax.legend()
        fig.tight_layout()
        fig.savefig(path.with_suffix(".png"), dpi=120)
    except ImportError:
        print("(matplotlib missing: no PNG)")
    print(f"wrote {path} and .png")


if __name__ == "__main__":
    main()
