"""The peer baselines (qsgd, terngrad, signsgd, onebit, powersgd) on CUDA against the CPU,
two simulated ranks (hvd_compress.compressors.aggregation.in_process: allgather =
concatenation, allreduce = sum, as the glue does).

The sign bits of signsgd/onebit are device-independent: equal bit for bit; their float
scales are sums whose order of additions differs between devices.  qsgd and terngrad
draw from the device's generator (CUDA and CPU draws differ): checked for what they
promise, the quantization lattice of the CUDA draws.  PowerSGD's QR differs in rounding:
close to the CPU's result.  Decoding a CUDA aggregate on the CPU gives CUDA's result.
"""
import math

import pytest
import torch

import hvd_compress
from hvd_compress.compressors.aggregation import in_process
from gpu_helpers import DEV, GPU, assert_same_bits, laplace

pytestmark = GPU

SHAPE = (517, 389)


def grads(step=0, dtype=torch.float32):
    return [laplace(math.prod(SHAPE), seed=100 * step + r).reshape(SHAPE).to(dtype)
            for r in range(2)]


def ranks(spec):
    sep = "," if ":" in spec else ":"
    return [hvd_compress.from_spec(f"{spec}{sep}rank={r}") if spec.startswith(("qsgd", "terngrad"))
            else hvd_compress.from_spec(spec) for r in range(2)]


@pytest.mark.parametrize("spec", ["signsgd", "onebit"])
def test_sign_methods_cuda_equal_cpu(spec):
    gpu, cpu = ranks(spec), ranks(spec)
    for step in range(2):                          # the second step has residuals
        g = grads(step)
        pg = [c.compress(x.to(DEV), "w") for c, x in zip(gpu, g)]
        pc = [c.compress(x, "w") for c, x in zip(cpu, g)]
        for (a, _), (b, _) in zip(pg, pc):
            assert_same_bits(a[0], b[0], f"{spec} step {step}: sign bytes")
            torch.testing.assert_close(a[1].cpu(), b[1], rtol=1e-5, atol=0)
        agg = tuple(torch.cat([p[i] for p, _ in pg]) for i in range(2))
        out = gpu[0].decompress(agg, pg[0][1])
        assert out.device.type == DEV.split(":")[0]
        on_cpu = ranks(spec)[0].decompress(tuple(t.cpu() for t in agg), pg[0][1])
        torch.testing.assert_close(out.cpu(), on_cpu, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("spec", ["qsgd", "qsgd:levels=4,block=64", "terngrad"])
def test_stochastic_quantizers_on_cuda_keep_their_lattice(spec):
    cs = ranks(spec)
    g = [x.to(DEV) for x in grads()]
    outs, _ = in_process(cs, g, "w")
    assert outs[0].device.type == DEV.split(":")[0] and torch.equal(outs[0], outs[1])
    c = ranks(spec)[0]
    payload, ctx = c.compress(g[0], "w")
    own = c.decompress(payload, ctx).cpu().double()
    x = g[0].cpu().double().reshape(-1)
    own = own.reshape(-1)
    if spec.startswith("terngrad"):
        s = x.abs().max()
        assert set(torch.unique(torch.round(own / s)).tolist()) <= {-1.0, 0.0, 1.0}
        assert torch.all((own == 0) | (torch.sign(own) == torch.sign(x)))
    else:
        levels = c.levels
        norms = payload[1].cpu().double()
        per_value = norms.repeat_interleave(c.block)[:x.numel()]
        u = x.abs() * levels / per_value
        lvl = (own.abs() * levels / per_value).round()
        assert torch.all((lvl == torch.floor(u)) | (lvl == torch.ceil(u)))
    # unbiased: over the 201k values, the error is centred
    assert abs(float((own - x).mean())) < 5 * float((own - x).std()) / math.sqrt(x.numel())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_powersgd_cuda_close_to_cpu(dtype):
    gpu, cpu = ranks("powersgd:rank=4"), ranks("powersgd:rank=4")
    for step in range(3):                          # warm start and error feedback
        g = grads(step, dtype)
        og, _ = in_process(gpu, [x.to(DEV) for x in g], "w")
        oc, _ = in_process(cpu, g, "w")
        assert og[0].dtype == dtype and og[0].device.type == DEV.split(":")[0]
        assert torch.equal(og[0], og[1])
        err = (og[0].cpu().double() - oc[0].double()).norm() / oc[0].double().norm()
        assert err < (1e-4 if dtype == torch.float32 else 2e-2), (step, float(err))
