"""TensorFlow step time under ``horovodrun -np 2 --gloo`` on plain loopback: a Keras
model shaped like CNNMLPLarge (two convolutions, then 4096 -> 1536 -> 10: 6.3M
parameters, most in one tensor), trained by a ``DistributedGradientTape`` step with each
compressor, eagerly and inside ``tf.function``, one thread per worker.  Rank 0 prints
the median step of each (compressor, mode) and the ratio to ``none`` in the same mode,
and writes JSON and a PNG.

    python benchmarks/step_time_tf.py                      # none, topk, laplace_topk
    python benchmarks/step_time_tf.py --specs "none;twobit" --modes eager --launches 3

Each launch runs every (mode, compressor) in turn on the same two processes; with
``--launches N`` the whole launch is repeated and every median is kept (a launch-to-launch
spread is this machine's noise; the table shows their range).  The split of a step
(compress, communicate, ...) is PyTorch's benchmark's (``step_time.py``); here only the
whole step.
"""
import sys
from pathlib import Path

# benchmarks/select.py is named like the stdlib module (which socket imports): drop this
# folder from sys.path first.
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SPECS = "none;topk:density=0.01;laplace_topk:density=0.01"


def worker(args):
    import numpy as np
    import tensorflow as tf
    import horovod.tensorflow as hvd
    sys.path.insert(0, str(ROOT))
    import hvd_compress
    import hvd_compress.tensorflow as hctf
    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.keras.utils.set_random_seed(0)
    L = tf.keras.layers
    model = tf.keras.Sequential([
        tf.keras.Input((32, 32, 3)),
        L.Conv2D(32, 3, padding="same", activation="relu"), L.MaxPooling2D(),
        L.Conv2D(64, 3, padding="same", activation="relu"), L.MaxPooling2D(),
        L.Flatten(), L.Dense(1536, activation="relu"), L.Dense(10)])
    variables = model.trainable_variables
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    rng = np.random.default_rng(hvd.rank())
    x = rng.random((args.batch, 32, 32, 3), dtype=np.float32)
    y = rng.integers(0, 10, args.batch)
    rows = []
    for mode in args.modes.split(","):
        for spec in args.specs.split(";"):
            compression = hvd_compress.from_spec(spec)

            def step(x, y, compression=compression):
                with tf.GradientTape() as tape:
                    loss = loss_fn(y, model(x, training=True))
                tape = hctf.DistributedGradientTape(tape, compression=compression)
                for v, g in zip(variables, tape.gradient(loss, variables)):
                    v.assign_sub(0.01 * g)
                return loss

            step = tf.function(step) if mode == "graph" else step
            times = []
            for i in range(args.warmup + args.steps):
                start = time.perf_counter()
                float(step(x, y))
                if i >= args.warmup:
                    times.append(time.perf_counter() - start)
            rows.append({"mode": mode, "spec": spec, "median_s": statistics.median(times),
                         "steps_s": times, "sent": hctf.stats(compression).as_dict()})
    if hvd.rank() == 0:
        Path(args.out).write_text(json.dumps(rows))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--specs", default=SPECS, help="separated by ';'")
    p.add_argument("--modes", default="eager,graph", help="eager and/or graph (tf.function)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--launches", type=int, default=2)
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/...)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    stamp = datetime.date.today().isoformat()
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"step_time_tf_{stamp}.json")
    horovodrun = str(Path(sys.executable).with_name("horovodrun"))
    launches = []
    for n in range(args.launches):
        part = out.with_suffix(f".launch{n}.tmp")
        cmd = [horovodrun, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, __file__,
               "--worker", "--specs", args.specs, "--modes", args.modes, "--steps",
               str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch),
               "--out", str(part)]
        print(f"launch {n + 1}/{args.launches}", flush=True)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
        launches.append(json.loads(part.read_text()))
        part.unlink()
    import tensorflow as tf
    result = {"date": stamp, "tensorflow": tf.__version__, "cpus": os.cpu_count(),
              "workers": 2, "threads_per_worker": 1, "link": "plain", "launches": launches}
    print(f"\nTensorFlow {tf.__version__}, 2 workers, plain loopback, {stamp}; median ms a step "
          f"per launch (x faster than none in the same launch and mode)")
    print("| mode | compressor | step ms | × vs none |\n|---|---|---|---|")
    cells = {}
    for rows in launches:
        base = {r["mode"]: r["median_s"] for r in rows if r["spec"] == "none"}
        for r in rows:
            ratio = base[r["mode"]] / r["median_s"] if r["mode"] in base else float("nan")
            cells.setdefault((r["mode"], r["spec"]), []).append((r["median_s"] * 1e3, ratio))
    for (mode, spec), v in cells.items():
        ms = " / ".join(f"{m:.0f}" for m, _ in v)
        ratio = " / ".join(f"{q:.2f}×" for _, q in v)
        print(f"| {mode} | `{spec}` | {ms} | {ratio} |")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    plot(cells, out.with_suffix(".png"), f"TensorFlow {tf.__version__} step, 2 workers, {stamp}")
    print(f"wrote {out} and {out.with_suffix('.png')}")


def plot(cells, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 4))
    labels = [f"{spec}\n({mode})" for mode, spec in cells]
    for i, v in enumerate(cells.values()):
        ax.scatter([i] * len(v), [m for m, _ in v], color="C0")
        ax.bar(i, statistics.median(m for m, _ in v), color="C0", alpha=0.3)
    ax.set_xticks(range(len(labels)), labels, fontsize=7)
    ax.set_ylabel("median ms per step (each dot a launch)")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
