"""`make gpu-test`'s script (ci/gpu.sh) runs every step without a GPU: GPU_TEST_DEVICE=cpu
puts CPU tensors through the CUDA code path (HVD_COMPRESS_BACKEND=triton, its kernels in
Triton's interpreter), with Horovod and TensorFlow unimportable as on the lent GPU
machine.  A lent GPU is rare: a benchmark that broke since the last GPU run would waste
it.  Every kernel launch of every step is also compiled for sm_90 (GPU_TEST_COMPILE_FOR,
tests/triton_compile.py), so a benchmark's own kernel variants that would not compile
fail here.  This asserts that each step ran and wrote what the summary reads; no figure
of it is a GPU figure."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STEPS = ["preflight", "tests", "select 4K", "codecs", "models", "gpu step", "breakdown",
         "bucket ops", "select 1K,2K + real", "profile", "codec time", "select 8K"]


def test_every_step_of_make_gpu_test_runs_on_the_cpu(tmp_path):
    env = dict(os.environ, GPU_TEST_DEVICE="cpu", PYTHON=sys.executable,
               RESULTS_DIR=str(tmp_path), GPU_TEST_TESTS="tests/gpu/test_gpu_coded.py",
               GPU_TEST_COMPILE_FOR="90",       # each kernel variant compiled for sm_90
               GPU_TEST_BUDGET="780")       # every step ends within the budget: a clean failure
    r = subprocess.run(["bash", str(ROOT / "ci" / "gpu.sh")], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=900)
    tail = (r.stdout + r.stderr)[-4000:]
    assert r.returncode == 0, tail
    summary = json.loads((tmp_path / "gpu_summary.json").read_text())
    assert summary["status"] == "dry_run", tail
    assert "Triton kernels compiled for sm_90" in (tmp_path / "gpu.log").read_text()
    assert [s["step"] for s in summary["steps"]] == STEPS
    assert all(s["status"] == "ok" for s in summary["steps"]), summary["steps"]
    assert summary["tests"]["passed"] > 0 and not summary["tests"]["failed"]
    assert summary["preflight"]["loaded_frameworks"] == []          # no Horovod, no TF
    figures = summary["figures"]
    # the fused seed-000 selection ran at every size, and selected about k
    fused = [row for row in figures["select"] if "laplace_topk_fused_ms" in row]
    assert {row["n"] for row in fused} >= {4000, 8000}
    assert all(0.5 <= row["laplace_topk_fused_count_over_k"] <= 2 for row in fused), fused
    padded = [row for row in figures["select"] if "laplace_topk_padded_cached_ms" in row]
    assert {row["n"] for row in padded} >= {4000, 8000}     # (the launch cache's column)
    warm = [row for row in figures["select"] if "laplace_topk_padded_warm_ms" in row]
    assert {row["n"] for row in warm} >= {4000, 8000}        # (warm=1, its first pass folded)
    assert all(0.98 <= row["laplace_topk_padded_warm_count_over_k"] <= 1.02 for row in warm)
    ops = {row["op"] for row in figures["codecs"]}
    assert {"laplace_topk:density=0.01,fused=1,values=rangefloat8 compress",
            "rangefloat8 decode", "block DCT 64", "twobit pack"} <= ops
    schemes = {(row["model"], row["scheme"]) for row in figures["models"]}
    assert ("resnet_small", "laplace_topk:density=0.01,fused=1 (1 bucket)") in schemes
    steps = {(row["model"], row["spec"]) for row in figures["gpu_step"]}
    assert ("gpt2", "laplace_topk:density=0.01") in steps and ("resnet50", "powersgd:rank=4") in steps
    assert ("gpt2", "laplace_topk:density=0.01,padded=1") in steps
    assert len(figures["breakdown_graph"]) == 7 and figures["breakdown_launch"]["aten_op_us"] > 0
    assert figures["breakdown_launch"]["cache_key_us"] > 0      # (the cache's host work)
    assert figures["gpu_step_ddp_check"]["status"] == "passed", figures["gpu_step_ddp_check"]
    profile = json.loads((tmp_path / "profile.json").read_text())
    assert profile["run_device"] == "cpu" and len(profile["results"]) >= 9
    breakdown = json.loads(next(tmp_path.glob("gpu_breakdown_tiny_*.json")).read_text())
    assert len(breakdown["compress"]) == 18
    graphs = [(r["what"], r["spec"], r["layout"]) for r in breakdown["graph"]]
    assert len(graphs) == 7 and ("compress", "twobit", "one") in graphs    # tiny: no resnet
    assert ("compress", "laplace_topk:density=0.01,padded=1", "gpt2") in graphs
    assert all(r["equal"] and "graph_ms" not in r for r in breakdown["graph"]), breakdown["graph"]
    assert all(row["wall_ms"] > 0 for row in breakdown["compress"])
    assert [row["layout"] for row in breakdown["topk"]] == ["gpt2", "resnet"]
    assert all(row["equal"] for row in breakdown["topk"])     # the sort = a topk per tensor
    assert [row["layout"] for row in breakdown["search"]] == ["gpt2", "one"]   # tiny
    assert all(row["exact_equal"] for row in breakdown["search"])   # both pass schedules
    assert [row["layout"] for row in breakdown["aligned"]] == ["gpt2", "one"]
    assert all(row["select_aligned_ms"] > 0 for row in breakdown["aligned"])
    assert [row["layout"] for row in breakdown["passes"]] == ["gpt2", "one"]
    assert all(row["equal"] and row["whole_chunks"] == [4096, 4096] for row in breakdown["passes"])
    assert [row["layout"] for row in breakdown["twobit"]] == ["gpt2", "one"]
    assert all(row["equal"] and row["w64_ms"] > 0 and "w256_add_apart_ms" in row
               for row in breakdown["twobit"])
    assert [row["layout"] for row in breakdown["warm"]] == ["gpt2", "one"]
    for row in breakdown["warm"]:      # within the spread one read, past it three
        assert row["stay_warm_reading_passes"] == 1 and row["past_warm_reading_passes"] == 3
        assert row["stay_warm_ms"] > 0 and abs(row["stay_warm_count"] / row["k"] - 1) <= 0.01
        # folded into the sums pass: one read fewer within the spread; past it above, the
        # start narrows (hi, +Inf] to (hi, bits(max|c|)], where one more pass lands
        assert row["stay_fold_reading_passes"] == 0 and row["past_fold_reading_passes"] == 1
        assert row["stay_fold_ms"] > 0 and abs(row["stay_fold_count"] / row["k"] - 1) <= 0.01
    assert [(r["layout"], r["ranks"]) for r in breakdown["scatter"]] == [
        (lay, p) for lay in ("gpt2", "one") for p in (2, 4, 8)]
    assert all(r["sorted_cpu_bits"] and r["by_rank_cpu_bits"]
               and (r["ranks"] > 2 or r["atomic_cpu_bits"])
               for r in breakdown["scatter"])       # two values: the same sum either way
    assert [row["layout"] for row in breakdown["warps"]] == ["gpt2", "one"]
    assert all(row["same_count"] and row["select_8_8_ms"] > 0 for row in breakdown["warps"])
    assert all(row["fold_equal"] and row["select_fold_8_ms"] > 0 for row in breakdown["warps"])
    ops = json.loads(next(tmp_path.glob("bucket_ops_*.json")).read_text())
    counted = [r for r in ops["rows"] if "tensors" in r]
    assert {(r["spec"], r["tensors"]) for r in counted} == {
        (s, t) for s in ("twobit", "qsgd") for t in (4, 40)}
    assert all(r["compress_launches"] > 0 for r in counted)
    host = [r for r in ops["rows"] if r.get("host")]
    assert [r["spec"] for r in host] == ["twobit", "qsgd"]
    assert all(r["python_calls"]["6"] > r["python_calls"]["2"] > 0 for r in host)
    assert "DRY RUN" in r.stdout
