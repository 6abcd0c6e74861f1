"""``make gpu-test``'s summary: one JSON (``gpu_summary.json``) and a printed table from
everything ci/gpu.sh left in the results folder (``python benchmarks/gpu_bench.py summary
--results DIR``; loaded by gpu_bench.py, which loads gpu_common first).
"""
import datetime
import json
import sys
import time
from pathlib import Path

_common = sys.modules["gpu_common"]
write_json = _common.write_json
load_json = _common.load_json
ROOT = _common.ROOT


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
        data = load_json(p) or {}
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
        for fused in ("laplace_topk_fused", "laplace_topk_fused_exact", "laplace_topk_padded",
                      "laplace_topk_padded_cached", "laplace_topk_padded_warm"):
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
        for name, label in (("laplace_topk_fused", "fused"),
                            ("laplace_topk_padded_cached", "padded, launch cache"),
                            ("laplace_topk_padded_warm", "padded, warm")):
            fused = m.get(name)
            if fused and r["n"] == 25_000_000:
                targets[f"{label} {r['input']} 25M density {r['density']}"] = {
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

def summary(args):
    res = Path(args.results)
    pre = load_json(res / ".preflight.json") or {}
    steps = []
    if (res / ".steps.tsv").exists():
        for line in (res / ".steps.tsv").read_text().splitlines():
            name, rc, seconds, status = (line.split("\t") + ["", "", "", ""])[:4]
            steps.append({"step": name, "rc": int(rc) if rc.lstrip("-").isdigit() else None,
                          "seconds": float(seconds or 0), "status": status})
    tests = parse_junit(res / "tests.xml")
    records = load_json(res / ".records.json") or {}
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
    codecs_ = load_json(res / "codecs.json")
    if codecs_:
        out["figures"]["codecs"] = [{k: r.get(k) for k in ("op", "n", "ms", "GBps", "fraction_of_peak",
                                                           "TFLOPs") if k in r}
                                    for r in codecs_.get("results", [])]
    models_ = load_json(res / "models.json")
    if models_:
        out["figures"]["models"] = [{k: r[k] for k in ("model", "scheme", "compress_ms", "decompress_ms",
                                                       "step_ms", "ratio_vs_dense")}
                                    for r in models_.get("results", [])]
    for path in sorted(res.glob("gpu_step_*.json")):       # benchmarks/gpu_step.py
        data = load_json(path) or {}
        if "ddp_check" in data:
            out["figures"]["gpu_step_ddp_check"] = data["ddp_check"]
        out["figures"].setdefault("gpu_step", []).extend(
            dict({k: v for k, v in r.items() if k != "per_bucket"}, model=data.get("model"))
            for r in data.get("rows", []))
        out["figures"].setdefault("gpu_step_targets", {}).update(data.get("targets") or {})
    for path in sorted(res.glob("gpu_breakdown*.json"))[-1:]:   # the host's costs, graphs
        data = load_json(path) or {}
        out["figures"]["breakdown_launch"] = data.get("launch") or {}
        out["figures"]["breakdown_graph"] = [
            {k: r[k] for k in ("what", "spec", "layout", "eager_ms", "graph_ms", "equal", "error")
             if k in r} for r in data.get("graph") or []]
    bad_steps = [s["step"] for s in steps if s["status"].startswith(("failed", "timed out"))]
    unfinished = [s["step"] for s in steps if s["status"] == "skipped: budget spent"]
    dry_run = bool(getattr(args, "dry_run", False))
    if pre.get("error") or not pre:
        out["status"] = "error"
    elif dry_run:                                # GPU_TEST_DEVICE=cpu: the steps ran, or not
        failed = (bad_steps or unfinished or tests is None or tests["failed"] or tests["errors"]
                  or not tests["passed"])
        out["status"] = "dry_run_failed" if failed else "dry_run"
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
    launch = out["figures"].get("breakdown_launch") or {}
    if any(k.endswith("_us") for k in launch):
        print("host per call: " + ", ".join(f"{k[:-3].replace('_', ' ')} {v:.1f} us"
                                            for k, v in launch.items() if k.endswith("_us")))
    for r in out["figures"].get("breakdown_graph", []):
        if "graph_ms" in r:              # (CUDA only: the dry run issues the calls eagerly)
            print(f"graph {r['what']} {r['spec']} ({r['layout']}): eager {r['eager_ms']:.3f} ms, "
                  f"replayed {r['graph_ms']:.3f} ms, equal {r.get('equal')}")
        elif "error" in r:
            print(f"graph {r['what']} {r['spec']} ({r['layout']}): {r['error'][:120]}")
    if out["sync_counts"]:
        print(f"host synchronisations recorded for {len(out['sync_counts'])} calls (sync_counts)")
    if dry_run:
        print("DRY RUN on the CPU (GPU_TEST_DEVICE=cpu): the CUDA code path's kernels ran in "
              "Triton's interpreter at tiny sizes; no figure here is a GPU figure.")
    if out["status"] == "no_cuda":
        print("NO CUDA DEVICE: nothing ran on a GPU.  The GPU tests were collected and skipped "
              "(counted as skipped, not passed); the benchmarks did not run.")
    print(f"wrote {res / 'gpu_summary.json'}")
    print("=" * 78)
    return {"passed": 0, "no_cuda": 0, "dry_run": 0}.get(out["status"], 1)
