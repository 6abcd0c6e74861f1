"""Checks shared by the PyTorch and TensorFlow horovodrun tests: each worker writes the
same keys (see tests/workers/), so one check serves both frameworks."""
import math

import numpy as np

from cases import (AGG_SHAPES, AGG_SPECS, AGG_STEPS, AGG_ZERO_STEP, AUTO_STEPS,  # noqa: F401
                   BUCKET_MBS, BUCKET_SHAPES, BUCKET_SPECS, BUCKET_TOL_SPECS,
                   POLICY, SHAPES, SPECS)                      # (re-exported for the tests)
from launch import ROOT, horovodrun
from reference import powersgd_reference, reference_contribution, topk_mask
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
        if spec.startswith("powersgd"):     # not a sum of per-rank contributions
            rank = int(dict(p.split("=") for p in spec.split(":")[1].split(","))["rank"])
            expected = powersgd_reference(inputs, rank, n) / div
            np.testing.assert_allclose(outs[0], expected, rtol=1e-4, atol=1e-5)
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
    for rank, r in enumerate(ranks):
        np.testing.assert_array_equal(r["resumed"], r["straight"])
        # the checkpoint records its rank; the other rank's is refused (PyTorch: by the
        # optimizer's compressor; TensorFlow: restored first, refused by the tape)
        assert int(r["saved_rank"]) == rank
        assert f"rank {1 - rank}, but this is rank {rank}" in str(r["other_refused"])


def mismatch_job(worker, tmp_path):
    """One launch of every mismatch scenario (each rank catches its ValueError, prints
    CONFIG_ERROR and goes on; the worker exits 3 at the end): ``(rc, log)``."""
    return horovodrun([ROOT / "tests/workers" / worker, "mismatch", "bucket_mismatch",
                       "auto_mismatch"], tmp_path, timeout=240)


def check_mismatch_fails_clearly(job):
    rc, log = job
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
        # powersgd: the matrices it compresses in one bucket, what it sends as is (the
        # vector, the 0-d and the 5x3 parameter, too small to shrink) in another
        whole = [3, 3] if spec.startswith("powersgd") else [n]
        assert 1 < len(small) < n and sorted(default) == whole
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


def check_bucket_mismatch_fails_clearly(job):
    rc, log = job
    assert rc != 0
    assert "CONFIG_ERROR rank 0" in log and "CONFIG_ERROR rank 1" in log
    assert "bucket_mb=25" in log and "bucket_mb=0.002" in log


# -- aggregation-aware selection (agg=union/leader/hint) -----------------------------------

def _spec_params(spec):
    name, _, params = spec.partition(":")
    return name, dict(p.split("=") for p in params.split(",") if p)


def agg_reference(inputs, spec, steps, ranks=None):
    """topk with agg=union/leader/hint over ``P`` ranks, error feedback on, computed here:
    per tensor, ``c_r = g_r + r_r``; union: U = the union of each rank's top-k of |c_r|;
    leader: the top-k of rank ``step mod P``; hint: top-k of ``|c_r| (1 + beta [i in H])``
    with H from the previous aggregate; out = sum_r c_r[U]; r_r = c_r with U zeroed.
    ``inputs[r][(step, name)]``; returns (outs[step][name], unions[step], residuals)."""
    _, kv = _spec_params(spec)
    agg, density = kv["agg"], float(kv["density"])
    beta, hint = float(kv.get("beta", 8.0)), kv.get("hint", "top")   # the defaults
    P = len(inputs)
    names = sorted({n for (_, n) in inputs[0]})
    res = [{n: np.zeros(inputs[0][(0, n)].size, np.float32) for n in names} for _ in range(P)]
    H = {n: np.zeros(inputs[0][(0, n)].size, bool) for n in names}
    outs, unions = [], []
    for step in range(steps):
        out, union = {}, 0
        for n in names:
            c = [inputs[r][(step, n)].reshape(-1).astype(np.float32) + res[r][n] for r in range(P)]
            if agg == "leader":
                U = np.flatnonzero(topk_mask(c[step % P], density))
            else:
                scores = [np.abs(x) * (1 + beta * H[n]) if agg == "hint" else x for x in c]
                U = np.unique(np.concatenate([np.flatnonzero(topk_mask(s, density))
                                              for s in scores]))
            total = np.zeros_like(c[0])
            for x in c:
                total[U] += x[U]
            for r in range(P):
                res[r][n] = c[r].copy()
                res[r][n][U] = 0
            if agg == "hint":
                mags = np.abs(total[U])
                keep = U if hint == "union" else U[mags >= mags.sum(dtype=np.float32) / len(U)]
                H[n] = np.zeros_like(H[n])
                H[n][keep] = True
            out[n] = total.reshape(inputs[0][(step, n)].shape)
            union += len(U)
        outs.append(out)
        unions.append(union)
    return outs, unions, res


def _same_sum(a, b, P, err_msg=""):
    """Two runs' sums over ``P`` ranks: bit for bit with 2 ranks; with more, Gloo's ring
    and Horovod's tensor fusion may add in another order (a last-bit difference)."""
    if P == 2:
        np.testing.assert_array_equal(_bits(a), _bits(b), err_msg=err_msg)
    else:
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7, err_msg=err_msg)


def check_agg(ranks, spec, shapes, steps, zero_step):
    """Every rank ends every step with the same gradient, the same tensor by tensor
    (eager) and bucketed (tf.function); topk equals :func:`agg_reference`; error
    feedback conserves the gradients; stats count the union; checkpoints resume exactly."""
    P = len(ranks)
    name, kv = _spec_params(spec)
    for step in range(steps):
        for n in shapes:
            for mb in (0, 25):
                for r in ranks[1:]:
                    np.testing.assert_array_equal(_bits(r[f"{spec}|{mb}|{step}|{n}"]),
                                                  _bits(ranks[0][f"{spec}|{mb}|{step}|{n}"]))
            if name in ("topk", "randomk"):   # (searches may stop earlier eagerly in TF)
                _same_sum(ranks[0][f"{spec}|25|{step}|{n}"], ranks[0][f"{spec}|0|{step}|{n}"], P,
                          err_msg=f"{spec}: bucket vs tensor, {n}")
    inputs = [{(s, n): r[f"in|{s}|{n}"] for s in range(steps) for n in shapes} for r in ranks]
    stats = ranks[0][f"{spec}|25|stats"]              # sent, received, received_local, union, k
    ks = sum(max(1, math.ceil(float(kv["density"]) * max(1, int(np.prod(s))))) for s in shapes.values())
    if name != "dct":
        assert (stats[:, 4] == ks).all(), (stats[:, 4], ks)
    if name == "topk":
        outs, unions, res = agg_reference(inputs, spec, steps)
        for step in range(steps):
            for n in shapes:
                np.testing.assert_allclose(ranks[0][f"{spec}|25|{step}|{n}"], outs[step][n],
                                           rtol=1e-5, atol=1e-6, err_msg=f"{spec} step {step} {n}")
        assert list(stats[:, 3]) == unions
        for r, rank in enumerate(ranks):
            for n in shapes:
                np.testing.assert_allclose(rank[f"{spec}|25|state|residual/{n}"], res[r][n],
                                           rtol=1e-5, atol=1e-6)
    if kv.get("agg") == "leader":
        assert (stats[:, 3] <= ks).all()             # the union is the leader's k at most
        if kv.get("ef") == "0" and name == "laplace_topk":
            # the leader had nothing to propose: empty union, zero aggregate, no hang
            assert stats[zero_step, 3] == 0
            for n in shapes:
                assert not ranks[0][f"{spec}|25|{zero_step}|{n}"].any()
    if kv.get("ef") != "0":                          # nothing lost, only delayed
        for n in shapes:
            sent = sum(ranks[0][f"{spec}|25|{s}|{n}"].astype(np.float64) for s in range(steps))
            kept = sum(r[f"{spec}|25|state|residual/{n}"].astype(np.float64).reshape(sent.shape)
                       for r in ranks)
            given = sum(r[f"in|{s}|{n}"].astype(np.float64) for r in ranks for s in range(steps))
            np.testing.assert_allclose(sent + kept, given, rtol=1e-4, atol=1e-4,
                                       err_msg=f"{spec}: error feedback lost gradient in {n}")
    if f"{spec}|resumed|{next(iter(shapes))}" in ranks[0]:
        for rank in ranks:
            for n in shapes:
                _same_sum(rank[f"{spec}|resumed|{n}"], rank[f"{spec}|25|{steps - 1}|{n}"], P,
                          err_msg=f"{spec}: restored run differs in {n}")
    # bytes: leader's non-leaders receive k indices; local's estimate (P-1) k 8
    assert (stats[:, 2] == (P - 1) * ks * 8).all() or name == "dct"


def check_agg_average_and_process_set(ranks, specs, shapes):
    """op=Average divides the Sum by P; on -np 3 a process set of ranks 0 and 2 runs
    agg=leader among them (leader: set rank step mod 2 = global rank 0, then 2)."""
    P = len(ranks)
    for n in shapes:
        for r in ranks:
            np.testing.assert_allclose(r[f"average|{n}"], r[f"{specs[0]}|25|0|{n}"] / P, rtol=1e-6)
    if P == 3:
        members = [ranks[0], ranks[2]]
        inputs = [{(s, n): r[f"in|{s}|{n}"] for s in range(2) for n in shapes} for r in members]
        outs, _, _ = agg_reference(inputs, specs[1], 2)
        for r in members:
            for s in range(2):
                for n in shapes:
                    np.testing.assert_allclose(r[f"pset|{s}|{n}"], outs[s][n], rtol=1e-5, atol=1e-6)
        assert not any(k.startswith("pset|") for k in ranks[1])


# -- auto: a compressor chosen per bucket ----------------------------------------------------

def _auto_reference(ranks, candidates, steps, choice_of):
    """Each rank's contribution per step and final residuals in numpy: a residual per
    tensor goes on across switches; none/fp16 send it with the gradient."""
    import json
    buckets = json.loads(str(ranks[0]["buckets"]))
    totals, residuals = [], []
    for r in ranks:
        res = {n: np.zeros(s, np.float32) for n, s in BUCKET_SHAPES.items()}
        sent_steps = []
        for step in range(steps):
            sent = {}
            for b, names in enumerate(buckets):
                spec = candidates[choice_of(step)[b]]
                for n in names:
                    comp = r[f"in|{step}|{n}"] + res[n]
                    if spec.startswith("topk"):
                        sent[n] = np.where(topk_mask(comp, 0.1), comp, 0).astype(np.float32)
                        res[n] = comp - sent[n]
                    else:
                        sent[n] = comp.astype(np.float16) if spec == "fp16" else comp
                        res[n] = np.zeros_like(comp)
            sent_steps.append(sent)
        totals.append(sent_steps)
        residuals.append(res)
    expected = []
    for step in range(steps):
        expected.append({n: (totals[0][step][n] + totals[1][step][n]).astype(np.float32)
                         for n in BUCKET_SHAPES})
    return expected, residuals


def check_auto(ranks):
    """Every rank sends each bucket with the same candidate at every step; the aggregate
    is that of the chosen fixed compressor; residuals go on across switches."""
    candidates = ["none", "topk", "fp16"]
    for step in range(AUTO_STEPS):
        np.testing.assert_array_equal(ranks[0][f"choice|{step}"], ranks[1][f"choice|{step}"])
    for step in range(3):            # calibration: every bucket with candidate step % 3
        assert set(ranks[0][f"choice|{step}"].tolist()) == {step}
    # the calibration's decision at least (whether a check step's follows within
    # AUTO_STEPS depends on timings: a check may find drift and calibrate again)
    assert int(ranks[0]["decisions"]) >= 1
    expected, residuals = _auto_reference(ranks, candidates, AUTO_STEPS,
                                          lambda step: ranks[0][f"choice|{step}"])
    for step in range(AUTO_STEPS):
        for n in BUCKET_SHAPES:
            np.testing.assert_allclose(ranks[0][f"out|{step}|{n}"], expected[step][n],
                                       rtol=1e-6, atol=1e-6, err_msg=f"step {step} {n}")
            np.testing.assert_array_equal(ranks[0][f"out|{step}|{n}"], ranks[1][f"out|{step}|{n}"])
    for r, res in zip(ranks, residuals):
        for n in BUCKET_SHAPES:
            got = r[f"residual|{n}"]
            want = res[n].reshape(-1)
            if got.size == 0:        # no residual held: nothing may be owed
                assert not want.any(), n
            else:
                np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=n)
    # checkpoint: the resumed run makes the same choices and the same aggregates, bit for bit
    for r in ranks:
        for step in range(3, 6):
            np.testing.assert_array_equal(r[f"ckpt|choice|resumed|{step}"],
                                          r[f"ckpt|choice|straight|{step}"])
            for n in BUCKET_SHAPES:
                np.testing.assert_array_equal(_bits(r[f"ckpt|resumed|{step}|{n}"]),
                                              _bits(r[f"ckpt|straight|{step}|{n}"]), err_msg=n)


def check_auto_mismatch_fails_clearly(job):
    rc, log = job
    assert rc != 0
    assert "CONFIG_ERROR rank 0" in log and "CONFIG_ERROR rank 1" in log
    assert "candidates=none:ef=0|topk" in log
