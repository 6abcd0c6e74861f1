"""What one bucket exchange asks of the host on the GPU code path, counted per compressor:
Triton launches and framework (ATen) ops of a compress (error feedback included) and of
a decompress of two ranks' payloads (as the exchange driver runs it: checks deferred,
then read back once), for a bucket of 4 and of 40 tensors (issue 26: on an H200 an ATen
op cost the host 11 us and a Triton launch 27.5 us, and bucket compresses were bound by
them).

    python benchmarks/bucket_ops.py --out DIR            # CPU: the CUDA code path, kernels
                                                         # in Triton's interpreter
    python benchmarks/bucket_ops.py --device cuda --out DIR
    python benchmarks/bucket_ops.py --compare OLD.json   # the earlier run's bars beside

On the CPU, ``TRITON_INTERPRET=1`` and ``HVD_COMPRESS_BACKEND=triton`` are set here, and
the ops that Triton's interpreter issues itself (copies of a kernel's arguments) are
left out: an op counts when no frame of its call stack is Triton's.  ``views`` are the
ops that launch no kernel (views, allocations, splits).  ``host_us_estimate`` is
``launches * 27.5 + (ops - views) * 11`` -- **an estimate from the H200's costs
(benchmarks/results/gpu_2026-11-26/after_sort/gpu_breakdown_2026-11-26.json), not a
time**.

The host's work per tensor (its residuals, step counters, tables: Python that grows
with T even where launches and ops do not) is measured on buckets of T = 4, 40 and 200
tensors of 64 values: ``python_calls`` counts the exchange's Python and builtin function
calls (``sys.setprofile``, the kernels' bodies in the interpreter left out; exact), and
``host_us`` times it (the wall time on CUDA; on the CPU, minus the time in Triton's
interpreter, which still leaves the ATen ops' own work on data that grows with T, a
GPU's work, and is noisy: read the calls there).  ``*_per_tensor`` is the growth from 4
to 200 (``--host-tensors``).  Writes ``bucket_ops_<date>.json`` and ``.png``.
"""
import os
import sys
from pathlib import Path

sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse  # noqa: E402
import collections  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import traceback  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SPECS = ["none", "topk:density=0.01", "laplace_topk:density=0.01",
         "laplace_topk:density=0.01,fused=1", "laplace_topk:density=0.01,fused=1,values=rangefloat8",
         "laplace_topk:density=0.01,padded=1", "laplace_topk:density=0.01,padded=1,values=rangefloat8",
         "dct:density=0.01,padded=1",
         "topk:density=0.01,values=rangefloat8", "dct:density=0.01", "twobit",
         "rangefloat:bits=8", "qsgd", "terngrad", "onebit", "signsgd", "randomk:density=0.01",
         "threshold:threshold=2.5"]
#: ops that launch no kernel
VIEWS = ("aten.view", "aten.select", "aten.empty", "aten.detach", "aten.split", "aten.unbind",
         "aten.slice", "aten.as_strided", "aten._unsafe_view", "aten.t.", "aten.permute",
         "aten.expand", "aten.alias", "aten.lift_fresh", "aten._reshape_alias", "aten.squeeze",
         "aten.unsqueeze")
OP_US, LAUNCH_US = 11.0, 27.5        # the H200's, 2026-11-26 (gpu_breakdown's launch row)
HOST_TENSORS = "4,40,200"            # bucket sizes for the host's work per tensor


def counter_mode():
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not any("triton" in f.filename for f in traceback.extract_stack(limit=40)):
                self.ops[str(func)] += 1
            return func(*args, **(kwargs or {}))
    return Ops, torch


def driver_decompress(c, two, ctx):
    """``c.decompress_bucket`` as the exchange driver runs it: its checks deferred, then
    read back (the driver's once-per-step settle; here the step has this one bucket)."""
    from hvd_compress.ops import torch_ops
    sink = []
    with torch_ops.deferred_checks(sink):
        out = c.decompress_bucket(two, ctx)
    torch_ops.settle_checks(sink)
    return out


def one_exchange(spec, T, device):
    """``{"compress": (launches, ops, views), "decompress": ...}`` after a warm-up step."""
    import numpy as np
    import hvd_compress
    from hvd_compress import kernels as K
    from hvd_compress.buckets import layout
    Ops, torch = counter_mode()
    lay = layout([f"t{i}" for i in range(T)], [(1000 + 37 * i,) for i in range(T)])
    c = hvd_compress.from_spec(spec)
    out = {}
    for step in range(2):
        flat = torch.from_numpy(np.random.default_rng(step).laplace(size=lay.total)
                                .astype(np.float32)).to(device)
        with Ops() as oc, K.counting_launches() as lc:
            payload, ctx = c.compress_bucket(flat, lay)
        two = (tuple(torch.cat([p, p]) for p in payload) if isinstance(payload, tuple)
               else payload * 2)
        with Ops() as od, K.counting_launches() as ld:
            driver_decompress(c, two, ctx)
    for name, ops, launched in (("compress", oc.ops, lc), ("decompress", od.ops, ld)):
        views = sum(v for k, v in ops.items() if k.startswith(VIEWS))
        out[name] = (sum(launched.values()), sum(ops.values()), views)
    return out


def interpreter_clock():
    """A list: [0] accumulates the seconds spent inside Triton's interpreter (the kernels'
    bodies, which a GPU runs instead), [1] is True while inside; [0] stays 0 off the
    interpreter."""
    state = [0.0, False]
    if os.environ.get("TRITON_INTERPRET") != "1":
        return state
    import time
    from triton.runtime import interpreter
    run = interpreter.InterpretedFunction.run
    if getattr(run, "clocked", None) is not None:
        return run.clocked

    def clocked_run(self, *args, **kwargs):
        t, state[1] = time.perf_counter(), True
        try:
            return run(self, *args, **kwargs)
        finally:
            state[0] += time.perf_counter() - t
            state[1] = False
    clocked_run.clocked = state
    interpreter.InterpretedFunction.run = clocked_run
    return state


def host_work(spec, T, device, reps=5):
    """Host work of one exchange (compress with error feedback, decompress of two ranks'
    payloads) of a bucket of ``T`` tensors of 64 values, the kernels' bodies left out:
    ``(python_calls, median_us)``.  ``python_calls`` counts the Python and builtin
    function calls the exchange makes (``sys.setprofile``; generator resumes left out;
    exact, so it compares across machines; as tests/counting.py's ``python_calls``
    counts); ``median_us`` is its host time (noisy on the CPU, where the interpreter's
    work between the calls disturbs it)."""
    import time
    import numpy as np
    import torch
    import hvd_compress
    from hvd_compress.buckets import layout
    clock = interpreter_clock()
    lay = layout([f"t{i}" for i in range(T)], [(64,)] * T)
    c = hvd_compress.from_spec(spec)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    calls = [0]

    def count(frame, event, arg):
        if not clock[1] and (event == "c_call" or (
                event == "call" and frame.f_code.co_name != "<genexpr>")):
            calls[0] += 1

    def exchange(flat):
        payload, ctx = c.compress_bucket(flat, lay)
        two = (tuple(torch.cat([p, p]) for p in payload) if isinstance(payload, tuple)
               else payload * 2)
        driver_decompress(c, two, ctx)

    times = []
    for step in range(reps + 3):
        flat = torch.from_numpy(np.random.default_rng(step).laplace(size=lay.total)
                                .astype(np.float32)).to(device)
        sync()
        if step == reps + 2:                   # the last exchange is counted, not timed
            sys.setprofile(count)
            try:
                exchange(flat)
            finally:
                sys.setprofile(None)
            break
        inside, t = clock[0], time.perf_counter()
        exchange(flat)
        host = time.perf_counter() - t - (clock[0] - inside)
        sync()
        if step >= 2:
            times.append(host * 1e6)
    return calls[0], float(np.median(times))


def plot(rows, title, path, before=None, before_label=None):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib missing: no PNG)")
        return
    mine = [r for r in rows if r.get("tensors") == 40]
    old = {r["spec"]: r.get("host_us_estimate") for r in before or () if r.get("tensors") == 40}
    host = {r["spec"]: r["python_calls_per_tensor"] for r in rows if r.get("host")}
    old_host = {r["spec"]: r["python_calls_per_tensor"] for r in before or () if r.get("host")}
    panels = [("estimate", old, {r["spec"]: r["host_us_estimate"] for r in mine},
               "estimated host us per bucket exchange of 40 tensors\n"
               f"(launches x {LAUNCH_US} + kernel-launching ops x {OP_US}; log scale)")]
    if host:
        panels.append(("per tensor", old_host, host,
                       "Python calls per added tensor (T = 4 to 200; sys.setprofile,\n"
                       "the kernels' bodies left out)"))
    specs = [r["spec"] for r in mine]
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 0.45 * len(specs) + 1.5),
                             squeeze=False)
    y = list(range(len(specs)))
    for ax, (what, earlier, now, label) in zip(axes[0], panels):
        if earlier:
            ax.barh([v + 0.2 for v in y], [earlier.get(s) or 0 for s in specs], height=0.4,
                    color="lightgrey", label=before_label)
        ax.barh([v - 0.2 * bool(earlier) for v in y], [now.get(s) or 0 for s in specs],
                height=0.4 if earlier else 0.8, color="tab:blue", label="this run")
        ax.set_yticks(y)
        ax.set_yticklabels(specs if what == "estimate" else [], fontsize=7)
        if what == "estimate":
            ax.set_xscale("log")
        ax.set_xlabel(label)
        if earlier:
            ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--specs", default=";".join(SPECS), help="';'-separated compressor specs")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--name", default="bucket_ops")
    p.add_argument("--compare", help="a JSON of an earlier run, drawn beside this one")
    p.add_argument("--host-reps", type=int, default=5,
                   help="exchanges timed per bucket size for host_us (0: no host work)")
    p.add_argument("--host-tensors", default=HOST_TENSORS,
                   help="','-separated bucket sizes (tensors) for the host's work, smallest "
                        "first")
    args = p.parse_args()
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
        import triton  # noqa: F401  (before anything imports TensorFlow)
    os.environ["HVD_COMPRESS_BACKEND"] = "triton"
    rows = []
    print(f"{'spec':55s} {'T':>3s} {'compress (launches/ops/views)':>30s} "
          f"{'decompress':>14s} {'host us (est.)':>15s}")
    for spec in args.specs.split(";"):
        for T in (4, 40):
            try:
                got = one_exchange(spec, T, args.device)
            except Exception as e:  # noqa: BLE001 - a spec without a bucket path: recorded
                rows.append({"spec": spec, "tensors": T, "error": f"{type(e).__name__}: {e}"[:200]})
                print(f"{spec:55s} {T:3d} error {rows[-1]['error'][:60]}")
                continue
            (lc, oc, vc), (ld, od, vd) = got["compress"], got["decompress"]
            est = (lc + ld) * LAUNCH_US + (oc - vc + od - vd) * OP_US
            rows.append({"spec": spec, "tensors": T, "compress_launches": lc, "compress_ops": oc,
                         "compress_views": vc, "decompress_launches": ld, "decompress_ops": od,
                         "decompress_views": vd, "host_us_estimate": est})
            print(f"{spec:55s} {T:3d} {f'{lc}/{oc}/{vc}':>30s} {f'{ld}/{od}/{vd}':>14s} "
                  f"{est:15.0f}", flush=True)
        if args.host_reps:
            sizes = [int(v) for v in args.host_tensors.split(",")]
            try:
                work = {T: host_work(spec, T, args.device, args.host_reps) for T in sizes}
            except Exception as e:  # noqa: BLE001 - recorded like the counts' errors
                rows.append({"spec": spec, "host": True, "error": f"{type(e).__name__}: {e}"[:200]})
                continue
            lo, hi = sizes[0], sizes[-1]
            rows.append({"spec": spec, "host": True, "tensor_numel": 64,
                         "python_calls": {str(T): w[0] for T, w in work.items()},
                         "python_calls_per_tensor": (work[hi][0] - work[lo][0]) / (hi - lo),
                         "host_us": {str(T): w[1] for T, w in work.items()},
                         "host_us_per_tensor": (work[hi][1] - work[lo][1]) / (hi - lo)})
            print(f"{'':55s} python calls: "
                  + ", ".join(f"T={T} {w[0]}" for T, w in work.items())
                  + f" ({rows[-1]['python_calls_per_tensor']:.1f} per tensor); host us: "
                  + ", ".join(f"{w[1]:.0f}" for w in work.values()), flush=True)
    import subprocess
    import torch
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    info = {"date": datetime.date.today().isoformat(), "device": args.device, "commit": commit,
            "torch": torch.__version__, "op_us": OP_US, "launch_us": LAUNCH_US}
    out = Path(args.out) / f"{args.name}_{info['date']}"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"info": info, "rows": rows}, indent=1))
    before = label = None
    if args.compare:
        earlier = json.loads(Path(args.compare).read_text())
        before = [r for r in earlier["rows"] if "error" not in r]
        label = f"{earlier['info'].get('commit')} ({Path(args.compare).name})"
    plot([r for r in rows if "error" not in r],
         f"{args.name}: {commit}, {args.device} (counts; host time estimated)",
         out.with_suffix(".png"), before, label)
    print(f"wrote {out}.json and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
