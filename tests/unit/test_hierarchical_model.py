"""The alpha-beta model of benchmarks/hierarchical_model.py (issue 28): its limits are
the flat exchange's, and the slow-link bytes follow (H-1) m against (P-1) m."""
import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("hierarchical_model",
                                              ROOT / "benchmarks" / "hierarchical_model.py")
model = importlib.util.module_from_spec(spec)
spec.loader.exec_module(model)

C = {"alpha_x": 50e-6, "alpha_in": 5e-6, "bx": 10e9 / 8, "bin": 300e9, "codec": 130e9}


def test_one_worker_per_host_is_the_flat_exchange():
    for P in (2, 8, 64):
        flat, hier = model.sparse_flat(25e6, P, 1, C, 0.01), model.sparse_hier(25e6, P, 1, C, 0.01)
        assert hier["slow_bytes_per_host"] == flat["slow_bytes_per_host"]
        assert hier["comm_s"] == pytest.approx(flat["comm_s"])
        assert hier["codec_s"] == pytest.approx(flat["codec_s"])


def test_one_host_sends_nothing_over_the_network_and_compresses_nothing():
    hier = model.sparse_hier(25e6, 8, 8, C, 0.01)
    assert hier["slow_bytes_per_host"] == 0 and hier["codec_s"] == 0
    assert model.dense_flat(25e6, 8, 8, C)["slow_bytes_per_host"] == 0


@pytest.mark.parametrize("P", [16, 256, 512])
def test_hierarchical_sends_l_times_fewer_bytes_per_host(P):
    m = 8 * 0.01 * 124e6
    flat, hier = model.sparse_flat(124e6, P, 8, C, 0.01), model.sparse_hier(124e6, P, 8, C, 0.01)
    assert flat["slow_bytes_per_host"] == pytest.approx((P - 1) * m)
    assert hier["slow_bytes_per_host"] == pytest.approx((P // 8 - 1) * m)
    assert hier["comm_s"] + hier["codec_s"] < flat["comm_s"] + flat["codec_s"]


def test_rows_cover_every_method_and_skip_uneven_worker_counts():
    args = SimpleNamespace(alpha_x_us=50.0, alpha_in_us=5.0, intra_gbps=300.0,
                           codec_gbps=130.0, density=0.01)
    rows = model.rows_for(25e6, [8, 12, 16], 8, [10, 100], args)
    assert {r["P"] for r in rows} == {8, 16}
    assert len(rows) == 2 * 2 * 3
