"""Variants of the bucket kernels that only a GPU can choose between, timed by
``benchmarks/gpu_breakdown.py`` (its parts 5 to 9, where they are described): the
kernels told the layout's alignment or not (``aligned`` rows), the fused selection's
histogram and band-write warps and its pick folded into the histogram's launch
(``warps`` rows), and its kernels one by one with each program's block read whole or
in chunks (``passes`` rows); twobit's compress with its pack programs of 256, 128 and 64
words, and with error feedback's add folded into the first pass or not (``twobit``
rows); the fused selection started cold or warm (``warm`` rows); the sparse
decompress's sum sorted or with atomics (``scatter`` rows).  Each function takes
the script's arguments, its ``make_layout`` and its density, and returns the rows.
Loaded by gpu_breakdown.py, which loads gpu_common first.
"""
import sys

import torch

common = sys.modules["gpu_common"]


def aligned_rows(args, make_layout, density):
    """The bucket kernels told that every offset is a multiple of 16 values (as now: the
    layout's ``segmented.alignment``, which lets the compiler load 16 bytes at a time)
    against told nothing (``alignment`` forced to 1: one value a load, as before
    2026-11-26's fourth stop): ``segment_abs_sum_max``, the twobit bucket compress, the
    fused selection."""
    import hvd_compress
    from hvd_compress.compressors.fused_search import HISTOGRAM_PASSES, select_histogram
    from hvd_compress.kernels import segmented
    from hvd_compress.ops import torch_ops
    real = segmented.alignment

    def use(alignment):          # the tables are cached with the alignment: built anew
        segmented.alignment = alignment
        segmented._DEVICE_BLOCKS.clear()
        segmented._WORD_TABLES.clear()

    rows = []
    for lname in ("gpt2", "one"):
        lay = make_layout(lname, args.tiny)
        flat = common.laplace(torch, lay.total, args.device, seed=6)
        row = {"layout": lname, "numel": lay.total, "align": real(lay.numels, 4096)}
        twobit = hvd_compress.from_spec("twobit:ef=0")
        search = hvd_compress.from_spec(f"laplace_topk:density={density},fused=1")
        calls = {"abs_sum_max": lambda: segmented.segment_abs_sum_max(flat, lay.numels),
                 "twobit_compress": lambda: twobit.compress_bucket(flat, lay),
                 "select": lambda: select_histogram(search, flat, lay, torch_ops,
                                                    HISTOGRAM_PASSES)[0]}
        for told, alignment in (("aligned", real), ("unaligned", lambda *a, **k: 1)):
            use(alignment)
            try:
                for name, fn in calls.items():
                    row[f"{name}_{told}_ms"] = 1e3 * common.timeit(torch, fn, args.repeat,
                                                                   args.device)
            finally:
                use(real)
        rows.append(row)
        pairs = (f"{name} {row[f'{name}_aligned_ms']:8.3f} vs {row[f'{name}_unaligned_ms']:8.3f} ms"
                 for name in calls)
        print(f"aligned {lname:7s} (align {row['align']:2d})  " + "  ".join(pairs), flush=True)
    return rows


def warps_rows(args, make_layout, density):
    """The fused selection at each (histogram, band-write) warps pair."""
    import hvd_compress
    from hvd_compress.compressors.fused_search import HISTOGRAM_PASSES, select_histogram
    from hvd_compress.kernels import band_compact as B
    from hvd_compress.kernels import histogram_select as H
    from hvd_compress.ops import torch_ops
    now, fold_now = (H.HISTOGRAM_WARPS, B.BAND_WRITE_WARPS), H.FOLD_PICK
    rows = []
    for lname in ("gpt2", "one"):
        lay = make_layout(lname, args.tiny)
        flat = common.laplace(torch, lay.total, args.device, seed=7)
        search = hvd_compress.from_spec(f"laplace_topk:density={density},fused=1")
        row = {"layout": lname, "numel": lay.total, "default": list(now)}
        counts, fold_equal = set(), []
        fn = lambda: select_histogram(search, flat, lay, torch_ops,  # noqa: E731
                                      HISTOGRAM_PASSES)[0]
        H.FOLD_PICK = False                 # the reference: a pick launch of its own
        want = fn()
        for pair in ((4, 4), (4, 8), (8, 4), (8, 8), ("fold", 4), ("fold", 8)):
            fold = pair[0] == "fold"        # FOLD_PICK, histogram warps 4 or 8
            H.HISTOGRAM_WARPS, B.BAND_WRITE_WARPS = (pair[1], now[1]) if fold else pair
            H.FOLD_PICK = fold
            try:
                row[f"select_{pair[0]}_{pair[1]}_ms"] = 1e3 * common.timeit(torch, fn, args.repeat,
                                                                          args.device)
                got = fn()
                counts.add(int(got.numel()))
                if fold:
                    fold_equal.append(torch.equal(got, want))
            finally:
                H.HISTOGRAM_WARPS, B.BAND_WRITE_WARPS = now
                H.FOLD_PICK = False
        H.FOLD_PICK = fold_now
        row["same_count"] = len(counts) == 1
        row["fold_equal"] = all(fold_equal)
        rows.append(row)
        times = [f"{k[7:-3]} {v:8.3f} ms" for k, v in row.items() if k.startswith("select_")]
        print(f"warps {lname:7s} (histogram, band write) " + "  ".join(times)
              + f"  same count {row['same_count']}, fold equal {row['fold_equal']}",
              flush=True)
    return rows


#: (name, histogram chunk, band chunk): the block read whole (as before 2026-11-30's
#: twenty-third stop), in chunks of 1024 for both (the histogram's 44 and 72 registers
#: against 39 and 48 at 512, sm_90), and the defaults
CHUNKS = (("whole", 4096, 4096), ("c1024", 1024, 1024), ("default", None, None))


def passes_rows(args, make_layout, density):
    """The fused selection's kernels one by one, in launch order, with the device time of
    each (torch.profiler: the coarse pass, each fine pass with its pick (one kernel with
    ``histogram_select.FOLD_PICK``, the default), the band count, offsets and write
    apart, where the ``compress`` rows sum them by name), for each ``CHUNKS`` setting,
    and the whole selection's wall time; the indices must be equal."""
    import hvd_compress
    from hvd_compress.compressors.fused_search import HISTOGRAM_PASSES, select_histogram
    from hvd_compress.kernels import band_compact as B
    from hvd_compress.kernels import histogram_select as H
    from hvd_compress.ops import torch_ops
    now = (H.HISTOGRAM_CHUNK, B.BAND_CHUNK)
    cuda = args.device == "cuda"
    rows = []
    for lname in ("gpt2", "one"):
        lay = make_layout(lname, args.tiny)
        flat = common.laplace(torch, lay.total, args.device, seed=8)
        search = hvd_compress.from_spec(f"laplace_topk:density={density},fused=1")
        fn = lambda: select_histogram(search, flat, lay, torch_ops,  # noqa: E731
                                      HISTOGRAM_PASSES)[0]
        row, got = {"layout": lname, "numel": lay.total}, []
        for name, hist, band in CHUNKS:
            H.HISTOGRAM_CHUNK, B.BAND_CHUNK = hist or now[0], band or now[1]
            try:
                row[f"{name}_chunks"] = [H.HISTOGRAM_CHUNK, B.BAND_CHUNK]
                row[f"{name}_ms"] = 1e3 * common.timeit(torch, fn, args.repeat, args.device)
                row[f"{name}_kernels"] = launch_order(fn) if cuda else []
                got.append(fn())
            finally:
                H.HISTOGRAM_CHUNK, B.BAND_CHUNK = now
        row["equal"] = all(torch.equal(g, got[0]) for g in got)
        rows.append(row)
        for name, *_ in CHUNKS:
            each = " ".join(f"{k['kernel'].replace('void ', '').lstrip('_')[:6]} {k['us']:.0f}"
                            for k in row[f"{name}_kernels"])
            print(f"passes {lname:5s} {name:8s} chunks {row[f'{name}_chunks']}  "
                  f"{row[f'{name}_ms']:8.3f} ms  us: {each or '-'}", flush=True)
        print(f"passes {lname:5s} equal {row['equal']}", flush=True)
    return rows


#: (name, twobit_segments.PACK_WORDS, error feedback's add in the first pass)
TWOBIT = (("w256", 256, True), ("w128", 128, True), ("w64", 64, True),
          ("w256_add_apart", 256, False))


def twobit_rows(args, make_layout, density=None):
    """twobit's compress with error feedback (its adaptive threshold): GPT-2's block as a
    bucket, and a 25M-value tensor alone (``compress``; its add folded into the first
    pass since 2026-11-30's twenty-fourth stop), for each ``TWOBIT`` setting: wall time,
    each kernel's device time in launch order; the first step's payloads must be
    equal."""
    import hvd_compress
    from hvd_compress.kernels import twobit_segments as TS
    now, cuda, rows = TS.PACK_WORDS, args.device == "cuda", []
    for lname in ("gpt2", "one"):
        lay = make_layout(lname, args.tiny)
        flat = common.laplace(torch, lay.total, args.device, seed=9)
        row, got = {"layout": lname, "numel": lay.total}, []
        for name, words, fold in TWOBIT:
            c = hvd_compress.from_spec("twobit")
            if not fold:                       # (this compressor only)
                c.adds_residual = lambda *a: False
            if lname == "one":
                fn = lambda c=c: c.compress(flat, "one")[0]  # noqa: E731
            else:
                fn = lambda c=c: c.compress_bucket(flat.clone(), lay)[0]  # noqa: E731
            TS.PACK_WORDS = words
            try:
                got.append([t.clone() for t in fn()])
                row[f"{name}_ms"] = 1e3 * common.timeit(torch, fn, args.repeat, args.device)
                row[f"{name}_kernels"] = launch_order(fn) if cuda else []
            finally:
                TS.PACK_WORDS = now
        row["equal"] = all(all(torch.equal(a, b) for a, b in zip(g, got[0])) for g in got)
        rows.append(row)
        for name, *_ in TWOBIT:
            each = " ".join(f"{k['kernel'].replace('void ', '').lstrip('_')[:6]} {k['us']:.0f}"
                            for k in row[f"{name}_kernels"])
            print(f"twobit {lname:5s} {name:15s} {row[f'{name}_ms']:8.3f} ms  us: {each or '-'}",
                  flush=True)
        print(f"twobit {lname:5s} equal {row['equal']}", flush=True)
    return rows


def launch_order(fn):
    """``[{"kernel", "us"}]``: the CUDA kernels of one ``fn()`` in the order they ran, each
    with its device microseconds (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.events()
              if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
    events.sort(key=lambda e: e.time_range.start)
    return [{"kernel": e.name[:60], "us": round(e.time_range.elapsed_us(), 2)} for e in events]


#: how the data moves from the search that gave the warm brackets: (name, factor), the
#: first within ``fused_search.WARM_SPREAD``, the second past it
MOVES = (("stay", 1.05), ("past", 1.5))


def warm_rows(args, make_layout, density):
    """The fused selection started cold (at each tensor's Laplace fit, ``HISTOGRAM_PASSES``)
    and warm (within a factor 1.13 of a previous search's brackets), its first pass apart
    (``warm``, ``WARM_PASSES``) or folded into the sums pass (``fold``: ``warm=1``'s,
    ``WARM_FOLDED_PASSES``) on
    data whose threshold moved by a factor within that spread and past it: wall time,
    each kernel's device time in launch order, the passes that read the bucket (counted
    in a run of their own: a host read each) and the count sent against k."""
    import hvd_compress
    from hvd_compress.compressors import fused_search as fs
    from hvd_compress.kernels.histogram_select import C_HI, QUOTA
    from hvd_compress.ops import torch_ops
    cuda, rows = args.device == "cuda", []
    for lname in ("gpt2", "one"):
        lay = make_layout(lname, args.tiny)
        flat = common.laplace(torch, lay.total, args.device, seed=10)
        noise = common.laplace(torch, lay.total, args.device, seed=11)
        search = hvd_compress.from_spec(f"laplace_topk:density={density},fused=1")
        warm = fs.warm_brackets(fs.histogram_search(search, flat, lay, torch_ops)[1])
        k = sum(search.k(n) for n in lay.numels)
        row = {"layout": lname, "numel": lay.total, "k": k}
        for move, factor in MOVES:
            moved = flat * factor + 0.01 * noise
            for start, bracket, fold in (("cold", None, False), ("warm", warm, False),
                                         ("fold", warm, True)):
                name = f"{move}_{start}"
                fn = (lambda m=moved, b=bracket, f=fold:          # noqa: E731
                      fs.select_histogram(search, m, lay, torch_ops, warm=b, fold=f)[0])
                row[f"{name}_ms"] = 1e3 * common.timeit(torch, fn, args.repeat, args.device)
                row[f"{name}_kernels"] = launch_order(fn) if cuda else []
                reading = []
                state = fs.histogram_search(search, moved, lay, torch_ops, warm=bracket,
                                            reading=reading, fold=fold)[1]
                row[f"{name}_reading_passes"], row[f"{name}_bucket_reads"] = fs.reads(
                    reading, lay.numels)
                row[f"{name}_count"] = int((state[C_HI] + state[QUOTA]).sum())
        rows.append(row)
        for move, _ in MOVES:
            print(f"warm {lname:5s} {move:5s} " + "  ".join(
                f"{s} {row[f'{move}_{s}_ms']:8.3f} ms, {row[f'{move}_{s}_reading_passes']} "
                f"reads, {row[f'{move}_{s}_count'] / k - 1:+.3%} off k"
                for s in ("cold", "warm", "fold")),
                flush=True)
    return rows


def scatter_rows(args, make_layout, density):
    """The aggregate's sum in a sparse decompress (``ops.scatter_sum``): ``P`` ranks'
    (value, index) pairs, ``density`` of GPT-2's block and of a 25M-value tensor each,
    their indices mostly the same, summed sorted (``index_put_``'s accumulation: what
    ``scatter_sum`` does where more than two values can meet at an index), with
    ``index_add_``'s atomics (at most two: the same bits; ``summing_ranks``), and rank
    by rank (an ``index_add_`` a rank: what it does since 2026-12-01's thirty-first stop
    where the exchange knows each rank's number of pairs, ``segments``), at 2, 4 and 8
    ranks: wall time, device time (the kernels' sum) and whether each gives the CPU's
    bits.  (The H200 run of 2026-11-30 drew a rank's indices with repeats, so its atomic
    rows at 2 ranks did not give the CPU's bits: 3 values met at some indices.)"""
    from hvd_compress.ops import torch_ops
    cuda, rows = args.device == "cuda", []
    for lname in ("gpt2", "one"):
        n = make_layout(lname, args.tiny).total
        k = max(1, int(density * n))
        for ranks in (2, 4, 8):
            # each rank's k distinct indices: 80% of them the ranks' shared ones (a
            # selection sends an index once: with duplicates, index_add_ would add 3+)
            shared = torch.randperm(n, device=args.device)[:k * 4 // 5]
            own = [torch.randperm(n, device=args.device)[:2 * k] for _ in range(ranks)]
            idx = torch.cat([torch.cat([shared, o[~torch.isin(o, shared)][:k - shared.numel()]])
                             for o in own])
            values = common.laplace(torch, idx.numel(), args.device, seed=12)
            want = torch_ops.scatter_sum(n, idx.cpu(), values.cpu())            # in order
            row = {"layout": lname, "numel": n, "k": k, "ranks": ranks}
            ways = (("sorted", max(ranks, 3), None), ("atomic", 2, None),
                    ("by_rank", max(ranks, 3), [k] * ranks))
            for name, meeting, segments in ways:
                fn = (lambda m=meeting, s=segments:                               # noqa: E731
                      torch_ops.scatter_sum(n, idx, values, meeting=m, segments=s))
                row[f"{name}_ms"] = 1e3 * common.timeit(torch, fn, args.repeat, args.device)
                row[f"{name}_device_us"] = (sum(e["us"] for e in launch_order(fn)) if cuda
                                            else None)
                row[f"{name}_cpu_bits"] = bool(torch.equal(fn().cpu().view(torch.int32),
                                                           want.view(torch.int32)))
            rows.append(row)
            dev = lambda s: ("" if row[f"{s}_device_us"] is None  # noqa: E731
                             else f" (device {row[f'{s}_device_us']:.0f} us)")
            print(f"scatter {lname:5s} {ranks} ranks  " + "  ".join(
                f"{s} {row[f'{s}_ms']:7.3f} ms{dev(s)}, CPU bits {row[f'{s}_cpu_bits']}"
                for s, _, _ in ways), flush=True)
    return rows
