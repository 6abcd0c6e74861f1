"""Runs under ``torchrun --nproc_per_node 2`` (Gloo, CPU): hvd_compress.ddp inside real
PyTorch DDP, scenarios named on the command line.  Each rank writes what it saw to
``$OUT_DIR/ddp_<scenario>_rank<r>.npz``; tests/integration/test_ddp.py computes the expected
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

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from cases import AUTO_CKPT_SPEC, AUTO_SPEC, AUTO_STEPS, BUCKET_SHAPES  # noqa: E402
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "examples"))
from mnist_common import exit_skipping_teardown  # noqa: E402

#: compressors run through DDP by the "aggregate" scenario (policies by name, below)
SPECS = ["none", "fp16", "bf16", "topk:density=0.05", "randomk:density=0.05,seed=4",
         "threshold:threshold=0.12", "laplace_topk:density=0.05,exact=1",
         "laplace_topk:density=0.05,exact=1,fused=1", "dgc:density=0.05",
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
AUTO_CAP_MB = 0.0005         # auto: three DDP buckets after the first step, one of four tensors
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


class AutoParams(torch.nn.Module):
    """BUCKET_SHAPES (as the horovodrun auto scenario): a loss whose gradients are given."""

    def __init__(self):
        super().__init__()
        for n, shape in BUCKET_SHAPES.items():
            self.register_parameter(n, torch.nn.Parameter(torch.zeros(shape)))

    def forward(self, grads):
        return sum((p * grads[n]).sum() for n, p in self.named_parameters())


def auto_grads(step):
    return {n: np.random.default_rng([dist.get_rank(), 51, step, i]).standard_normal(shape)
            .astype(np.float32) for i, (n, shape) in enumerate(BUCKET_SHAPES.items())}


def _auto_run(spec, steps, start=0, saved=None, group=None, save_at=None):
    """``steps`` steps of AutoParams in DDP (several buckets) with ``spec`` (or the
    Policy AUTO_POLICY with "policy") and op sum; ``saved``: a ``state.state_dict()`` to
    restore first; ``save_at``: a step before which ``state.state_dict()`` is kept in
    ``state.saved``.  Returns (p.grad per step, [(auto bucket key, candidate index,
    names)] per step as the hook sent them, the state)."""
    torch.manual_seed(0)
    model = AutoParams().to(DEVICE)
    ddp = DDP(model, bucket_cap_mb=AUTO_CAP_MB, process_group=group)
    comp = hvd_compress.Policy(AUTO_POLICY, default=AUTO_CKPT_SPEC) if spec == "policy" \
        else hvd_compress.from_spec(spec)
    state = hvd_compress.ddp.register(ddp, comp, op="sum")
    if saved is not None:
        state.load_state_dict(saved)
    sent, record = [], state.auto.record

    def recording(key, index, *times):       # what the hook used, bucket by bucket
        sent.append((key, index))
        return record(key, index, *times)
    state.auto.record = recording
    outs, used = [], []
    for step in range(start, start + steps):
        if step == save_at:
            state.saved = state.state_dict()
        del sent[:]
        ddp.zero_grad()
        ddp({n: torch.from_numpy(g).to(DEVICE) for n, g in auto_grads(step).items()}).backward()
        outs.append({n: host(p.grad) for n, p in model.named_parameters()})
        # per tensor: the candidate of the auto bucket that sent it (keys of this step)
        used.append([(k, i, list(state.auto_names[k])) for k, i in sent])
    return outs, used, state


def _save_auto_steps(out, prefix, outs, used, start=0):
    for step, (o, u) in enumerate(zip(outs, used), start):
        per_name = {n: i for _, i, names in u for n in names}       # -1: not auto's
        out[f"{prefix}choice|{step}"] = np.array([per_name.get(n, -1) for n in BUCKET_SHAPES],
                                                 np.int32)
        out[f"{prefix}sent|{step}"] = np.array([f"{k}={i}" for k, i, _ in u])
        for n, v in o.items():
            out[f"{prefix}out|{step}|{n}"] = v


#: auto (AUTO_CKPT_SPEC) by default, beside fixed compressors in one DDP bucket
AUTO_POLICY = {"w": "topk:density=0.1", "late": "fp16"}
AUTO_POLICY_STEPS = 5


def auto(out):
    """``auto`` (AUTO_SPEC: calibration, decision, check steps) for AUTO_STEPS steps; a
    checkpoint of AUTO_CKPT_SPEC (decide once) after 3 steps restored into a new process
    group, model and state; ranks restoring different states."""
    import json
    for step in range(AUTO_STEPS):
        for n, g in auto_grads(step).items():
            out[f"in|{step}|{n}"] = g
    outs, used, state = _auto_run(AUTO_SPEC, AUTO_STEPS)
    _save_auto_steps(out, "", outs, used)
    out["buckets"] = np.array(json.dumps([[n] for n in BUCKET_SHAPES]))   # per tensor
    for n in BUCKET_SHAPES:
        r = state.compression.residual(n)
        out[f"residual|{n}"] = np.zeros(0, np.float32) if r is None else host(r)
    out["decisions"] = np.array(len(state.compression.decisions))
    out["stats_choices"] = np.array(json.dumps(state.stats.as_dict().get("choices", {})))

    # the run saved before step 3 goes on; new objects restored from the checkpoint must
    # do the same (its decision came from its own timings)
    s_outs, s_used, first = _auto_run(AUTO_CKPT_SPEC, 6, save_at=3)
    _save_auto_steps(out, "ckpt|straight|", s_outs, s_used)
    path = os.path.join(os.environ["OUT_DIR"], f"ddp_auto_ckpt_rank{dist.get_rank()}.pt")
    torch.save(first.saved, path)
    group = dist.new_group(list(range(dist.get_world_size())))
    r_outs, r_used, _ = _auto_run(AUTO_CKPT_SPEC, 3, start=3, saved=torch.load(path),
                                  group=group)
    _save_auto_steps(out, "ckpt|resumed|", r_outs, r_used, start=3)

    # auto inside a Policy: a DDP bucket with auto's tensors, a topk one and an fp16 one
    p_outs, p_used, _ = _auto_run("policy", AUTO_POLICY_STEPS)
    _save_auto_steps(out, "policy|", p_outs, p_used)

    # one rank restores the checkpoint, the other starts afresh: ValueError on both
    try:
        _auto_run(AUTO_CKPT_SPEC, 1, saved=torch.load(path) if dist.get_rank() == 1 else None)
        print(f"NO_ERROR auto_restored rank {dist.get_rank()}", flush=True)
    except ValueError as e:
        print(f"CONFIG_ERROR auto_restored rank {dist.get_rank()}: {e}", flush=True)


def mismatch(out):
    """Ranks configured differently: every rank raises ValueError at the first step."""
    rank = dist.get_rank()
    variants = {"compressor": ("topk:density=0.05", "randomk:density=0.05", "average"),
                "op": ("topk:density=0.05", "topk:density=0.05", "sum"),
                "auto": ("auto:candidates=none|topk:density=0.1,verbose=0",
                         "auto:verbose=0", "average")}
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


#: compressors whose payload rank 1 corrupts in the "malformed" scenario
MALFORMED_SPECS = ["topk:density=0.05", "laplace_topk:density=0.05,fused=1",
                   "topk:density=0.05,values=rangefloat8"]


def malformed(out):
    """Rank 1's payloads hold indices past its tensors (corrupted after its compress, as
    on the wire): every rank raises ValueError at the step's end (the decompress checks,
    deferred to one read-back a step), none hangs; then a fresh model trains a step."""
    rank = dist.get_rank()
    for spec in MALFORMED_SPECS:
        torch.manual_seed(0)
        ddp = DDP(TinyNet().to(DEVICE), bucket_cap_mb=BUCKET_CAP_MB)
        state = hvd_compress.ddp.register(ddp, spec)
        if rank == 1:
            c = state.compression
            for name in ("compress", "compress_bucket"):
                def corrupted(*a, _inner=getattr(c, name), **k):
                    payload, ctx = _inner(*a, **k)
                    p = tuple(payload)
                    return p[:-1] + (p[-1] + 10 ** 6,), ctx
                setattr(c, name, corrupted)
        x, y = batch(0)
        try:
            F.cross_entropy(ddp(x), y).backward()
            said = f"NO_ERROR malformed {spec} rank {rank}"
        except ValueError as e:
            said = f"PAYLOAD_ERROR {spec} rank {rank}: {e}"
        except Exception as e:      # noqa: BLE001 - the test wants ValueError: say what it got
            said = f"OTHER_ERROR malformed {spec} rank {rank}: {type(e).__name__}: {e}"
        sys.stdout.write(said + "\n")  # one write: both ranks raise at once, into one pipe
        sys.stdout.flush()
    torch.manual_seed(0)
    ddp = DDP(TinyNet().to(DEVICE), bucket_cap_mb=BUCKET_CAP_MB)
    hvd_compress.ddp.register(ddp, MALFORMED_SPECS[0])
    x, y = batch(1)
    F.cross_entropy(ddp(x), y).backward()
    out["after"] = np.concatenate([host(p.grad).reshape(-1) for p in ddp.parameters()
                                   if p.grad is not None])


SCENARIOS = {"aggregate": aggregate, "bf16": bf16, "views": views, "skew": skew,
             "checkpoint": checkpoint, "mismatch": mismatch, "auto": auto,
             "malformed": malformed}


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
    exit_skipping_teardown()          # torch's Gloo may abort a rank at exit otherwise
