"""benchmarks/gpu_step.py (issue 26) runs on the CPU with its tiny models: both models,
three compressors, one measured step; its JSON holds positive times, fewer bytes for
topk than for none, and a modelled step no faster on the slower link."""
import importlib.util
import json
import os
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
        # each bucket's fastest step is at most its median; the sums follow
        for b in r["per_bucket"]:
            assert 0 < b["compress_min_ms"] <= b["compress_ms"]
            assert 0 < b["decompress_min_ms"] <= b["decompress_ms"]
        assert 0 < r["codec_min_ms"] <= r["compress_ms"] + r["decompress_ms"] + 1e-9
        assert r["codec_min_over_backward"] == pytest.approx(r["codec_min_ms"] / r["backward_ms"])
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


@pytest.mark.parametrize("model", ["gpt2", "resnet50"])
def test_in_step_rows_launch_every_bucket_from_a_hook(results, model):
    rows = {r["spec"]: r for r in results[model]["rows"]}
    for spec in ("none", "topk:density=0.01"):
        r = rows[spec]
        assert r["inline_backward_ms"] > 0 and r["plain_backward_ms"] > 0
        assert r["inline_codec_ms"] == pytest.approx(r["inline_backward_ms"]
                                                     - r["plain_backward_ms"])
        assert r["inline_from_hooks"] == r["inline_buckets"] == r["buckets"]
    assert "two rounds" in rows["powersgd:rank=4"]["inline_skipped"]
    assert "inline_backward_ms" not in rows["powersgd:rank=4"]
    assert "in-step" in results["stdout"]


def _exchange_module():
    spec = importlib.util.spec_from_file_location("gpu_step_exchange",
                                                  ROOT / "benchmarks" / "gpu_step_exchange.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("spec", ["none", "topk:density=0.25"])
def test_in_step_exchange_averages_rank_1s_replayed_payload(spec):
    """The in-step pass's results are the two ranks' average: rank 0's gradient of the
    hooked backward with rank 1's payload made beforehand (replayed), as an exchange of
    both ranks in lockstep gives it."""
    import torch
    import hvd_compress
    from hvd_compress import buckets
    from hvd_compress.exchange import Exchange, finish_all
    from hvd_compress.exchange.in_process import World
    from hvd_compress.ops import torch_ops
    inline = _exchange_module()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    names = [n for n, _ in model.named_parameters()]
    lays = [buckets.layout(names[:2], [tuple(model[0].weight.shape), (16,)]),
            buckets.layout(names[2:3], [tuple(model[2].weight.shape)]),
            buckets.layout(names[3:], [(3,)])]
    x0, x1 = torch.randn(5, 8), torch.randn(5, 8)
    model(x1).square().sum().backward()
    g1 = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    model(x0).square().sum().backward()
    g0 = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    # the reference: both ranks exchanged for real, in lockstep
    refs, world = [hvd_compress.from_spec(spec) for _ in range(2)], World(2, torch_ops)
    expected = []
    for lay in lays:
        exs = []
        for r, g in enumerate((g0, g1)):
            c = refs[r].for_tensor(lay.names[0], g[lay.names[0]])
            if len(lay.names) == 1:
                exs.append(Exchange(c, world.transport(r), lay.names[0],
                                    tensor=g[lay.names[0]].clone(), average=True))
            else:
                exs.append(Exchange(c, world.transport(r), lay.key, layout=lay, average=True,
                                    flat=torch.cat([g[n].reshape(-1) for n in lay.names])))
        finish_all(exs)
        expected.append(exs[0].result)
    step = inline.InlineStep(model, hvd_compress.from_spec(spec), lays)
    try:
        got = step.run(model(x0).square().sum(), inline.rank1_replays(
            hvd_compress.from_spec(spec), lays, g1))
    finally:
        step.remove()
    assert step.from_hooks == len(lays)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_once_world_makes_each_aggregate_once():
    """The in-step pass's world hands both ranks one aggregate per collective (a plain
    in-process world combines once per rank that waits), so rank 1's is not timed."""
    import torch
    from hvd_compress.ops import torch_ops
    world = _exchange_module().OnceWorld(2, torch_ops)
    a, b = torch.ones(3), torch.full((3,), 2.0)
    total = world.sum([a, b])
    assert world.sum([a, b]) is total and torch.equal(total, torch.full((3,), 3.0))
    pa, pb = (a, torch.arange(3)), (b, torch.arange(3))
    cat = world.concat([pa, pb])
    assert world.concat([pa, pb]) is cat and cat[0].numel() == 6
    assert world.sum([b, a]) is not total                       # other contributions


def test_a_specs_suffixes_are_settings_for_its_row(monkeypatch):
    """``twobit+graphs+cache`` is twobit with graphs and the launch cache on, set for its
    row only; a row without ``+graphs`` turns replay (the default) off; a setting the
    process had comes back after."""
    spec = importlib.util.spec_from_file_location("gpu_step_", ROOT / "benchmarks" / "gpu_step.py")
    gpu_step = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_step)
    assert gpu_step.variant("twobit+graphs+cache") == (
        "twobit", {"HVD_COMPRESS_CUDA_GRAPHS": "1", "HVD_COMPRESS_LAUNCH_CACHE": "1"})
    assert gpu_step.variant("laplace_topk:density=0.01,padded=1") == (     # eager rows:
        "laplace_topk:density=0.01,padded=1", {"HVD_COMPRESS_CUDA_GRAPHS": "0"})  # replay off
    monkeypatch.setenv("HVD_COMPRESS_BACKEND", "triton")
    monkeypatch.delenv("HVD_COMPRESS_CUDA_GRAPHS", raising=False)
    with gpu_step.environment(gpu_step.variant("twobit+aten+graphs")[1]):
        assert os.environ["HVD_COMPRESS_BACKEND"] == "torch"
        assert os.environ["HVD_COMPRESS_CUDA_GRAPHS"] == "1"
    assert os.environ["HVD_COMPRESS_BACKEND"] == "triton"
    assert "HVD_COMPRESS_CUDA_GRAPHS" not in os.environ
