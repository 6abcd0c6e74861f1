"""Coded SGD's arithmetic on CUDA (no Horovod on the GPU machine: n workers simulated in
one process by ``hvd_compress.coded.exchange.in_process``): the fixed-point encoding, the
wrap-around and every coded exchange give the same bits on the GPU as on the CPU."""
from math import comb

import numpy as np
import pytest
import torch

from gpu_helpers import DEV, GPU
from hvd_compress.coded.exchange import in_process
from hvd_compress.ops import torch_ops as o

pytestmark = GPU


def test_fixed_point_encoding_matches_the_cpu():
    g = torch.randn(1_000_003, generator=torch.Generator().manual_seed(0)) * 4
    g[:4] = torch.tensor([10.0, -10.0, 11.0, float("nan")])
    q_cpu, c_cpu = o.fixed_encode(g, 10.0)
    q_dev, c_dev = o.fixed_encode(g.to(DEV), 10.0)
    assert torch.equal(q_dev.cpu(), q_cpu) and torch.equal(c_dev.cpu(), c_cpu)
    assert torch.equal(o.fixed_decode(q_dev.long(), 10.0).cpu(), o.fixed_decode(q_cpu.long(), 10.0))
    x = (q_cpu.long() * 3)[:1000]
    assert torch.equal(o.wrap_int32(x.to(DEV)).cpu(), o.wrap_int32(x))


@pytest.mark.parametrize("exchange", ["multicast", "multicast_alltoall", "reduce_scatter"])
@pytest.mark.parametrize("n,r", [(3, 2), (4, 2), (4, 3), (5, 2)])
def test_coded_exchange_matches_the_cpu(n, r, exchange):
    rng = np.random.default_rng([n, r])
    grads = [torch.from_numpy(rng.standard_normal(100_003).astype(np.float32) / comb(n, r))
             for _ in range(comb(n, r))]
    cpu = in_process(n, r, grads, exchange)
    dev = in_process(n, r, [g.to(DEV) for g in grads], exchange)
    for (tc, fc), (td, fd) in zip(cpu, dev):
        assert td.device.type == DEV
        assert torch.equal(td.cpu(), tc) and fc == fd
