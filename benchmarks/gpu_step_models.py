"""The models and the DDP check of benchmarks/gpu_step.py.

The models, in plain torch: a GPT-2-small-shaped decoder (12 layers, 768 wide, 12 heads,
vocabulary 50257, context 1024, the output layer tied to the token embedding: 124M
parameters) and a ResNet-50-shaped conv net (bottleneck blocks 3-4-6-3, 224x224 images,
1000 classes: 25.6M parameters); ``tiny``: a few layers of small width, for a CPU smoke
test.  Inputs are random tokens / images
with random labels; the loss is cross entropy.

Imports torch (hvd_compress.ddp in the DDP check's workers); benchmarks/gpu_step.py loads
this file by path, as ``gpu_step_models``.
"""
import json

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.attn, self.proj = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ln2, self.fc, self.out = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2)
                   for t in self.attn(self.ln1(x)).split(C, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    """A GPT-2 decoder; the output layer shares the token embedding."""

    def __init__(self, layers=12, d=768, heads=12, vocab=50257, context=1024):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(context, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


class Bottleneck(nn.Module):
    def __init__(self, cin, width, stride):
        super().__init__()
        cout = 4 * width
        self.conv1, self.bn1 = nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3, self.bn3 = nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout)
        self.down = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else None)

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return F.relu(y + (x if self.down is None else self.down(x)))


class ResNet(nn.Module):
    """ResNet-50's shape: a 7x7 stem, bottleneck stages of ``blocks``, a linear head."""

    def __init__(self, blocks=(3, 4, 6, 3), width=64, classes=1000):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width),
                                  nn.ReLU(), nn.MaxPool2d(3, 2, 1))
        layers, cin = [], width
        for i, n in enumerate(blocks):
            for j in range(n):
                layers.append(Bottleneck(cin, width * 2 ** i, 2 if i and not j else 1))
                cin = 4 * width * 2 ** i
        self.layers, self.fc = nn.Sequential(*layers), nn.Linear(cin, classes)

    def forward(self, x):
        return self.fc(self.layers(self.stem(x)).mean((2, 3)))


def build(name, tiny, batch, seq, image, device):
    """(model, make_batch) with make_batch(gen) -> (inputs, labels) on ``device``."""
    if name == "gpt2":
        model = GPT(2, 64, 4, 512, 64) if tiny else GPT()
        seq, vocab = min(seq or (32 if tiny else 1024), model.wpe.num_embeddings), model.wte.num_embeddings
        batch = batch or (2 if tiny else 8)

        def make(gen):
            x = torch.randint(0, vocab, (batch, seq + 1), generator=gen).to(device)
            return x[:, :-1], x[:, 1:]
    elif name == "resnet50":
        model = ResNet((1, 1, 1, 1), 8, 10) if tiny else ResNet()
        image, batch = image or (32 if tiny else 224), batch or (4 if tiny else 64)
        classes = model.fc.out_features

        def make(gen):
            return (torch.randn(batch, 3, image, image, generator=gen).to(device),
                    torch.randint(0, classes, (batch,), generator=gen).to(device))
    else:
        raise SystemExit(f"unknown model {name!r}: gpt2 or resnet50")
    return model.to(device), make


def loss_of(model, x, y):
    out = model(x)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), y.reshape(-1))


# -- two processes through the DDP hook -------------------------------------------------

def _ddp_train(model_name, spec, device, steps, rank, cap_mb=None):
    """The tiny ``model_name`` from seed 0, ``steps`` SGD steps of this rank's batches
    through DDP and ``hvd_compress.ddp.register``; ``(parameters before, after, the
    hook's stats)``, flat.  ``cap_mb``: DDP's ``bucket_cap_mb`` (default: DDP's)."""
    from torch.nn.parallel import DistributedDataParallel

    import hvd_compress.ddp
    torch.manual_seed(0)
    model, make = build(model_name, True, None, None, None, device)
    before = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    ddp = DistributedDataParallel(model, device_ids=[0] if device.startswith("cuda") else None,
                                  **({} if cap_mb is None else {"bucket_cap_mb": cap_mb}))
    state = hvd_compress.ddp.register(ddp, compression=spec)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1 + rank)          # each rank its own batches
    for _ in range(steps):
        opt.zero_grad()
        loss_of(ddp, *make(gen)).backward()
        opt.step()
    return before, torch.cat([p.detach().reshape(-1) for p in model.parameters()]), state.stats


def _graphs_runs(model_name, spec, device, steps, rank, result):
    """The check with CUDA-graph replay (``HVD_COMPRESS_CUDA_GRAPHS``): for DDP's own
    buckets and for a bucket per tensor (each tensor alone: sent as a bucket of one
    where replayed), a run eagerly and one replayed from the same start; each replayed
    run must end on the eager run's parameters bit for bit, on both ranks, with
    compresses replayed (on CUDA)."""
    import os

    import torch.distributed as dist
    from hvd_compress.compressors import replay
    runs, ok = [], True
    for what, cap in (("DDP's buckets", None), ("a bucket per tensor", 1e-6)):
        ends = []
        for graphs in ("0", "1"):
            os.environ[replay.ENV_VAR] = graphs
            before = dict(replay.STATS)
            _, flat, _ = _ddp_train(model_name, spec, device, steps, rank, cap)
            ends.append((flat, {k: replay.STATS[k] - before[k] for k in before}))
        os.environ[replay.ENV_VAR] = "0"
        both = [torch.empty_like(ends[1][0]) for _ in range(2)]
        dist.all_gather(both, ends[1][0])
        run = {"buckets": what, "max_diff_replayed_vs_eager": float(
            (ends[0][0] - ends[1][0]).abs().max()), "max_param_diff_ranks": float(
            (both[0] - both[1]).abs().max()), "replay": ends[1][1]}
        ok &= run["max_diff_replayed_vs_eager"] == 0 and run["max_param_diff_ranks"] == 0 and (
            run["replay"]["replayed"] > 0 or not device.startswith("cuda"))
        runs.append(run)
    result.update(status="passed" if ok else "failed", runs=runs,
                  note=None if device.startswith("cuda") else "CPU tensors: never replayed")


def _ddp_worker(rank, port, model_name, spec, out, device, steps, graphs=False):
    import datetime
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=120))
    result = {"spec": spec, "model": f"{model_name} (tiny)", "device": device, "steps": steps}
    try:
        try:                        # what the hook needs of Gloo: sums and byte gathers
            dist.all_reduce(torch.ones(1, device=device))
            dist.all_gather([torch.zeros(4, dtype=torch.uint8, device=device) for _ in range(2)],
                            torch.ones(4, dtype=torch.uint8, device=device))
        except Exception as e:      # noqa: BLE001 - Gloo without such tensors: skipped
            result.update(status="skipped", reason=f"Gloo refuses {device} tensors: "
                                                   f"{type(e).__name__}: {e}")
            return
        if graphs:
            _graphs_runs(model_name, spec, device, steps, rank, result)
            return
        before, flat, stats = _ddp_train(model_name, spec, device, steps, rank)
        both = [torch.empty_like(flat) for _ in range(2)]
        dist.all_gather(both, flat)
        diff, moved = float((both[0] - both[1]).abs().max()), float((flat - before).abs().max())
        result.update(status="passed" if diff == 0 and moved > 0 else "failed",
                      max_param_diff=diff, max_param_change=moved, stats=stats.as_dict())
    finally:
        if rank == 0:
            with open(out, "w") as f:
                json.dump(result, f, indent=1, default=str)
        dist.barrier()
    # All is written: end without the interpreter's teardown, nor destroy_process_group,
    # where torch 2.13's Gloo aborts a rank now and then ("terminate called without an
    # active exception", SIGABRT: once in the replay check of a dry run, 2026-11-30),
    # which mp.spawn would report as this check failing; both ranks leave the barrier
    # together.
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from mnist_common import exit_skipping_teardown
    exit_skipping_teardown()


def ddp_check(model_name, spec, device, steps=3, graphs=False):
    """Two processes on ``device`` (both on CUDA device 0 for "cuda"), torch.distributed
    Gloo, the tiny ``model_name`` wrapped in DistributedDataParallel with
    ``hvd_compress.ddp.register(ddp, compression=spec)``, each rank training on its own
    batches for ``steps`` SGD steps: passed when both ranks end with equal parameters
    that moved.  ``graphs``: the replay check instead (:func:`_graphs_runs`).  Returns a
    dict: status passed / failed / skipped, and the reason."""
    import os
    import socket
    import tempfile

    import torch.distributed as dist
    import torch.multiprocessing as mp
    if not dist.is_available() or not dist.is_gloo_available():
        return {"status": "skipped", "reason": "torch.distributed without Gloo"}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "ddp.json")
        try:
            mp.spawn(_ddp_worker, args=(port, model_name, spec, out, device, steps, graphs),
                     nprocs=2)
        except Exception as e:  # noqa: BLE001 - reported in the results
            return {"status": "failed", "reason": f"{type(e).__name__}: {str(e)[-1500:]}"}
        with open(out) as f:
            return json.load(f)
