"""Flat against hierarchical exchange on hosts of L workers, modelled (alpha-beta), from
P = 8 to 512 workers: bytes over each host's slow link per step, and the modelled
exchange time (communication + compress + decompress; compute excluded, it is the same
for both).  One process, no Horovod, seconds to run.

    python benchmarks/hierarchical_model.py                     # the table, JSON and PNG
    python benchmarks/hierarchical_model.py --local 4 --inter-gbit 10,100

Setting (issue 28): H hosts of L workers (P = H L), a fast link inside a host (default
300 GB/s, NVLink-class, alpha_in = 5 us per message step) and one network link per
host between hosts (10, 25, 100 Gbit/s, alpha_x = 50 us), models of n = 25M
(ResNet-50-sized) and 124M (GPT-2 small) float32 parameters, one fused bucket.  Ranks
are numbered host by host, as horovodrun numbers them, so a ring over all P workers
crosses each host's network link once in each direction (on a single host, P <= L,
the flat rings run over the fast link instead).

Methods, per step (``m = 8 d n`` bytes: laplace_topk at density ``d``, an int32 index
and a float32 value per kept entry; every rank sends ``m``):

  dense flat           ring allreduce of 4n bytes over P:
                         2 (P-1) (alpha_x + 4n / (P B_x))
                         slow-link bytes per host: 2 (P-1)/P 4n
  sparse flat          ring allgather of m per rank over P:
                         (P-1) (alpha_x + m / B_x)
                         slow-link bytes per host: (P-1) m
                         compress n; decompress: 4n + P m
  sparse hierarchical  (1) reduce-scatter of 4n inside the host,
                         (L-1) (alpha_in + 4n / (L B_in));
                       (2) local rank l compresses its shard of n/L values (m/L bytes)
                         and allgathers it with the H ranks of local rank l: L rings
                         share the host's link, so each runs at B_x / L:
                         (H-1) (alpha_x + (m/L) / (B_x / L)) = (H-1) (alpha_x + m / B_x)
                         slow-link bytes per host: L (H-1) m/L = (H-1) m;
                       (3) decompress H shards: 4n/L + H m/L;
                       (4) allgather of 4n inside the host, (L-1) (alpha_in + 4n/(L B_in)).

So the hierarchical exchange sends L times fewer bytes over each host's link
((H-1) m against (P-1) m) and compresses 1/L of the gradient per worker, for two dense
passes over the fast link.  Compress and decompress run at ``--codec-gbps`` (default
130 GB/s of float32 input: laplace_topk on the H100,
benchmarks/results/gpu_2026-11-23/codecs.json, 116-141 GB/s at 25M-100M values).

Prints a markdown table per model and writes
benchmarks/results/hierarchical_model_<date>.json and .png (slow-link MB per host and
modelled ms against P, one panel per model and inter-host bandwidth).
"""
import sys
from pathlib import Path

sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def link(P, L, c):
    """(alpha, bandwidth, slow?) of a flat ring over P workers: on one host (P <= L) the
    fast link, else each step waits for the edges that cross a host's network link."""
    return (c["alpha_in"], c["bin"], False) if P <= L else (c["alpha_x"], c["bx"], True)


def dense_flat(n, P, L, c):
    alpha, bw, slow = link(P, L, c)
    t = 2 * (P - 1) * (alpha + 4 * n / (P * bw))
    return {"slow_bytes_per_host": 2 * (P - 1) / P * 4 * n if slow else 0.0, "comm_s": t,
            "codec_s": 0.0}


def sparse_flat(n, P, L, c, d):
    m = 8 * d * n
    alpha, bw, slow = link(P, L, c)
    comm = (P - 1) * (alpha + m / bw)
    codec = (4 * n + 4 * n + P * m) / c["codec"]
    return {"slow_bytes_per_host": (P - 1) * m if slow else 0.0, "comm_s": comm,
            "codec_s": codec}


def sparse_hier(n, P, L, c, d):
    H = P // L
    m = 8 * d * n
    local = 2 * (L - 1) * (c["alpha_in"] + 4 * n / (L * c["bin"])) if L > 1 else 0.0
    cross = (H - 1) * (c["alpha_x"] + m / c["bx"])
    # one host: the dense reduce-scatter and allgather are the whole exchange
    codec = (4 * n / L + 4 * n / L + H * m / L) / c["codec"] if H > 1 else 0.0
    return {"slow_bytes_per_host": (H - 1) * m, "comm_s": local + cross, "codec_s": codec,
            "intra_s": local}


def rows_for(n, ps, L, gbits, args):
    rows = []
    for g in gbits:
        c = {"alpha_x": args.alpha_x_us * 1e-6, "alpha_in": args.alpha_in_us * 1e-6,
             "bx": g * 1e9 / 8, "bin": args.intra_gbps * 1e9, "codec": args.codec_gbps * 1e9}
        for P in ps:
            if P % L:
                continue
            for method, fn in (("dense flat", lambda: dense_flat(n, P, L, c)),
                               ("sparse flat", lambda: sparse_flat(n, P, L, c, args.density)),
                               ("sparse hier", lambda: sparse_hier(n, P, L, c, args.density))):
                r = fn()
                r.update(method=method, params=n, P=P, L=L, hosts=P // L, inter_gbit=g,
                         total_s=r["comm_s"] + r["codec_s"])
                rows.append(r)
    return rows


def table(rows, n, gbits, ps):
    out = [f"\n### {n / 1e6:.0f}M parameters (laplace_topk density 0.01; MB over each "
           "host's link per step / modelled ms, communication + compress + decompress)\n"]
    head = "| P (hosts × 8) | " + " | ".join(
        f"{m} @ {g} Gbit/s" for g in gbits for m in ("dense flat", "sparse flat", "sparse hier"))
    out += [head + " | hier vs flat |", "|" + "---|" * (2 + 3 * len(gbits))]
    for P in ps:
        cells, ratio = [], []
        for g in gbits:
            sel = {r["method"]: r for r in rows if r["P"] == P and r["inter_gbit"] == g}
            if not sel:
                continue
            for m in ("dense flat", "sparse flat", "sparse hier"):
                r = sel[m]
                cells.append(f"{r['slow_bytes_per_host'] / 1e6:,.1f} MB / "
                             f"{1e3 * r['total_s']:,.1f} ms")
            ratio.append(f"{sel['sparse flat']['total_s'] / sel['sparse hier']['total_s']:.1f}×")
        if cells:
            out.append(f"| {P} ({P // rows[0]['L']}) | " + " | ".join(cells) +
                       f" | {' / '.join(ratio)} |")
    return "\n".join(out)


def plot(rows, models, gbits, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, len(models), figsize=(6 * len(models), 8), squeeze=False)
    styles = {10: ":", 25: "--", 100: "-"}
    colors = {"dense flat": "gray", "sparse flat": "tab:red", "sparse hier": "tab:blue"}
    for j, n in enumerate(models):
        for m in colors:
            for g in gbits:
                sel = sorted((r for r in rows if r["params"] == n and r["method"] == m
                              and r["inter_gbit"] == g), key=lambda r: r["P"])
                ps = [r["P"] for r in sel]
                axes[1][j].plot(ps, [1e3 * r["total_s"] for r in sel], styles.get(g, "-"),
                                color=colors[m], marker=".", label=f"{m} {g} Gbit/s")
            sel = sorted((r for r in rows if r["params"] == n and r["method"] == m
                          and r["inter_gbit"] == gbits[0] and r["slow_bytes_per_host"] > 0),
                         key=lambda r: r["P"])      # one host: nothing on a log axis
            axes[0][j].plot([r["P"] for r in sel], [r["slow_bytes_per_host"] / 1e6 for r in sel],
                            color=colors[m], marker=".", label=m)
        axes[0][j].set_ylabel("MB over each host's link per step")
        axes[1][j].set_ylabel("modelled ms per exchange")
        for i in range(2):
            ax = axes[i][j]
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("workers P (8 per host)")
            ax.set_title(f"{n / 1e6:.0f}M parameters")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers", default="8,16,32,64,128,256,512")
    p.add_argument("--local", type=int, default=8, help="workers per host (L)")
    p.add_argument("--params", default="25e6,124e6")
    p.add_argument("--inter-gbit", default="10,25,100")
    p.add_argument("--intra-gbps", type=float, default=300.0, help="GB/s inside a host")
    p.add_argument("--alpha-x-us", type=float, default=50.0)
    p.add_argument("--alpha-in-us", type=float, default=5.0)
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--codec-gbps", type=float, default=130.0)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args()
    if args.local < 1:
        p.error("--local must be >= 1")
    if not 0 < args.density <= 1:
        p.error("--density must be in (0, 1]")
    ps = [int(x) for x in args.workers.split(",")]
    models = [int(float(x)) for x in args.params.split(",")]
    gbits = [float(x) if "." in x else int(x) for x in args.inter_gbit.split(",")]
    rows = [r for n in models for r in rows_for(n, ps, args.local, gbits, args)]
    for n in models:
        print(table([r for r in rows if r["params"] == n], n, gbits, ps))
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"hierarchical_model_{datetime.date.today().isoformat()}")
    info = dict(date=datetime.date.today().isoformat(), args=vars(args), rows=rows)
    with open(stem + ".json", "w") as f:
        json.dump(info, f, indent=1)
    plot(rows, models, gbits, stem + ".png")
    print(f"\nwrote {stem}.json and .png")


if __name__ == "__main__":
    main()
