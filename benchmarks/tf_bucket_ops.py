"""What one TensorFlow bucket costs as the number of its tensors grows: graph ops, trace
time and time per call of a compress (error feedback included) and a decompress of two
ranks' payloads, eagerly and inside ``tf.function``, for a bucket of the same values
split into T = 4 and T = 160 tensors (a ResNet-50 has 161).

    python benchmarks/tf_bucket_ops.py --out DIR [--values 8336000] [--specs twobit,...]

Tensor by tensor, each tensor's codec adds its own ops (some 130-180 for twobit); the
codecs that TensorFlow packs over the whole bucket (``tf_ops.codecs._VECTORISED``) add a
few.  Times are this machine's (a CPU: one intra-op thread, ``--threads``); best of
``--reps``.  Writes ``tf_bucket_ops_<date>.json`` and ``.png``.
"""
import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402

SPECS = ["twobit", "rangefloat:bits=8", "topk:density=0.01", "fp16"]


def _bucket(spec, T, values):
    import tensorflow as tf

    import hvd_compress
    from hvd_compress.buckets import layout
    c = hvd_compress.from_spec(spec)
    lay = layout([f"t{i}" for i in range(T)], [(values // T,)] * T)

    def step(flat):
        payload, ctx = c.compress_bucket(flat, lay)
        two = (tuple(tf.concat([p, p], 0) for p in payload) if c.collective == "allgather"
               else tf.nest.map_structure(lambda p: p + p, payload))
        return c.decompress_bucket(two, ctx)
    flat = tf.constant(np.random.default_rng(0).standard_normal(lay.total).astype(np.float32))
    return step, flat


def _best(fn, flat, reps):
    fn(flat)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        out = fn(flat)
        np.asarray(out)
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def measure(spec, T, values, reps):
    import tensorflow as tf
    step, flat = _bucket(spec, T, values)
    eager_ms = _best(step, flat, reps)
    step, flat = _bucket(spec, T, values)
    # (autograph off: the glue's entry points are tf.autograph's do_not_convert, so
    # a model's traced step does not convert the library either; converting it doubled
    # the trace time, 8.6 against 17.0 s for onebit at 160 tensors, 2026-12-01)
    graph = tf.function(step, autograph=False)
    start = time.perf_counter()
    concrete = graph.get_concrete_function(flat)
    trace_s = time.perf_counter() - start
    return {"spec": spec, "tensors": T, "values": values // T * T,
            "graph_ops": len(concrete.graph.get_operations()), "trace_s": round(trace_s, 2),
            "eager_ms": round(eager_ms, 1), "function_ms": round(_best(graph, flat, reps), 1)}


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    specs = list(dict.fromkeys(r["spec"] for r in rows))
    ts = sorted({r["tensors"] for r in rows})
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, key, label in zip(axes, ("graph_ops", "eager_ms", "function_ms"),
                              ("graph ops", "eager ms a call", "tf.function ms a call")):
        for j, T in enumerate(ts):
            vals = [next((r[key] for r in rows if r["spec"] == s and r["tensors"] == T), 0)
                    for s in specs]
            ax.bar(np.arange(len(specs)) + j * 0.4, vals, 0.4, label=f"{T} tensors")
        ax.set_xticks(np.arange(len(specs)) + 0.2, specs, rotation=20, fontsize=8)
        ax.set_title(label)
        ax.legend(fontsize=8)
    fig.suptitle("TensorFlow: one bucket's compress + decompress (two ranks)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--specs", default=",".join(SPECS), help="comma-separated compressors")
    ap.add_argument("--tensors", default="4,160", help="comma-separated tensor counts")
    ap.add_argument("--values", type=int, default=8_336_000, help="values in the bucket")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="TensorFlow intra-op threads")
    ap.add_argument("--out", default="benchmarks/results", help="folder for JSON and PNG")
    ap.add_argument("--name", default=None, help="file stem (default tf_bucket_ops_<date>)")
    args = ap.parse_args(argv)
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    measure(args.specs.split(",")[0], 2, 256, 1)    # TensorFlow's own first-use costs
    rows = [measure(s, int(T), args.values, args.reps)
            for s in args.specs.split(",") for T in args.tensors.split(",")]
    print(f"{'spec':24} {'T':>4} {'graph ops':>9} {'trace s':>8} {'eager ms':>9} "
          f"{'function ms':>11}")
    for r in rows:
        print(f"{r['spec']:24} {r['tensors']:>4} {r['graph_ops']:>9} {r['trace_s']:>8} "
              f"{r['eager_ms']:>9} {r['function_ms']:>11}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = args.name or f"tf_bucket_ops_{datetime.date.today().isoformat()}"
    meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
            "tensorflow": tf.__version__, "threads": args.threads, "reps": args.reps,
            "device": "cpu", "rows": rows}
    (out / f"{stem}.json").write_text(json.dumps(meta, indent=1))
    plot(rows, out / f"{stem}.png")
    print(f"wrote {out / stem}.json and .png")
    return rows


if __name__ == "__main__":
    main()
