"""Seed 002 benchmark: DCT and range-based float throughput, and rate-distortion.

1. Throughput (GB/s of float32 input): block DCT + inverse, rangefloat encode/decode
   (8 bits), and the whole dct compressor (compress / decompress), at 4M and 25M values.
2. Rate-distortion on the real gradients in benchmarks/data/: relative reconstruction
   error ||g - g_hat|| / ||g|| against bytes on the wire, for dct, topk (float32 values
   + int32 indices), laplace_topk with rangefloat8 values, rangefloat alone and fp16.
Prints tables, writes JSON and a PNG plot (benchmarks/results/).

    python benchmarks/dct.py
    python benchmarks/dct.py --transforms --threads 1,2   # the CPU's product against FFT

``--transforms``: the block DCT and its inverse on the CPU, the product with the DCT-II
matrix (``x.view(-1, B) @ D^T``) against the real FFT (``kernels.dct.fft_dct_rows``),
every block size, 1 and 2 threads: where ``kernels.dct.FFT_FROM_BLOCK`` comes from
(``dct_fft_cpu_<date>.json`` / ``.png``).
"""
import sys
from pathlib import Path

# benchmarks/select.py is named like the stdlib module `select`: drop this folder from
# sys.path before anything imports subprocess (see select.py).
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import hvd_compress  # noqa: E402
from hvd_compress.compressors import payload_bytes  # noqa: E402
from hvd_compress.kernels import dct as dct_kernels  # noqa: E402
from hvd_compress.kernels import rangefloat as rf  # noqa: E402
from hvd_compress.ops import torch_ops  # noqa: E402

DENSITIES = [0.001, 0.003, 0.01, 0.03, 0.1]


def timeit(fn, repeat, sync):
    fn()
    sync()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def throughput(sizes, repeat, device, sync):
    rows = []
    for n in sizes:
        x = torch.from_numpy(np.random.default_rng(0).laplace(size=n).astype(np.float32)).to(device)
        coefs = dct_kernels.dct(x, 256)
        emax = rf.max_exponent(x)
        data = rf.encode(x, emax, 4, 3)
        per_group = torch.full((data.numel(),), int(emax), dtype=torch.int32, device=device)
        c = hvd_compress.from_spec("dct:density=0.01,ef=0")
        payload, ctx = c.compress(x, "g")
        cases = {"block DCT (256)": lambda: dct_kernels.dct(x, 256),
                 "block IDCT (256)": lambda: dct_kernels.idct(coefs, 256),
                 "rangefloat8 encode": lambda: rf.encode(x, emax, 4, 3),
                 "rangefloat8 decode": lambda: rf.decode(data, per_group, 4, 3),
                 "dct compress (1%)": lambda: c.compress(x, "g"),
                 "dct decompress (1%)": lambda: c.decompress(payload, ctx)}
        for name, fn in cases.items():
            t = timeit(fn, repeat, sync)
            rows.append({"op": name, "n": n, "seconds": t, "GBps": 4 * n / t / 1e9})
    return rows


def transforms(sizes, repeat, threads):
    rows = []
    for t in threads:
        torch.set_num_threads(t)
        for n in sizes:
            x = torch.from_numpy(np.random.default_rng(0).laplace(size=n).astype(np.float32))
            for block in dct_kernels.BLOCKS:
                r = dct_kernels._pad(x, block)
                cases = {"product": lambda: r @ dct_kernels.basis_t(block),
                         "fft": lambda: dct_kernels.fft_dct_rows(r),
                         "inverse product": lambda: r @ dct_kernels.basis(block),
                         "inverse fft": lambda: dct_kernels.fft_idct_rows(r)}
                for way, fn in cases.items():
                    rows.append({"threads": t, "n": n, "block": block, "way": way,
                                 "seconds": timeit(fn, repeat, lambda: None)})
    return rows


def plot_transforms(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    keys = sorted({(r["threads"], r["n"]) for r in rows})
    fig, axes = plt.subplots(1, len(keys), figsize=(5.5 * len(keys), 4), squeeze=False)
    for ax, (t, n) in zip(axes[0], keys):
        for way in dict.fromkeys(r["way"] for r in rows):
            pts = [(r["block"], 1e3 * r["seconds"]) for r in rows
                   if (r["threads"], r["n"], r["way"]) == (t, n, way)]
            ax.plot(*zip(*pts), "o-" if "fft" in way else "s--", label=way)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("block")
        ax.set_ylabel("ms")
        ax.set_title(f"{n / 1e6:g}M values, {t} thread(s)")
        ax.grid(True, alpha=0.3)
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main_transforms(args, stamp):
    rows = transforms([int(s) for s in args.sizes.split(",")], args.repeat,
                      [int(t) for t in args.threads.split(",")])
    print(f"\nCPU, torch {torch.__version__}, {stamp}; ms (median of {args.repeat})")
    print(f"{'threads':>7s} {'n':>10s} {'block':>5s} {'product':>8s} {'fft':>8s} {'x':>6s} "
          f"{'inv prod':>8s} {'inv fft':>8s} {'x':>6s}")
    by = {(r["threads"], r["n"], r["block"], r["way"]): 1e3 * r["seconds"] for r in rows}
    for t, n, b in dict.fromkeys(k[:3] for k in by):
        f, fi = by[t, n, b, "product"], by[t, n, b, "inverse product"]
        g, gi = by[t, n, b, "fft"], by[t, n, b, "inverse fft"]
        print(f"{t:7d} {n:10d} {b:5d} {f:8.2f} {g:8.2f} {f / g:6.2f} {fi:8.2f} {gi:8.2f} "
              f"{fi / gi:6.2f}")
    out = ROOT / "benchmarks" / "results" / f"dct_fft_cpu_{stamp}.json"
    out.write_text(json.dumps({"device": "cpu", "torch": torch.__version__, "date": stamp,
                               "fft_from_block": dct_kernels.FFT_FROM_BLOCK,
                               "transforms": rows}, indent=1))
    plot_transforms(rows, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


def rate_distortion(arrays):
    configs = [("fp16", "fp16")]
    configs += [(f"rangefloat{b}", f"rangefloat:bits={b}") for b in (4, 6, 8, 12, 16)]
    for d in DENSITIES:
        configs += [("dct", f"dct:density={d}"), ("dct block64", f"dct:density={d},block=64"),
                    ("topk", f"topk:density={d}"),
                    ("laplace_topk+rf8", f"laplace_topk:density={d},values=rangefloat8")]
    rows = []
    for key, g in arrays.items():
        x = torch.from_numpy(g)
        for family, spec in configs:
            c = hvd_compress.from_spec(spec + (",ef=0" if ":" in spec else ":ef=0"))
            payload, ctx = c.compress(x, "g")
            out = c.decompress(payload, ctx)
            rows.append({"tensor": key, "family": family, "spec": spec, "n": g.size,
                         "bytes": int(payload_bytes(payload, torch_ops)),
                         "dense_bytes": 4 * g.size,
                         "rel_error": float((out - x).norm() / x.norm())})
    return rows


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    tensors = sorted({r["tensor"] for r in rows})
    fig, axes = plt.subplots(1, len(tensors), figsize=(6 * len(tensors), 4.5), squeeze=False)
    for ax, key in zip(axes[0], tensors):
        for family in dict.fromkeys(r["family"] for r in rows if not r["family"].startswith("rangefloat")):
            pts = sorted((r["bytes"], r["rel_error"]) for r in rows
                         if r["tensor"] == key and r["family"] == family)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=family)
        pts = sorted((r["bytes"], r["rel_error"]) for r in rows
                     if r["tensor"] == key and r["family"].startswith("rangefloat"))
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "s--", label="rangefloat 4..16 bits")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("bytes on the wire")
        ax.set_ylabel("||g - g_hat|| / ||g||")
        ax.set_title(key)
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="4000000,25000000")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--transforms", action="store_true",
                   help="only the CPU's block DCT: the product against the FFT")
    p.add_argument("--threads", default="1,2", help="with --transforms: torch threads")
    args = p.parse_args()
    if args.transforms:
        return main_transforms(args, datetime.date.today().isoformat())
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else None
    stamp = datetime.date.today().isoformat()
    tp = throughput([int(s) for s in args.sizes.split(",")], args.repeat, args.device, sync)
    real = np.load(ROOT / "benchmarks" / "data" / "real_gradients.npz")
    rd = rate_distortion({k: real[k] for k in ("cnn_step100", "mlp_step100")})
    print(f"\n{gpu or 'CPU'}, torch {torch.__version__}, {torch.get_num_threads()} threads, {stamp}")
    print(f"{'operation':22s} {'n':>10s} {'ms':>9s} {'GB/s':>7s}")
    for r in tp:
        print(f"{r['op']:22s} {r['n']:10d} {1e3 * r['seconds']:9.2f} {r['GBps']:7.2f}")
    print(f"\n{'tensor':12s} {'spec':42s} {'bytes':>9s} {'x dense':>8s} {'rel err':>8s}")
    for r in rd:
        print(f"{r['tensor']:12s} {r['spec']:42s} {r['bytes']:9d} "
              f"{r['dense_bytes'] / r['bytes']:8.1f} {r['rel_error']:8.4f}")
    name = (gpu or "cpu").replace(" ", "_")
    out = ROOT / "benchmarks" / "results" / f"dct_{name}_{stamp}.json"
    out.write_text(json.dumps({"device": gpu or "cpu", "torch": torch.__version__,
                               "date": stamp, "throughput": tp, "rate_distortion": rd}, indent=1))
    plot(rd, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
