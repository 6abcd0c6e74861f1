"""PyTorch glue through real ``horovodrun -np 2 --gloo`` (see workers/torch_worker.py).

Every expected value is computed here, from both ranks' inputs, without hvd_compress.
"""
import math

import numpy as np
import pytest

from conftest import load_ranks
from horovod_checks import (SPECS, check_aggregate, check_checkpoint, check_empty_rank,
                            check_functional, check_mismatch_fails_clearly, check_nonfinite,
                            check_policy)

DTYPES = {"int": "torch.int32", "fp16": "torch.float16", "bf16": "torch.bfloat16"}
CASES = [(s, op, b) for s in SPECS for op in ("average", "sum") for b in (1, 2)]


@pytest.mark.parametrize("spec,op,bpps", CASES)
def test_aggregate_equals_independent_reference(torch_job, spec, op, bpps):
    check_aggregate(load_ranks(torch_job, "torch_aggregate"), f"{spec}|{op}|{bpps}", spec, op,
                    passes=bpps)


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
    check_functional(load_ranks(torch_job, "torch_functional"), case, DTYPES)


def test_rank_with_nothing_to_send_does_not_hang(torch_job):
    check_empty_rank(load_ranks(torch_job, "torch_empty_rank"))


def test_nonfinite_passes_through_and_keeps_residual(torch_job):
    check_nonfinite(load_ranks(torch_job, "torch_nonfinite"))


def test_checkpoint_restore_is_bitwise_identical(torch_job):
    check_checkpoint(load_ranks(torch_job, "torch_checkpoint"))


def test_stock_horovod_optimizer(torch_job):
    ranks = load_ranks(torch_job, "torch_stock")
    expected = sum(r["in"].astype(np.float16).astype(np.float32) for r in ranks)
    np.testing.assert_allclose(ranks[0]["out"], expected, rtol=2e-3)
    assert "hvd_compress.torch.DistributedOptimizer" in str(ranks[0]["topk_error"])


def test_ranks_with_different_compressors_fail_clearly(tmp_path):
    check_mismatch_fails_clearly("torch_worker.py", tmp_path)


def test_per_parameter_policy(torch_job):
    check_policy(load_ranks(torch_job, "torch_policy"), keras=False)
