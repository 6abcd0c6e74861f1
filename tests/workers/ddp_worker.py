"""Runs under ``torchrun --nproc_per_node 2`` (Gloo, CPU): hvd_compress.ddp inside real
PyTorch DDP, scenarios named on the command line.  Each rank writes what it saw to
``$OUT_DIR/ddp_<scenario>_rank<r>.npz``; tests/test_ddp.py computes the expected
aggregates from both ranks' files.  No Horovod.

``DDP_WORKER_DEVICE=cuda`` (default cpu) and ``DDP_WORKER_BACKEND=nccl`` (default gloo)
run the same on a GPU (two ranks may share one GPU with Gloo; NCCL needs one per rank).
"""
import copy
import faulthandler
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import hvd_compress
import hvd_compress.ddp

#: compressors run through DDP by the "aggregate" scenario (policies by name, below)
SPECS = ["none", "fp16", "bf16", "topk:density=0.05", "randomk:density=0.05,seed=4",
         "threshold:threshold=0.12", "laplace_topk:density=0.05,exact=1", "dgc:density=0.05",
         "gaussian_k:density=0.05", "sidco_exp:density=0.05", "rangefloat:bits=8", "twobit",
         "dct:density=0.05,block=32", "topk:density=0.05,values=rangefloat8",
         "qsgd", "terngrad", "signsgd", "onebit",
         "policy:hylo", "policy:mixed",
         "topk:density=0.05,agg=union", "topk:density=0.05,agg=leader", "powersgd:rank=2"]
#: the same on a bfloat16 model (DDP's buckets are bfloat16)
BF16_SPECS = ["none", "topk:density=0.05", "bf16"]
#: with DDP's gradient_as_bucket_view=True (p.grad are views of the buckets)
VIEW_SPECS = ["topk:density=0.05", "topk:density=0.05,agg=union", "policy:mixed"]
#: with rank 1's backward slower (collectives must still pair up in the same order)
SKEW_SPECS = ["topk:density=0.05,agg=union", "threshold:threshold=0.05", "powersgd:rank=2"]
#: error feedback state restored from a checkpoint: residuals, random-k counters, hint, Q
CKPT_SPECS = ["topk:density=0.05", "randomk:density=0.1,seed=4", "topk:density=0.05,agg=hint",
              "powersgd:rank=2", "policy:mixed"]
STEPS = 3
BUCKET_CAP_MB = 0.001        # several DDP buckets, some of several tensors
DEVICE = torch.device(os.environ.get("DDP_WORKER_DEVICE", "cpu"))
BACKEND = os.environ.get("DDP_WORKER_BACKEND", "gloo")


def build(spec):
    """A compressor, or one of two policies: Hylo's mix (kernel_select, twobit, none, each
    in buckets of its own kind) and topk beside none (a DDP bucket mixing them)."""
    if spec == "policy:hylo":
        return hvd_compress.Policy({"conv.weight": "kernel_select:fraction=0.25",
                                    "fc.weight": "twobit"}, default="none")
    if spec == "policy:mixed":
        return hvd_compress.Policy({"fc.weight": "topk:density=0.05",
                                    "conv.weight": "topk:density=0.05"}, default="none")
    return hvd_compress.from_spec(spec)


class TinyNet(torch.nn.Module):
    """A convolution, a linear layer, a 0-d parameter and an empty one."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(2, 4, 3)            # weight (4, 2, 3, 3)
        self.fc = torch.nn.Linear(4 * 6 * 6, 10)
        self.scale = torch.nn.Parameter(torch.tensor(1.0))
        self.empty = torch.nn.Parameter(torch.zeros(0, 3))

    def forward(self, x):
        h = F.relu(self.conv(x)) * self.scale + self.empty.sum()
        return self.fc(h.flatten(1))


def batch(step, dtype=torch.float32):
    r = np.random.default_rng([dist.get_rank(), step])
    x = torch.from_numpy(r.standard_normal((8, 2, 8, 8)).astype(np.float32)).to(DEVICE, dtype)
    return x, torch.from_numpy(r.integers(0, 10, 8)).to(DEVICE)


def host(t):
    """A copy on the host (p.grad may be a view of a DDP bucket that the next step reuses)."""
    return t.detach().float().cpu().numpy().copy()


def recording(hook, log):
    """``hook``, with the parameter names of every bucket it is called with logged."""
    def wrapped(state, bucket):
        log.append([state.names[id(p)] for p in bucket.parameters()])
        return hook(state, bucket)
    return wrapped


def own_contribution(spec, state, plain):
    """This rank's part of the sum, computed apart from DDP: a copy of the compressor
    (its error-feedback state and counters loaded from ``state``) compresses this rank's
    local gradients tensor by tensor and decompresses its own payload alone."""
    shadow = build(spec)
    shadow.load_state_dict(state.state_dict())
    out = {}
    for n, p in plain.named_parameters():
        if p.grad.numel():
            c = shadow.for_tensor(n, p)
            payload, ctx = c.compress(p.grad.detach().clone(), n)
            out[n] = c.decompress(payload, ctx)
    return out


def aggregate(out, specs=SPECS, dtype=torch.float32, prefix="", **ddp_kwargs):
    """STEPS steps per compressor (lr 0): the local gradient of a plain copy of the model,
    this rank's own contribution, and what DDP wrote into p.grad."""
    for spec in specs:
        key = prefix + spec
        torch.manual_seed(0)
        model = TinyNet().to(DEVICE, dtype)
        plain = copy.deepcopy(model)
        ddp = DDP(model, bucket_cap_mb=BUCKET_CAP_MB, **ddp_kwargs)
        state = hvd_compress.ddp.CompressionState(ddp, build(spec))
        log = []
        ddp.register_comm_hook(state, recording(hvd_compress.ddp.compression_hook, log))
        two_round = any(state.compression.for_tensor(n, p).collective == "two_round"
                        for n, p in model.named_parameters())
        for step in range(STEPS):
            x, y = batch(step, dtype)
            plain.zero_grad()
            F.cross_entropy(plain(x).float(), y).backward()
            if not two_round:
                for n, c in own_contribution(spec, state, plain).items():
                    out[f"{key}|{step}|{n}|contrib"] = host(c)
            del log[:]
            ddp.zero_grad()
            F.cross_entropy(ddp(x).float(), y).backward()
            for (n, p), (_, q) in zip(model.named_parameters(), plain.named_parameters()):
                out[f"{key}|{step}|{n}|in"] = host(q.grad)
                out[f"{key}|{step}|{n}|out"] = host(p.grad)
                out[f"{key}|{step}|{n}|dtype"] = np.array(str(p.grad.dtype))
            out[f"{key}|{step}|buckets"] = np.array(["+".join(b) for b in log])
            out[f"{key}|{step}|stats"] = np.array([state.stats.last_sent, state.stats.last_dense,
                                                   state.stats.steps])
        for n, _ in model.named_parameters():
            r = state.compression.residual(n)
            if r is not None:
                out[f"{key}|residual|{n}"] = host(r)


def bf16(out):
    aggregate(out, BF16_SPECS, torch.bfloat16, "bf16model|")


def views(out):
    aggregate(out, VIEW_SPECS, prefix="views|", gradient_as_bucket_view=True)


class Slow(torch.autograd.Function):
    """Identity; in backward, rank 1 sleeps (when ``on``) before passing the gradient on."""

    @staticmethod
    def forward(ctx, x, on):
        ctx.on = on
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        if ctx.on and dist.get_rank() == 1:
            time.sleep(0.03)
        return g, None


class DeepNet(torch.nn.Module):
    """Four linear layers, one DDP bucket each, rank 1 slower between them if ``slow``."""

    def __init__(self, slow):
        super().__init__()
        self.slow = slow
        self.layers = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(4))

    def forward(self, x):
        for layer in self.layers:
            x = Slow.apply(torch.tanh(layer(x)), self.slow)
        return x


def skew(out):
    """Rank 1's backward 30 ms slower per layer, so each rank's earlier collectives finish
    at another point of its backward: the same bits as without the delay, on both ranks
    (a collective started from a Future callback would pair with another one here)."""
    for spec in SKEW_SPECS:
        for slow in (False, True):
            torch.manual_seed(0)
            model = DeepNet(slow).to(DEVICE)
            ddp = DDP(model, bucket_cap_mb=0.004)
            log = []
            state = hvd_compress.ddp.CompressionState(ddp, build(spec))
            ddp.register_comm_hook(state, recording(hvd_compress.ddp.compression_hook, log))
            for step in range(STEPS):
                x, _ = batch(200 + step)
                del log[:]
                ddp.zero_grad()
                ddp(x.reshape(-1, 32)).pow(2).mean().backward()
                for n, p in model.named_parameters():
                    out[f"{spec}|{slow}|{step}|{n}"] = host(p.grad)
            out[f"{spec}|{slow}|buckets"] = np.array(len(log))


def _train(ddp, opt, start, steps):
    for step in range(start, start + steps):
        x, y = batch(100 + step)
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()


def _build_for_training(spec, saved=None, group=None):
    torch.manual_seed(0)
    model = TinyNet().to(DEVICE)
    if saved is not None:
        model.load_state_dict(saved["model"])
    ddp = DDP(model, bucket_cap_mb=BUCKET_CAP_MB, process_group=group)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    state = hvd_compress.ddp.register(ddp, build(spec))
    if saved is not None:
        opt.load_state_dict(saved["opt"])
        state.load_state_dict(saved["compression"])
    return model, ddp, opt, state


def checkpoint(out):
    """3 steps, save, 2 more; then a new process group (new Gloo connections) and a new
    model restore the checkpoint and take the same 2 steps (DDP's buckets differ then:
    its first step has one bucket)."""
    paths = {}
    for i, spec in enumerate(CKPT_SPECS):
        model, ddp, opt, state = _build_for_training(spec)
        _train(ddp, opt, 0, 3)
        paths[spec] = os.path.join(os.environ["OUT_DIR"], f"ddp_ckpt{i}_rank{dist.get_rank()}.pt")
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                    "compression": state.state_dict()}, paths[spec])
        _train(ddp, opt, 3, 2)
        for n, p in model.named_parameters():
            out[f"{spec}|straight|{n}"] = host(p)
        out[f"{spec}|steps"] = np.array(state.stats.steps)
    group = dist.new_group(list(range(dist.get_world_size())))
    for spec in CKPT_SPECS:
        model, ddp, opt, state = _build_for_training(spec, torch.load(paths[spec]), group)
        assert state.process_group is group
        _train(ddp, opt, 3, 2)
        for n, p in model.named_parameters():
            out[f"{spec}|resumed|{n}"] = host(p)


def mismatch(out):
    """Ranks configured differently: every rank raises ValueError at the first step."""
    rank = dist.get_rank()
    variants = {"compressor": ("topk:density=0.05", "randomk:density=0.05", "average"),
                "op": ("topk:density=0.05", "topk:density=0.05", "sum")}
    for what, (spec0, spec1, op1) in variants.items():
        torch.manual_seed(0)
        ddp = DDP(TinyNet().to(DEVICE), bucket_cap_mb=BUCKET_CAP_MB)
        hvd_compress.ddp.register(ddp, spec0 if rank == 0 else spec1,
                                  op="average" if rank == 0 else op1)
        x, y = batch(0)
        try:
            F.cross_entropy(ddp(x), y).backward()
            print(f"NO_ERROR {what} rank {rank}", flush=True)
        except ValueError as e:
            print(f"CONFIG_ERROR {what} rank {rank}: {e}", flush=True)
        except Exception as e:      # noqa: BLE001 - the test wants ValueError: say what it got
            print(f"OTHER_ERROR {what} rank {rank}: {type(e).__name__}: {e}", flush=True)


SCENARIOS = {"aggregate": aggregate, "bf16": bf16, "views": views, "skew": skew,
             "checkpoint": checkpoint, "mismatch": mismatch}


def main():
    if os.environ.get("DDP_WORKER_TIMEOUT"):     # a hang prints every thread's stack, then exits
        faulthandler.dump_traceback_later(float(os.environ["DDP_WORKER_TIMEOUT"]), exit=True)
    if DEVICE.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    dist.init_process_group(BACKEND)
    torch.set_num_threads(1)
    for name in sys.argv[1:]:
        out = {}
        SCENARIOS[name](out)
        np.savez(os.path.join(os.environ["OUT_DIR"], f"ddp_{name}_rank{dist.get_rank()}.npz"),
                 **out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
