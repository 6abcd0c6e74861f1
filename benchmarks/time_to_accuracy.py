"""Time to accuracy: MNIST-5k test accuracy against wall-clock seconds, per compressor,
PyTorch and TensorFlow, on plain loopback and on loopback shaped to 100 Mbit/s.

    python benchmarks/time_to_accuracy.py                      # everything (~30 minutes)
    python benchmarks/time_to_accuracy.py --frameworks pytorch --links 100mbit --epochs 5

Each run is the README's own example (examples/pytorch_mnist.py or
examples/tensorflow2_mnist.py) under ``horovodrun -np 2 --gloo``, started by this script
(inside a shaped network namespace for 100mbit: hvd_compress/tools/shaped_link.py, root
needed).  The examples log, per epoch, the seconds since training started (rank 0, test
evaluation included: the same 1,000 images for every compressor) and the test accuracy.
Prints the time to reach ``--target`` per compressor and its speed-up over ``none``, and
writes benchmarks/results/time_to_accuracy_<date>.json and .png (one curve per
compressor, a panel per framework and link).
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
import time  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from hvd_compress.tools.shaped_link import shaped_link  # noqa: E402

SPECS = ["none", "fp16", "topk:density=0.01", "laplace_topk:density=0.01",
         "laplace_topk:density=0.01,values=rangefloat8", "hylo",
         "powersgd:rank=4", "qsgd", "terngrad", "signsgd", "onebit"]     # peer baselines
LINKS = {"plain": None, "100mbit": "100mbit"}
EXAMPLES = {"pytorch": "examples/pytorch_mnist.py", "tensorflow": "examples/tensorflow2_mnist.py"}


def run_one(prefix, framework, spec, epochs, timeout):
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "log.json")
        python = sys.executable
        horovodrun = str(Path(python).with_name("horovodrun"))
        argv = prefix + [horovodrun, "-np", "2", "-H", "localhost:2", "--gloo", python,
                         str(ROOT / EXAMPLES[framework]), "--compression", spec,
                         "--epochs", str(epochs), "--json", out, "--no-progress"]
        start = time.perf_counter()
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                              cwd=str(ROOT))
        wall = time.perf_counter() - start
        if done.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"{framework} {spec} failed ({done.returncode}):\n"
                               + done.stderr[-3000:])
        with open(out) as f:
            log = json.load(f)
    log["launch_wall_s"] = wall
    return log


def time_to(log, target):
    for row in log["epochs_log"]:
        if row["test_accuracy"] >= target:
            return row["elapsed_s"]
    return None


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--frameworks", default="pytorch,tensorflow")
    p.add_argument("--links", default="plain,100mbit")
    p.add_argument("--specs", default=";".join(SPECS), help="separated by ';'")
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--target", type=float, default=0.95)
    p.add_argument("--timeout", type=int, default=1800)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--name", default="time_to_accuracy", help="results file stem (before the date)")
    args = p.parse_args()
    frameworks, links, specs = args.frameworks.split(","), args.links.split(","), args.specs.split(";")
    if any(LINKS.get(link) for link in links) and os.geteuid() != 0:
        print("not root: shaped links need a network namespace and tc; plain loopback only")
        links = ["plain"]
    runs = []
    for link in links:
        with shaped_link(LINKS[link]) as prefix:
            for framework in frameworks:
                for spec in specs:
                    log = run_one(prefix, framework, spec, args.epochs, args.timeout)
                    log.update(link=link, time_to_target_s=time_to(log, args.target))
                    runs.append(log)
                    last = log["epochs_log"][-1]
                    ttt = log["time_to_target_s"]
                    print(f"  [{link}] {framework:10s} {spec:45s} final {100 * last['test_accuracy']:.1f}% "
                          f"in {last['elapsed_s']:.1f} s; {100 * args.target:.0f}% at "
                          f"{'never' if ttt is None else f'{ttt:.1f} s'}", flush=True)
    print(f"\n| link | framework | compressor | final accuracy | train s | s to {100 * args.target:.0f}% "
          "| speed-up vs none |\n|---|---|---|---|---|---|---|")
    for r in runs:
        base = next((b["time_to_target_s"] for b in runs if b["link"] == r["link"]
                     and b["framework"] == r["framework"] and b["compression"] == "none"), None)
        t = r["time_to_target_s"]
        speed = f"{base / t:.2f}×" if (t and base) else "-"
        print(f"| {r['link']} | {r['framework']} | {r['compression']} | "
              f"{100 * r['epochs_log'][-1]['test_accuracy']:.1f}% | "
              f"{r['epochs_log'][-1]['elapsed_s']:.1f} | {'never' if t is None else f'{t:.1f}'} | {speed} |")
    info = dict(date=datetime.date.today().isoformat(), target=args.target, epochs=args.epochs,
                links=links, frameworks=frameworks, runs=runs)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"{args.name}_{info['date']}")
    with open(stem + ".json", "w") as f:
        json.dump(info, f, indent=1)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(links), len(frameworks), figsize=(6 * len(frameworks), 4 * len(links)),
                             squeeze=False)
    for i, link in enumerate(links):
        for j, fw in enumerate(frameworks):
            ax = axes[i][j]
            for r in runs:
                if r["link"] == link and r["framework"] == fw:
                    ax.plot([e["elapsed_s"] for e in r["epochs_log"]],
                            [100 * e["test_accuracy"] for e in r["epochs_log"]], marker=".",
                            label=r["compression"])
            ax.axhline(100 * args.target, color="k", ls="--", lw=0.8)
            ax.set_ylim(80, 100)
            ax.set_xlabel("wall-clock seconds (rank 0)")
            ax.set_ylabel("test accuracy %")
            ax.set_title(f"{fw}, {link}")
            ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(stem + ".png", dpi=100)
    print(f"\nwrote {stem}.json and .png")


if __name__ == "__main__":
    main()
