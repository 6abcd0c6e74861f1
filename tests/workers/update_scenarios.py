"""The compressed-update scenarios (``compressed_update=True``) that the Horovod worker
(compressed_update_worker.py, ``horovodrun``) and the DDP worker (ddp_update_worker.py,
``torchrun``) both run, each through its own glue: a ``Glue`` gives ``rank``,
``build(spec, saved=None, model=None) -> (model, optimizer, parts)`` and ``start(model,
opt)`` (what a user does before the first step: Horovod's broadcasts).  ``parts`` has
``compression``, ``stats`` and ``updates`` (the LocalUpdates).  Every scenario writes
into ``out`` under its name; tests/integration/test_compressed_update.py computes the
expected values from them.

Scenarios: ``trace`` (each step's start, this rank's update as a plain AdamW on its own
gradient makes it, parameters and residuals after, what torch's step hooks saw;
``trace_min_size``, ``trace_decay``:
with ``min_size=20``, ``ef_decay=0.5``), ``resume`` (a checkpoint after step
3, restored into fresh objects; the same residuals marked as gradients' refused), ``nan`` (rank 1's gradient NaN at step 3),
``closure_and_scaler`` (step(closure), the GradScaler recipe, NaN/Inf on rank 1),
``each_spec`` (five compressors), ``gpt2`` (a transformers model), ``malformed`` (rank
1's payload corrupted at step 2: every rank raises, its parameters and residuals are back
at the step's start, and the next step trains).
"""
import io

import numpy as np
import torch

from tiny_mlp import Net, batch, flat, tiny_gpt2

STEPS = 6
SPEC = "topk:density=0.3"
ADAMW = dict(lr=0.05, betas=(0.9, 0.99), weight_decay=0.1)
SPECS = ("laplace_topk:density=0.1", "dct:density=0.1", "twobit", "powersgd:rank=2",
         "auto:candidates=none|topk:density=0.1", "laplace_topk:density=0.1,min_size=20")


def residuals(parts):
    state = parts.compression.state_dict()["state"]
    keys = sorted(k for k in state if k.startswith("residual/"))
    return np.concatenate([state[k].double().numpy() for k in keys]) if keys else np.zeros(0)


def one_step(glue, model, opt, step, poison=False):
    x, y = batch(step, glue.rank)
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    if poison:
        loss = loss * float("nan")
    loss.backward()
    opt.step()
    return float(loss)


def trace(glue, out, spec=SPEC, key="trace"):
    """The reference's local optimizer is a plain AdamW on a copy of the model: set to
    each step's start and stepped on this rank's gradient, its state follows the wrapped
    optimizer's (the same gradients from the same parameters)."""
    model, opt, parts = glue.build(spec)
    ref = Net()
    ref_opt = torch.optim.AdamW(ref.parameters(), **ADAMW)
    hooks = []                           # torch's step hooks: once a step, after the exchange
    opt.register_step_pre_hook(lambda *args: hooks.append(("pre", None)))
    opt.register_step_post_hook(lambda *args: hooks.append(("post", flat(model.parameters()))))
    for step in range(1, STEPS + 1):
        start = flat(model.parameters())
        with torch.no_grad():
            for r, p in zip(ref.parameters(), model.parameters()):
                r.copy_(p)
        x, y = batch(step, glue.rank)
        ref_opt.zero_grad()
        torch.nn.functional.cross_entropy(ref(x), y).backward()
        ref_opt.step()
        out[f"{key}/{step}/start"] = start
        out[f"{key}/{step}/update"] = flat(ref.parameters()) - start
        one_step(glue, model, opt, step)
        out[f"{key}/{step}/grad"] = flat(p.grad for p in model.parameters())
        out[f"{key}/{step}/ref_grad"] = flat(p.grad for p in ref.parameters())
        out[f"{key}/{step}/param"] = flat(model.parameters())
        out[f"{key}/{step}/hooks"] = np.array([kind for kind, _ in hooks])
        out[f"{key}/{step}/hook_param"] = hooks[-1][1]
        hooks.clear()
        out[f"{key}/{step}/residual"] = residuals(parts)
        out[f"{key}/{step}/exp_avg"] = flat(opt.state[p]["exp_avg"] for p in model.parameters())
        out[f"{key}/{step}/ref_exp_avg"] = flat(ref_opt.state[p]["exp_avg"]
                                                for p in ref.parameters())
    out[f"{key}/sent"] = np.array(parts.stats.as_dict()["total_sent"])
    out[f"{key}/dense"] = np.array(parts.stats.as_dict()["total_dense"])


def trace_min_size(glue, out):
    """The trace with ``min_size=20``: the MLP's biases (16 and 3 values) go whole."""
    trace(glue, out, SPEC + ",min_size=20", "min_size")


def trace_decay(glue, out):
    """The trace with ``ef_decay=0.5``: half of what a rank does not send is kept."""
    trace(glue, out, SPEC + ",ef_decay=0.5", "decay")


def resume(glue, out):
    model, opt, parts = glue.build(SPEC)
    for step in range(1, 4):
        one_step(glue, model, opt, step)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                "compression": parts.compression.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    out["resume/residuals_of"] = np.array(saved["compression"]["residuals_of"])
    try:                                      # the same residuals, said to be gradients'
        glue.build(SPEC, saved=dict(saved, compression=dict(saved["compression"],
                                                             residuals_of="gradients")))
        out["resume/gradients_error"] = np.array("")
    except ValueError as e:
        out["resume/gradients_error"] = np.array(str(e))
    model, opt, parts = glue.build(SPEC, saved=saved)
    for step in range(4, STEPS + 1):
        one_step(glue, model, opt, step)
    out["resume/param"] = flat(model.parameters())
    out["resume/residual"] = residuals(parts)


def nan(glue, out):
    model, opt, parts = glue.build(SPEC)
    params = list(model.parameters())

    def state():
        return np.concatenate([flat(opt.state[p][k] for p in params)
                               for k in ("exp_avg", "exp_avg_sq")])

    for step in (1, 2):
        one_step(glue, model, opt, step)
    out["nan/state_before"] = state()
    out["nan/residual_before"] = residuals(parts)
    out["nan/start"] = flat(params)
    one_step(glue, model, opt, 3, poison=glue.rank == 1)
    out["nan/state_after"] = state()
    out["nan/residual_after"] = residuals(parts)
    out["nan/param"] = flat(params)
    out["nan/skipped"] = np.array(parts.updates.skipped)
    out["nan/step_count"] = np.array(float(opt.state[params[0]]["step"]))
    one_step(glue, model, opt, 4)
    out["nan/next_param"] = flat(params)


def closure_and_scaler(glue, out):
    """``step(closure)`` (the closure computes the gradients) trains as the plain loop
    does; a closure whose gradients are NaN on rank 1 skips rank 1's step only.  The
    GradScaler recipe (unscale_, step, update) with an overflow on rank 1 does not hang."""
    model, opt, parts = glue.build(SPEC)

    def closure_for(step, poison=False):
        def closure():
            x, y = batch(step, glue.rank)
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss = loss * float("nan") if poison else loss
            loss.backward()
            return loss
        return closure

    losses = [float(opt.step(closure_for(step))) for step in range(1, 4)]
    out["closure/param"] = flat(model.parameters())
    out["closure/loss"] = np.array(losses)
    opt.step(closure_for(4, poison=glue.rank == 1))
    out["closure/skipped"] = np.array(parts.updates.skipped)
    out["closure/poisoned_param"] = flat(model.parameters())
    model, opt, parts = glue.build(SPEC)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    for step in range(1, 4):
        x, y = batch(step, glue.rank)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        if step == 2 and glue.rank == 1:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        opt.step()
        scaler.update()
    out["scaler/param"] = flat(model.parameters())
    out["scaler/skipped"] = np.array(parts.updates.skipped)
    out["scaler/scale"] = np.array(float(scaler.get_scale()))


def each_spec(glue, out):
    for spec in SPECS:
        model, opt, _ = glue.build(spec)
        losses = [one_step(glue, model, opt, step) for step in range(1, 6)]
        out[f"spec/{spec}/param"] = flat(model.parameters())
        out[f"spec/{spec}/loss"] = np.array(losses)


def gpt2(glue, out):
    """A ``transformers`` GPT-2 with AdamW at 5%: the same batch each step, its loss must
    go down."""
    model, opt, parts = glue.build("laplace_topk:density=0.05", model=tiny_gpt2(),
                                   optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    glue.start(model, opt)
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(glue.rank))
    losses, sent = [], []
    for _ in range(8):
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(float(loss))
        sent.append(parts.stats.as_dict()["last_sent"])
    out["gpt2/param"] = flat(model.parameters())
    out["gpt2/loss"] = np.array(losses)
    out["gpt2/sent"] = np.array(sent)
    out["gpt2/dense"] = np.array(sum(p.numel() for p in model.parameters()) * 4)


def malformed(glue, out):
    model, opt, parts = glue.build(SPEC)
    one_step(glue, model, opt, 1)
    out["malformed/start"] = flat(model.parameters())
    out["malformed/residual_before"] = residuals(parts)
    c, kept = parts.compression, {}
    if glue.rank == 1:                        # indices past the tensors, as on the wire
        for name in ("compress", "compress_bucket"):
            kept[name] = getattr(c, name)

            def corrupted(*a, _inner=kept[name], **k):
                payload, ctx = _inner(*a, **k)
                p = tuple(payload)
                return p[:-1] + (p[-1] + 10 ** 6,), ctx
            setattr(c, name, corrupted)
    try:
        one_step(glue, model, opt, 2)
        out["malformed/error"] = np.array("")
    except ValueError as e:
        out["malformed/error"] = np.array(str(e))
    out["malformed/param"] = flat(model.parameters())
    out["malformed/residual_after"] = residuals(parts)
    for name in kept:
        delattr(c, name)                      # the class's own again
    out["malformed/next_loss"] = np.array(one_step(glue, model, opt, 3))
    out["malformed/next_param"] = flat(model.parameters())


ALL = (trace, trace_min_size, trace_decay, resume, nan, closure_and_scaler, each_spec, gpt2, malformed)
