"""Every compressor of the spec registry on CUDA tensors against the same compressor on
the CPU, with two simulated ranks aggregated as the PyTorch glue does
(hvd_compress/torch/collectives.py): ``allreduce`` sums the payloads, ``allgather``
concatenates each payload tensor in rank order; ``decompress`` of the aggregate is the
sum over the ranks.  Two steps, so error feedback is exercised.

``EXACT`` compressors do the same arithmetic on both devices: the decompressed sum, the
residuals and the payloads are equal bit for bit (``ORDER_FREE`` ones may list their
entries in another order: torch.topk with ``sorted=False``).  ``APPROX`` ones start from a
float reduction (mean|g|, mean/std, block DCT) whose order of additions differs between
devices, draw their sample with the device's own generator (dgc: CPU and CUDA draws
differ, ``ops.random_sample``), or (laplace_topk with ``exact=0``) search with 16
thresholds a pass on CUDA and 8 on the CPU; they are checked for what they promise
instead.  For every compressor,
decoding a CUDA aggregate on CUDA equals decoding it on the CPU.
"""
import math

import pytest
import torch

import hvd_compress
from hvd_compress.compressors import REGISTRY
from hvd_compress.kernels import twobit as TB
from gpu_helpers import DEV, GPU, assert_same_bits, laplace

pytestmark = GPU

RANKS = 2
SHAPE = (517, 389)           # 201,113 values: a multiple of no kernel's block
CONV = (64, 48, 3, 3)        # kernel_select needs a convolution weight

EXACT = ["none", "fp16", "bf16",
         "topk:density=0.01", "topk:density=0.01,values=rangefloat8",
         "randomk:density=0.01,seed=3", "randomk:density=0.6,seed=3", "threshold:threshold=2.5",
         "threshold:threshold=2.5,values=rangefloat6",
         "laplace_topk:density=0.01,exact=1", "laplace_topk:density=0.001,exact=1,values=rangefloat12",
         "laplace_topk:density=0.01,exact=1,fused=1", "laplace_topk:density=0.01,exact=1,padded=1",
         "laplace_topk:density=0.01,exact=1,warm=1",
         "rangefloat:bits=4", "rangefloat:bits=6", "rangefloat:bits=8", "rangefloat:bits=12",
         "rangefloat:bits=16", "rangefloat:bits=8,exp_bits=3",
         "twobit:threshold=0.5",
         "kernel_select", "kernel_select:fraction=0.1"]
ORDER_FREE = ("topk", "kernel_select")
APPROX = ["laplace_topk:density=0.01", "laplace_topk:density=0.001,tol=0.05",
          "laplace_topk:density=0.01,values=rangefloat8", "laplace_topk:density=0.01,fused=1",
          "laplace_topk:density=0.001,fused=1,values=rangefloat8",
          "laplace_topk:density=0.01,padded=1", "laplace_topk:density=0.01,padded=1,warm=1",
          "dgc:density=0.01", "gaussian_k:density=0.01", "sidco_exp:density=0.01",
          "sidco_exp:density=0.001,stages=3",
          "twobit", "twobit:scale=2",
          "dct:density=0.01", "dct:density=0.05,block=64,bits=12", "dct:density=0.01,padded=1"]


#: the peer baselines, tested in test_gpu_peers.py
PEERS = {"qsgd", "terngrad", "signsgd", "onebit", "powersgd"}


def name_of(spec):
    return spec.partition(":")[0]


def shape_for(spec):
    return CONV if name_of(spec) == "kernel_select" else SHAPE


#: strategies that choose among the compressors above (their choice is what runs)
STRATEGIES = {"auto"}


def test_every_registered_compressor_is_covered():
    covered = {name_of(s) for s in EXACT + APPROX} | PEERS | STRATEGIES
    assert set(REGISTRY) <= covered, f"not tested on CUDA: {sorted(set(REGISTRY) - covered)}"


def gradients(shape, step, dtype=torch.float32, nonfinite=False):
    grads = [laplace(math.prod(shape), seed=100 * step + r).reshape(shape).to(dtype)
             for r in range(RANKS)]
    if nonfinite:
        flat = grads[0].view(-1)
        flat[3], flat[77], flat[-1] = float("nan"), float("inf"), -float("inf")
    return grads


def aggregate(compressor, payloads):
    """What the glue's collective hands to ``decompress``."""
    if compressor.collective == "allreduce":
        total = payloads[0]
        for p in payloads[1:]:
            total = total + p
        return total
    return tuple(torch.cat([p[i] for p in payloads]) for i in range(len(payloads[0])))


def to_cpu(payload):
    return payload.cpu() if torch.is_tensor(payload) else tuple(t.cpu() for t in payload)


def run(spec, device, steps=2, dtype=torch.float32, nonfinite=False):
    """Compress, aggregate and decompress ``steps`` steps of two ranks on ``device``."""
    comps = [hvd_compress.from_spec(spec) for _ in range(RANKS)]
    history = []
    for step in range(steps):
        grads = gradients(shape_for(spec), step, dtype, nonfinite and step == 0)
        payloads, ctx = [], None
        for c, g in zip(comps, grads):
            p, ctx = c.compress(g.to(device), "layer")
            payloads.append(p)
        agg = aggregate(comps[0], payloads)
        out = comps[0].decompress(agg, ctx)
        history.append({"grads": grads, "payloads": payloads, "agg": agg, "ctx": ctx, "out": out,
                        "residuals": [c.residual("layer") for c in comps]})
    return history


def check_decode_on_cpu(spec, h, exact=True):
    """Decoding the CUDA aggregate on CUDA == decoding it on the CPU."""
    on_cpu = hvd_compress.from_spec(spec).decompress(to_cpu(h["agg"]), h["ctx"])
    if exact:
        assert_same_bits(h["out"], on_cpu, f"{spec}: decode on CUDA vs CPU")
    else:
        a, b = h["out"].cpu().double(), on_cpu.double()
        assert ((a - b).norm() / b.norm().clamp_min(1e-30)).item() <= 1e-5


@pytest.mark.parametrize("spec", EXACT)
def test_exact_compressor_cuda_equals_cpu(spec):
    gpu, cpu = run(spec, DEV), run(spec, "cpu")
    for step, (g, c) in enumerate(zip(gpu, cpu)):
        what = f"{spec} step {step}"
        assert g["out"].device.type == DEV.split(":")[0]
        assert_same_bits(g["out"], c["out"], f"{what}: decompressed sum")
        for r in range(RANKS):
            if c["residuals"][r] is not None:
                assert_same_bits(g["residuals"][r], c["residuals"][r], f"{what}: residual {r}")
            pg, pc = g["payloads"][r], c["payloads"][r]
            pg, pc = ([pg], [pc]) if torch.is_tensor(pg) else (pg, pc)
            assert [t.dtype for t in pg] == [t.dtype for t in pc]
            assert [t.numel() for t in pg] == [t.numel() for t in pc], f"{what}: payload sizes"
            if name_of(spec) in ORDER_FREE:             # same entries, maybe another order
                assert torch.equal(pg[-1].cpu().sort().values, pc[-1].sort().values), what
            else:
                for i, (a, b) in enumerate(zip(pg, pc)):
                    assert_same_bits(a, b, f"{what}: rank {r} payload[{i}]")
        check_decode_on_cpu(spec, g)


@pytest.mark.parametrize("spec", ["none", "fp16", "bf16", "topk:density=0.01",
                                  "laplace_topk:density=0.01,exact=1", "rangefloat:bits=8",
                                  "twobit:threshold=0.5", "threshold:threshold=2.5"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_gradients(spec, dtype):
    gpu, cpu = run(spec, DEV, dtype=dtype), run(spec, "cpu", dtype=dtype)
    if name_of(spec) == "topk":
        # Half precision has many equal magnitudes at the k-th largest; torch.topk breaks
        # those ties one way on CUDA and another on the CPU (seen on an H100), and error
        # feedback carries the difference into the next step.  What topk promises is a
        # top set of the step's gradient, with its own values, and a sum of those.
        h = gpu[0]
        for r in range(RANKS):
            values, idx = h["payloads"][r]
            g = h["grads"][r].reshape(-1)
            assert idx.numel() == hvd_compress.from_spec(spec).k(g.numel())
            assert top_set_ok(g, idx), f"{spec} {dtype}: rank {r} did not send a top set"
            assert_same_bits(values.to(dtype), g.to(DEV)[idx.long()], f"{spec} {dtype}: values")
        for g, c in zip(gpu, cpu):
            assert g["out"].dtype == dtype
        return
    for g, c in zip(gpu, cpu):
        assert g["out"].dtype == dtype
        assert_same_bits(g["out"], c["out"], f"{spec} {dtype}")


def top_set_ok(g, idx):
    """Every selected |g| >= every unselected |g| (a top set, ties allowed)."""
    a = g.reshape(-1).float().abs().cpu()
    chosen = torch.zeros(a.numel(), dtype=torch.bool)
    chosen[idx.cpu().long()] = True
    if chosen.all() or not chosen.any():
        return True
    return a[chosen].min().item() >= a[~chosen].max().item()


def unpadded(payload):
    """A ``padded=1`` payload's ``(values, indices)`` without its padding (the value 0.0,
    which a sent value never is: zeros are never selected)."""
    values, idx = payload
    sent = values != 0
    return values[sent], idx[sent]


@pytest.mark.parametrize("spec", APPROX)
def test_approximate_compressor_on_cuda(spec, record):
    gpu, cpu = run(spec, DEV), run(spec, "cpu")
    c0 = hvd_compress.from_spec(spec)
    name = name_of(spec)
    h, hc = gpu[0], cpu[0]                      # step 0: the compensated gradient is g
    for r in range(RANKS):
        g = h["grads"][r].reshape(-1)
        p, pc = h["payloads"][r], hc["payloads"][r]
        if name in ("laplace_topk", "dgc", "gaussian_k", "sidco_exp"):
            idx = p[-1]
            if getattr(c0, "padded", None):      # its slots: the selection, then padding
                k = c0.k(g.numel())
                assert idx.numel() == pc[-1].numel() == k + int(c0.tol * k), idx.numel()
                p, pc = unpadded(p), unpadded(pc)
                idx = p[-1]
            assert idx.dtype == torch.int32 and torch.unique(idx).numel() == idx.numel()
            assert top_set_ok(g, idx), f"{spec}: not the largest magnitudes"
            if len(p) == 2:                      # float values: exactly g at those indices
                assert_same_bits(p[0], g.to(DEV)[idx.long()], f"{spec}: values")
            k = c0.k(g.numel())
            count, count_cpu = idx.numel(), pc[-1].numel()
            record("selected_count_cuda_vs_cpu", f"{spec} rank {r}",
                   {"k": k, "cuda": count, "cpu": count_cpu})
            if name == "laplace_topk":           # the count is within tol of k on both
                assert abs(count - k) <= c0.tol * k + 1 and abs(count_cpu - k) <= c0.tol * k + 1
            else:                       # same fit, other additions' order (or sample: dgc)
                assert 0.5 <= count / max(count_cpu, 1) <= 2.0, (count, count_cpu)
        elif name == "twobit":
            words, t = p
            t_cpu = pc[1]
            assert t.item() == pytest.approx(t_cpu.item(), rel=1e-5)
            # the codes are exactly those of the reference at the threshold CUDA chose
            assert_same_bits(words, TB.pack_reference(g, t.cpu()), f"{spec}: words")
        elif name == "dct":
            k = c0.k(-(-g.numel() // c0.block) * c0.block)
            count = p[-1].numel()
            assert abs(count - k) <= c0._select.tol * k + 1, (count, k)
        else:
            raise AssertionError(f"no check for {spec}")
    for step, (g, c) in enumerate(zip(gpu, cpu)):
        total = sum(x.double() for x in g["grads"]).reshape(-1)
        err_gpu = ((g["out"].cpu().double().reshape(-1) - total).norm() / total.norm()).item()
        err_cpu = ((c["out"].double().reshape(-1) - total).norm() / total.norm()).item()
        record("relative_error_cuda_vs_cpu", f"{spec} step {step}",
               {"cuda": err_gpu, "cpu": err_cpu})
        if name in ("laplace_topk", "twobit", "dct"):    # gaussian_k, sidco_exp: recorded only
            assert err_gpu <= 1.05 * err_cpu + 1e-6, f"{spec} step {step}: {err_gpu} vs {err_cpu}"
        check_decode_on_cpu(spec, g, exact=(name != "dct"))
        for r in range(RANKS):
            rg, rc = g["residuals"][r], c["residuals"][r]
            assert torch.isfinite(rg).all()
            assert rg.double().norm().item() == pytest.approx(rc.double().norm().item(), rel=0.1)


@pytest.mark.parametrize("spec", EXACT + APPROX)
def test_nonfinite_gradient_same_as_cpu(spec):
    """NaN/Inf in one rank's gradient: the sum is non-finite where it is on the CPU (NaN
    where NaN and Inf where Inf, but for dct)."""
    gpu, cpu = run(spec, DEV, steps=1, nonfinite=True), run(spec, "cpu", steps=1, nonfinite=True)
    og, oc = gpu[0]["out"].cpu(), cpu[0]["out"]
    if name_of(spec) == "dct":      # the inverse transform adds +-Inf products in another
        # order: Inf on one device may be NaN (Inf - Inf) on the other (H200, 2026-11-29)
        assert torch.equal(torch.isfinite(og), torch.isfinite(oc)), spec
    else:
        assert torch.equal(torch.isnan(og), torch.isnan(oc)), spec
        assert torch.equal(torch.isinf(og), torch.isinf(oc)), spec
    if spec in EXACT:
        assert_same_bits(og, oc, spec)
    for r in range(RANKS):
        rg, rc = gpu[0]["residuals"][r], cpu[0]["residuals"][r]
        if rc is not None:
            assert torch.equal(torch.isfinite(rg).cpu(), torch.isfinite(rc)), spec


def test_hylo_policy_step_on_cuda():
    """Hylo's per-parameter policy (kernel_select, twobit, none) on a model's gradients."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    from models import vgg_small

    torch.manual_seed(0)
    model = vgg_small()
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    torch.nn.functional.cross_entropy(model(x), y).backward()
    grads = [(n, p.grad.detach().clone()) for n, p in model.named_parameters()]
    outs = {}
    for device in (DEV, "cpu"):
        ranks = [hvd_compress.Hylo.from_model(model) for _ in range(RANKS)]
        for name, g in grads:
            cs = [policy.for_tensor(name, g) for policy in ranks]
            sent = [c.compress((g * (r + 1)).to(device), name) for r, c in enumerate(cs)]
            ctx = sent[0][1]
            outs[device, name] = (cs[0].name,
                                  cs[0].decompress(aggregate(cs[0], [p for p, _ in sent]), ctx))
    for name, _ in grads:
        kind, og = outs[DEV, name]
        _, oc = outs["cpu", name]
        if kind == "twobit":        # adaptive threshold: mean|g| summed in another order
            # (rank r sends (r + 1) g: both ranks' codes agree, so the sum's sign is the
            # code); the scale may differ in its last bits (H200, 2026-11-29: one ulp, so
            # every nonzero value differed), the codes only near the threshold
            og = og.cpu()
            differ = (og.sign() != oc.sign()).float().mean().item()
            assert differ <= 1e-3, f"{name}: {differ:.2%} of the codes differ"
            same = og.sign() == oc.sign()
            torch.testing.assert_close(og[same], oc[same], rtol=1e-5, atol=0)
        else:
            assert_same_bits(og, oc, f"{name} ({kind})")
