"""Compressed updates (``compressed_update=True``) through real ``horovodrun -np 2
--gloo`` (hvd_compress.torch.DistributedOptimizer).  One launch runs every scenario;
each rank saves ``update_rank<r>.npz`` in $OUT_DIR for
tests/integration/test_compressed_update.py, which computes the expected values itself.

Scenarios: ``trace`` (each step's start, this rank's update as a plain AdamW on its own
gradient makes it, parameters and residuals after), ``resume`` (a checkpoint after step
3, restored into fresh objects), ``nan`` (rank 1's gradient NaN at step 3), ``clip``
(synchronize, clip, skip_synchronize: the update still goes), ``spec/<compressor>``,
``gpt2`` (a transformers model), ``errors`` (what it cannot be combined with),
``closure`` and ``scaler`` (step(closure), the GradScaler recipe, NaN/Inf on rank 1),
``mismatch`` (one rank with compressed updates, one without).
"""
import io
import os
import sys

import numpy as np
import torch
import horovod.torch as hvd

import hvd_compress.torch as hc
from tiny_mlp import Net, batch, flat, tiny_gpt2

hvd.init()
RANK = hvd.rank()
torch.set_num_threads(1)
STEPS = 6
SPEC = "topk:density=0.3"
OUT = {}
ADAMW = dict(lr=0.05, betas=(0.9, 0.99), weight_decay=0.1)


def build(spec=SPEC, saved=None, **kwargs):
    model = Net()
    opt = hc.DistributedOptimizer(torch.optim.AdamW(model.parameters(), **ADAMW),
                                  model.named_parameters(), compression=spec,
                                  compressed_update=True, **kwargs)
    if saved is not None:
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        opt.compression.load_state_dict(saved["compression"])
    return model, opt


def residuals(opt):
    state = opt.compression.state_dict()["state"]
    keys = sorted(k for k in state if k.startswith("residual/"))
    return np.concatenate([state[k].double().numpy() for k in keys]) if keys else np.zeros(0)


def one_step(model, opt, step, poison=False):
    x, y = batch(step, RANK)
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    if poison:
        loss = loss * float("nan")
    loss.backward()
    opt.step()
    return float(loss)


def trace():
    """The reference's local optimizer is a plain AdamW on a copy of the model: set to
    each step's start and stepped on this rank's gradient, its state follows the wrapped
    optimizer's (the same gradients from the same parameters)."""
    model, opt = build()
    ref = Net()
    ref_opt = torch.optim.AdamW(ref.parameters(), **ADAMW)
    for step in range(1, STEPS + 1):
        start = flat(model.parameters())
        with torch.no_grad():
            for r, p in zip(ref.parameters(), model.parameters()):
                r.copy_(p)
        x, y = batch(step, RANK)
        ref_opt.zero_grad()
        torch.nn.functional.cross_entropy(ref(x), y).backward()
        ref_opt.step()
        OUT[f"trace/{step}/start"] = start
        OUT[f"trace/{step}/update"] = flat(ref.parameters()) - start
        one_step(model, opt, step)
        OUT[f"trace/{step}/grad"] = flat(p.grad for p in model.parameters())
        OUT[f"trace/{step}/ref_grad"] = flat(p.grad for p in ref.parameters())
        OUT[f"trace/{step}/param"] = flat(model.parameters())
        OUT[f"trace/{step}/residual"] = residuals(opt)
        OUT[f"trace/{step}/exp_avg"] = flat(opt.state[p]["exp_avg"] for p in model.parameters())
        OUT[f"trace/{step}/ref_exp_avg"] = flat(ref_opt.state[p]["exp_avg"]
                                                for p in ref.parameters())
    OUT["trace/sent"] = np.array(opt.stats.as_dict()["total_sent"])
    OUT["trace/dense"] = np.array(opt.stats.as_dict()["total_dense"])


def resume():
    model, opt = build()
    for step in range(1, 4):
        one_step(model, opt, step)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                "compression": opt.compression.state_dict()}, buf)
    buf.seek(0)
    model, opt = build(saved=torch.load(buf, weights_only=True))
    for step in range(4, STEPS + 1):
        one_step(model, opt, step)
    OUT["resume/param"] = flat(model.parameters())
    OUT["resume/residual"] = residuals(opt)


def nan():
    model, opt = build()
    for step in (1, 2):
        one_step(model, opt, step)
    state = [flat(opt.state[p][k] for p in model.parameters()) for k in ("exp_avg", "exp_avg_sq")]
    OUT["nan/state_before"] = np.concatenate(state)
    OUT["nan/residual_before"] = residuals(opt)
    OUT["nan/start"] = flat(model.parameters())
    one_step(model, opt, 3, poison=RANK == 1)
    state = [flat(opt.state[p][k] for p in model.parameters()) for k in ("exp_avg", "exp_avg_sq")]
    OUT["nan/state_after"] = np.concatenate(state)
    OUT["nan/residual_after"] = residuals(opt)
    OUT["nan/param"] = flat(model.parameters())
    OUT["nan/skipped"] = np.array(opt._update.skipped)
    OUT["nan/step_count"] = np.array(float(opt.state[model.fc1.weight]["step"]))
    one_step(model, opt, 4)
    OUT["nan/next_param"] = flat(model.parameters())


def clip():
    """Horovod's recipe for clipping: synchronize(), clip the (local) gradients,
    step() inside skip_synchronize(): the update is exchanged all the same."""
    model, opt = build()
    for step in range(1, 4):
        x, y = batch(step, RANK)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        with opt.skip_synchronize():
            opt.step()
    OUT["clip/param"] = flat(model.parameters())
    OUT["clip/sent"] = np.array(opt.stats.as_dict()["total_sent"])


def closure_and_scaler():
    """``step(closure)`` (the closure computes the gradients) trains as the plain loop
    does; a closure whose gradients are NaN on rank 1 skips rank 1's step only.  The
    GradScaler recipe (unscale_, step, update) with an overflow on rank 1 does not hang."""
    model, opt = build()

    def closure_for(step, poison=False):
        def closure():
            x, y = batch(step, RANK)
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss = loss * float("nan") if poison else loss
            loss.backward()
            return loss
        return closure

    losses = [float(opt.step(closure_for(step))) for step in range(1, 4)]
    OUT["closure/param"] = flat(model.parameters())
    OUT["closure/loss"] = np.array(losses)
    opt.step(closure_for(4, poison=RANK == 1))
    OUT["closure/skipped"] = np.array(opt._update.skipped)
    OUT["closure/poisoned_param"] = flat(model.parameters())
    model, opt = build()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    for step in range(1, 4):
        x, y = batch(step, RANK)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        if step == 2 and RANK == 1:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        opt.step()
        scaler.update()
    OUT["scaler/param"] = flat(model.parameters())
    OUT["scaler/skipped"] = np.array(opt._update.skipped)
    OUT["scaler/scale"] = np.array(float(scaler.get_scale()))


def each_spec():
    for spec in ("laplace_topk:density=0.1", "dct:density=0.1", "twobit",
                 "powersgd:rank=2", "auto:candidates=none|topk:density=0.1"):
        model, opt = build(spec=spec)
        losses = [one_step(model, opt, step) for step in range(1, 6)]
        OUT[f"spec/{spec}/param"] = flat(model.parameters())
        OUT[f"spec/{spec}/loss"] = np.array(losses)


def gpt2():
    model = tiny_gpt2()
    opt = hc.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2),
                                  model.named_parameters(),
                                  compression="laplace_topk:density=0.05",
                                  compressed_update=True)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(RANK))
    losses, sent = [], []
    for _ in range(8):          # the same batch each step: its loss must go down
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(float(loss))
        sent.append(opt.stats.as_dict()["last_sent"])
    OUT["gpt2/param"] = flat(model.parameters())
    OUT["gpt2/loss"] = np.array(losses)
    OUT["gpt2/sent"] = np.array(sent)
    OUT["gpt2/dense"] = np.array(sum(p.numel() for p in model.parameters()) * 4)


def errors():
    cases = {"momentum": dict(compressed_momentum=3),
             "scaler": dict(grad_scaler=torch.amp.GradScaler("cpu")),
             "dgc": dict(compression="topk:density=0.1,momentum=0.9"),
             "value": dict(compressed_update="yes"), "sum": dict(op=hvd.Sum),
             "lbfgs": dict(optimizer=torch.optim.LBFGS), "loss_scale": dict(loss_scale=8.0),
             "environment": dict(environment="3")}
    for name, kwargs in cases.items():
        model = Net()
        kwargs = dict(dict(compression=SPEC, compressed_update=True), **kwargs)
        make = kwargs.pop("optimizer", torch.optim.AdamW)
        scale = kwargs.pop("loss_scale", None)
        os.environ["HVD_COMPRESS_MOMENTUM"] = kwargs.pop("environment", "")
        try:
            opt = hc.DistributedOptimizer(make(model.parameters()), model.named_parameters(),
                                          **kwargs)
            if scale is not None:
                opt.set_loss_scale(scale)
            OUT[f"errors/{name}"] = np.array("")
        except ValueError as e:
            OUT[f"errors/{name}"] = np.array(str(e))
    del os.environ["HVD_COMPRESS_MOMENTUM"]


def mismatch():
    model = Net()
    opt = hc.DistributedOptimizer(torch.optim.AdamW(model.parameters()),
                                  model.named_parameters(), compression=SPEC,
                                  compressed_update=RANK == 0)
    try:
        one_step(model, opt, 1)
        OUT["mismatch/error"] = np.array("")
    except ValueError as e:
        OUT["mismatch/error"] = np.array(str(e))


if __name__ == "__main__":
    trace()
    resume()
    nan()
    clip()
    closure_and_scaler()
    each_spec()
    gpt2()
    errors()
    mismatch()                         # last: a failed configuration check ends the job
    np.savez(os.path.join(os.environ["OUT_DIR"], f"update_rank{RANK}.npz"), **OUT)
    print(f"rank {RANK} done", flush=True)
    sys.exit(0)
