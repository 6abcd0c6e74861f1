"""GPU benchmarks and the summary of ``make gpu-test`` (ci/gpu.sh runs every subcommand).

    python benchmarks/gpu_bench.py preflight --out F   # versions, device; imports without Horovod/TF
    python benchmarks/gpu_bench.py codecs --out F      # twobit, rangefloat, block DCT throughput
    python benchmarks/gpu_bench.py models --out F      # compress + decompress per step, examples/models.py
    python benchmarks/gpu_bench.py profile --out F     # time, host-sync sites and top ops per compressor
    python benchmarks/gpu_bench.py summary --results DIR   # one JSON from everything in DIR

Throughput is reported as the bytes an operation must read and write divided by its median
time (CUDA events), and as a fraction of the device's peak memory bandwidth (looked up from
the device name: H100 SXM 3.35 TB/s, H200 4.8 TB/s, ...; ``--peak-gbps`` overrides).
"""
import sys
from pathlib import Path

# benchmarks/select.py is named like the stdlib module `select`: drop this folder from
# sys.path before anything imports subprocess (see select.py).
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Peak memory bandwidth (GB/s) by device name, most specific first (vendor data sheets).
PEAK_GBPS = [("GH200", 4000), ("H200", 4800), ("H100 NVL", 3900), ("H100 PCIe", 2000),
             ("H100", 3350), ("H800", 3350), ("B200", 8000), ("A100-SXM4-80GB", 2039),
             ("A100 80GB PCIe", 1935), ("A100", 1555), ("L40S", 864), ("L4", 300),
             ("A10G", 600), ("V100", 900), ("T4", 320)]


def peak_gbps(device_name, override=None):
    if override:
        return float(override)
    for key, value in PEAK_GBPS:
        if device_name and key.lower() in device_name.lower():
            return float(value)
    return None


def parse_size(text):
    text = text.strip().upper()
    scale = {"K": 10**3, "M": 10**6, "G": 10**9}.get(text[-1], 1)
    return int(float(text.rstrip("KMG")) * scale)


def write_json(path, obj):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1, sort_keys=False, default=str))


def device_info(torch):
    info = {"python": platform.python_version(), "torch": torch.__version__,
            "cuda_available": torch.cuda.is_available(), "date": datetime.date.today().isoformat()}
    try:
        import triton
        info["triton"] = triton.__version__
    except Exception as e:   # noqa: BLE001 - reported, not fatal here
        info["triton"] = None
        info["triton_error"] = f"{type(e).__name__}: {e}"
    if info["cuda_available"]:
        p = torch.cuda.get_device_properties(0)
        info.update(device=torch.cuda.get_device_name(0), capability=list(torch.cuda.get_device_capability(0)),
                    multiprocessors=p.multi_processor_count, memory_GiB=round(p.total_memory / 2**30, 1),
                    cuda_runtime=torch.version.cuda, device_count=torch.cuda.device_count())
    else:
        info["device"] = None
    return info


def cuda_timeit(torch, fn, repeat, warmup=2):
    """Median seconds of ``fn()`` between CUDA events (host-side gaps included)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def laplace_cuda(torch, n, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    u = torch.rand(n, generator=g, device="cuda") - 0.5
    return -torch.sign(u) * torch.log1p(-2 * u.abs())


# -- preflight ----------------------------------------------------------------------------

def preflight(args):
    """Versions and device; hvd_compress and its kernels import with no Horovod/TensorFlow."""
    out = {"executable": sys.executable, "python": platform.python_version()}
    try:
        import torch
    except Exception as e:   # noqa: BLE001
        out["error"] = f"cannot import torch with {sys.executable}: {type(e).__name__}: {e}"
        write_json(args.out, out)
        print(f"preflight: {out['error']}")
        return 2
    out.update(device_info(torch))
    out["peak_bandwidth_GBps"] = peak_gbps(out.get("device"), args.peak_gbps)
    try:
        import importlib
        import numpy
        out["numpy"] = numpy.__version__
        import hvd_compress
        for mod in ("hvd_compress.kernels", "hvd_compress.kernels.abs_stats",
                    "hvd_compress.kernels.threshold_count", "hvd_compress.kernels.compact",
                    "hvd_compress.kernels.twobit", "hvd_compress.kernels.rangefloat",
                    "hvd_compress.kernels.dct", "hvd_compress.ops.torch_ops",
                    "hvd_compress.compressors", "hvd_compress.strategies.policy"):
            importlib.import_module(mod)
        out["hvd_compress"] = hvd_compress.__version__
        out["kernels_path"] = str(Path(sys.modules["hvd_compress.kernels"].__file__).parent)
        x = torch.arange(10, dtype=torch.float32, device="cuda" if out["cuda_available"] else "cpu")
        c = hvd_compress.from_spec("topk:density=0.3")
        payload, ctx = c.compress(x, "x")
        out["smoke_compress"] = c.decompress(payload, ctx).tolist()
    except Exception as e:   # noqa: BLE001
        out["error"] = f"hvd_compress does not import/run here: {type(e).__name__}: {e}"
    heavy = {m: (sys.modules.get(m) is not None) for m in ("horovod", "tensorflow", "keras")}
    out["loaded_frameworks"] = [m for m, loaded in heavy.items() if loaded]
    if out["loaded_frameworks"] and "error" not in out:
        out["error"] = f"importing hvd_compress loaded {out['loaded_frameworks']}"
    try:
        import hvd_compress.torch  # noqa: F401 - the Horovod glue; expected to fail without Horovod
        out["glue_hvd_compress_torch"] = "imported (Horovod present)"
    except ImportError as e:
        out["glue_hvd_compress_torch"] = f"not importable without Horovod ({e.__class__.__name__}), as expected"
    write_json(args.out, out)
    print(f"python {out['python']} ({sys.executable}), torch {out.get('torch')}, "
          f"triton {out.get('triton')}, numpy {out.get('numpy')}")
    print(f"device: {out.get('device') or 'NO CUDA DEVICE'}"
          + (f" ({out['memory_GiB']} GiB, peak {out['peak_bandwidth_GBps']} GB/s)" if out.get("device") else ""))
    print(f"hvd_compress {out.get('hvd_compress')} kernels from {out.get('kernels_path')}; "
          f"frameworks loaded: {out['loaded_frameworks'] or 'none'}; "
          f"hvd_compress.torch: {out['glue_hvd_compress_torch']}")
    if "error" in out:
        print(f"preflight: {out['error']}")
        return 2
    return 0


# -- codecs and DCT ---------------------------------------------------------------------

def codecs(args):
    import torch

    import hvd_compress
    from hvd_compress.kernels import dct as D
    from hvd_compress.kernels import rangefloat as RF
    from hvd_compress.kernels import twobit as TB
    torch.backends.cuda.matmul.allow_tf32 = False
    info = device_info(torch)
    peak = peak_gbps(info["device"], args.peak_gbps)
    rows = []
    for n in map(parse_size, args.sizes.split(",")):
        x = laplace_cuda(torch, n)
        t = x.abs().mean()
        words = TB.pack(x, t)
        emax = RF.max_exponent(x)
        cases = [("twobit pack", lambda: TB.pack(x, t), 4 * n + 4 * words.numel(), 0),
                 ("twobit unpack", lambda: TB.unpack(words), 4 * words.numel() + 64 * words.numel(), 0),
                 ("rangefloat max_exponent", lambda: RF.max_exponent(x), 4 * n, 0)]
        for bits in (4, 8, 12, 16):
            e, m = RF.SPLITS[bits]
            g, nb = RF.group(bits)
            data = RF.encode(x, emax, e, m)
            groups = data.numel() // nb
            per_group = emax.to(torch.int32).expand(groups).contiguous()
            cases += [(f"rangefloat{bits} encode", lambda e=e, m=m: RF.encode(x, emax, e, m),
                       4 * n + data.numel(), 0),
                      (f"rangefloat{bits} decode",
                       lambda d=data, p=per_group, e=e, m=m: RF.decode(d, p, e, m),
                       data.numel() + 4 * groups + 4 * g * groups, 0)]
        for block in (64, 256, 1024):
            coefs = D.dct(x, block)
            cases += [(f"block DCT {block}", lambda b=block: D.dct(x, b), 8 * coefs.numel(),
                       2 * coefs.numel() * block),
                      (f"block IDCT {block}", lambda c=coefs, b=block: D.idct(c, b),
                       8 * coefs.numel(), 2 * coefs.numel() * block)]
        for spec in ("twobit", "rangefloat:bits=8", "dct:density=0.01", "dct:density=0.01,block=64",
                     "laplace_topk:density=0.01,values=rangefloat8",
                     "laplace_topk:density=0.01,fused=1", "laplace_topk:density=0.01,fused=1,values=rangefloat8"):
            c = hvd_compress.from_spec(spec + (",ef=0" if ":" in spec else ":ef=0"))
            payload, ctx = c.compress(x, "g")
            cases += [(f"{spec} compress", lambda c=c: c.compress(x, "g"), 4 * n, 0),
                      (f"{spec} decompress", lambda c=c, p=payload, k=ctx: c.decompress(p, k), 4 * n, 0)]
        for name, fn, nbytes, flops in cases:
            seconds = cuda_timeit(torch, fn, args.repeat)
            row = {"op": name, "n": n, "ms": 1e3 * seconds, "bytes": nbytes,
                   "GBps": nbytes / seconds / 1e9}
            row["fraction_of_peak"] = row["GBps"] / peak if peak else None
            if flops:
                row["TFLOPs"] = flops / seconds / 1e12
            rows.append(row)
            print(f"{name:48s} {n:>11,d} {row['ms']:9.3f} ms {row['GBps']:8.1f} GB/s"
                  + (f" ({row['fraction_of_peak']:.0%} of peak)" if peak else "")
                  + (f" {row['TFLOPs']:.1f} TFLOP/s" if flops else ""), flush=True)
        del x, words, cases
        torch.cuda.empty_cache()
    write_json(args.out, {"info": info, "peak_bandwidth_GBps": peak, "repeat": args.repeat,
                          "note": "GBps = bytes an op must read + write / median time; compress/"
                                  "decompress rows count the float32 input only",
                          "results": rows})
    print(f"wrote {args.out}")
    return 0


# -- models: compress + decompress per training step ------------------------------------

MODEL_SCHEMES = ["none", "fp16", "bf16", "topk:density=0.01", "laplace_topk:density=0.01",
                 "laplace_topk:density=0.01,exact=1", "laplace_topk:density=0.01,fused=1",
                 "dgc:density=0.01", "gaussian_k:density=0.01",
                 "twobit", "rangefloat:bits=8", "dct:density=0.01,block=64", "hylo"]


def _time_two_ranks(compress, decompress, repeat, sync):
    """Median seconds of rank 0's ``compress(0)`` and of ``decompress(sent0, sent1)``
    (after a warm-up that compiles kernels and creates residuals); also rank 0's last
    payload."""
    sent0, sent1 = compress(0), compress(1)
    decompress(sent0, sent1)
    times_c, times_d = [], []
    for _ in range(repeat):
        sync()
        t0 = time.perf_counter()
        sent0 = compress(0)
        sync()
        t1 = time.perf_counter()
        sent1 = compress(1)
        sync()
        t2 = time.perf_counter()
        decompress(sent0, sent1)
        sync()
        times_c.append(t1 - t0)
        times_d.append(time.perf_counter() - t2)
    return statistics.median(times_c), statistics.median(times_d), sent0


def _bucket_row(model_name, params, ranks, scheme, repeat, sync):
    """compress_bucket of all of a model's gradients (one bucket per rank, as
    bucket_mb=25 makes of these models) and decompress_bucket of the 2 ranks' aggregate."""
    import torch

    import hvd_compress
    from hvd_compress import buckets
    from hvd_compress.compressors import payload_bytes
    from hvd_compress.ops import torch_ops
    lay = buckets.layout([n for n, _ in ranks[0]], [tuple(g.shape) for _, g in ranks[0]])
    comps = [hvd_compress.from_spec(scheme) for _ in ranks]

    def compress(r):
        flat = torch.cat([g.reshape(-1) for _, g in ranks[r]])
        return comps[r].compress_bucket(flat, lay)

    def decompress(s0, s1):
        return comps[0].decompress_bucket(_aggregate(comps[0], [s0[0], s1[0]]), s0[1])

    compress_s, decompress_s, s0 = _time_two_ranks(compress, decompress, repeat, sync)
    sent = payload_bytes(s0[0], torch_ops)
    row = {"model": model_name, "params": params, "tensors": len(ranks[0]),
           "scheme": scheme + " (1 bucket)", "bytes_sent_per_rank": sent,
           "ratio_vs_dense": 4 * params / sent, "compress_ms": 1e3 * compress_s,
           "decompress_ms": 1e3 * decompress_s}
    row["step_ms"] = row["compress_ms"] + row["decompress_ms"]
    return row


def models(args):
    import torch
    import torch.nn.functional as F

    import hvd_compress
    from hvd_compress.compressors import payload_bytes
    from hvd_compress.ops import torch_ops
    sys.path.insert(0, str(ROOT / "examples"))
    from models import ResNetSmall, vgg_small

    info = device_info(torch)
    sync = torch.cuda.synchronize
    results = []
    for model_name, build in (("vgg_small", vgg_small), ("resnet_small", ResNetSmall)):
        torch.manual_seed(0)
        model = build().cuda()
        ranks = []
        for r in range(2):                                   # two ranks, two batches
            model.zero_grad()
            x = torch.randn(32, 3, 32, 32, device="cuda")
            y = torch.randint(0, 10, (32,), device="cuda")
            F.cross_entropy(model(x), y).backward()
            ranks.append([(n, p.grad.detach().clone()) for n, p in model.named_parameters()])
        params = sum(g.numel() for _, g in ranks[0])
        for scheme in filter(None, (s.strip() for s in args.schemes.split(";"))):
            comps = [hvd_compress.Hylo.from_model(model) if scheme == "hylo"
                     else hvd_compress.from_spec(scheme) for _ in ranks]

            def compress(r):
                out = []
                for name, g in ranks[r]:
                    c = comps[r].for_tensor(name, g)
                    out.append((c, *c.compress(g, name)))
                return out

            def decompress(sent0, sent1):
                return [c.decompress(_aggregate(c, [p0, p1]), ctx)
                        for (c, p0, ctx), (_, p1, _) in zip(sent0, sent1)]

            compress_s, decompress_s, sent0 = _time_two_ranks(compress, decompress, args.repeat, sync)
            sent = sum(payload_bytes(p, torch_ops) for _, p, _ in sent0)
            row = {"model": model_name, "params": params, "tensors": len(ranks[0]), "scheme": scheme,
                   "bytes_sent_per_rank": sent, "ratio_vs_dense": 4 * params / sent,
                   "compress_ms": 1e3 * compress_s, "decompress_ms": 1e3 * decompress_s}
            row["step_ms"] = row["compress_ms"] + row["decompress_ms"]
            results.append(row)
            print(f"{model_name:13s} {scheme:36s} compress {row['compress_ms']:8.2f} ms  "
                  f"decompress (2 ranks) {row['decompress_ms']:8.2f} ms  "
                  f"{row['ratio_vs_dense']:6.1f}x fewer bytes", flush=True)
            if scheme != "hylo" and comps[0].segmented:       # the same, one bucket per rank
                row = _bucket_row(model_name, params, ranks, scheme, args.repeat, sync)
                results.append(row)
                print(f"{model_name:13s} {scheme + ' (1 bucket)':36s} compress {row['compress_ms']:8.2f} ms  "
                      f"decompress (2 ranks) {row['decompress_ms']:8.2f} ms  "
                      f"{row['ratio_vs_dense']:6.1f}x fewer bytes", flush=True)
    write_json(args.out, {"info": info, "repeat": args.repeat,
                          "note": "per step, all parameters: compress = one rank's compress calls "
                                  "(error feedback on); decompress = decoding the aggregate of 2 ranks' "
                                  "payloads; host time with a synchronize before and after",
                          "results": results})
    print(f"wrote {args.out}")
    return 0


def _aggregate(compressor, payloads):
    """What the glue's collective hands to decompress (allreduce: sum; allgather: concat)."""
    import torch
    if compressor.collective == "allreduce":
        return payloads[0] + payloads[1]
    return tuple(torch.cat([p[i] for p in payloads]) for i in range(len(payloads[0])))


# -- summary ------------------------------------------------------------------------------

def _load(path):
    path = Path(path)
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        return {"error": f"unreadable {path.name}: {e}"}


def parse_junit(path):
    """pass/fail/error/skip counts, skip reasons and failures from pytest's JUnit XML."""
    import xml.etree.ElementTree as ET
    path = Path(path)
    if not path.exists():
        return None
    root = ET.parse(path).getroot()
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    reasons, failures, per_module = {}, [], {}
    for case in root.iter("testcase"):
        module = case.get("classname", "")
        test_id = f"{module}::{case.get('name')}"
        if case.find("failure") is not None:
            outcome, node = "failed", case.find("failure")
        elif case.find("error") is not None:
            outcome, node = "errors", case.find("error")
        elif case.find("skipped") is not None:
            outcome, node = "skipped", case.find("skipped")
        else:
            outcome, node = "passed", None
        counts[outcome] += 1
        per_module.setdefault(module, {"passed": 0, "failed": 0, "errors": 0, "skipped": 0})[outcome] += 1
        if outcome == "skipped":
            reason = (node.get("message") or "").strip()
            reasons[reason] = reasons.get(reason, 0) + 1
        elif outcome in ("failed", "errors"):
            failures.append({"test": test_id, "message": (node.get("message") or "")[:400]})
    counts["total"] = sum(counts.values())
    return dict(counts, skip_reasons=reasons, failures=failures, per_module=per_module)


def merge_select(results_dir):
    parts = sorted(Path(results_dir).glob(".select_*.json"))
    merged, info = [], None
    for p in parts:
        data = _load(p) or {}
        info = info or data.get("info")
        merged += data.get("results", [])
    if not merged:
        return None
    return {"info": info, "date": datetime.date.today().isoformat(), "results": merged}


def select_figures(select, peak):
    rows, targets = [], {}
    for r in select["results"]:
        m = r["methods"]
        lap = m.get("laplace_topk")
        row = {"input": r["input"], "n": r["n"], "density": r["density"],
               "topk_ms": 1e3 * m["topk"]["seconds"] if "topk" in m else None}
        if lap:
            gbps = 4 * r["n"] / lap["seconds"] / 1e9          # one float32 read of the tensor
            row.update(laplace_topk_ms=1e3 * lap["seconds"], speedup_vs_topk=lap.get("speedup_vs_topk"),
                       count_over_k=lap["count_over_k"], over_read3=lap["over_read3"],
                       effective_GBps=gbps, effective_fraction_of_peak=gbps / peak if peak else None)
        if "laplace_topk_exact" in m:
            row["exact_ms"] = 1e3 * m["laplace_topk_exact"]["seconds"]
            row["exact_speedup_vs_topk"] = m["laplace_topk_exact"].get("speedup_vs_topk")
        for fused in ("laplace_topk_fused", "laplace_topk_fused_exact"):
            if fused in m:
                row[f"{fused}_ms"] = 1e3 * m[fused]["seconds"]
                row[f"{fused}_speedup_vs_topk"] = m[fused].get("speedup_vs_topk")
                row[f"{fused}_count_over_k"] = m[fused]["count_over_k"]
        row["read3_fraction_of_peak"] = (12 * r["n"] / r["read3_seconds"] / 1e9 / peak) if peak else None
        for other in ("dgc", "gaussian_k", "sidco_exp"):
            if other in m:
                row[f"{other}_speedup_vs_topk"] = m[other].get("speedup_vs_topk")
                row[f"{other}_count_over_k"] = m[other]["count_over_k"]
        rows.append(row)
        fused = m.get("laplace_topk_fused")
        if fused and r["n"] == 25_000_000:
            targets[f"fused {r['input']} 25M density {r['density']}"] = {
                "speedup_vs_topk": fused.get("speedup_vs_topk"),
                "count_over_k": fused["count_over_k"],
                "meets_5x_faster_than_topk": (fused.get("speedup_vs_topk") or 0) >= 5,
                "meets_8x_faster_than_topk": (fused.get("speedup_vs_topk") or 0) >= 8}
        if lap and r["n"] == 25_000_000 and r["density"] == 0.001:
            targets[f"{r['input']} 25M density 0.001"] = {
                "speedup_vs_topk": lap.get("speedup_vs_topk"),
                "meets_8x_faster_than_topk": (lap.get("speedup_vs_topk") or 0) >= 8,
                "time_over_three_reads": lap["over_read3"],
                "meets_within_2x_of_three_reads": lap["over_read3"] <= 2}
    return rows, targets


# -- profile: where a compressor's time and host synchronisations go --------------------

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
    pkg = (str(ROOT / "hvd_compress"),)          # the kernels are in hvd_compress/kernels/
    results = []

    def sync_sites(fn):
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
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    for n in map(parse_size, args.sizes.split(",")):
        g = torch.randn(n, device="cuda")
        g2 = torch.randn(n, device="cuda")
        for spec in filter(None, (s.strip() for s in args.specs.split(";"))):
            comps = [hvd_compress.from_spec(spec), hvd_compress.from_spec(spec)]
            state = {}

            def compress():
                state["p0"], state["ctx"] = comps[0].compress(g, "x")
                state["p1"], _ = comps[1].compress(g2, "x")

            def decompress():
                return comps[0].decompress(_aggregate(comps[0], [state["p0"], state["p1"]]), state["ctx"])

            compress(), decompress(), compress(), decompress()           # warm-up
            row = {"spec": spec, "n": n,
                   "compress_ms_two_ranks": 1e3 * timed(compress, args.repeat),
                   "decompress_ms": 1e3 * timed(decompress, args.repeat),
                   "compress_sync_sites": sync_sites(compress),
                   "decompress_sync_sites": sync_sites(decompress)}
            with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                compress()
                decompress()
                torch.cuda.synchronize()
            events = prof.key_averages()
            row["cuda_kernels"] = sum(e.count for e in events
                                      if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA)
            top = sorted(events, key=lambda e: e.cpu_time_total, reverse=True)[:args.top]
            row["top_cpu_ops"] = [{"op": e.key, "count": e.count, "cpu_ms": e.cpu_time_total / 1e3}
                                  for e in top]
            results.append(row)
            print(f"\n{spec}  n={n:,}: compress (2 ranks) {row['compress_ms_two_ranks']:.3f} ms, "
                  f"decompress {row['decompress_ms']:.3f} ms, {row['cuda_kernels']} CUDA kernels")
            for what in ("compress_sync_sites", "decompress_sync_sites"):
                for site, count in sorted(row[what].items(), key=lambda kv: -kv[1]):
                    print(f"   {what[:-11]:10s} sync x{count:<3d} {site}")
            for e in row["top_cpu_ops"]:
                print(f"   cpu {e['cpu_ms']:8.3f} ms  x{e['count']:<4d} {e['op'][:90]}")
    write_json(args.out, {"info": info, "results": results})
    print(f"wrote {args.out}")
    return 0



def summary(args):
    res = Path(args.results)
    pre = _load(res / ".preflight.json") or {}
    steps = []
    if (res / ".steps.tsv").exists():
        for line in (res / ".steps.tsv").read_text().splitlines():
            name, rc, seconds, status = (line.split("\t") + ["", "", "", ""])[:4]
            steps.append({"step": name, "rc": int(rc) if rc.lstrip("-").isdigit() else None,
                          "seconds": float(seconds or 0), "status": status})
    tests = parse_junit(res / "tests.xml")
    records = _load(res / ".records.json") or {}
    peak = pre.get("peak_bandwidth_GBps")
    out = {"status": None, "date": datetime.date.today().isoformat(),
           "time_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%H:%M:%S"),
           "device": pre.get("device"), "cuda_available": pre.get("cuda_available"),
           "torch": pre.get("torch"), "triton": pre.get("triton"), "python": pre.get("python"),
           "numpy": pre.get("numpy"), "hvd_compress": pre.get("hvd_compress"),
           "peak_bandwidth_GBps": peak, "preflight": pre, "steps": steps, "tests": tests,
           "sync_counts": records.pop("sync_counts", {}), "measured": records, "figures": {}}
    select = merge_select(res)
    if select:
        write_json(res / "select.json", select)
        try:
            import importlib.util
            spec = importlib.util.spec_from_file_location("hvd_select_bench", ROOT / "benchmarks" / "select.py")
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            mod.plot(select["results"], res / "select.png",
                     f"top-k selection, {out['device']}, torch {out['torch']}")
        except Exception as e:   # noqa: BLE001 - a missing plot is no failure
            out["select_plot_error"] = f"{type(e).__name__}: {e}"
        rows, targets = select_figures(select, peak)
        out["figures"]["select"] = rows
        out["figures"]["laplace_topk_targets"] = targets
    codecs_ = _load(res / "codecs.json")
    if codecs_:
        out["figures"]["codecs"] = [{k: r.get(k) for k in ("op", "n", "ms", "GBps", "fraction_of_peak",
                                                           "TFLOPs") if k in r}
                                    for r in codecs_.get("results", [])]
    models_ = _load(res / "models.json")
    if models_:
        out["figures"]["models"] = [{k: r[k] for k in ("model", "scheme", "compress_ms", "decompress_ms",
                                                       "step_ms", "ratio_vs_dense")}
                                    for r in models_.get("results", [])]
    for path in sorted(res.glob("gpu_step_*.json")):       # benchmarks/gpu_step.py
        data = _load(path) or {}
        if "ddp_check" in data:
            out["figures"]["gpu_step_ddp_check"] = data["ddp_check"]
        out["figures"].setdefault("gpu_step", []).extend(
            dict({k: v for k, v in r.items() if k != "per_bucket"}, model=data.get("model"))
            for r in data.get("rows", []))
        out["figures"].setdefault("gpu_step_targets", {}).update(data.get("targets") or {})
    bad_steps = [s["step"] for s in steps if s["status"].startswith(("failed", "timed out"))]
    unfinished = [s["step"] for s in steps if s["status"] == "skipped: budget spent"]
    if pre.get("error") or not pre:
        out["status"] = "error"
    elif not pre.get("cuda_available"):
        out["status"] = "no_cuda"
    elif bad_steps or tests is None or tests["failed"] or tests["errors"] or not tests["passed"] \
            or any(r.startswith("no CUDA device") for r in tests["skip_reasons"]):
        out["status"] = "failed"                 # (on a GPU, no test may pass by skipping)
    elif unfinished:
        out["status"] = "incomplete"
    else:
        out["status"] = "passed"
    out["failed_steps"], out["unfinished_steps"] = bad_steps, unfinished
    out["files"] = sorted(p.name for p in res.iterdir() if not p.name.startswith("."))
    if "gpu_summary.json" not in out["files"]:
        out["files"].append("gpu_summary.json")
    write_json(res / "gpu_summary.json", out)
    if not args.keep:
        for p in res.glob(".*"):
            if p.is_file():
                p.unlink()

    # the report
    print("=" * 78)
    print(f"make gpu-test summary ({out['date']}): {out['status'].upper()}")
    print(f"device {out['device'] or 'NONE'}, torch {out['torch']}, triton {out['triton']}, "
          f"python {out['python']}")
    if tests:
        print(f"tests: {tests['passed']} passed, {tests['failed']} failed, {tests['errors']} errors, "
              f"{tests['skipped']} skipped (of {tests['total']})")
        for reason, n in tests["skip_reasons"].items():
            print(f"  skipped {n}: {reason[:150]}")
        for f in tests["failures"][:20]:
            print(f"  FAILED {f['test']}: {f['message'][:200]}")
    else:
        print("tests: no result (the test step did not finish)")
    for s in steps:
        print(f"step {s['step']:26s} {s['status']:28s} rc={s['rc']} {s['seconds']:6.1f} s")
    for name, t in out["figures"].get("laplace_topk_targets", {}).items():
        if "time_over_three_reads" in t:
            print(f"laplace_topk {name}: {t['speedup_vs_topk']:.2f}x torch.topk (target >= 8), "
                  f"{t['time_over_three_reads']:.2f}x three reads (target <= 2)")
        else:
            print(f"laplace_topk {name}: {t['speedup_vs_topk'] or 0:.2f}x torch.topk (target >= 5, "
                  f"goal 8), count/k {t['count_over_k']:.3f}")
    for name, t in out["figures"].get("gpu_step_targets", {}).items():
        print(f"GPT-2 small step, {name}: {t['codec_over_backward']:.1%} of backward")
    if out["sync_counts"]:
        print(f"host synchronisations recorded for {len(out['sync_counts'])} calls (sync_counts)")
    if out["status"] == "no_cuda":
        print("NO CUDA DEVICE: nothing ran on a GPU.  The GPU tests were collected and skipped "
              "(counted as skipped, not passed); the benchmarks did not run.")
    print(f"wrote {res / 'gpu_summary.json'}")
    print("=" * 78)
    return {"passed": 0, "no_cuda": 0}.get(out["status"], 1)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("preflight")
    a.add_argument("--out", required=True)
    a.add_argument("--peak-gbps", type=float, default=None)
    a = sub.add_parser("codecs")
    a.add_argument("--out", required=True)
    a.add_argument("--sizes", default="25M,100M")
    a.add_argument("--repeat", type=int, default=10)
    a.add_argument("--peak-gbps", type=float, default=None)
    a = sub.add_parser("models")
    a.add_argument("--out", required=True)
    a.add_argument("--repeat", type=int, default=10)
    a.add_argument("--schemes", default=";".join(MODEL_SCHEMES),
                   help="compressor specs separated by ';' (a spec has commas of its own)")
    a = sub.add_parser("profile")
    a.add_argument("--out", required=True)
    a.add_argument("--sizes", default="1M,25M")
    a.add_argument("--repeat", type=int, default=10)
    a.add_argument("--top", type=int, default=12)
    a.add_argument("--specs", default=";".join(PROFILE_SPECS), help="specs separated by ';'")
    a = sub.add_parser("summary")
    a.add_argument("--results", required=True)
    a.add_argument("--keep", action="store_true", help="keep the intermediate .files")
    args = p.parse_args()
    if args.cmd in ("codecs", "models", "profile"):
        import torch
        if not torch.cuda.is_available():
            print(f"{args.cmd}: no CUDA device; nothing to measure")
            return 3
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    return {"preflight": preflight, "codecs": codecs, "models": models, "profile": profile,
            "summary": summary}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
