"""Throughput of the CPU paths, in GB/s of float32 input on one core.

For every primitive the compressors spend their CPU time in, times the vectorised CPU
path that runs today and the torch reference it must equal bit for bit (the reference is
what the Triton kernels are tested against), and checks that they are equal:

  twobit pack / decode (2 ranks), rangefloat encode / decode (4, 8, 12, 16 bits),
  error feedback (compensate + update, dense and sparse), sparse decode (scatter of two
  ranks' 1% payloads into the dense sum), block DCT / inverse (64, 256),
  and whole compressors: compress (error feedback on) + decompress of 2 ranks' payloads.

    python benchmarks/cpu_paths.py [--n 16777216] [--threads 1] [--quick]

Prints a table and writes benchmarks/results/cpu_paths_<date>.json and .png.
The issue's target: >= 1 GB/s per primitive (>= 0.5 GB/s for the block DCT).  The slow
references (twobit, rangefloat: int64 bit manipulation) are timed at --ref-n values, the
others at --n; "reference" for error feedback is the out-of-place update it replaced.
"""
import sys
from pathlib import Path

# benchmarks/select.py shadows the standard library's select module: drop this folder from
# sys.path before anything imports subprocess (see select.py).
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from hvd_compress import from_spec  # noqa: E402
from hvd_compress import kernels as K  # noqa: E402
from hvd_compress.kernels import dct as D, rangefloat as R, twobit as T  # noqa: E402
from hvd_compress.ops import torch_ops  # noqa: E402


def best_time(fn, repeat):
    fn()                                               # warm-up (tables, caches, pages)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def same_bits(a, b):
    if isinstance(a, (tuple, list)):
        return all(same_bits(x, y) for x, y in zip(a, b))
    if a.dtype.is_floating_point:
        a, b = a.contiguous().view(torch.int32 if a.element_size() == 4 else torch.int16), \
            b.contiguous().view(torch.int32 if b.element_size() == 4 else torch.int16)
    return bool(torch.equal(a, b))


def primitives(n, ref_n, rng):
    """(name, fast fn, reference fn or None, check fn or None) over n (ref at ref_n)."""
    def data(size):
        return torch.from_numpy(rng.laplace(size=size).astype(np.float32)) * 1e-3

    x, xr = data(n), data(ref_n)
    rows = []

    t = float(x.abs().mean())
    rows.append(("twobit pack", lambda: T.pack_cpu(x, t), lambda: T.pack_reference(xr, t),
                 lambda: same_bits(T.pack_cpu(xr, t), T.pack_reference(xr, t))))
    words = torch.cat([T.pack_cpu(x, t), T.pack_cpu(x.flip(0), t)])
    words_r = torch.cat([T.pack_cpu(xr, t), T.pack_cpu(xr.flip(0), t)])
    thr = torch.tensor([t, 0.5 * t])

    def decode_ref(w, size):
        signs = T.unpack_reference(w).reshape(2, -1)[:, :size]
        return (signs * thr[:, None]).reshape(-1).reshape(-1, size).sum(0)
    rows.append(("twobit decode (2 ranks)", lambda: T.unpack_cpu(words, scale=thr, n=n),
                 lambda: decode_ref(words_r, ref_n),
                 lambda: same_bits(T.unpack_cpu(words_r, scale=thr, n=ref_n), decode_ref(words_r, ref_n))))

    emax = R.max_exponent(x)
    for bits, (e, m) in R.SPLITS.items():
        data_b = R.encode_cpu(x, emax, e, m)
        data_r = R.encode_cpu(xr, emax, e, m)
        g, nb = R.group(bits)
        pg = torch.full((data_b.numel() // nb,), int(emax), dtype=torch.int32)
        pg_r = torch.full((data_r.numel() // nb,), int(emax), dtype=torch.int32)
        rows.append((f"rangefloat{bits} encode", lambda e=e, m=m: R.encode_cpu(x, emax, e, m),
                     lambda e=e, m=m: R.encode_reference(xr, emax, e, m),
                     lambda e=e, m=m: same_bits(R.encode_cpu(xr, emax, e, m),
                                                R.encode_reference(xr, emax, e, m))))
        rows.append((f"rangefloat{bits} decode",
                     lambda d=data_b, p=pg, e=e, m=m: R.decode_cpu(d, p, e, m),
                     lambda d=data_r, p=pg_r, e=e, m=m: R.decode_reference(d, p, e, m),
                     lambda d=data_r, p=pg_r, e=e, m=m: same_bits(R.decode_cpu(d, p, e, m),
                                                                  R.decode_reference(d, p, e, m))))

    # error feedback: c = g + r; r = c - sent  (dense: sent is a full tensor)
    from hvd_compress.memory import ResidualMemory
    from hvd_compress.stores import TorchStore
    sent = data(n)
    k = n // 100
    idx = torch.from_numpy(rng.choice(n, k, replace=False).astype(np.int32))
    for label, sparse in (("dense", False), ("sparse 1%", True)):
        store_fast, store_ref = TorchStore(), TorchStore()

        def ef(store, reuse, size, sparse=sparse):
            mem = ResidualMemory(store, torch_ops, reuse=reuse)
            g = x[:size]
            c = mem.compensate("g", g)
            if sparse:
                i = idx[idx < size]
                vals = c[i.long()]
                sub = lambda cc, inplace: torch_ops.subtract_at(cc, i, vals, inplace)  # noqa: E731
            else:
                sub = lambda cc, inplace: torch_ops.subtract(cc, sent[:size], inplace)  # noqa: E731
            mem.update("g", c, sub, torch_ops.all_finite(c))

        def ef_ref(store, size, sparse=sparse):   # what base.Compressor did before: out of place
            mem = ResidualMemory(store, torch_ops, reuse=False)
            g = x[:size]
            c = mem.compensate("g", g)
            if sparse:
                i = idx[idx < size]
                s = torch_ops.scatter_sum(size, i, c[i.long()])
            else:
                s = sent[:size]
            mem.update("g", c, lambda cc, inplace: cc - s, torch_ops.all_finite(c))

        def check(size=ref_n, ef=ef, ef_ref=ef_ref):
            a, b = TorchStore(), TorchStore()
            for _ in range(3):
                ef(a, True, size)
                ef_ref(b, size)
            return same_bits(a.get("residual/g", None), b.get("residual/g", None))
        rows.append((f"error feedback ({label})", lambda s=store_fast, ef=ef: ef(s, True, n),
                     lambda s=store_ref, ef_ref=ef_ref: ef_ref(s, n), check))

    # sparse decode: two ranks' 1% payloads scattered (added) into the dense sum
    i2 = torch.cat([idx, torch.from_numpy(rng.choice(n, k, replace=False).astype(np.int32))])
    v2 = data(2 * k)
    rows.append(("sparse decode (2 ranks, 1%)", lambda: torch_ops.scatter_sum(n, i2, v2), None, None))

    for block in (64, 256):
        coefs = D.dct(x, block)
        rows.append((f"block DCT {block}", lambda b=block: D.dct(x, b),
                     lambda b=block: D.dct_reference(x, b), None))
        rows.append((f"block IDCT {block}", lambda b=block, c=coefs: D.idct(c, b),
                     lambda b=block, c=coefs: D.idct_reference(c, b), None))
    return rows, x


def compressors(x, specs):
    """compress (ef on, 1 rank) + decompress of the 2-rank aggregate, per compressor."""
    from hvd_compress.compressors.base import payload_bytes
    rows = []
    y = x.flip(0).contiguous()
    for spec in specs:
        a, b = from_spec(spec), from_spec(spec)

        def run(a=a, b=b):
            pa, ctx = a.compress(x, "g")
            pb, _ = b.compress(y, "g")
            if a.collective == "allreduce":
                agg = pa + pb
            else:
                agg = tuple(torch.cat([s, t]) for s, t in zip(pa, pb))
            return a.decompress(agg, ctx)
        pa, _ = a.compress(x, "h")
        rows.append((spec, run, payload_bytes(pa, torch_ops)))
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=1 << 24, help="float32 values per tensor")
    p.add_argument("--ref-n", type=int, default=1 << 21, help="size for the slow references")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="small sizes (a smoke test)")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    args = p.parse_args()
    if args.quick:
        args.n, args.ref_n, args.repeat = 1 << 16, 1 << 14, 1
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    rows, x = primitives(args.n, args.ref_n, rng)
    # the slow references (twobit, rangefloat) run at ref_n values; the others at n
    n_of = {name: args.n for name, *_ in rows
            if name.startswith(("error feedback", "block"))}
    results = []
    print(f"CPU paths, {args.n:,} float32 values ({args.n * 4 / 1e6:.0f} MB), "
          f"{args.threads} thread(s), torch {torch.__version__}")
    print(f"{'primitive':30s} {'ms':>8s} {'GB/s':>7s} {'ref GB/s':>9s} {'speed-up':>9s} {'bit-identical':>14s}")
    for name, fast, ref, check in rows:
        t = best_time(fast, args.repeat)
        gbs = args.n * 4 / t / 1e9
        size = n_of.get(name, args.ref_n)
        ref_gbs = size * 4 / best_time(ref, 1) / 1e9 if ref is not None else None
        same = check() if check is not None else None
        results.append(dict(primitive=name, ms=1e3 * t, gb_per_s=gbs, reference_gb_per_s=ref_gbs,
                            speedup=gbs / ref_gbs if ref_gbs else None, bit_identical=same))
        print(f"{name:30s} {1e3 * t:8.1f} {gbs:7.2f} "
              f"{(f'{ref_gbs:9.3f}' if ref_gbs else '        -')} "
              f"{(f'{gbs / ref_gbs:8.1f}x' if ref_gbs else '        -')} {str(same):>14s}")
    specs = ["twobit", "rangefloat:bits=8", "topk:density=0.01", "laplace_topk:density=0.01",
             "laplace_topk:density=0.01,values=rangefloat8", "dct:density=0.01,block=64"]
    print(f"\n{'compressor (compress x2 + decompress)':44s} {'ms':>8s} {'GB/s':>7s} {'bytes/rank':>12s}")
    comp = []
    for spec, run, nbytes in compressors(x, specs):
        t = best_time(run, max(1, args.repeat // 2))
        gbs = 2 * args.n * 4 / t / 1e9      # two ranks' gradients in
        comp.append(dict(spec=spec, ms=1e3 * t, gb_per_s=gbs, payload_bytes=nbytes))
        print(f"{spec:44s} {1e3 * t:8.1f} {gbs:7.2f} {nbytes:12,d}")
    info = dict(date=datetime.date.today().isoformat(), n=args.n, ref_n=args.ref_n,
                threads=args.threads, torch=torch.__version__, numpy=np.__version__,
                machine=platform.machine(), processor=platform.processor() or platform.machine(),
                cpus=os.cpu_count(), primitives=results, compressors=comp)
    if args.quick:
        return
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"cpu_paths_{info['date']}")
    with open(stem + ".json", "w") as f:
        json.dump(info, f, indent=1)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG")
        return
    fig, ax = plt.subplots(figsize=(9, 0.32 * len(results) + 1.5))
    names = [r["primitive"] for r in results][::-1]
    ax.barh(np.arange(len(names)) + 0.2, [r["gb_per_s"] for r in results][::-1], 0.4,
            label="vectorised CPU path")
    ax.barh(np.arange(len(names)) - 0.2, [r["reference_gb_per_s"] or 0 for r in results][::-1],
            0.4, label="torch reference")
    ax.axvline(1.0, color="k", ls="--", lw=0.8)
    ax.set_yticks(np.arange(len(names)), names)
    ax.set_xlabel("GB/s of float32 input, one core")
    ax.set_title(f"CPU paths ({args.n:,} values, {info['date']})")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(stem + ".png", dpi=110)
    print(f"wrote {stem}.json and .png")


if __name__ == "__main__":
    main()
