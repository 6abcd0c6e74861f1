"""TensorFlow glue through real ``horovodrun -np 2 --gloo`` (see workers/tf_worker.py),
eagerly and inside tf.function.  Expected values are computed here, from both ranks'
inputs, without hvd_compress."""
import math

import pytest

from launch import load_ranks
from horovod_checks import (mismatch_job, AGG_SHAPES, AGG_SPECS, AGG_STEPS, AGG_ZERO_STEP, check_agg,
                            check_agg_average_and_process_set, BUCKET_SPECS, BUCKET_TOL_SPECS, SPECS, check_aggregate,
                            check_bucket_equals_tensorwise, check_bucket_mismatch_fails_clearly,
                            check_bucket_tolerance,
                            check_checkpoint, check_empty_rank, check_functional,
                            check_mismatch_fails_clearly, check_nonfinite, check_policy, check_auto,
                            check_auto_mismatch_fails_clearly)

DTYPES = {"int": "int32", "fp16": "float16", "bf16": "bfloat16"}
CASES = [(s, op, m) for s in SPECS for op in ("average", "sum") for m in ("eager", "function")]


@pytest.fixture(scope="module")
def mismatch(tmp_path_factory):
    """Every configuration-mismatch scenario in one launch: (rc, log)."""
    return mismatch_job("tf_worker.py", tmp_path_factory.mktemp("mismatch"))



@pytest.mark.parametrize("spec,op,mode", CASES)
def test_aggregate_equals_independent_reference(tf_job, spec, op, mode):
    check_aggregate(load_ranks(tf_job, "tf_aggregate"), f"{spec}|{op}|{mode}", spec, op)


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_stats_count_topk_payload_bytes(tf_job, mode):
    ranks = load_ranks(tf_job, "tf_aggregate")
    sent, dense = ranks[0][f"topk:density=0.05|sum|{mode}|stats"]
    assert sent == sum(math.ceil(0.05 * n) * 8 for n in (120, 7))
    assert dense == (120 + 7) * 4


@pytest.mark.parametrize("case", ["zero_d", "empty", "int", "fp16", "bf16", "sparse"])
def test_functional_awkward_tensors(tf_job, case):
    check_functional(load_ranks(tf_job, "tf_functional"), case, DTYPES)


def test_rank_with_nothing_to_send_does_not_hang(tf_job):
    check_empty_rank(load_ranks(tf_job, "tf_empty_rank"))


def test_nonfinite_passes_through_and_keeps_residual(tf_job):
    check_nonfinite(load_ranks(tf_job, "tf_nonfinite"))


def test_checkpoint_restore_is_bitwise_identical(tf_job):
    check_checkpoint(load_ranks(tf_job, "tf_checkpoint"))


def test_ranks_with_different_compressors_fail_clearly(mismatch):
    check_mismatch_fails_clearly(mismatch)


def test_per_parameter_policy(tf_job):
    check_policy(load_ranks(tf_job, "tf_policy"), keras=True)


@pytest.mark.parametrize("spec", BUCKET_SPECS)
def test_buckets_equal_tensor_by_tensor(tf_job, spec):
    """Bucketed inside tf.function, 3 steps with error feedback and a missing gradient,
    bit for bit the same as tensor by tensor eagerly (twobit, qsgd, signsgd: inside
    tf.function too; their eager scales differ in the last bit)."""
    check_bucket_equals_tensorwise(load_ranks(tf_job, "tf_buckets"), spec)


@pytest.mark.parametrize("spec", BUCKET_TOL_SPECS)
def test_bucketed_laplace_topk_counts_within_tolerance(tf_job, spec):
    check_bucket_tolerance(load_ranks(tf_job, "tf_buckets"), spec)


def test_ranks_with_different_bucket_sizes_fail_clearly(mismatch):
    check_bucket_mismatch_fails_clearly(mismatch)


@pytest.mark.parametrize("spec", AGG_SPECS)
@pytest.mark.parametrize("np_", [2, 3])
def test_aggregation_aware_selection(request, spec, np_):
    """agg=union/leader/hint: every rank the same aggregate, equal to the reference;
    error feedback conserves; checkpoints resume; an empty union hangs nobody."""
    out = request.getfixturevalue("tf_job" if np_ == 2 else "agg3_tf_job")
    check_agg(load_ranks(out, "tf_agg", np_), spec, AGG_SHAPES, AGG_STEPS, AGG_ZERO_STEP)


@pytest.mark.parametrize("np_", [2, 3])
def test_aggregation_average_and_process_set(request, np_):
    out = request.getfixturevalue("tf_job" if np_ == 2 else "agg3_tf_job")
    check_agg_average_and_process_set(load_ranks(out, "tf_agg", np_), AGG_SPECS, AGG_SHAPES)


def test_auto_same_choice_on_every_rank_and_aggregate_of_the_choice(tf_job):
    check_auto(load_ranks(tf_job, "tf_auto"))


def test_auto_inside_tf_function_is_a_clear_error(tf_job):
    message = str(load_ranks(tf_job, "tf_auto")[0]["graph_error"])
    assert "needs eager execution" in message and "run_eagerly=True" in message


def test_auto_ranks_with_different_candidates_fail_clearly(mismatch):
    check_auto_mismatch_fails_clearly(mismatch)
