"""Where a bucket's compress spends its time on CUDA, kernel by kernel, and the
alternatives for its per-tensor top-k at the same layouts (issue 26).

    python benchmarks/gpu_breakdown.py --out DIR                 # CUDA
    python benchmarks/gpu_breakdown.py --device cpu --tiny --out DIR   # a smoke test

Layouts (Laplace values, float32): ``gpt2``, one GPT-2-small transformer block's 12
tensors (7.1M values: the size of the buckets the glue makes of GPT-2); ``resnet``, 8
ResNet-50 bottlenecks of layer 3, 72 tensors (8.9M values); ``one``, a single 25M-value
tensor.  ``--tiny`` divides every size by 1000.

1. **compress**: per spec and layout, one rank's ``compress_bucket`` (``compress`` for a
   single tensor, as the glue): wall time (CUDA events, median of ``--repeat``), the CUDA
   kernels it runs and their summed device time (torch.profiler), so ``wall - device``
   is what the host adds (launches, Python, synchronisations); the top kernels by
   device time.  A bucket's call includes copying the gradient into the bucket's buffer
   (``copy_ms`` alone), as the glue's ``torch.cat`` does: error feedback keeps its
   residual in the buffer a compress was given.
2. **top-k**: each tensor's k = ceil(density n) largest |x| by a ``torch.topk`` per
   tensor (no finiteness check), and by ``torch_ops.segment_abs_topk`` (on CUDA one
   stable sort of the bucket, finiteness and its host synchronisation included);
   ``torch.topk`` of the whole bucket (one k, not per tensor) as a bound.  The sets must
   be equal.  Layouts where ``segment_abs_topk`` leaves the work to a torch.topk per
   tensor (one tensor) are skipped.
3. **graph**: laplace_topk ``fused=1``'s passes before its read-back
   (``fused_search.histogram_search``), and the whole bucket compress of
   ``laplace_topk:padded=1``, ``twobit`` and ``rangefloat:bits=8`` (no host
   synchronisation in them), issued eagerly against replayed from a CUDA graph
   (``GRAPH_CASES``; the CPU dry run runs the calls only).
4. **search**: laplace_topk ``fused=1``'s whole selection (``fused_search.select_histogram``)
   with its passes as now (a coarse first pass of 62 bins counted per block, then three
   of 2046 with an atomic per entry in the bracket) against four passes of 2046 (before
   2026-11-26's second stop), and ``torch.topk`` per tensor; ``exact=1`` indices must be
   equal, and the tolerance mode's counts are given.
5. **aligned**: the bucket kernels told that the layout's offsets are multiples of 16
   values (16-byte loads) against told nothing, for ``segment_abs_sum_max``, the twobit
   bucket compress and the fused selection (layouts ``gpt2`` and ``one``).
6. **warps**: the fused selection with its histogram and band-write programs at 4 or 8
   warps (``histogram_select.HISTOGRAM_WARPS``, ``band_compact.BAND_WRITE_WARPS``: 4 and
   8 since 2026-11-26's fifth stop, chosen from register counts, not timed), layouts
   ``gpt2`` and ``one``; the counts must not change.  ``fold_4``, ``fold_8``: each pass's
   step made in the histogram's launch (``histogram_select.FOLD_PICK``, on by default
   since 2026-12-01: 4 launches fewer, more registers), histogram warps 4 or 8;
   ``fold_equal``: the same indices as a pick launch of its own.
7. **passes**: the fused selection's kernels one by one in launch order, each with its
   device time (the coarse pass, the fine ones, the band count, offsets and write), with
   every program reading its block whole (as before 2026-11-30), in chunks of 1024, and
   in the chunks of ``histogram_select.HISTOGRAM_CHUNK`` and ``band_compact.BAND_CHUNK``
   (the defaults, chosen from register counts, not timed), layouts ``gpt2`` and ``one``;
   the indices must be equal.
8. **twobit**: twobit's compress with error feedback, GPT-2's block as a bucket and a
   25M-value tensor alone, with pack programs of 256 (the default,
   ``twobit_segments.PACK_WORDS``), 128 and 64 words, and with error feedback's add as a
   pass of its own (before 2026-11-30's twenty-fourth stop, for a tensor alone); each
   kernel's device time in launch order; the payloads must be equal.
9. **warm**: the fused selection started cold (at the Laplace fit) and warm (within a
   factor 1.13 of a previous search's brackets, ``fused_search.warm_brackets``), its
   first pass apart (``warm``) or folded into the sums pass (``fold``, what ``warm=1``
   runs), on data whose threshold moved by 1.05 (within) and 1.5 (past it): wall time,
   device time kernel by kernel, histogram passes that read the bucket, count against
   k; layouts ``gpt2`` and ``one``.
10. **launch**: microseconds for the host to issue an ATen op (``abs`` of 1K values) and
   one of our Triton launches (the histogram of 1K values), no synchronisation; on CUDA
   also the same kernel through Triton's JIT dispatch alone and through its compiled
   kernel's own launcher (what our launchers would save by calling it directly), and
   through the launch cache; the cache's own key and arguments, on any device
   (``gpu_launch.py``).
11. **scatter**: a sparse decompress's sum of 2 and 8 ranks' pairs, sorted or with
   atomics (``gpu_variants.scatter_rows``): wall and device time, the CPU's bits or not.

They run in the order launch, compress, graph, search, passes, twobit, warm, scatter, top-k,
aligned, warps (the JSON is written after each), so that a time limit stops the least
decisive.  Writes ``--out``/gpu_breakdown_<date>.json and .png and prints tables;
wall-clock times on a CPU dry run are no GPU figures.
"""
import sys
from pathlib import Path

sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse  # noqa: E402
import datetime  # noqa: E402
import importlib.util  # noqa: E402
import math  # noqa: E402

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
_spec = importlib.util.spec_from_file_location("gpu_common", Path(__file__).with_name("gpu_common.py"))
common = sys.modules.setdefault("gpu_common", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(common)
variants = common.sibling("gpu_variants")      # the aligned and warps rows
launch = common.sibling("gpu_launch")          # the launch row

GPT2_BLOCK = [768, 768, 768 * 2304, 2304, 768 * 768, 768, 768, 768, 768 * 3072, 3072,
              3072 * 768, 768]
BOTTLENECK = [1024 * 256, 256, 256, 256 * 256 * 9, 256, 256, 256 * 1024, 1024, 1024]
LAYOUTS = {"gpt2": GPT2_BLOCK, "resnet": BOTTLENECK * 8, "one": [25_000_000]}
SPECS = ["topk:density=0.01", "laplace_topk:density=0.01", "laplace_topk:density=0.01,fused=1",
         "laplace_topk:density=0.01,fused=1,exact=1", "twobit", "rangefloat:bits=8"]
DENSITY = 0.01


def make_layout(name, tiny):
    from hvd_compress.buckets import layout
    sizes = [max(1, n // 1000) if tiny else n for n in LAYOUTS[name]]
    return layout([f"{name}.{i}" for i in range(len(sizes))], [(n,) for n in sizes])


def device_kernels(fn, cuda):
    """(kernel count, summed device ms, top kernels) of one ``fn()`` (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile
    if not cuda:
        return None, None, []
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages()
               if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]

    def self_ms(e):
        return getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)) / 1e3
    top = sorted(kernels, key=self_ms, reverse=True)
    return (sum(e.count for e in kernels), sum(self_ms(e) for e in kernels),
            [{"kernel": e.key[:120], "count": e.count, "device_ms": self_ms(e)} for e in top[:8]])


def compress_rows(args, cuda):
    import hvd_compress
    rows = []
    for lname in LAYOUTS:
        lay = make_layout(lname, args.tiny)
        flat = common.laplace(torch, lay.total, args.device, seed=1)
        # a bucket compress writes c, then its residual, over its input, which error
        # feedback keeps (as with the glue's bucket, a torch.cat of the gradients): each
        # call copies the gradient into one of two buffers in turn (the other one holds
        # the residual), so every call compresses the same gradient; the copy is timed
        # with it (copy_ms: the copy alone).  (Until 2026-11-27 every call compressed the
        # one buffer that the previous call had left its residual in: c = 2 r.)
        scratch, turn = [torch.empty_like(flat), torch.empty_like(flat)], [0]
        copy_ms = 1e3 * common.timeit(torch, lambda: scratch[0].copy_(flat), args.repeat,
                                      args.device, warmup=1)
        for spec in SPECS:
            c = hvd_compress.from_spec(spec)
            if len(lay.numels) == 1:
                def call(c=c):
                    return c.compress(flat, lay.names[0])       # (into a buffer of its own)
            else:
                def call(c=c, lay=lay):
                    turn[0] += 1
                    return c.compress_bucket(scratch[turn[0] % 2].copy_(flat), lay)
            wall = common.timeit(torch, call, args.repeat, args.device,
                                 warmup=1 if args.tiny else 2)
            count, busy, top = device_kernels(call, cuda)
            rows.append({"layout": lname, "tensors": len(lay.numels), "numel": lay.total,
                         "spec": spec, "wall_ms": 1e3 * wall, "kernels": count, "device_ms": busy,
                         "top_kernels": top,
                         "copy_ms": copy_ms if len(lay.numels) > 1 else 0.0})
            print(f"{lname:7s} {spec:50s} wall {1e3 * wall:8.3f} ms  device "
                  + (f"{busy:8.3f} ms  {count:4d} kernels" if cuda else "   (cpu)"), flush=True)
    return rows


def topk_rows(args):
    from hvd_compress.ops import torch_ops
    rows = []
    for lname in LAYOUTS:
        lay = make_layout(lname, args.tiny)
        flat = common.laplace(torch, lay.total, args.device, seed=3)
        ks = [max(1, math.ceil(DENSITY * n)) for n in lay.numels]
        if torch_ops.segment_abs_topk(flat, lay.numels, ks) is None:
            continue                         # a torch.topk per tensor is the library's way
        starts = [sum(lay.numels[:i]) for i in range(len(lay.numels))]

        def per_tensor():
            return torch.cat([torch.topk(p.abs(), k, sorted=False).indices + s
                              for p, k, s in zip(flat.split(lay.numels), ks, starts)])

        def by_sort():
            return torch_ops.segment_abs_topk(flat, lay.numels, ks)[0]

        def whole():
            return torch.topk(flat.abs(), sum(ks), sorted=False).indices
        row = {"layout": lname, "tensors": len(ks), "numel": lay.total}
        for name, fn in (("per_tensor_topk", per_tensor), ("one_sort", by_sort),
                         ("whole_bucket_topk", whole)):
            row[f"{name}_ms"] = 1e3 * common.timeit(torch, fn, args.repeat, args.device)
        row["equal"] = bool(torch.equal(per_tensor().sort().values, by_sort().sort().values))
        rows.append(row)
        print(f"top-k {lname:7s} per tensor {row['per_tensor_topk_ms']:8.3f} ms  one sort "
              f"{row['one_sort_ms']:8.3f} ms  whole bucket {row['whole_bucket_topk_ms']:8.3f} ms"
              f"  equal {row['equal']}", flush=True)
    return rows


#: what the graph step captures: laplace_topk ``fused=1``'s passes before its read-back
#: (``search``), and the whole bucket compress, error feedback included, of the codecs
#: whose compress makes no host synchronisation (``compress``; tests/counting.py)
GRAPH_CASES = [("search", "laplace_topk:density=0.01,fused=1", "gpt2"),
               ("search", "laplace_topk:density=0.01,fused=1", "resnet"),
               ("compress", "laplace_topk:density=0.01,padded=1", "gpt2"),
               ("compress", "laplace_topk:density=0.01,padded=1", "one"),
               ("compress", "twobit", "gpt2"), ("compress", "twobit", "one"),
               ("compress", "rangefloat:bits=8", "gpt2"), ("compress", "rangefloat:bits=8", "one")]


def graph_case(what, spec, lay, flat):
    """``fn()``: the case's launches issued once, returning what they compute (the
    search's state, or the compress's payload)."""
    import hvd_compress
    from hvd_compress.compressors.fused_search import histogram_search
    from hvd_compress.ops import torch_ops
    c = hvd_compress.from_spec(spec)
    if what == "search":
        return lambda: histogram_search(c, flat, lay, torch_ops)[1]
    if len(lay.numels) == 1:
        return lambda: c.compress(flat, lay.names[0])[0]
    return lambda: c.compress_bucket(flat, lay)[0]


def captured(fn):
    """``(graph, output)``: ``fn`` run once on a side stream (kernels compiled, tables
    cached), then captured in a CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def same(a, b):
    """Whether two outputs (a tensor, or a tuple of tensors) hold the same bits."""
    def parts(t):
        return tuple(t) if isinstance(t, (tuple, list)) else (t,)
    return len(parts(a)) == len(parts(b)) and all(map(torch.equal, parts(a), parts(b)))


def graph_rows(args, cuda):
    """The launches of :data:`GRAPH_CASES` issued eagerly against replayed from a CUDA
    graph captured once: what capturing them would save the host.  Timed as the
    library runs them (error feedback on); equality is checked on a second capture
    with ``ef=0`` (the same input each call, so eager and replayed must give the same
    bits).  On a CPU dry run, the cases' own calls run eagerly (no graph, no
    ``graph_ms``; ``resnet`` skipped under ``--tiny``).  An error is recorded, not raised."""
    rows = []
    for what, spec, lname in GRAPH_CASES:
        if args.tiny and lname == "resnet":
            continue                         # 72 tensors: slow in the interpreter
        lay = make_layout(lname, args.tiny)
        flat = common.laplace(torch, lay.total, args.device, seed=4)
        row = {"what": what, "spec": spec, "layout": lname, "tensors": len(lay.numels),
               "numel": lay.total}
        try:
            fn = graph_case(what, spec, lay, flat)
            row["eager_ms"] = 1e3 * common.timeit(torch, fn, args.repeat, args.device)
            no_ef = spec + ("," if ":" in spec else ":") + "ef=0"
            pure = fn if what == "search" else graph_case(what, no_ef, lay, flat)
            if cuda:
                graph, _ = captured(fn)
                row["graph_ms"] = 1e3 * common.timeit(torch, graph.replay, args.repeat,
                                                      args.device)
                graph, out = captured(pure)
                graph.replay()
            else:
                out = pure()
            row["equal"] = bool(same(out, pure()))
        except Exception as e:   # noqa: BLE001 - recorded for the next GPU run to read
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        rows.append(row)
        replayed = f"  replayed {row['graph_ms']:8.3f} ms" if "graph_ms" in row else ""
        print(f"graph {what:8s} {spec:36s} {lname:7s} " + (
            f"error {row['error']}" if "error" in row else
            f"eager {row['eager_ms']:8.3f} ms{replayed}  equal {row['equal']}"), flush=True)
    return rows


def search_rows(args):
    """The fused selection with the passes of ``laplace.HISTOGRAM_PASSES`` against four
    fine passes (one atomic per entry in the bracket, the first over about 10% of a
    Laplace tensor), and a torch.topk per tensor."""
    import hvd_compress
    from hvd_compress.compressors.fused_search import HISTOGRAM_PASSES, select_histogram
    from hvd_compress.ops import torch_ops
    variants = {"coarse_then_fine": HISTOGRAM_PASSES, "fine_only": (2046,) * 4}
    rows = []
    tiny_skip = ("resnet",) if args.tiny else ()     # 72 tensors: slow in the interpreter
    for lname in [n for n in LAYOUTS if n not in tiny_skip]:
        lay = make_layout(lname, args.tiny)
        flat = common.laplace(torch, lay.total, args.device, seed=5)
        row = {"layout": lname, "tensors": len(lay.numels), "numel": lay.total}
        for exact in (0, 1):
            c = hvd_compress.from_spec(f"laplace_topk:density={DENSITY},fused=1,exact={exact}")
            picked = {}
            for name, passes in variants.items():
                fn = (lambda c=c, lay=lay, flat=flat, passes=passes:
                      select_histogram(c, flat, lay, torch_ops, passes)[0])
                row[f"{name}{'_exact' * exact}_ms"] = 1e3 * common.timeit(torch, fn, args.repeat,
                                                                         args.device)
                picked[name] = fn()
                row[f"{name}{'_exact' * exact}_count"] = int(picked[name].numel())
            if exact:
                row["exact_equal"] = bool(torch.equal(picked["coarse_then_fine"].sort().values,
                                                      picked["fine_only"].sort().values))
        parts = lay.split(flat, torch_ops)
        ks = [max(1, math.ceil(DENSITY * n)) for n in lay.numels]
        row["torch_topk_ms"] = 1e3 * common.timeit(
            torch, lambda: [p.abs().topk(k, sorted=False) for p, k in zip(parts, ks)],
            args.repeat, args.device)
        row["k"] = sum(ks)
        rows.append(row)
        print(f"search {lname:7s} coarse+fine {row['coarse_then_fine_ms']:8.3f} ms "
              f"(exact {row['coarse_then_fine_exact_ms']:8.3f})  fine only "
              f"{row['fine_only_ms']:8.3f} ms (exact {row['fine_only_exact_ms']:8.3f})  "
              f"torch.topk {row['torch_topk_ms']:8.3f} ms  exact equal {row['exact_equal']}",
              flush=True)
    return rows


def plot(rows, title, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib missing: no PNG)")
        return
    fig, axes = plt.subplots(1, len(LAYOUTS), figsize=(5 * len(LAYOUTS), 4.5))
    for ax, lname in zip(axes, LAYOUTS):
        mine = [r for r in rows if r["layout"] == lname]
        labels = [r["spec"].replace(":density=0.01", "") for r in mine]
        y = range(len(mine))
        ax.barh(y, [r["wall_ms"] for r in mine], color="lightgrey", label="wall")
        ax.barh(y, [r["device_ms"] or 0 for r in mine], color="tab:blue", label="device busy")
        ax.set_yticks(list(y))
        ax.set_yticklabels(labels, fontsize=7)
        ax.set_xlabel("ms, one rank's compress")
        ax.set_title(f"{lname}: {mine[0]['tensors']} tensors, {mine[0]['numel']:,} values", fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="every size / 1000 (a CPU smoke test)")
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args()
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device (use --device cpu --tiny for a dry run)")
    info = common.device_info(torch)
    title = (f"{info.get('device') or 'cpu'}, torch {info['torch']}, triton {info.get('triton')}, "
             f"{info['date']}{' (tiny, CPU: no GPU figures)' if not cuda else ''}")
    print(title, flush=True)
    stamp = datetime.date.today().isoformat()
    out = Path(args.out) / f"gpu_breakdown{'_tiny' if args.tiny else ''}_{stamp}"
    result = {"info": info, "args": vars(args)}
    # the host's costs first (a second, and what decides between a launch cache and
    # graphs), then the breakdown: what ran is kept if make gpu-test's limit stops the rest
    steps = [("launch", lambda: launch.launch_row(args)),
             ("compress", lambda: compress_rows(args, cuda)),
             ("graph", lambda: graph_rows(args, cuda)), ("search", lambda: search_rows(args)),
             ("passes", lambda: variants.passes_rows(args, make_layout, DENSITY)),
             ("twobit", lambda: variants.twobit_rows(args, make_layout)),
             ("warm", lambda: variants.warm_rows(args, make_layout, DENSITY)),
             ("scatter", lambda: variants.scatter_rows(args, make_layout, DENSITY)),
             ("topk", lambda: topk_rows(args)),
             ("aligned", lambda: variants.aligned_rows(args, make_layout, DENSITY)),
             ("warps", lambda: variants.warps_rows(args, make_layout, DENSITY))]
    for name, rows in steps:
        result[name] = rows()
        common.write_json(out.with_suffix(".json"), result)
    plot(result["compress"], title, out.with_suffix(".png"))
    print(f"wrote {out}.json and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
