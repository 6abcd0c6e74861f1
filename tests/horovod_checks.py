"""Checks shared by the PyTorch and TensorFlow horovodrun tests: each worker writes the
same keys (see tests/workers/), so one check serves both frameworks."""
import math

import numpy as np

from cases import (BUCKET_MBS, BUCKET_SHAPES, BUCKET_SPECS, BUCKET_TOL_SPECS,  # noqa: F401
                   POLICY, SHAPES, SPECS)                      # (re-exported for the tests)
from conftest import ROOT, horovodrun, reference_contribution
TOL = {"fp16": 2e-3, "bf16": 1e-6}


def check_aggregate(ranks, key, spec, op, passes=1):
    """Both ranks end with the same gradient, equal to the aggregate computed here."""
    for n in SHAPES:
        inputs = [sum(r[f"{key}|{n}|in{p}"] for p in range(passes)) for r in ranks]
        outs = [r[f"{key}|{n}|out"] for r in ranks]
        np.testing.assert_array_equal(outs[0], outs[1])
        div = 2.0 if op == "average" else 1.0
        if spec.startswith("randomk"):
            # same (seed, step) on both ranks -> same k indices: the sum there, 0 elsewhere
            support = outs[0] != 0
            assert support.sum() == math.ceil(0.05 * inputs[0].size)
            np.testing.assert_allclose(outs[0][support], ((inputs[0] + inputs[1]) / div)[support],
                                       rtol=1e-6)
            continue
        expected = sum(reference_contribution(spec, g) for g in inputs) / div
        np.testing.assert_allclose(outs[0], expected, rtol=TOL.get(spec, 1e-6), atol=1e-6)


def check_empty_rank(ranks):
    """Rank 1 sent nothing; both ranks hold rank 0's contribution."""
    assert ranks[1]["stats"][0] == 0
    for n in SHAPES:
        expected = reference_contribution("threshold:threshold=1.0", ranks[0][f"{n}|in"])
        assert np.count_nonzero(expected) > 0
        for r in ranks:
            np.testing.assert_array_equal(r[f"{n}|out"], expected)


def check_nonfinite(ranks):
    """Step 1 (rank 0 has NaN/Inf) is non-finite where it should be; the residual of
    rank 0 is the one from step 0, and step 2 is finite again."""
    for r in ranks:
        assert np.isnan(r["1|out"][0, 3]) and np.isinf(r["1|out"][2, 5])
        assert np.isfinite(r["0|out"]).all() and np.isfinite(r["2|out"]).all()
        assert np.isfinite(r["2|residual"]).all()
    np.testing.assert_array_equal(ranks[0]["1|residual"], ranks[0]["0|residual"])
    assert np.abs(ranks[0]["0|residual"]).sum() > 0


def check_checkpoint(ranks):
    for r in ranks:
        np.testing.assert_array_equal(r["resumed"], r["straight"])


def check_mismatch_fails_clearly(worker, tmp_path):
    rc, log = horovodrun([ROOT / "tests/workers" / worker, "mismatch"], tmp_path, timeout=180)
    assert rc != 0
    assert "CONFIG_ERROR rank 0" in log and "CONFIG_ERROR rank 1" in log
    assert "topk:density=0.05" in log and "randomk:density=0.05" in log


def check_policy(ranks, keras=False):
    """Each parameter aggregated with its own compressor; bytes counted per compressor."""
    expected_sent = 0
    for n, (_, _, spec) in POLICY.items():
        ref_spec = spec + (",layout=keras" if keras and spec.startswith("kernel_select") else "")
        inputs = [r[f"{n}|in"] for r in ranks]
        expected = sum(reference_contribution(ref_spec, g) for g in inputs)
        for r in ranks:
            np.testing.assert_allclose(r[f"{n}|out"], expected, rtol=1e-6, atol=1e-6)
        size = inputs[0].size
        if spec.startswith("kernel_select"):
            expected_sent += math.ceil(0.25 * 32) * 9 * 4 + math.ceil(0.25 * 32) * 4
        elif spec == "twobit":
            expected_sent += math.ceil(size / 16) * 4 + 4
        else:
            expected_sent += size * 4
    assert ranks[0]["stats"][0] == expected_sent


def check_functional(ranks, case, dtype_name):
    """The functional allreduce on an awkward tensor (topk:density=0.2, op Sum):
    ``dtype_name`` maps "int"/"fp16"/"bf16" to the framework's dtype name."""
    out0, out1 = ranks[0][f"{case}|out"], ranks[1][f"{case}|out"]
    np.testing.assert_array_equal(out0, out1)
    inputs = [r[f"{case}|in"] for r in ranks]
    assert out0.shape == inputs[0].shape
    if case == "int":                 # integers go uncompressed and stay integers
        assert str(ranks[0][f"{case}|dtype"]) == dtype_name["int"]
        np.testing.assert_array_equal(out0, inputs[0] + inputs[1])
        return
    expected = sum(reference_contribution("topk:density=0.2", g.astype(np.float32))
                   for g in inputs)
    if case in ("fp16", "bf16"):      # the result keeps the gradient's dtype
        assert str(ranks[0][f"{case}|dtype"]) == dtype_name[case]
        np.testing.assert_allclose(out0, expected, rtol=1e-2, atol=1e-2)
    else:
        np.testing.assert_allclose(out0, expected, rtol=1e-6)


def _bits(a):
    a = np.ascontiguousarray(a)
    return a.view(np.int32) if a.dtype == np.float32 else a


def check_bucket_equals_tensorwise(ranks, spec, bpps=1):
    """Bucketed (small and default sizes) == tensor by tensor, bit for bit, every step and
    parameter, on both ranks; error-feedback state under the same keys with the same bits."""
    for r in ranks:
        ref = {k[len(f"{spec}|0|{bpps}|"):]: v for k, v in r.items()
               if k.startswith(f"{spec}|0|{bpps}|")}
        assert ref, f"no tensor-by-tensor result for {spec}"
        for mb in BUCKET_MBS[1:]:
            got = {k[len(f"{spec}|{mb}|{bpps}|"):]: v for k, v in r.items()
                   if k.startswith(f"{spec}|{mb}|{bpps}|")}
            assert sorted(k for k in got if k != "buckets") == sorted(k for k in ref if k != "buckets")
            for key, value in ref.items():
                if key == "buckets":
                    continue
                np.testing.assert_array_equal(_bits(got[key]), _bits(value),
                                              err_msg=f"{spec} bucket_mb={mb}: {key}")


def check_bucket_plan(ranks, spec, segmented):
    """Tensor by tensor: one bucket per parameter; small buckets: several, the parameter
    larger than a bucket alone; default: everything in one bucket (segmented compressors)."""
    n = len(BUCKET_SHAPES)
    assert list(ranks[0][f"{spec}|0|1|buckets"]) == [1] * n
    small, default = ranks[0][f"{spec}|{BUCKET_MBS[1]}|1|buckets"], ranks[0][f"{spec}|25|1|buckets"]
    assert small.sum() == default.sum() == n
    if segmented:
        assert 1 < len(small) < n and list(default) == [n]
    else:
        assert list(small) == list(default) == [1] * n


def check_bucket_tolerance(ranks, spec, density=0.05, tol=0.01):
    """laplace_topk in tolerance mode, bucketed: each tensor's count within tol of its k
    (the aggregate of 2 ranks has at most 2 counts' worth of nonzeros, at least one)."""
    for mb in BUCKET_MBS[1:]:
        for r in ranks:
            for step in range(3):
                for name, shape in BUCKET_SHAPES.items():
                    if step == 1 and name == "late":
                        continue
                    n = int(np.prod(shape)) if shape else 1
                    k = max(1, min(n, math.ceil(density * n)))
                    nz = np.count_nonzero(r[f"{spec}|{mb}|1|{step}|{name}"])
                    assert k - tol * k - 1 <= nz <= 2 * (k + tol * k + 1), (spec, mb, name, nz, k)


def check_bucket_policy_and_checkpoint(ranks):
    for r in ranks:
        for mb in BUCKET_MBS[1:]:
            for name in BUCKET_SHAPES:
                np.testing.assert_array_equal(_bits(r[f"policy|{mb}|{name}"]),
                                              _bits(r[f"policy|0|{name}"]), err_msg=f"policy {mb} {name}")
        assert len(r["policy|25|buckets"]) < len(BUCKET_SHAPES)      # some share a bucket
        for name in BUCKET_SHAPES:
            np.testing.assert_array_equal(_bits(r[f"ckpt|bucket_then_tensor|{name}"]),
                                          _bits(r[f"ckpt|bucket_then_bucket|{name}"]), err_msg=name)


def check_bucket_mismatch_fails_clearly(worker, tmp_path):
    rc, log = horovodrun([ROOT / "tests/workers" / worker, "bucket_mismatch"], tmp_path, timeout=180)
    assert rc != 0
    assert "CONFIG_ERROR rank 0" in log and "CONFIG_ERROR rank 1" in log
    assert "bucket_mb=25" in log and "bucket_mb=0.002" in log
