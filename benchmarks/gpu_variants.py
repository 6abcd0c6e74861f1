"""Variants of the bucket kernels that only a GPU can choose between, timed by
``benchmarks/gpu_breakdown.py`` (its parts 5 and 6, where they are described): the
kernels told the layout's alignment or not (``aligned`` rows), and the fused selection's
histogram and band-write warps and its pick folded into the histogram's launch
(``warps`` rows).  Each function takes the script's arguments, its ``make_layout`` and
its density, and returns the rows.  Loaded by gpu_breakdown.py, which loads gpu_common
first.
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
    now = (H.HISTOGRAM_WARPS, B.BAND_WRITE_WARPS)
    rows = []
    for lname in ("gpt2", "one"):
        lay = make_layout(lname, args.tiny)
        flat = common.laplace(torch, lay.total, args.device, seed=7)
        search = hvd_compress.from_spec(f"laplace_topk:density={density},fused=1")
        row = {"layout": lname, "numel": lay.total, "default": list(now)}
        counts, fold_equal = set(), []
        fn = lambda: select_histogram(search, flat, lay, torch_ops,  # noqa: E731
                                      HISTOGRAM_PASSES)[0]
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
        row["same_count"] = len(counts) == 1
        row["fold_equal"] = all(fold_equal)
        rows.append(row)
        times = [f"{k[7:-3]} {v:8.3f} ms" for k, v in row.items() if k.startswith("select_")]
        print(f"warps {lname:7s} (histogram, band write) " + "  ".join(times)
              + f"  same count {row['same_count']}, fold equal {row['fold_equal']}",
              flush=True)
    return rows
