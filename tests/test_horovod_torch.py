"""PyTorch glue through real ``horovodrun -np 2 --gloo`` (see workers/torch_worker.py).

Every expected value is computed here, from both ranks' inputs, without hvd_compress.
"""
import math

import numpy as np
import pytest

from conftest import ROOT, horovodrun, load_ranks, reference_contribution

SPECS = ["none", "fp16", "bf16", "topk:density=0.05", "randomk:density=0.05",
         "threshold:threshold=1.0", "laplace_topk:density=0.05,exact=1"]
CASES = [(s, op, b) for s in SPECS for op in ("average", "sum") for b in (1, 2)]
TOL = {"fp16": 2e-3, "bf16": 1e-6}


@pytest.mark.parametrize("spec,op,bpps", CASES)
def test_aggregate_equals_independent_reference(torch_job, spec, op, bpps):
    ranks = load_ranks(torch_job, "torch_aggregate")
    key = f"{spec}|{op}|{bpps}"
    for n in ("w", "b"):
        inputs = [sum(r[f"{key}|{n}|in{p}"] for p in range(bpps)) for r in ranks]
        outs = [r[f"{key}|{n}|out"] for r in ranks]
        np.testing.assert_array_equal(outs[0], outs[1])     # both ranks identical
        div = 2.0 if op == "average" else 1.0
        if spec.startswith("randomk"):
            # same (seed, step) on both ranks -> same k indices: the sum there, 0 elsewhere
            k = math.ceil(0.05 * inputs[0].size)
            support = outs[0] != 0
            assert support.sum() == k
            np.testing.assert_allclose(outs[0][support], ((inputs[0] + inputs[1]) / div)[support],
                                       rtol=1e-6)
            continue
        expected = sum(reference_contribution(spec, g) for g in inputs) / div
        np.testing.assert_allclose(outs[0], expected, rtol=TOL.get(spec, 1e-6), atol=1e-6)


def test_stats_count_topk_payload_bytes(torch_job):
    ranks = load_ranks(torch_job, "torch_aggregate")
    sent, dense = ranks[0]["topk:density=0.05|sum|1|stats"]
    ks = [math.ceil(0.05 * 120), math.ceil(0.05 * 7)]
    assert sent == sum(k * (4 + 4) for k in ks)             # float32 values + int32 indices
    assert dense == (120 + 7) * 4
    sent, dense = ranks[0]["fp16|sum|1|stats"]
    assert sent == (120 + 7) * 2


@pytest.mark.parametrize("case", ["zero_d", "empty", "int", "fp16", "bf16", "noncontig", "sparse"])
def test_functional_awkward_tensors(torch_job, case):
    ranks = load_ranks(torch_job, "torch_functional")
    out0, out1 = ranks[0][f"{case}|out"], ranks[1][f"{case}|out"]
    np.testing.assert_array_equal(out0, out1)
    inputs = [r[f"{case}|in"] for r in ranks]
    assert tuple(ranks[0][f"{case}|shape"]) == inputs[0].shape
    if case == "int":     # integers go uncompressed and stay integers
        assert str(ranks[0][f"{case}|dtype"]) == "torch.int32"
        np.testing.assert_array_equal(out0, inputs[0] + inputs[1])
        return
    expected = sum(reference_contribution("topk:density=0.2", g.astype(np.float32))
                   for g in inputs)
    if case in ("fp16", "bf16"):
        assert str(ranks[0][f"{case}|dtype"]) == f"torch.{'float16' if case == 'fp16' else 'bfloat16'}"
        np.testing.assert_allclose(out0, expected, rtol=1e-2, atol=1e-2)
    else:
        np.testing.assert_allclose(out0, expected, rtol=1e-6)


def test_rank_with_nothing_to_send_does_not_hang(torch_job):
    ranks = load_ranks(torch_job, "torch_empty_rank")
    assert ranks[1]["stats"][0] == 0                      # rank 1 really sent nothing
    for n in ("w", "b"):
        expected = reference_contribution("threshold:threshold=1.0", ranks[0][f"{n}|in"])
        assert np.count_nonzero(expected) > 0
        for r in ranks:
            np.testing.assert_array_equal(r[f"{n}|out"], expected)


def test_nonfinite_passes_through_and_keeps_residual(torch_job):
    ranks = load_ranks(torch_job, "torch_nonfinite")
    for r in ranks:
        assert np.isnan(r["1|out"][0, 3]) and np.isinf(r["1|out"][2, 5])
        assert np.isfinite(r["0|out"]).all() and np.isfinite(r["2|out"]).all()
        assert np.isfinite(r["2|residual"]).all()
    # rank 0 (the NaN rank): residual unchanged by the bad step, not poisoned
    np.testing.assert_array_equal(ranks[0]["1|residual"], ranks[0]["0|residual"])
    assert np.abs(ranks[0]["0|residual"]).sum() > 0


def test_checkpoint_restore_is_bitwise_identical(torch_job):
    for r in load_ranks(torch_job, "torch_checkpoint"):
        np.testing.assert_array_equal(r["resumed"], r["straight"])


def test_stock_horovod_optimizer(torch_job):
    ranks = load_ranks(torch_job, "torch_stock")
    expected = sum(r["in"].astype(np.float16).astype(np.float32) for r in ranks)
    np.testing.assert_allclose(ranks[0]["out"], expected, rtol=2e-3)
    assert "hvd_compress.torch.DistributedOptimizer" in str(ranks[0]["topk_error"])


def test_ranks_with_different_compressors_fail_clearly(tmp_path):
    rc, log = horovodrun([ROOT / "tests/workers/torch_worker.py", "mismatch"], tmp_path,
                         timeout=180)
    assert rc != 0
    assert "CONFIG_ERROR rank 0" in log and "CONFIG_ERROR rank 1" in log
    assert "topk:density=0.05" in log and "randomk:density=0.05" in log
