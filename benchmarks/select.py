"""Top-k selection benchmark: laplace_topk (seed 000) against torch.topk of the installed
torch and the peers dgc, gaussian_k and sidco_exp, all through the same compressor call
(``compress`` with ``ef=0``: selection plus gathering the values).  ``topk`` is the
topk compressor: torch.topk on CUDA, numpy's partition on the CPU (``ops.topk_indices``);
``torch_topk`` calls torch.topk itself (``|x|``, top-k, the values gathered).

For every method, size, density and input: median time per call, achieved count / k,
the speed-up over torch.topk (``topk``) measured in the same run, and the time relative
to reading the tensor three times (three ``sum`` passes; on a GPU also the effective
bandwidth of that read as a fraction of the measured copy bandwidth).  Prints a table,
writes JSON and a PNG plot.

    python benchmarks/select.py                        # CPU: 1M, 4M, 25M, 100M
    python benchmarks/select.py --sizes 1M,25M --repeat 3
    python benchmarks/select.py --framework tensorflow --sizes 1M,4M   # eager TF, CPU
    python benchmarks/select.py --framework tensorflow --graph          # in tf.function
    python benchmarks/select.py --sizes 1.28M,6.4M --inputs gaussian,embedding \
        --methods torch_topk,topk --out benchmarks/results/select_cpu_zeros.json
                                      # "embedding": 2/3 of its 256-wide rows zero

With ``--framework tensorflow`` the same compressors run on TensorFlow tensors (eagerly,
or each call traced once into a ``tf.function`` with ``--graph``, as Keras' ``fit`` runs
them) and ``tf_top_k`` (``tf.math.top_k`` of ``|x|``, the values gathered) takes
``torch_topk``'s place.
"""
import sys
from pathlib import Path

# This file is named like the stdlib module `select`, which subprocess imports: run as a
# script, its folder is sys.path[0] and would shadow it.  Drop that entry first.
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]
import hvd_compress  # noqa: E402
from mnist_common import show_progress  # noqa: E402  (no bar off a terminal)

_spec = importlib.util.spec_from_file_location("gpu_common",
                                               Path(__file__).with_name("gpu_common.py"))
common = sys.modules.setdefault("gpu_common", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(common)       # (environment(): the launch cache for a call)

METHODS = {
    "torch_topk": None,                                     # torch.topk itself, no compressor
    "tf_top_k": None,                                       # tf.math.top_k itself (TF)
    "topk": "topk:density={d},ef=0",
    "laplace_topk": "laplace_topk:density={d},ef=0,small=0",   # the search, at every size
    "laplace_topk_exact": "laplace_topk:density={d},exact=1,ef=0",
    "laplace_topk_fused": "laplace_topk:density={d},fused=1,ef=0",    # histogram search
    "laplace_topk_fused_exact": "laplace_topk:density={d},fused=1,exact=1,ef=0",
    # the fused search with a payload of fixed size: no host synchronisation at all;
    # "_cached": with the launch cache (HVD_COMPRESS_LAUNCH_CACHE=1) during its calls
    "laplace_topk_padded": "laplace_topk:density={d},padded=1,ef=0",
    "laplace_topk_padded_cached": "laplace_topk:density={d},padded=1,ef=0",
    # warm=1: each call's search starts at the brackets of the call before it, on the
    # same input (the steady state: a GPT-2's threshold stayed within the window 87% of
    # tensor-steps, benchmarks/threshold_drift.py), its first pass folded into the sums
    "laplace_topk_padded_warm": "laplace_topk:density={d},padded=1,warm=1,ef=0",
    "dgc": "dgc:density={d},ef=0",
    "gaussian_k": "gaussian_k:density={d},ef=0",
    "sidco_exp": "sidco_exp:density={d},ef=0",
}
SYNTHETIC = ("laplace", "gaussian", "student_t2")
#: inputs that are not in the default set: "embedding", an embedding's gradient (Laplace
#: values, 2/3 of the 256-wide rows zero: the tokens that were not in the batch)
EXTRA = ("embedding",)


def parse_size(text):
    text = text.strip().upper()
    scale = {"K": 10**3, "M": 10**6, "G": 10**9}.get(text[-1], 1)
    return int(float(text.rstrip("KMG")) * scale)


def make_input(kind, n, device, seed=0):
    r = np.random.default_rng(seed)
    if kind == "laplace":
        a = r.laplace(size=n)
    elif kind == "gaussian":
        a = r.standard_normal(n)
    elif kind == "student_t2":
        a = r.standard_t(2, n)
    elif kind == "embedding":
        a = r.laplace(size=n)
        a[np.repeat(r.random(-(-n // 256)) < 2 / 3, 256)[:n]] = 0.0
    else:
        raise ValueError(kind)
    return torch.from_numpy(a.astype(np.float32)).to(device)


def timeit(fn, repeat, sync):
    fn()
    sync()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def numel(x):
    return int(np.prod(tuple(x.shape)))


def measure(x, density, repeat, sync, methods, graph=False):
    n = numel(x)
    k = max(1, min(n, int(np.ceil(density * n))))
    if isinstance(x, torch.Tensor):
        read3 = timeit(lambda: [x.sum() for _ in range(3)], repeat, sync)
    else:
        import tensorflow as tf
        read3 = timeit(lambda: [tf.reduce_sum(x) for _ in range(3)], repeat, sync)
    rows = {}
    for method in methods:
        out = {}
        if method == "torch_topk":

            def call():
                i = torch.topk(x.abs(), k, sorted=False).indices
                out["payload"] = (x[i], i)
        else:
            if method == "tf_top_k":

                def fn(t):
                    i = tf.math.top_k(tf.abs(t), k, sorted=False).indices
                    return tf.gather(t, i), i
            else:
                c = hvd_compress.from_spec(METHODS[method].format(d=density))

                def fn(t, c=c):
                    return c.compress(t, "g")[0]
            fn = tf.function(fn) if graph else fn

            def call(fn=fn, settings={"HVD_COMPRESS_LAUNCH_CACHE": "1"}
                     if method.endswith("_cached") else {}):
                with common.environment(settings):
                    out["payload"] = fn(x)

        seconds = timeit(call, repeat, sync)
        count = numel(out["payload"][1])
        rows[method] = {"seconds": seconds, "count": count, "count_over_k": count / k,
                        "over_read3": seconds / read3}
    base = rows.get("topk", {}).get("seconds")
    torch_base = rows.get("torch_topk", rows.get("tf_top_k", {})).get("seconds")
    for r in rows.values():
        r["speedup_vs_topk"] = base / r["seconds"] if base else None
        r["speedup_vs_torch_topk"] = torch_base / r["seconds"] if torch_base else None
    return k, read3, rows


def device_info(device):
    info = {"device": device, "torch": torch.__version__, "python": platform.python_version(),
            "cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads()}
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
        x = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
        y = torch.empty_like(x)
        t = timeit(lambda: y.copy_(x), 10, torch.cuda.synchronize)
        info["copy_bandwidth_GBps"] = 2 * x.numel() / t / 1e9      # read + write
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    return info


def plot(results, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    # the synthetic inputs, Laplace alone when it ran (the default run: one line a method)
    kinds = [k for k in SYNTHETIC + EXTRA if any(r["input"] == k for r in results)]
    kinds = ["laplace"] if "laplace" in kinds else kinds
    styles = ["o-", "s--", "^:", "d-."]
    for density, ax in zip(sorted({r["density"] for r in results}), axes):
        for kind, style in zip(kinds, styles):
            for method in METHODS:
                pts = sorted((r["n"], r["methods"][method]["seconds"]) for r in results
                             if r["density"] == density and r["input"] == kind
                             and method in r["methods"])
                if pts:
                    ax.loglog([p[0] for p in pts], [1e3 * p[1] for p in pts], style,
                              label=method if len(kinds) == 1 else f"{method}, {kind}")
        ax.set_title(f"{' and '.join(kinds)} input, density {density}")
        ax.set_xlabel("elements")
        ax.set_ylabel("median ms per call")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1M,4M,25M,100M")
    p.add_argument("--densities", default="0.001,0.01")
    p.add_argument("--inputs", default=",".join(SYNTHETIC + ("real",)))
    p.add_argument("--methods", default=None,
                   help="default: all but tf_top_k (torch; the padded ones only where the "
                        "kernels run), tf_top_k,topk,laplace_topk (TF)")
    p.add_argument("--framework", default="torch", choices=("torch", "tensorflow"))
    p.add_argument("--graph", action="store_true", help="TensorFlow: in tf.function")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/...)")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args()

    device = args.device
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    info = device_info(device)
    name = info.get("gpu", "cpu").replace(" ", "_")
    stamp = datetime.date.today().isoformat()
    to_framework = lambda t: t                                            # noqa: E731
    if args.framework == "tensorflow":
        if device != "cpu":
            p.error("--framework tensorflow measures the CPU only")
        import tensorflow as tf
        info.update(tensorflow=tf.__version__,
                    tf_threads=tf.config.threading.get_intra_op_parallelism_threads())
        name = "tf_cpu_graph" if args.graph else "tf_cpu"
        to_framework = lambda t: tf.constant(t.numpy())                   # noqa: E731
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"select_{name}_{stamp}.json")
    if args.methods is None:
        # (padded=1 where its kernels run: on the CPU it runs the torch references, which
        # are there to check the kernels, not to be timed)
        kernels = device == "cuda" or os.environ.get("HVD_COMPRESS_BACKEND") == "triton"
        methods = ["tf_top_k", "topk", "laplace_topk"] if args.framework == "tensorflow" \
            else [m for m in METHODS if m != "tf_top_k" and (kernels or "padded" not in m)]
    else:
        methods = args.methods.split(",")

    cases = []
    for kind in args.inputs.split(","):
        if kind == "real":
            real = np.load(ROOT / "benchmarks" / "data" / "real_gradients.npz")
            for key in ("cnn_step100", "mlp_step100"):
                cases.append((f"real_{key}", lambda key=key: to_framework(
                    torch.from_numpy(real[key]).to(device))))
        else:
            for size in map(parse_size, args.sizes.split(",")):
                cases.append((kind, lambda kind=kind, size=size: to_framework(
                    make_input(kind, size, device))))
    densities = [float(d) for d in args.densities.split(",")]

    from tqdm import tqdm
    results = []
    bar = tqdm(total=len(cases) * len(densities), disable=not show_progress(not args.no_progress),
               desc="select")
    for kind, make in cases:
        x = make()
        for density in densities:
            k, read3, rows = measure(x, density, args.repeat, sync, methods, args.graph)
            entry = {"input": kind, "n": numel(x), "density": density, "k": k,
                     "read3_seconds": read3, "methods": rows}
            if device == "cuda":
                entry["read3_bandwidth_fraction"] = 3 * 4 * numel(x) / read3 / 1e9 / \
                    info["copy_bandwidth_GBps"]
            results.append(entry)
            bar.update()
        del x
    bar.close()

    print(f"\n{info.get('gpu', 'CPU')} ({device}), torch {info['torch']}, "
          f"{info['threads']} threads, {stamp}"
          + (f", TensorFlow {info['tensorflow']} ({'tf.function' if args.graph else 'eager'})"
             if "tensorflow" in info else ""))
    header = f"{'input':18s} {'n':>10s} {'density':>7s}  " + "  ".join(f"{m:>22s}" for m in methods)
    print(header)
    print(" " * 39 + "  ".join(f"{'ms  (xtopk, cnt/k)':>22s}" for _ in methods))
    for r in results:
        cells = []
        for m in methods:
            v = r["methods"][m]
            cells.append(f"{1e3 * v['seconds']:8.2f} ({v['speedup_vs_topk'] or 0:5.2f}x,"
                         f"{v['count_over_k']:6.3f})")
        print(f"{r['input']:18s} {r['n']:>10d} {r['density']:>7g}  " + "  ".join(cells))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"info": info, "date": stamp, "results": results}, indent=1))
    png = out.with_suffix(".png")
    plot(results, png, f"top-k selection, {info.get('gpu', 'CPU')}, torch {info['torch']}")
    print(f"wrote {out} and {png}")


if __name__ == "__main__":
    main()
