"""Does compression make a training step faster?  Median step time under
``horovodrun -np 2 --gloo`` per compressor and model, on plain loopback and on loopback
shaped to 1 Gbit/s and 100 Mbit/s, split into compute / compress / communicate /
decompress (see benchmarks/step_time_worker.py for what each part holds).

    python benchmarks/step_time.py                     # everything (about 15-25 minutes)
    python benchmarks/step_time.py --links plain --models cnn_mlp_large --quick
    python benchmarks/step_time.py --links plain,1gbit --models transformer   # torch's own
                                                  # nn.TransformerEncoder, 4.5M parameters
    python benchmarks/step_time.py --specs "none;topk:density=0.01@0;topk:density=0.01"
                                                  # "@0": bucket_mb=0 (tensor by tensor)
    python benchmarks/step_time.py --np 3 --links 1gbit --name step_time_agg \
        --specs "none;topk:density=0.01;topk:density=0.01,agg=leader"   # 3 workers

Every compressor of a (link, model) pair runs in one horovodrun launch, one after the
other on the same processes.  ``horovod`` is Horovod's own DistributedOptimizer without
compression: the speed users have without this project.  Shaped links need root (a
network namespace with ``tc ... tbf``, hvd_compress/shaped_link.py); without it the
script says so and measures plain loopback only.  Two workers share this machine's cores
(one thread each), so absolute times are CPU times; ratios between compressors of the
same run are the result.  Prints a table per link and writes
benchmarks/results/step_time_<date>.json and .png (stacked bars).
"""
import sys
from pathlib import Path

sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from hvd_compress.shaped_link import shaped_link  # noqa: E402

SPECS = ["horovod", "none", "fp16", "topk:density=0.01", "laplace_topk:density=0.01",
         "laplace_topk:density=0.01,values=rangefloat8", "dct:density=0.01,block=64",
         "twobit", "hylo", "rangefloat:bits=8",
         # peer baselines (hvd_compress.compressors.lowrank / stochastic / sign)
         "powersgd:rank=4", "qsgd", "terngrad", "signsgd", "onebit"]
MODELS = ["mnist_cnn", "vgg_small", "resnet_small", "cnn_mlp_large"]
LINKS = {"plain": None, "1gbit": "1gbit", "100mbit": "100mbit"}
# (measured steps, warm-up steps) per link and model: more steps where steps are short,
# so that every median is of several seconds of training where it can be
STEPS = {"plain": {"mnist_cnn": (60, 5), "vgg_small": (20, 3), "resnet_small": (20, 3),
                   "cnn_mlp_large": (15, 3)},
         "1gbit": {"mnist_cnn": (40, 5), "vgg_small": (12, 3), "resnet_small": (12, 3),
                   "cnn_mlp_large": (10, 3)},
         "100mbit": {"mnist_cnn": (30, 5), "vgg_small": (8, 2), "resnet_small": (8, 2),
                     "cnn_mlp_large": (6, 2)}}
PARTS = ["compute", "compress", "communicate", "decompress", "other"]


def run_pair(prefix, link, model, specs, steps, warmup, timeout, workers=2):
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        python = sys.executable
        horovodrun = str(Path(python).with_name("horovodrun"))
        argv = prefix + [horovodrun, "-np", str(workers), "-H", f"localhost:{workers}", "--gloo", python,
                         str(ROOT / "benchmarks" / "step_time_worker.py"), "--model", model,
                         "--specs", ";".join(specs), "--steps", str(steps),
                         "--warmup", str(warmup), "--out", out]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        for line in done.stdout.splitlines():
            if "<stdout>:" in line:
                print(f"  [{link}]" + line.split("<stdout>:", 1)[1], flush=True)
        if done.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"horovodrun failed ({done.returncode}) for {link}/{model}:\n"
                               + done.stderr[-3000:])
        with open(out) as f:
            rows = json.load(f)
    for r in rows:
        r["link"] = link
    return rows


def table(rows, link):
    lines = [f"\n### {link}\n",
             "| model | compressor | step ms | × vs none | compute | compress | communicate "
             "| decompress | other | bytes sent / step |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for model in dict.fromkeys(r["model"] for r in rows if r["link"] == link):
        sel = [r for r in rows if r["link"] == link and r["model"] == model]
        base = next((r["total"] for r in sel if r["spec"] == "none"), None)
        for r in sel:
            ratio = f"{base / r['total']:.2f}×" if base else "-"
            lines.append(f"| {model} | {r['spec']} | {1e3 * r['total']:.1f} | {ratio} | "
                         + " | ".join(f"{1e3 * r[p]:.1f}" for p in PARTS)
                         + f" | {r['sent']:,.0f} |")
    return "\n".join(lines)


def plot(rows, links, models, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(links), len(models), figsize=(4.2 * len(models), 3.6 * len(links)),
                             squeeze=False)
    colors = dict(compute="#4c72b0", compress="#dd8452", communicate="#c44e52",
                  decompress="#8172b3", other="#bbbbbb")
    for i, link in enumerate(links):
        for j, model in enumerate(models):
            ax = axes[i][j]
            sel = [r for r in rows if r["link"] == link and r["model"] == model]
            bottom = [0.0] * len(sel)
            for part in PARTS:
                vals = [1e3 * r[part] for r in sel]
                ax.bar(range(len(sel)), vals, bottom=bottom, color=colors[part],
                       label=part if (i, j) == (0, 0) else None)
                bottom = [b + v for b, v in zip(bottom, vals)]
            ax.set_xticks(range(len(sel)), [r["spec"].replace(":density=0.01", "")
                                             .replace(",values=rangefloat8", "+rf8")
                                             .replace(",block=64", "") for r in sel],
                          rotation=60, ha="right", fontsize=7)
            ax.set_title(f"{model} — {link}", fontsize=9)
            if j == 0:
                ax.set_ylabel("median step ms")
    fig.legend(loc="upper center", ncol=len(PARTS), fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=100)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--links", default=",".join(LINKS), help="plain,1gbit,100mbit")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--specs", default=";".join(SPECS), help="separated by ';'")
    p.add_argument("--quick", action="store_true", help="3 steps after 1 warm-up")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per horovodrun launch")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--np", type=int, default=2, dest="workers",
                   help="workers (horovodrun -np), one thread each")
    p.add_argument("--name", default="step_time", help="results file stem (before the date)")
    args = p.parse_args()
    links = args.links.split(",")
    models, specs = args.models.split(","), args.specs.split(";")
    if any(LINKS.get(link) for link in links) and os.geteuid() != 0:
        print("not root: shaped links need a network namespace and tc; measuring plain "
              "loopback only", flush=True)
        links = ["plain"]
    rows = []
    for link in links:
        with shaped_link(LINKS[link]) as prefix:
            for model in models:
                steps, warmup = (3, 1) if args.quick else STEPS[link].get(model, (10, 3))
                rows += run_pair(prefix, link, model, specs, steps, warmup, args.timeout,
                                 args.workers)
    import torch
    import horovod
    info = dict(date=datetime.date.today().isoformat(), torch=torch.__version__,
                horovod=horovod.__version__, cpus=os.cpu_count(), workers=args.workers,
                threads_per_worker=1, links=links, rows=rows)
    for link in links:
        print(table(rows, link))
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"{args.name}_{info['date']}")
    with open(stem + ".json", "w") as f:
        json.dump(info, f, indent=1)
    plot(rows, links, models, stem + ".png")
    print(f"\nwrote {stem}.json and .png")


if __name__ == "__main__":
    main()
