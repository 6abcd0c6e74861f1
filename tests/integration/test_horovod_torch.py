"""PyTorch glue through real ``horovodrun -np 2 --gloo`` (see workers/torch_worker.py).

Every expected value is computed here, from both ranks' inputs, without hvd_compress.
"""
import math

import numpy as np
import pytest

from cases import BUCKET_MBS, REPLAY_SPECS, TORCH_BUCKET_SPECS, TORCH_BUCKET_TOL_SPECS
from launch import load_ranks
from horovod_checks import (mismatch_job, AGG_SHAPES, AGG_SPECS, AGG_STEPS, AGG_ZERO_STEP, check_agg,
                            check_agg_average_and_process_set, BUCKET_SPECS, BUCKET_TOL_SPECS, SPECS, check_aggregate,
                            check_bucket_equals_tensorwise, check_bucket_mismatch_fails_clearly,
                            check_bucket_plan, check_bucket_policy_and_checkpoint,
                            check_bucket_tolerance, check_checkpoint, check_empty_rank,
                            check_functional, check_mismatch_fails_clearly, check_nonfinite,
                            check_policy, check_auto, check_auto_mismatch_fails_clearly)
import hvd_compress

DTYPES = {"int": "torch.int32", "fp16": "torch.float16", "bf16": "torch.bfloat16"}
CASES = [(s, op, b) for s in SPECS for op in ("average", "sum") for b in (1, 2)]


@pytest.fixture(scope="module")
def mismatch(tmp_path_factory):
    """Every configuration-mismatch scenario in one launch: (rc, log)."""
    return mismatch_job("torch_worker.py", tmp_path_factory.mktemp("mismatch"))



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


def test_ranks_with_different_compressors_fail_clearly(mismatch):
    check_mismatch_fails_clearly(mismatch)


def test_per_parameter_policy(torch_job):
    check_policy(load_ranks(torch_job, "torch_policy"), keras=False)


@pytest.mark.parametrize("spec", BUCKET_SPECS + TORCH_BUCKET_SPECS)
def test_buckets_equal_tensor_by_tensor(torch_job, spec):
    ranks = load_ranks(torch_job, "torch_buckets")
    check_bucket_equals_tensorwise(ranks, spec)
    check_bucket_plan(ranks, spec, hvd_compress.from_spec(spec).segmented)


def test_buckets_with_backward_passes_per_step_2(torch_job):
    check_bucket_equals_tensorwise(load_ranks(torch_job, "torch_buckets"), "topk:density=0.05", bpps=2)


@pytest.mark.parametrize("spec", BUCKET_TOL_SPECS + TORCH_BUCKET_TOL_SPECS)
def test_bucketed_laplace_topk_counts_within_tolerance(torch_job, spec):
    check_bucket_tolerance(load_ranks(torch_job, "torch_buckets"), spec)


def test_buckets_policy_and_checkpoint_between_paths(torch_job):
    check_bucket_policy_and_checkpoint(load_ranks(torch_job, "torch_buckets"))


@pytest.mark.parametrize("mb", BUCKET_MBS)
@pytest.mark.parametrize("spec", REPLAY_SPECS)
def test_replayed_buckets_give_the_eager_steps(torch_job, spec, mb):
    """``HVD_COMPRESS_CUDA_GRAPHS=1`` through the optimizer under horovodrun, the graphs
    taken by the stand-in (no GPU; workers/torch_worker.py's ``replay``): every step's
    aggregate and the residuals bit for bit those of the eager run on both ranks, with
    every bucket size (tensor by tensor: each tensor a bucket of one), compresses
    replayed and none turned off; the same with rank 0 replaying and rank 1 not (the
    setting may differ between ranks)."""
    for r, rank in enumerate(load_ranks(torch_job, "torch_replay")):
        eager, replayed, mixed = (f"{spec}|{mb}|{graphs}|" for graphs in ("0", "1", "mixed"))
        keys = [k[len(eager):] for k in rank if k.startswith(eager)]
        assert "state|residual/big" in keys
        for other in (replayed, mixed):
            for k in keys:
                if k in ("replayed", "off"):
                    continue
                a, b = rank[eager + k], rank[other + k]
                assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), (
                    other, k)
            assert rank[other + "off"] == 0
        assert rank[eager + "replayed"] == 0 and rank[replayed + "replayed"] > 0
        assert (rank[mixed + "replayed"] > 0) == (r == 0)


def test_ranks_with_different_bucket_sizes_fail_clearly(mismatch):
    check_bucket_mismatch_fails_clearly(mismatch)


@pytest.mark.parametrize("spec", AGG_SPECS)
@pytest.mark.parametrize("np_", [2, 3])
def test_aggregation_aware_selection(request, spec, np_):
    """agg=union/leader/hint: every rank the same aggregate, equal to the reference;
    error feedback conserves; checkpoints resume; an empty union hangs nobody."""
    out = request.getfixturevalue("torch_job" if np_ == 2 else "agg3_torch_job")
    check_agg(load_ranks(out, "torch_agg", np_), spec, AGG_SHAPES, AGG_STEPS, AGG_ZERO_STEP)


@pytest.mark.parametrize("np_", [2, 3])
def test_aggregation_average_and_process_set(request, np_):
    out = request.getfixturevalue("torch_job" if np_ == 2 else "agg3_torch_job")
    check_agg_average_and_process_set(load_ranks(out, "torch_agg", np_), AGG_SPECS, AGG_SHAPES)


def test_auto_same_choice_on_every_rank_and_aggregate_of_the_choice(torch_job):
    check_auto(load_ranks(torch_job, "torch_auto"))


def test_auto_ranks_with_different_candidates_fail_clearly(mismatch):
    check_auto_mismatch_fails_clearly(mismatch)
