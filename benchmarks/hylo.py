"""Hylo (seed 004) benchmark: bytes per step and compression time, per model.

For a small VGG-like and ResNet-like model (examples/models.py) and each scheme (none,
fp16, topk 1%, laplace_topk 1%, Hylo's per-layer policy), one step's gradients are
compressed; reported: bytes this rank sends per step, the ratio to dense float32, and
the median time of compressing all gradients (error feedback on, as in training).
Prints a table, writes JSON (benchmarks/results/).

    python benchmarks/hylo.py [--repeat 10]
"""
import sys
from pathlib import Path

# benchmarks/select.py is named like the stdlib module `select`: drop this folder from
# sys.path before anything imports subprocess (see select.py).
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import hvd_compress  # noqa: E402
from hvd_compress.compressors import payload_bytes  # noqa: E402
from hvd_compress.ops import torch_ops  # noqa: E402
from models import ResNetSmall, vgg_small  # noqa: E402

SCHEMES = ["none", "fp16", "topk:density=0.01", "laplace_topk:density=0.01", "hylo"]


def gradients(model, batch=32, seed=0):
    torch.manual_seed(seed)
    x = torch.randn(batch, 3, 32, 32)
    y = torch.randint(0, 10, (batch,))
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    return [(n, p.grad.detach().clone()) for n, p in model.named_parameters()]


def run(model, scheme, grads, repeat, sync):
    compression = hvd_compress.Hylo.from_model(model) if scheme == "hylo" \
        else hvd_compress.from_spec(scheme)

    def step():
        sent = 0
        for name, g in grads:
            c = compression.for_tensor(name, g)
            payload, _ = c.compress(g, name)
            sent += payload_bytes(payload, torch_ops)
        sync()
        return sent

    sent = step()                                     # warm-up (and error-feedback state)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    dense = sum(4 * g.numel() for _, g in grads)
    return {"bytes_sent": sent, "bytes_dense": dense, "ratio": dense / sent,
            "compress_ms": 1e3 * statistics.median(times)}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    info = {"device": args.device, "gpu": torch.cuda.get_device_name() if args.device == "cuda"
            else None, "torch": torch.__version__, "threads": torch.get_num_threads(),
            "python": platform.python_version()}
    results = []
    for model_name, build in (("vgg_small", vgg_small), ("resnet_small", ResNetSmall)):
        model = build().to(args.device)
        grads = gradients(model.cpu()) if args.device == "cpu" else \
            [(n, g.to(args.device)) for n, g in gradients(model.cpu())]
        model.to(args.device)
        params = sum(g.numel() for _, g in grads)
        for scheme in SCHEMES:
            r = run(model, scheme, grads, args.repeat, sync)
            results.append(dict(model=model_name, params=params, scheme=scheme, **r))
    stamp = datetime.date.today().isoformat()
    print(f"\n{info['gpu'] or 'CPU'}, torch {info['torch']}, {info['threads']} threads, {stamp}")
    print(f"{'model':13s} {'params':>8s} {'scheme':27s} {'bytes/step':>11s} {'ratio':>7s} "
          f"{'compress ms':>12s}")
    for r in results:
        print(f"{r['model']:13s} {r['params']:8d} {r['scheme']:27s} {r['bytes_sent']:11d} "
              f"{r['ratio']:7.1f} {r['compress_ms']:12.2f}")
    name = (info["gpu"] or "cpu").replace(" ", "_")
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"hylo_{name}_{stamp}.json")
    out.write_text(json.dumps({"info": info, "date": stamp, "results": results}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
