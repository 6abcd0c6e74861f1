"""What the GPU benchmarks share (``benchmarks/gpu_bench.py`` and the modules it loads:
``gpu_profile.py``, ``gpu_summary.py``): the device's peak bandwidth, sizes, JSON, CUDA
event timing (wall clock on a CPU dry run), Laplace test data, the two-rank aggregate,
settings of the environment for a block (:func:`environment`; ``select.py`` uses it
too), and :func:`sibling`, which loads a benchmark module of this folder by its path
(this folder is not put on ``sys.path``: ``benchmarks/select.py`` is named like the
standard library's ``select``).
"""
import contextlib
import datetime
import importlib.util
import json
import os
import platform
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def sibling(name):
    """Module ``benchmarks/<name>.py``, loaded once by its path."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
        module = sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules[name]


@contextlib.contextmanager
def environment(settings):
    """``os.environ`` with ``settings`` inside the block; put back after."""
    old = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for name, value in old.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


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


def timeit(torch, fn, repeat, device="cuda", warmup=2):
    """Median seconds of ``fn()``: between CUDA events on a GPU (host-side gaps included),
    by ``time.perf_counter`` on the CPU (a dry run of a GPU benchmark, not a GPU figure).
    ``warmup`` calls come first; on the CPU one at most, which still runs the warm path
    (cached state, error feedback's residual) once: a dry run's times are no figures, and
    each call of a kernel in Triton's interpreter takes seconds."""
    import time
    if device != "cuda":
        warmup = min(warmup, 1)
    for _ in range(warmup):
        fn()
    sync(torch, device)
    times = []
    for _ in range(repeat):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def sync(torch, device):
    """Wait for the device (nothing to wait for on the CPU)."""
    if device == "cuda":
        torch.cuda.synchronize()


def laplace(torch, n, device="cuda", seed=0):
    """n Laplace(0, 1) float32 values made on ``device``, all finite: ``u`` is kept off
    -1/2, where ``log1p(-2|u|)`` is -inf (``torch.rand`` can return 0: about one value in
    2^25 was +Inf before, so a 25M-value tensor often held one and took the compressors'
    NaN/Inf path)."""
    g = torch.Generator(device=device).manual_seed(seed)
    u = (torch.rand(n, generator=g, device=device) - 0.5).clamp_min(-0.5 + 2.0**-25)
    return -torch.sign(u) * torch.log1p(-2 * u.abs())


def aggregate(compressor, payloads):
    """What the glue's collective hands to decompress (allreduce: sum; allgather: concat)."""
    import torch
    if compressor.collective == "allreduce":
        return payloads[0] + payloads[1]
    return tuple(torch.cat([p[i] for p in payloads]) for i in range(len(payloads[0])))


def load_json(path):
    path = Path(path)
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        return {"error": f"unreadable {path.name}: {e}"}
