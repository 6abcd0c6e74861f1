"""Codec time of every compressor, the peer baselines beside ours: one exchange of two
simulated ranks in one process (hvd_compress.compressors.aggregation.in_process: the
allgather is a concatenation, the allreduce a sum; no network), per matrix size.

    python benchmarks/codec_time.py                         # CPU, 1M and 4M values
    python benchmarks/codec_time.py --device cuda --sizes 1M,25M

Times are medians of ``--repeat`` exchanges (both ranks' compress, the aggregation and
one rank's decompress; error feedback on where the compressor has it), after a warm-up;
on CUDA with a synchronize around each.  The bytes are what one rank sends.  Prints a
table and writes benchmarks/results/codec_time_<device>_<date>.json and .png.
"""
import sys
from pathlib import Path

sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SPECS = ["none", "fp16", "topk:density=0.01", "laplace_topk:density=0.01", "twobit",
         "dct:density=0.01", "powersgd:rank=4", "qsgd", "terngrad", "signsgd", "onebit"]


def size_of(text):
    text = text.strip().upper()
    return int(float(text[:-1]) * {"K": 1e3, "M": 1e6}[text[-1]]) if text[-1] in "KM" else int(text)


def measure(spec, n, device, repeat):
    import torch
    import hvd_compress
    from hvd_compress.compressors.aggregation import in_process
    from hvd_compress.stats import ring_received
    rows = 1024
    shape = (rows, -(-n // rows))
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(shape, generator=gen).to(device) for _ in range(2)]
    sep = "," if ":" in spec else ":"
    comps = [hvd_compress.from_spec(f"{spec}{sep}rank={r}" if spec.startswith(("qsgd", "terngrad"))
                                    else spec) for r in range(2)]
    comps = [c.for_tensor("w", grads[0]) for c in comps]

    def once():
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        outs, _ = in_process(comps, grads, "w")
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - start, outs[0]

    once()
    times = [once()[0] for _ in range(repeat)]
    c = comps[0]
    if c.collective == "two_round":
        msg, rnd = hvd_compress.from_spec(spec).propose(grads[0], "w", 0, 2)
        sent = msg.numel() * 4 * (1 + (shape[1] / shape[0]))     # P then Q: (rows + cols) r
    else:
        payload, _ = hvd_compress.from_spec(spec).for_tensor("w", grads[0]).compress(grads[0], "w")
        ts = payload if isinstance(payload, tuple) else (payload,)
        sent = sum(t.numel() * t.element_size() for t in ts)
    dense = grads[0].numel() * 4
    return {"spec": spec, "n": grads[0].numel(), "ms": 1e3 * statistics.median(times),
            "sent_bytes": int(sent), "ratio": dense / sent,
            "received_if_ring": ring_received(int(sent), 2) if c.collective != "allgather" else int(sent)}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--sizes", default="1M,4M")
    p.add_argument("--specs", default=";".join(SPECS), help="separated by ';'")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args()
    import torch
    sizes = [size_of(s) for s in args.sizes.split(",")]
    specs = [s for s in args.specs.split(";") if s]
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    date = datetime.date.today().isoformat()
    print(f"{name}, torch {torch.__version__}, {date}: one exchange of 2 ranks (median ms)")
    results = []
    header = f"{'compressor':32s}" + "".join(f"{f'{n:,}':>22s}" for n in sizes)
    print(header)
    for spec in specs:
        line = f"{spec:32s}"
        for n in sizes:
            r = measure(spec, n, args.device, args.repeat)
            results.append(r)
            line += f"{r['ms']:10.2f} ms {r['ratio']:7.1f}x  "
        print(line, flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"codec_time_{'cuda' if name != 'cpu' else 'cpu'}_{date}"
    stem.with_suffix(".json").write_text(json.dumps(
        {"device": name, "torch": torch.__version__, "date": date, "repeat": args.repeat,
         "note": "one exchange of 2 simulated ranks: both compress, aggregate, one decompress; "
                 "ratio = dense float32 bytes / bytes one rank sends", "results": results},
        indent=1))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(10, 4.5))
        width = 0.8 / len(sizes)
        for i, n in enumerate(sizes):
            ms = [next(r["ms"] for r in results if r["spec"] == s and r["n"] >= n * 0.99
                       and r["n"] <= n * 1.01 + 1024) for s in specs]
            ax.bar([j + i * width for j in range(len(specs))], ms, width, label=f"{n:,} values")
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(specs))])
        ax.set_xticklabels(specs, rotation=35, ha="right", fontsize=8)
        ax.set_ylabel("ms per exchange (2 ranks)")
        ax.set_yscale("log")
        ax.set_title(f"codec time, {name}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(stem.with_suffix(".png"), dpi=110)
    except ImportError:
        print("(matplotlib missing: no PNG)")
    print(f"wrote {stem}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
