"""The PyTorch glue with CUDA-graph replay (``HVD_COMPRESS_CUDA_GRAPHS=1``,
``hvd_compress/compressors/replay.py``): real DDP in a Gloo group of one process,
``hvd_compress.ddp.register``, the replay logic through tests/replay_standin.py's
stand-in for ``torch.cuda.graph`` on CPU tensors (no GPU here; the GPU check is
``benchmarks/gpu_step.py --ddp-check``'s replay check).  Replayed training ends on the
eager run's parameters bit for bit, with DDP's buckets and with a bucket per tensor,
whose tensors, each alone, the hook sends as buckets of one (``sends_alone``)."""
import pytest
import torch
import torch.distributed as dist

import hvd_compress.ddp
from hvd_compress.compressors import replay

from replay_standin import StandIn  # tests/replay_standin.py

STEPS = 5


@pytest.fixture
def group(tmp_path, monkeypatch):
    """A Gloo group of one; replay taken for CPU tensors, through the stand-in; the CUDA
    code path (kernels in Triton's interpreter), the one a GPU captures."""
    monkeypatch.setenv("HVD_COMPRESS_BACKEND", "triton")
    monkeypatch.setattr(replay, "wanted", lambda c, t: c.replayable and replay.enabled())
    monkeypatch.setattr(replay, "cuda_capture", StandIn())
    monkeypatch.setattr(replay, "_on_device", lambda capture, device: capture)
    monkeypatch.setattr(replay, "STATS", dict.fromkeys(replay.STATS, 0))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


def train(spec, graphs, cap_mb, monkeypatch):
    """Parameters after STEPS SGD steps through DDP and the hook, and replay's counts."""
    monkeypatch.setenv(replay.ENV_VAR, graphs)
    before = dict(replay.STATS)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.Tanh(), torch.nn.Linear(30, 7))
    ddp = torch.nn.parallel.DistributedDataParallel(
        model, **({} if cap_mb is None else {"bucket_cap_mb": cap_mb}))
    hvd_compress.ddp.register(ddp, compression=spec)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    counts = []
    for _ in range(STEPS):
        opt.zero_grad()
        ddp(torch.randn(16, 40, generator=gen)).square().mean().backward()
        opt.step()
        counts.append({k: replay.STATS[k] - before[k] for k in before})
        before = dict(replay.STATS)
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), counts


@pytest.mark.parametrize("cap_mb", [None, 1e-6], ids=["ddp_buckets", "a_bucket_per_tensor"])
@pytest.mark.parametrize("spec", ["twobit", "laplace_topk:density=0.1,padded=1",
                                  "dct:density=0.1,padded=1,block=32"])
def test_replayed_training_through_the_ddp_hook_ends_on_the_eager_parameters(
        spec, cap_mb, group, monkeypatch):
    eager, none = train(spec, "0", cap_mb, monkeypatch)
    replayed, counts = train(spec, "1", cap_mb, monkeypatch)
    assert all(c == dict.fromkeys(c, 0) for c in none)
    assert torch.equal(eager.view(torch.int32), replayed.view(torch.int32))
    buckets = 1 if cap_mb is None else 4
    # (DDP rebuilds its buckets after the first step: new layouts, eager once more;
    # then two captures for the compress, one for the decompress)
    assert sum(c["off"] for c in counts) == 0
    assert counts[-1] == {"eager": 0, "captured": 0, "replayed": 2 * buckets, "off": 0}
