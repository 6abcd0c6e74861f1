"""``python benchmarks/gpu_bench.py profile``: per compressor, its time, host-sync sites and
top CUDA ops (loaded by gpu_bench.py, which loads gpu_common first).
"""
import statistics
import sys
import time
from pathlib import Path

_common = sys.modules["gpu_common"]
parse_size = _common.parse_size
write_json = _common.write_json
device_info = _common.device_info
aggregate = _common.aggregate
ROOT = _common.ROOT


PROFILE_SPECS = ["topk:density=0.01", "laplace_topk:density=0.01", "laplace_topk:density=0.01,exact=1",
                 "laplace_topk:density=0.01,fused=1", "laplace_topk:density=0.01,fused=1,exact=1",
                 "laplace_topk:density=0.01,values=rangefloat8", "rangefloat:bits=8", "twobit",
                 "dct:density=0.01"]


def profile(args):
    """Per spec and size: median compress / decompress time, the source lines of
    hvd_compress that synchronise with the host (``torch.cuda.set_sync_debug_mode``), the
    number of CUDA kernels launched, and the top operations by CPU time (torch.profiler)."""
    import traceback
    import warnings
    from collections import Counter

    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    import hvd_compress
    info = device_info(torch)
    dev = args.device
    cuda = dev == "cuda"
    pkg = (str(ROOT / "hvd_compress"),)          # the kernels are in hvd_compress/kernels/
    results = []

    def sync_sites(fn):
        if not cuda:                      # CUDA's sync-debug mode only (tests/counting.py on a CPU)
            fn()
            return None
        sites = Counter()
        original = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if "synchroniz" not in str(message):
                return
            frames = [f for f in traceback.extract_stack()[:-1] if f.filename.startswith(pkg)]
            where = frames[-1] if frames else traceback.extract_stack()[-3]
            site = (Path(where.filename).relative_to(pkg[0]).as_posix()   # ops/torch_ops/core.py
                    if where.filename.startswith(pkg) else Path(where.filename).name)
            sites[f"{site}:{where.lineno} {where.name}"] += 1

        torch.cuda.synchronize()
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")      # (it can warn once itself: not counted)
            warnings.showwarning = show
            try:
                fn()
            finally:
                warnings.showwarning = original
                torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        return dict(sites)

    def timed(fn, repeat):
        times = []
        for _ in range(repeat):
            _common.sync(torch, dev)
            t0 = time.perf_counter()
            fn()
            _common.sync(torch, dev)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    for n in map(parse_size, args.sizes.split(",")):
        g = torch.randn(n, device=dev)
        g2 = torch.randn(n, device=dev)
        for spec in filter(None, (s.strip() for s in (args.specs or ";".join(PROFILE_SPECS)).split(";"))):
            comps = [hvd_compress.from_spec(spec), hvd_compress.from_spec(spec)]
            state = {}

            def compress():
                state["p0"], state["ctx"] = comps[0].compress(g, "x")
                state["p1"], _ = comps[1].compress(g2, "x")

            def decompress():
                return comps[0].decompress(aggregate(comps[0], [state["p0"], state["p1"]]), state["ctx"])

            compress(), decompress(), compress(), decompress()           # warm-up
            row = {"spec": spec, "n": n,
                   "compress_ms_two_ranks": 1e3 * timed(compress, args.repeat),
                   "decompress_ms": 1e3 * timed(decompress, args.repeat),
                   "compress_sync_sites": sync_sites(compress),
                   "decompress_sync_sites": sync_sites(decompress)}
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            with torch_profile(activities=activities) as prof:
                compress()
                decompress()
                _common.sync(torch, dev)
            events = prof.key_averages()
            row["cuda_kernels"] = sum(e.count for e in events if getattr(e, "device_type", None)
                                      == torch.autograd.DeviceType.CUDA) if cuda else None
            top = sorted(events, key=lambda e: e.cpu_time_total, reverse=True)[:args.top]
            row["top_cpu_ops"] = [{"op": e.key, "count": e.count, "cpu_ms": e.cpu_time_total / 1e3}
                                  for e in top]
            results.append(row)
            print(f"\n{spec}  n={n:,}: compress (2 ranks) {row['compress_ms_two_ranks']:.3f} ms, "
                  f"decompress {row['decompress_ms']:.3f} ms, {row['cuda_kernels']} CUDA kernels")
            for what in ("compress_sync_sites", "decompress_sync_sites"):
                for site, count in sorted((row[what] or {}).items(), key=lambda kv: -kv[1]):
                    print(f"   {what[:-11]:10s} sync x{count:<3d} {site}")
            for e in row["top_cpu_ops"]:
                print(f"   cpu {e['cpu_ms']:8.3f} ms  x{e['count']:<4d} {e['op'][:90]}")
    write_json(args.out, {"info": info, "run_device": dev, "results": results})
    print(f"wrote {args.out}")
    return 0
