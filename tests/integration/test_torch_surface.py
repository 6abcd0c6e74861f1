"""Horovod's optimizer surface and mixed precision through real ``horovodrun -np 2 --gloo``
(one launch of workers/torch_surface_worker.py for every scenario).

Expected values are computed here from both ranks' inputs (numpy), or are the same run
through Horovod's own DistributedOptimizer, or the same run at another loss scale.
"""
import numpy as np
import pytest

from launch import ROOT, horovodrun, load_ranks

SHAPES = {"w": (6, 10), "b": (10,), "v": (5,)}
AMP_SPECS = ("topk:density=0.1", "laplace_topk:density=0.1", "twobit", "powersgd:rank=2",
             "threshold:threshold=0.002")


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("surface")
    rc, log = horovodrun([ROOT / "tests/workers/torch_surface_worker.py"], out)
    assert rc == 0, log[-6000:]
    return out


def ranks(job, scenario):
    return load_ranks(job, f"surface_{scenario}")


# -- Horovod's surface -----------------------------------------------------------------
@pytest.mark.parametrize("opt", ["sgd", "adam", "adamw", "rmsprop"])
def test_broadcast_optimizer_state(job, opt):
    r = ranks(job, "broadcast_state")
    for which in ("topk", "none", "horovod"):
        key = f"{opt}|{which}|"
        for k in r[0]:
            if k.startswith(key) and "|ef_after" not in k:
                np.testing.assert_array_equal(r[0][k], r[1][k], err_msg=k)
        assert r[0][key + "lr"] == r[1][key + "lr"] and r[0][key + "eps"] == r[1][key + "eps"]
        # the broadcast's state-initialising step leaves error feedback untouched
        assert int(r[0][key + "ef_after_broadcast"]) == 0
    # ours with 'none' is Horovod's own optimizer
    for k in r[0]:
        if k.startswith(f"{opt}|horovod|param|"):
            np.testing.assert_allclose(r[0][k.replace("|horovod|", "|none|")], r[0][k],
                                       rtol=1e-6, atol=1e-7, err_msg=k)


def test_backward_passes_per_step_and_set_backward_passes_per_step(job):
    r = ranks(job, "passes")
    for step, n in ((0, 2), (1, 3)):
        for k in SHAPES:
            expected = sum(r[i][f"{step}|in{p}|{k}"] for i in range(2) for p in range(n))
            np.testing.assert_allclose(r[0][f"{step}|out|{k}"], expected, rtol=1e-5, atol=1e-6)
            np.testing.assert_array_equal(r[0][f"{step}|out|{k}"], r[1][f"{step}|out|{k}"])


def test_horovod_assertion_texts(job):
    r = ranks(job, "passes")[0]
    assert str(r["zero_grad_error"]) == (
        "AssertionError: optimizer.zero_grad() was called after loss.backward() but before "
        "optimizer.step() or optimizer.synchronize(). This is prohibited as it can cause a "
        "race condition.")
    assert str(r["fourth_backward_error"]) == (
        "AssertionError: Gradients were computed more than backward_passes_per_step times "
        "before call to step(). Increase backward_passes_per_step to accumulate gradients "
        "locally.")
    assert str(r["set_passes_error"]).startswith("AssertionError: set_backward_passes_per_step()")
    assert "backward_passes_per_step" in str(r["bad_passes_error"])


@pytest.mark.parametrize("spec", ["none", "topk:density=0.5"])
def test_skip_synchronize_with_gradient_clipping(job, spec):
    r = ranks(job, "clip")
    avg = {k: (r[0][f"{spec}|in|{k}"] + r[1][f"{spec}|in|{k}"]) / 2 for k in SHAPES}
    if spec == "none":
        for k in SHAPES:
            np.testing.assert_allclose(r[0][f"{spec}|avg|{k}"], avg[k], rtol=1e-6)
    else:
        avg = {k: r[0][f"{spec}|avg|{k}"] for k in SHAPES}       # what was exchanged
    norm = np.sqrt(sum(float(np.sum(v.astype(np.float64) ** 2)) for v in avg.values()))
    coef = min(1.0, 0.5 / (norm + 1e-6))
    for k in SHAPES:              # SGD lr=1 from zeros: the parameter is -clipped average
        for i in range(2):
            np.testing.assert_allclose(r[i][f"{spec}|param|{k}"], -coef * avg[k],
                                       rtol=1e-5, atol=1e-7)
    assert int(r[0][f"{spec}|in_flight"]) == 0


def test_parameters_without_gradients_and_requires_grad_changes(job):
    r = ranks(job, "no_grads")
    for step in range(3):
        for k in SHAPES:
            ins = [r[i].get(f"{step}|in|{k}") for i in range(2)]
            out = r[0][f"{step}|out|{k}"]
            if ins[0] is None:                       # no gradient: zeros exchanged
                np.testing.assert_array_equal(out, np.zeros(SHAPES[k], np.float32))
            else:
                np.testing.assert_allclose(out, ins[0] + ins[1], rtol=1e-6)
            np.testing.assert_array_equal(out, r[1][f"{step}|out|{k}"])
    # step 1: b frozen after building: zeros, on both ranks
    np.testing.assert_array_equal(r[0]["1|out|b"], np.zeros(10, np.float32))
    # step 2: "frozen" unfrozen after building: each rank keeps its own, with a warning
    assert r[0]["0|out|frozen"].size == 0
    np.testing.assert_array_equal(r[0]["2|out|frozen"], np.ones(4))
    np.testing.assert_array_equal(r[1]["2|out|frozen"], 2 * np.ones(4))
    assert "frozen" in str(r[0]["warnings"]) and "not exchanged" in str(r[0]["warnings"])


@pytest.mark.parametrize("case,words", [
    ("duplicate", ["duplicate", "w"]), ("missing", ["named_parameters"]),
    ("not_tuples", ["named_parameters"]), ("adasum", ["op=hvd.Adasum"]),
    ("adasum_topk", ["op=hvd.Adasum"]), ("predivide_sum", ["gradient_predivide_factor", "hvd.Sum"]),
    ("predivide_zero", ["gradient_predivide_factor"]), ("groups_bad", ["groups"]),
    ("groups_twice", ["groups", "once"]), ("groups_and_bucket_mb", ["groups", "bucket_mb"]),
    ("num_groups_bad", ["num_groups"]), ("passes_zero", ["backward_passes_per_step"]),
    ("grad_scaler_bad", ["grad_scaler"]), ("loss_scale_bad", ["set_loss_scale"]),
    ("horovod_custom", ["compression=", "Horovod compressor"])])
def test_bad_arguments_name_themselves(job, case, words):
    text = str(ranks(job, "errors")[0][case])
    assert text.startswith("ValueError: "), text
    for w in words:
        assert w in text, text


@pytest.mark.parametrize("spec", ["none", "topk:density=0.5"])
@pytest.mark.parametrize("as_dense", [0, 1])
def test_sparse_embedding_gradients(job, spec, as_dense):
    r = ranks(job, "sparse")
    key = f"{spec}|{as_dense}"
    assert bool(r[0][f"{key}|is_sparse"]) == bool(as_dense)
    expected = r[0][f"{key}|in"] + r[1][f"{key}|in"]
    if spec == "none":
        np.testing.assert_allclose(r[0][f"{key}|out"], expected, rtol=1e-6)
    else:           # topk keeps half of each rank's rows: the aggregate lies within them
        assert np.all((r[0][f"{key}|out"] != 0) <= (expected != 0))
    np.testing.assert_array_equal(r[0][f"{key}|out"], r[1][f"{key}|out"])


@pytest.mark.parametrize("name", ["none", "fp16"])
def test_horovod_compression_objects(job, name):
    r = ranks(job, "horovod_compression")
    assert str(r[0][f"{name}|spec"]).split(":")[0] == name
    for k in SHAPES:
        ins = [r[i][f"{name}|in|{k}"] for i in range(2)]
        if name == "fp16":
            ins = [x.astype(np.float16).astype(np.float32) for x in ins]
        np.testing.assert_allclose(r[0][f"{name}|out|{k}"], ins[0] + ins[1],
                                   rtol=2e-3 if name == "fp16" else 1e-6)


@pytest.mark.parametrize("spec", ["none", "topk:density=0.3", "twobit"])
def test_gradient_predivide_factor_equals_plain_average(job, spec):
    r = ranks(job, "predivide")
    for step in range(3):
        for k in SHAPES:
            plain, pre = r[0][f"{spec}|1|{step}|{k}"], r[0][f"{spec}|4|{step}|{k}"]
            np.testing.assert_allclose(pre, plain, rtol=1e-6, atol=1e-7, err_msg=f"{step} {k}")
            if spec == "none":
                np.testing.assert_allclose(
                    plain, (r[0][f"{spec}|1|{step}|{k}"] + r[1][f"{spec}|1|{step}|{k}"]) / 2)


def test_num_groups_and_groups_become_buckets(job):
    r = ranks(job, "groups")[0]
    assert sorted(r["num_groups|buckets"]) == ["b+w", "v"]      # [w, b] + [v]
    assert sorted(r["groups|buckets"]) == ["b", "v+w"]          # [[w, v]] + b alone
    assert sorted(r["groups_int|buckets"]) == ["b", "v", "w"]
    for key in ("num_groups", "groups", "groups_int"):    # per-tensor semantics kept
        for step in range(3):
            for k in SHAPES:
                np.testing.assert_array_equal(r[f"{key}|{step}|{k}"], r[f"tensorwise|{step}|{k}"])


# -- mixed precision -------------------------------------------------------------------
def _params(r, key):
    return {k.split("|param|")[1]: v for k, v in r.items() if k.startswith(key + "|param|")}


@pytest.mark.parametrize("spec,dtype,mb", [(s, "bfloat16", "None") for s in AMP_SPECS] +
                         [("topk:density=0.1", "float16", "None"),
                          ("topk:density=0.1", "bfloat16", "0")])
def test_amp_loss_scale_does_not_change_the_result(job, spec, dtype, mb):
    """Runs starting at 2^8 and 2^16 (growing every 2 steps) and at 2^12 (constant but
    for the overflow) end with the same parameters; the overflow step is skipped."""
    for r in ranks(job, "amp"):
        base = f"{spec}|{dtype}|1|{mb}|"
        scales = {s: r[base + s + "|scales"] for s in ("256", "65536", "const")}
        assert scales["256"][-1] > scales["256"][0] and scales["const"][0] == scales["const"][4]
        ref = _params(r, base + "256")
        for start in ("65536", "const"):
            for k, v in _params(r, base + start).items():
                np.testing.assert_allclose(v, ref[k], rtol=1e-6, atol=1e-7,
                                           err_msg=f"{start} {k}")
        for start in scales:
            assert int(r[base + start + "|overflows"]) == 1


@pytest.mark.parametrize("spec", AMP_SPECS)
def test_amp_overflow_step_leaves_every_residual_unchanged(job, spec):
    for r in ranks(job, "amp"):
        for start in ("256", "65536", "const"):
            key = f"{spec}|bfloat16|1|None|{start}|"
            names = list(r[key + "residual_keys"])
            assert names
            for n in names:
                np.testing.assert_array_equal(r[key + "after|" + n], r[key + "before|" + n],
                                              err_msg=n)
            # and the next, finite step does write them
            assert any(not np.array_equal(r[key + "later|" + n], r[key + "after|" + n])
                       for n in names if n.startswith("residual/"))


def test_amp_without_grad_scaler_mixes_scales(job):
    """Without ``grad_scaler`` (as before this option) a changing scale changes the
    result (residuals kept at one scale are added to gradients at another): what
    ``grad_scaler=`` fixes.  (An absolute threshold on scaled gradients sends almost
    everything at either scale; with ``grad_scaler`` it applies to unscaled ones.)"""
    r = ranks(job, "amp")[0]
    base = "topk:density=0.1|bfloat16|0|None|"
    a, b = _params(r, base + "256"), _params(r, base + "const")
    assert max(float(np.abs(a[k] - b[k]).max()) for k in a) > 1e-3
    assert np.array_equal(r[base + "256|scales"], r["topk:density=0.1|bfloat16|1|None|256|scales"])
