"""benchmarks/gpu_step.py (issue 26) runs on the CPU with its tiny models: both models,
three compressors, one measured step; its JSON holds positive times, fewer bytes for
topk than for none, and a modelled step no faster on the slower link."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SPECS = ["none", "topk:density=0.01", "powersgd:rank=4"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_step")
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_step.py"), "--device", "cpu",
                        "--tiny", "--repeat", "1", "--models", "gpt2,resnet50",
                        "--specs", ";".join(SPECS), "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return {m: json.loads(next(out.glob(f"gpu_step_{m}_tiny_*.json")).read_text())
            for m in ("gpt2", "resnet50")} | {"pngs": sorted(p.name for p in out.glob("*.png")),
                                              "stdout": r.stdout}


@pytest.mark.parametrize("model", ["gpt2", "resnet50"])
def test_rows_have_positive_times_and_fewer_bytes_compressed(results, model):
    data = results[model]
    assert data["device"] == "cpu" and data["torch"] and data["date"] and data["args"]["tiny"]
    rows = {r["spec"]: r for r in data["rows"]}
    assert list(rows) == SPECS
    for r in rows.values():
        assert r["backward_ms"] > 0 and r["forward_ms"] > 0
        assert r["compress_ms"] > 0 and r["decompress_ms"] > 0 and r["bytes_per_rank"] > 0
        assert r["codec_over_backward"] == pytest.approx(
            (r["compress_ms"] + r["decompress_ms"]) / r["backward_ms"])
    assert rows["none"]["bytes_per_rank"] == 4 * data["params"]     # float32, all of it
    assert rows["none"]["bytes_per_rank"] > rows["topk:density=0.01"]["bytes_per_rank"]
    assert rows["none"]["bytes_per_rank"] > rows["powersgd:rank=4"]["bytes_per_rank"]


@pytest.mark.parametrize("model", ["gpt2", "resnet50"])
def test_modelled_step_is_slower_on_a_slower_link(results, model):
    for r in results[model]["rows"]:
        assert r["step_ms_10gbit"] >= r["step_ms_25gbit"] >= r["step_ms_100gbit"] > 0
        # never faster than the computation it overlaps with
        assert r["step_ms_100gbit"] >= r["forward_ms"] + r["backward_ms"] - 1e-9
        assert r["speedup_10gbit"] > 0
    none = results[model]["rows"][0]
    assert none["speedup_10gbit"] == none["speedup_100gbit"] == 1.0


def test_png_per_model_and_a_table(results):
    assert results["pngs"] == [f"gpu_step_{m}_tiny_{results['gpt2']['date']}.png"
                               for m in ("gpt2", "resnet50")]
    assert "step@10" in results["stdout"] and "powersgd:rank=4" in results["stdout"]
