"""What each Triton kernel asks of an H100/H200 per entry, without one: every kernel that
a bucket compress and decompress launches, compiled for sm_90 by Triton's own compiler
(``tests/triton_compile.py``), with its machine instructions per entry, registers,
spilled bytes, 64-bit integer divisions and memory-ordering atomics.

    python benchmarks/kernel_instructions.py --out DIR
    python benchmarks/kernel_instructions.py --compare OLD.json   # an earlier run beside
    .venv-triton36/bin/python benchmarks/kernel_instructions.py    # the GPU machine's Triton

Each compressor of ``--specs`` compresses a bucket of 4 tensors (lengths multiples of 16,
as every tensor of GPT-2 and ResNet-50: the kernels get 16-byte loads) with error
feedback and decompresses two ranks' payloads, on the CPU through the CUDA code path
(``HVD_COMPRESS_BACKEND=triton``): each launch is compiled, then run in Triton's
interpreter.  ``sass_per_entry`` is ``instructions * 32 * num_warps / BLOCK`` for a
kernel that takes ``BLOCK`` entries a program: **a static figure** (every instruction
counted once, a loop or a subroutine once, a path not taken too), not a time.  On sm_90 a
64-bit integer division is a subroutine of some 85 instructions, and an atomic with
``acq_rel`` order waits behind a ``MEMBAR.ALL.GPU``.  Writes
``kernel_instructions_<date>.json`` and ``.png``.
"""
import os
import sys
from pathlib import Path

sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse  # noqa: E402
import datetime  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
for extra in (ROOT, ROOT / "tests"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))
_spec = importlib.util.spec_from_file_location("gpu_common",
                                               Path(__file__).with_name("gpu_common.py"))
common = sys.modules.setdefault("gpu_common", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(common)

SPECS = ["laplace_topk:density=0.01,fused=1", "laplace_topk:density=0.01,fused=1,exact=1",
         "laplace_topk:density=0.01", "topk:density=0.01,values=rangefloat8",
         "dct:density=0.01", "twobit", "rangefloat:bits=8", "qsgd", "onebit", "dgc:density=0.01"]
LENGTHS = (16 * 1024, 16 * 1000, 16 * 1037, 16 * 74)    #: the bucket's tensors


def exchange(spec):
    """One warm-up and one measured bucket exchange of ``spec``, on the CPU."""
    import numpy as np
    import torch
    import hvd_compress
    from hvd_compress.buckets import layout
    lay = layout([f"t{i}" for i in range(len(LENGTHS))], [(n,) for n in LENGTHS])
    c = hvd_compress.from_spec(spec)
    for step in range(2):
        flat = torch.from_numpy(np.random.default_rng(step).laplace(size=lay.total)
                                .astype(np.float32))
        try:
            payload, ctx = c.compress_bucket(flat, lay)
        except TypeError:            # one tensor at a time (dgc): each of the bucket's
            for i, t in enumerate(torch.split(flat, LENGTHS)):
                payload, ctx = c.compress(t, f"t{i}")
                c.decompress(payload, ctx)
            continue
        c.decompress_bucket(common.aggregate(c, [payload, payload]), ctx)


def variants(compiled, spec):
    """Rows of the variants compiled since the last call (``compiled``: the
    ``triton_compile.COMPILED`` rows not seen yet), named by the spec that launched them."""
    import triton_compile
    rows = []
    for r in compiled:
        row = {"kernel": r["kernel"], "spec": spec, "block": r.get("block"),
               "num_warps": r["num_warps"], "shared": r["shared"]}
        for key in ("registers", "local_bytes", "sass", "div64", "ordered_atomics",
                    "load_bits", "store_bits"):
            row[key] = r.get(key)
        row["sass_per_entry"] = triton_compile.entry_sass(r)
        rows.append(row)
    return rows


def widest(rows):
    """Per kernel, its variant with the widest block (the launchers' own), the most
    instructions among those; kernels without a ``BLOCK`` by their most instructions."""
    best = {}
    for r in rows:
        key = (r["block"] or 0, r["sass"] or 0)
        if r["kernel"] not in best or key > ((best[r["kernel"]]["block"] or 0),
                                             best[r["kernel"]]["sass"] or 0):
            best[r["kernel"]] = r
    return [best[k] for k in sorted(best)]


def plot(rows, title, path, before=None, before_label=None):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib missing: no PNG)")
        return
    mine = [r for r in rows if r["sass_per_entry"]]
    earlier = {r["kernel"]: r for r in before or () if r.get("sass_per_entry")}
    old = {k: r["sass_per_entry"] for k, r in earlier.items()}
    names = [r["kernel"] for r in mine]
    y = list(range(len(names)))
    fig, ax = plt.subplots(figsize=(8, 0.4 * len(names) + 1.6))
    if old:
        ax.barh([v + 0.2 for v in y], [old.get(n, 0) for n in names], height=0.4,
                color="lightgrey", label=before_label)
    ax.barh([v - 0.2 * bool(old) for v in y], [r["sass_per_entry"] for r in mine],
            height=0.4 if old else 0.8, color="tab:blue", label="this run")
    bars = [(v - 0.2 * bool(old), r) for v, r in zip(y, mine)]
    bars += [(v + 0.2, earlier[n]) for v, n in zip(y, names) if n in earlier]
    for v, r in bars:          # what costs more than its instructions show
        marks = [f"{r['div64']} div64"] if r.get("div64") else []
        marks += [f"{r['ordered_atomics']} acq_rel atomics"] if r.get("ordered_atomics") else []
        marks += [f"{r['local_bytes']} B spilled"] if r.get("local_bytes") else []
        if marks:
            ax.text(r["sass_per_entry"], v, " " + ", ".join(marks), va="center", fontsize=6,
                    color="tab:red")
    ax.set_yticks(y)
    ax.set_yticklabels(names, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("sm_90 machine instructions per entry, widest block (static, not a time)")
    if old:
        ax.legend(fontsize=7)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--specs", default=";".join(SPECS), help="';'-separated compressor specs")
    p.add_argument("--arch", type=int, default=90, help="compute capability to compile for")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--name", default="kernel_instructions")
    p.add_argument("--compare", help="a JSON of an earlier run, drawn beside this one")
    args = p.parse_args()
    os.environ.pop("TRITON_INTERPRET", None)       # triton.jit must build compilable kernels
    import triton_compile
    triton_compile.enable(args.arch)
    os.environ["HVD_COMPRESS_BACKEND"] = "triton"
    import torch
    import triton

    rows, seen = [], 0
    specs = args.specs.split(";")
    for i, spec in enumerate(specs):
        print(f"[{i + 1}/{len(specs)}] {spec}", file=sys.stderr, flush=True)
        exchange(spec)
        rows += variants(triton_compile.COMPILED[seen:], spec)
        seen = len(triton_compile.COMPILED)
    best = widest(rows)
    print(f"{'kernel':42s} {'first launched by':40s} {'block':>6s} {'regs':>5s} {'spill':>5s} "
          f"{'sass':>6s} {'/entry':>7s} {'div64':>5s} {'acq':>4s}")
    for r in best:
        per = f"{r['sass_per_entry']:7.1f}" if r["sass_per_entry"] else f"{'-':>7s}"
        print(f"{r['kernel']:42s} {r['spec'][:40]:40s} {r['block'] or 0:6d} "
              f"{r['registers'] or 0:5d} {r['local_bytes'] or 0:5d} {r['sass'] or 0:6d} {per} "
              f"{r['div64'] or 0:5d} {r['ordered_atomics'] or 0:4d}")
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    info = {"date": datetime.date.today().isoformat(), "arch": args.arch, "commit": commit,
            "triton": triton.__version__, "torch": torch.__version__, "lengths": LENGTHS,
            "static": "instructions counted in the cubin, not timed"}
    out = Path(args.out) / f"{args.name}_{info['date']}"
    common.write_json(out.with_suffix(".json"), {"info": info, "kernels": best, "variants": rows})
    before = label = None
    if args.compare:
        earlier = json.loads(Path(args.compare).read_text())
        before = earlier["kernels"]
        label = f"{earlier['info'].get('commit')} ({Path(args.compare).name})"
    plot(best, f"{args.name}: {commit}, sm_{args.arch}, Triton {triton.__version__}",
         out.with_suffix(".png"), before, label)
    print(f"wrote {out}.json and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
