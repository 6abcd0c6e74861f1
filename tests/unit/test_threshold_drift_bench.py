"""benchmarks/threshold_drift.py runs on a tiny GPT-2 for a few steps: its JSON holds a
share in [0, 1] per window, growing with the window, and the fused search's reading
passes (between 1 and its number of passes) at every step sampled, and started warm at
every step."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_threshold_drift_writes_its_table(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "threshold_drift.py"),
                        "--steps", "4", "--width", "32", "--layers", "1", "--seq", "16",
                        "--batch", "2", "--min-size", "100", "--search-every", "2",
                        "--out", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    data = json.loads(next(tmp_path.glob("threshold_drift_*.json")).read_text())
    first = data["windows"][0]
    shares = [v for k, v in first.items() if k.startswith("within_")]
    assert first["pairs"] > 0 and len(shares) == 5
    assert all(0 <= s <= 1 for s in shares) and shares == sorted(shares)
    assert [s["step"] for s in data["searches"]] == [0, 2]
    assert all(1 <= s["reading_passes"] <= 4 for s in data["searches"])
    assert [s["step"] for s in data["warm_steps"]] == [0, 1, 2, 3]     # warm: every step
    assert all(1 <= s["reading_passes"] <= 4 for s in data["warm_steps"])
    assert data["warm"]["steps"] == 3 and 1 <= data["warm"]["mean_passes"] <= 4
    assert 0 < data["warm"]["mean_bucket_reads"] <= data["warm"]["mean_passes"]
    assert all(0 < s["bucket_reads"] <= s["reading_passes"] for s in data["searches"])
    assert abs(sum(data["warm"]["share_by_passes"].values()) - 1) < 1e-9
    assert 0 < data["t_over_fit_p1"] <= data["t_over_fit_p50"] <= data["t_over_fit_p99"]
    assert (tmp_path / next(tmp_path.glob("*.json")).with_suffix(".png").name).exists()


def test_threshold_drift_folded_reads_a_bucket_less(tmp_path):
    """``--fold`` (warm=1's search): after the first (cold) step, at most the 3 passes that
    collapse any bracket read the bucket, and fewer of its entries than a cold search."""
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "threshold_drift.py"),
                        "--steps", "3", "--width", "32", "--layers", "1", "--seq", "16",
                        "--batch", "2", "--min-size", "100", "--search-every", "2",
                        "--fold", "--out", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    data = json.loads(next(tmp_path.glob("threshold_drift_fold_*.json")).read_text())
    assert data["args"]["fold"] is True
    assert all(0 <= s["reading_passes"] <= 3 for s in data["warm_steps"][1:])
    cold = sum(s["bucket_reads"] for s in data["searches"]) / len(data["searches"])
    assert 0 <= data["warm"]["mean_bucket_reads"] < cold
