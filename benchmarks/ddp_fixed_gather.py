"""What gathering a fixed-size payload without its lengths saves a DDP step
(``Compressor.fixed_size``, ``TorchDistributed.allgather_fixed``).

    python benchmarks/ddp_fixed_gather.py       # about 9 minutes on 2 cores, most of it
                    # laplace_topk:padded=1's fused search (its torch reference on the CPU)
    python benchmarks/ddp_fixed_gather.py --steps 20 --specs "twobit;bf16" --models mnist

Two processes (``torch.multiprocessing``, Gloo on plain loopback, one thread each) train
two copies of a model with the same compressor through ``hvd_compress.ddp``: one gathers
its payloads in one collective (the compressor's ``fixed_size``, as shipped), the other
as before, the byte lengths first (``fixed_size`` set False on its compressor).  Their
steps alternate, so both see the same machine; the median step time of each, and their
ratio, per model, DDP bucket size and compressor.  Synthetic batches (the step time does
not depend on the digits).  Absolute times are this machine's CPU times; the ratio is
the result.  Writes ``--out``/ddp_fixed_gather_<date>.json and .png and prints a table.
"""
import sys
from pathlib import Path

# (benchmarks/select.py would shadow the standard library's select, which socket imports)
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

SPECS = "twobit;rangefloat:bits=8;laplace_topk:density=0.01,padded=1"
MODELS = {"mnist": ("MnistNet", (1, 28, 28)), "cnn_mlp_large": ("CNNMLPLarge", (3, 32, 32))}


def one_model(name, spec, bucket_mb, fixed):
    """A DDP copy of model ``name`` with ``spec`` registered; ``fixed``: as shipped, else
    the compressor's ``fixed_size`` switched off (lengths gathered first)."""
    import models
    import hvd_compress.ddp
    torch.manual_seed(0)
    model = getattr(models, MODELS[name][0])()
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_mb)
    state = hvd_compress.ddp.register(ddp, spec)
    if not fixed:
        state.compression.fixed_size = False
    return ddp, torch.optim.SGD(ddp.parameters(), lr=0.01)


def worker(rank, port, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    rows = []
    for name in args.models.split(","):
        shape = MODELS[name][1]
        x = torch.randn(args.batch, *shape, generator=torch.Generator().manual_seed(rank))
        y = torch.randint(0, 10, (args.batch,), generator=torch.Generator().manual_seed(rank))
        for bucket_mb in (float(b) for b in args.bucket_mb.split(",")):
            for spec in args.specs.split(";"):
                pair = {mode: one_model(name, spec, bucket_mb, mode == "fixed")
                        for mode in ("fixed", "lengths")}
                times = {mode: [] for mode in pair}
                for step in range(args.warmup + args.steps):
                    for mode, (ddp, opt) in pair.items():
                        dist.barrier()
                        t0 = time.perf_counter()
                        opt.zero_grad()
                        torch.nn.functional.cross_entropy(ddp(x), y).backward()
                        opt.step()
                        if step >= args.warmup:
                            times[mode].append(time.perf_counter() - t0)
                same = all(torch.equal(a, b) for a, b in zip(pair["fixed"][0].parameters(),
                                                             pair["lengths"][0].parameters()))
                rows.append({"model": name, "bucket_mb": bucket_mb, "spec": spec,
                             "fixed_ms": 1e3 * statistics.median(times["fixed"]),
                             "lengths_ms": 1e3 * statistics.median(times["lengths"]),
                             "same_parameters": same})
                r = rows[-1]
                if rank == 0 and not args.quiet:
                    print(f"  {name} bucket {bucket_mb:g} MB {spec}: one collective "
                          f"{r['fixed_ms']:.2f} ms, lengths first {r['lengths_ms']:.2f} ms",
                          flush=True)
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def plot(rows, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels = [f"{r['model']}\n{r['bucket_mb']:g} MB\n{r['spec'].split(':')[0]}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(rows)), 4))
    at = range(len(rows))
    ax.bar([i - 0.2 for i in at], [r["lengths_ms"] for r in rows], 0.4, label="lengths first")
    ax.bar([i + 0.2 for i in at], [r["fixed_ms"] for r in rows], 0.4, label="one collective")
    ax.set_xticks(list(at), labels, fontsize=7)
    ax.set_ylabel("median step (ms)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="mnist,cnn_mlp_large")
    p.add_argument("--specs", default=SPECS, help="separated by ';'")
    p.add_argument("--bucket-mb", default="25,0.05", help="DDP bucket_cap_mb values")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, port, args, queue)) for r in range(2)]
    for proc in procs:
        proc.start()
    rows = queue.get()
    for proc in procs:
        proc.join()
    print(f"{'model':14s} {'bucket':>7s} {'compressor':40s} {'lengths':>9s} {'one':>9s} "
          f"{'ratio':>6s}")
    for r in rows:
        r["speedup"] = r["lengths_ms"] / r["fixed_ms"]
        print(f"{r['model']:14s} {r['bucket_mb']:5g}MB {r['spec']:40s} {r['lengths_ms']:7.2f}ms "
              f"{r['fixed_ms']:7.2f}ms {r['speedup']:5.2f}x"
              + ("" if r["same_parameters"] else "  (parameters differ!)"))
    date = datetime.date.today().isoformat()
    stem = Path(args.out) / f"ddp_fixed_gather_{date}"
    info = {"date": date, "torch": torch.__version__, "cpus": os.cpu_count(),
            "link": "plain loopback", "ranks": 2, "threads_per_rank": 1, "args": vars(args),
            "note": "median ms per step of two DDP copies trained alternately; 'lengths': "
                    "the payload's byte lengths gathered first (fixed_size off); 'fixed': "
                    "one all_gather; speedup = lengths / fixed"}
    stem.with_suffix(".json").write_text(json.dumps(dict(info, rows=rows), indent=1))
    plot(rows, stem.with_suffix(".png"), f"DDP, Gloo, plain loopback, 2 ranks, {date}")
    print(f"wrote {stem}.json and .png")
    return 0 if all(r["same_parameters"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
