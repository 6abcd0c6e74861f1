"""benchmarks/gpu_breakdown.py (issue 26) runs on the CPU with --tiny, the CUDA code
path's kernels in the interpreter: every spec on every layout with a positive wall time,
the per-tensor top-k and segment_abs_topk agreeing, a JSON, a PNG and a table."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_breakdown_tiny_on_the_cpu(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1", HVD_COMPRESS_BACKEND="triton")
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_breakdown.py"), "--device",
                        "cpu", "--tiny", "--repeat", "1", "--out", str(tmp_path)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    data = json.loads(next(tmp_path.glob("gpu_breakdown_tiny_*.json")).read_text())
    assert data["args"]["tiny"] and data["info"]["torch"]
    rows = data["compress"]
    assert {(row["layout"], row["spec"]) for row in rows} == {
        (lay, spec) for lay in ("gpt2", "resnet", "one") for spec in
        ("topk:density=0.01", "laplace_topk:density=0.01", "laplace_topk:density=0.01,fused=1",
         "laplace_topk:density=0.01,fused=1,exact=1", "twobit")}
    assert all(row["wall_ms"] > 0 and row["device_ms"] is None for row in rows)   # no CUDA
    assert [row["layout"] for row in data["topk"]] == ["gpt2", "resnet"]          # one: torch.topk
    assert all(row["equal"] and row["one_sort_ms"] > 0 for row in data["topk"])
    assert data["graph"] == []                                   # CUDA graphs: CUDA only
    assert data["launch"]["aten_op_us"] > 0 and data["launch"]["triton_launch_us"] > 0
    assert list(tmp_path.glob("gpu_breakdown_tiny_*.png"))
    assert "top-k resnet" in r.stdout and "launch:" in r.stdout
