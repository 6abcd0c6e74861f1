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
import importlib.util  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

_here = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("gpu_common", _here / "gpu_common.py")
common = sys.modules["gpu_common"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(common)
peak_gbps = common.peak_gbps
parse_size = common.parse_size
write_json = common.write_json
device_info = common.device_info
timeit = common.timeit
laplace = common.laplace
aggregate = common.aggregate
ROOT = common.ROOT
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


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
                    "hvd_compress.kernels.twobit", "hvd_compress.kernels.twobit_segments",
                    "hvd_compress.kernels.rangefloat",
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
        import horovod  # noqa: F401
        horovod_here = True
    except ImportError:
        horovod_here = False
    try:
        import hvd_compress.torch  # noqa: F401 - the Horovod glue imports Horovod when used
        out["glue_hvd_compress_torch"] = "imported" + (
            " (Horovod present)" if horovod_here else " without Horovod (it imports Horovod when used)")
    except ImportError as e:
        out["glue_hvd_compress_torch"] = f"not importable without Horovod ({e.__class__.__name__}: {e})"
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
        x = laplace(torch, n, args.device)
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
            seconds = timeit(torch, fn, args.repeat, args.device)
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
        if args.device == "cuda":
            torch.cuda.empty_cache()
    write_json(args.out, {"info": info, "run_device": args.device, "peak_bandwidth_GBps": peak,
                          "repeat": args.repeat,
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
        return comps[0].decompress_bucket(aggregate(comps[0], [s0[0], s1[0]]), s0[1])

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
    dev = args.device

    def sync():
        common.sync(torch, dev)
    results = []
    builds = {"vgg_small": vgg_small, "resnet_small": ResNetSmall}
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = sorted(set(names) - set(builds))
    if unknown or not names:
        raise SystemExit(f"--models: {', '.join(unknown) or 'none given'}; choose from "
                         f"{', '.join(builds)}")
    for model_name in names:
        build = builds[model_name]
        torch.manual_seed(0)
        model = build().to(dev)
        ranks = []
        for r in range(2):                                   # two ranks, two batches
            model.zero_grad()
            x = torch.randn(32, 3, 32, 32, device=dev)
            y = torch.randint(0, 10, (32,), device=dev)
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
                return [c.decompress(aggregate(c, [p0, p1]), ctx)
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
    write_json(args.out, {"info": info, "run_device": dev, "repeat": args.repeat,
                          "note": "per step, all parameters: compress = one rank's compress calls "
                                  "(error feedback on); decompress = decoding the aggregate of 2 ranks' "
                                  "payloads; host time with a synchronize before and after",
                          "results": results})
    print(f"wrote {args.out}")
    return 0


DRY_RUN = ("cpu: a dry run of the GPU code path on the CPU (with TRITON_INTERPRET=1 and "
           "HVD_COMPRESS_BACKEND=triton, the CUDA path's kernels in the interpreter); its times "
           "are not GPU figures")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("preflight")
    a.add_argument("--out", required=True)
    a.add_argument("--peak-gbps", type=float, default=None)
    a = sub.add_parser("codecs")
    a.add_argument("--out", required=True)
    a.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help=DRY_RUN)
    a.add_argument("--sizes", default="25M,100M")
    a.add_argument("--repeat", type=int, default=10)
    a.add_argument("--peak-gbps", type=float, default=None)
    a = sub.add_parser("models")
    a.add_argument("--out", required=True)
    a.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help=DRY_RUN)
    a.add_argument("--repeat", type=int, default=10)
    a.add_argument("--schemes", default=";".join(MODEL_SCHEMES),
                   help="compressor specs separated by ';' (a spec has commas of its own)")
    a.add_argument("--models", default="vgg_small,resnet_small",
                   help="models of examples/models.py, comma separated")
    a = sub.add_parser("profile")
    a.add_argument("--out", required=True)
    a.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help=DRY_RUN)
    a.add_argument("--sizes", default="1M,25M")
    a.add_argument("--repeat", type=int, default=10)
    a.add_argument("--top", type=int, default=12)
    a.add_argument("--specs", default=None, help="specs separated by ';' (default: gpu_profile.PROFILE_SPECS)")
    a = sub.add_parser("summary")
    a.add_argument("--results", required=True)
    a.add_argument("--keep", action="store_true", help="keep the intermediate .files")
    a.add_argument("--dry-run", action="store_true", help="the steps ran on the CPU (GPU_TEST_DEVICE=cpu)")
    args = p.parse_args()
    if args.cmd in ("codecs", "models", "profile"):
        import torch
        if args.device == "cuda" and not torch.cuda.is_available():
            print(f"{args.cmd}: no CUDA device; nothing to measure")
            return 3
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    if args.cmd == "profile":
        return common.sibling("gpu_profile").profile(args)
    if args.cmd == "summary":
        return common.sibling("gpu_summary").summary(args)
    return {"preflight": preflight, "codecs": codecs, "models": models}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
