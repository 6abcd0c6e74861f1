"""The host's cost of a launch (``gpu_breakdown.py``'s ``launch`` row, issue 26): an ATen
op, one of our Triton launches, on CUDA that kernel through Triton's JIT dispatch alone,
through its compiled kernel's own launcher and through the launch cache
(``hvd_compress/kernels/_launch.py``); and on any device what the cache itself adds to a
hit, its key and the launcher's arguments (host work only: the same code on the CPU).

Loaded by gpu_breakdown.py, which loads gpu_common first.
"""
import sys
import time

import torch

common = sys.modules["gpu_common"]


def launch_row(args):
    """Microseconds for the host to issue an ATen op and one of our Triton launches (the
    histogram of 1K values, through its launcher); on CUDA also that kernel through
    Triton's JIT dispatch alone (``kernel[grid](...)``: binding, specialisation key,
    cache lookup) and through the compiled kernel's own launcher (``compiled[grid]``,
    what a launch cache of our own would call), whose counts must equal the JIT's; then
    our launcher through that cache (``HVD_COMPRESS_LAUNCH_CACHE=1``); last, the cache's
    own key and arguments (:func:`cache_key_us`)."""
    from hvd_compress.kernels import histogram_select as H
    x = common.laplace(torch, 1000, args.device)
    blocks = H.block_table([1000], x.device)
    state = H.search_start(torch.zeros(1, dtype=torch.int64, device=x.device),
                           torch.full((1,), 0x7F000000, dtype=torch.int64, device=x.device),
                           x.abs().sum().reshape(1), x.abs().max().reshape(1))
    out = torch.zeros(1, 16, dtype=torch.int64, device=x.device)
    row, n = {}, 20 if args.tiny else 200
    calls = [("aten_op_us", lambda: x.abs()),
             ("triton_launch_us", lambda: H.segment_histogram(x, blocks, state, 14, out, "triton"))]
    if args.device == "cuda":
        try:
            calls += direct_launches(H, x, blocks, state, row)
        except Exception as e:   # noqa: BLE001 - recorded for the next GPU run to read
            row["direct_error"] = f"{type(e).__name__}: {e}"[:300]
    # our launcher again with the launch cache (HVD_COMPRESS_LAUNCH_CACHE=1): on CUDA, a
    # hit calls the compiled kernel's launcher (hvd_compress/kernels/_launch.py)
    calls.append(("cached_launch_us", calls[1][1]))
    for name, fn in calls:
        cache = "1" if name == "cached_launch_us" else "0"
        with common.environment({"HVD_COMPRESS_LAUNCH_CACHE": cache}):
            fn()
            common.sync(torch, args.device)
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            row[name] = 1e6 * (time.perf_counter() - t0) / n
            common.sync(torch, args.device)
    row["cache_key_us"] = cache_key_us(H, x, blocks, state, out, 50 * n)
    print("launch: " + ", ".join(f"{k[:-3].replace('_', ' ')} {v:.1f} us" for k, v in row.items()
                                 if k.endswith("_us")) + (f"; {row['direct_error']}"
                                                          if "direct_error" in row else ""),
          flush=True)
    return row


def histogram_call(H, x, blocks, state, out):
    """``(arguments, constexprs)`` of the histogram launch of 1K values into ``out``, as
    ``histogram_select._launch_histogram`` passes them without a pick (the calls timed
    here)."""
    meta = {"BINS": 14, "BLOCK": blocks.block, "LOCAL": False, "ALIGN": blocks.align,
            "PICK": False, "CHUNK": blocks.block}
    return (x, blocks.starts, blocks.stops, blocks.segs, state, 1, out, blocks.counts, out,
            out, out), meta


def direct_launches(H, x, blocks, state, row):
    """The histogram kernel issued by Triton's JIT dispatch and by its compiled kernel's
    launcher (every argument, constexprs included, in the kernel's order), each into its
    own zeroed counts, compared (``row["direct_equal"]``); the two calls to time."""
    jit, grid = H._kernels().histogram.jit, (blocks.starts.numel(),)   # not the cache's
    counts = [torch.zeros(1, 16, dtype=torch.int64, device=x.device) for _ in range(2)]
    calls = [histogram_call(H, x, blocks, state, out) for out in counts]

    def through_jit(call=calls[0]):
        return jit[grid](*call[0], **call[1], num_warps=H.HISTOGRAM_WARPS)
    runner = through_jit()[(grid[0], 1, 1)]

    def direct(call=calls[1]):
        runner(*call[0], *call[1].values())
    direct()
    row["direct_equal"] = bool(torch.equal(*counts))
    return [("jit_dispatch_us", through_jit), ("compiled_launcher_us", direct)]


def cache_key_us(H, x, blocks, state, out, n):
    """Microseconds of the launch cache's work on a hit of the histogram launch (its
    arguments as ``histogram_select._launch_histogram`` passes them): the key
    (``CachedKernel.key``) and the compiled launcher's arguments
    (``CachedKernel.arguments``), ``n`` times; on the CPU too (no launch)."""
    kernel = H._kernels().histogram
    args, meta = histogram_call(H, x, blocks, state, out)
    kw = dict(meta, num_warps=H.HISTOGRAM_WARPS)
    kernel.key(args, kw)
    t0 = time.perf_counter()
    for _ in range(n):
        kernel.key(args, kw)
        kernel.arguments(args, kw)
    return 1e6 * (time.perf_counter() - t0) / n
