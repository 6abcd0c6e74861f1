"""Compressed-momentum Adam through real collectives: under ``horovodrun -np 2 --gloo``
(hvd_compress.torch.DistributedOptimizer) or ``torchrun --nproc_per_node 2`` (the DDP
hook), chosen by the launcher's environment.  One launch runs every scenario; each rank
saves ``momentum_<mode>_rank<r>.npz`` in $OUT_DIR for tests/integration/test_momentum.py,
which computes the expected values itself.

Scenarios: ``trace`` (every step's local gradient, parameters and Adam state, what
torch's step hooks saw, and a plain AdamW stepped on the dense average for the warm-up), ``resume<k>`` (a checkpoint
after step k, restored into fresh objects), ``nan`` (one rank's NaN at a compressed
step), ``spec/<compressor>`` (each compressor, ranks agree), ``gpt2`` (a transformers
model), ``mismatch`` (ranks with different warm-ups).
"""
import io
import os
import sys

import numpy as np
import torch

from tiny_mlp import Net, batch, flat, tiny_gpt2

HOROVOD = "HOROVOD_RANK" in os.environ
if HOROVOD:
    import horovod.torch as hvd
    import hvd_compress.torch as hc
    hvd.init()
    RANK, SIZE = hvd.rank(), hvd.size()
else:
    import torch.distributed as dist
    import hvd_compress.ddp as hddp
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                    "examples"))
    from mnist_common import exit_skipping_teardown
    dist.init_process_group("gloo")
    RANK, SIZE = dist.get_rank(), dist.get_world_size()

torch.set_num_threads(1)
STEPS, WARMUP = 7, 3
SPEC = "topk:density=0.3"
OUT = {}


def build(spec=SPEC, warmup=WARMUP, saved=None, model=None):
    """(model, optimizer, compression owner) with every hvd_compress object fresh."""
    model = model or Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, betas=(0.9, 0.99), weight_decay=0.1)
    if HOROVOD:
        opt = hc.DistributedOptimizer(opt, model.named_parameters(), compression=spec,
                                      compressed_momentum=warmup)
        owner, ddp = opt, model
    else:
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        owner = hddp.register(ddp, compression=spec, optimizer=opt, compressed_momentum=warmup)
    if saved is not None:
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        (owner.compression if HOROVOD else owner).load_state_dict(saved["compression"])
    return model, ddp, opt, owner


def compression_state(owner):
    return (owner.compression if HOROVOD else owner).state_dict()


def residuals(owner):
    state = owner.compression.state_dict()["state"]
    keys = sorted(k for k in state if k.startswith("residual/"))
    return np.concatenate([state[k].double().numpy() for k in keys]) if keys else np.zeros(0)


def one_step(model, ddp, opt, step, poison=False):
    x, y = batch(step, RANK)
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(ddp(x), y)
    if poison:
        loss = loss * float("nan")
    loss.backward()
    opt.step()
    return float(loss)


def local_grad(model, step):
    x, y = batch(step, RANK)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    return torch.autograd.grad(loss, list(model.parameters()))


def dense_average(grads):
    if HOROVOD:
        return [hvd.allreduce(g, name=f"ref.{i}") for i, g in enumerate(grads)]
    out = []
    for g in grads:
        g = g.clone()
        dist.all_reduce(g)
        out.append(g / SIZE)
    return out


def adam_state(opt, model, key):
    return flat([opt.state[p][key] for p in model.parameters()])


def trace():
    model, ddp, opt, owner = build()
    ref = Net()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05, betas=(0.9, 0.99), weight_decay=0.1)
    OUT["trace/init"] = flat(model.parameters())
    hooks = []                      # torch's step hooks: once a step, after the whole step
    opt.register_step_pre_hook(lambda *args: hooks.append(("pre", None)))
    opt.register_step_post_hook(lambda *args: hooks.append(("post", flat(model.parameters()))))
    for step in range(1, STEPS + 1):
        g = local_grad(model, step)
        OUT[f"trace/{step}/grad"] = flat(g)
        if step <= WARMUP:             # plain AdamW on the dense average
            for p, a in zip(ref.parameters(), dense_average(g)):
                p.grad = a
            ref_opt.step()
            OUT[f"trace/{step}/dense_ref"] = flat(ref.parameters())
        one_step(model, ddp, opt, step)
        OUT[f"trace/{step}/param"] = flat(model.parameters())
        OUT[f"trace/{step}/hooks"] = np.array([kind for kind, _ in hooks])
        OUT[f"trace/{step}/hook_param"] = hooks[-1][1]
        hooks.clear()
        OUT[f"trace/{step}/m"] = adam_state(opt, model, "exp_avg")
        OUT[f"trace/{step}/v"] = adam_state(opt, model, "exp_avg_sq")
        OUT[f"trace/{step}/residual"] = residuals(owner)


def resume(k):
    model, ddp, opt, owner = build()
    for step in range(1, k + 1):
        one_step(model, ddp, opt, step)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                "compression": compression_state(owner)}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    model, ddp, opt, owner = build(saved=saved)
    for step in range(k + 1, STEPS + 1):
        one_step(model, ddp, opt, step)
    OUT[f"resume{k}/param"] = flat(model.parameters())
    OUT[f"resume{k}/residual"] = residuals(owner)


def nan():
    model, ddp, opt, owner = build(warmup=2)
    for step in (1, 2, 3):
        one_step(model, ddp, opt, step)
    before = [flat(model.parameters()), adam_state(opt, model, "exp_avg"),
              adam_state(opt, model, "exp_avg_sq"), residuals(owner)]
    one_step(model, ddp, opt, 4, poison=RANK == 1)
    after = [flat(model.parameters()), adam_state(opt, model, "exp_avg"),
             adam_state(opt, model, "exp_avg_sq"), residuals(owner)]
    for name, b, a in zip(("param", "m", "v", "residual"), before, after):
        OUT[f"nan/{name}/before"], OUT[f"nan/{name}/after"] = b, a
    one_step(model, ddp, opt, 5)
    OUT["nan/next_param"] = flat(model.parameters())
    momentum = opt._momentum if HOROVOD else owner.momentum
    OUT["nan/skipped"] = np.array(momentum.skipped)


def each_spec():
    for spec in ("laplace_topk:density=0.1", "topk:density=0.1", "onebit", "twobit",
                 "rangefloat:bits=8", "dct:density=0.1", "powersgd:rank=2",
                 "auto:candidates=none|topk:density=0.1"):
        model, ddp, opt, owner = build(spec=spec, warmup=2)
        losses = [one_step(model, ddp, opt, step) for step in range(1, 7)]
        OUT[f"spec/{spec}/param"] = flat(model.parameters())
        OUT[f"spec/{spec}/loss"] = np.array(losses)


def gpt2():
    model = tiny_gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if HOROVOD:
        opt = hc.DistributedOptimizer(opt, model.named_parameters(),
                                      compression="laplace_topk:density=0.05",
                                      compressed_momentum=2)
        ddp, stats = model, opt.stats
    else:
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        stats = hddp.register(ddp, compression="laplace_topk:density=0.05", optimizer=opt,
                              compressed_momentum=2).stats
    sent = []
    for step in range(1, 7):
        g = torch.Generator().manual_seed(step * 10 + RANK)
        ids = torch.randint(0, 64, (4, 16), generator=g)
        opt.zero_grad()
        loss = ddp(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        sent.append(stats.as_dict()["last_sent"])
    OUT["gpt2/param"] = flat(model.parameters())
    OUT["gpt2/sent"] = np.array(sent)
    OUT["gpt2/dense"] = np.array(sum(p.numel() for p in model.parameters()) * 4)


def dgc():
    """SGD without momentum + a sparsifier with DGC's recipe; and the refusal of SGD
    with a momentum of its own."""
    spec = "topk:density=0.1,momentum=0.9,clip=5.0,warmup_steps=3"
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if HOROVOD:
        opt = hc.DistributedOptimizer(opt, model.named_parameters(), compression=spec)
        ddp, owner = model, opt
    else:
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        owner = hddp.register(ddp, compression=spec, optimizer=opt)
    losses = [one_step(model, ddp, opt, step) for step in range(1, 7)]
    OUT["dgc/param"] = flat(model.parameters())
    OUT["dgc/loss"] = np.array(losses)
    state = owner.compression.state_dict()["state"]
    OUT["dgc/velocity_keys"] = np.array(sorted(k for k in state if k.startswith("velocity/")))
    try:
        bad = torch.optim.SGD(Net().parameters(), lr=0.1, momentum=0.9)
        if HOROVOD:
            hc.DistributedOptimizer(bad, Net().named_parameters(), compression=spec)
        else:
            hddp.register(torch.nn.parallel.DistributedDataParallel(Net()), compression=spec,
                          optimizer=bad)
        OUT["dgc/error"] = np.array("")
    except ValueError as e:
        OUT["dgc/error"] = np.array(str(e))


def warmup_exchange():
    """warmup_compression: the dense steps send PowerSGD's low-rank gradients; a
    checkpoint inside the warm-up (PowerSGD's residuals and warm start) resumes bit for
    bit; the compressed steps after it are unchanged."""
    schedule = {"warmup": 3, "warmup_compression": "powersgd:rank=2"}

    def run(saved=None, start=1, stop=STEPS):
        model, ddp, opt, owner = build(warmup=schedule, saved=saved)
        sent = []
        for step in range(start, stop + 1):
            one_step(model, ddp, opt, step)
            sent.append(owner.stats.as_dict()["last_sent"])
        return model, opt, owner, sent

    model, opt, owner, sent = run()
    OUT["warm/param"] = flat(model.parameters())
    OUT["warm/sent"] = np.array(sent)
    OUT["warm/dense"] = np.array(sum(p.numel() for p in model.parameters()) * 4)
    model, opt, owner, _ = run(stop=2)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                "compression": compression_state(owner)}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    OUT["warm/saved_keys"] = np.array(sorted(saved["opt"]["hvd_compress_momentum"]
                                             if HOROVOD else saved["compression"]["ddp_momentum"]))
    model, opt, owner, _ = run(saved=saved, start=3)
    OUT["warm/resumed"] = flat(model.parameters())


def mismatch():
    try:
        model, ddp, opt, owner = build(warmup=3 + RANK)
        one_step(model, ddp, opt, 1)
        OUT["mismatch/error"] = np.array("")
    except ValueError as e:
        OUT["mismatch/error"] = np.array(str(e))


if __name__ == "__main__":
    trace()
    for k in (2, 5):
        resume(k)
    nan()
    each_spec()
    gpt2()
    dgc()
    warmup_exchange()
    mismatch()                         # last: a failed configuration check ends the job
    mode = "horovod" if HOROVOD else "ddp"
    np.savez(os.path.join(os.environ["OUT_DIR"], f"momentum_{mode}_rank{RANK}.npz"), **OUT)
    print(f"rank {RANK} done", flush=True)
    if not HOROVOD:
        exit_skipping_teardown()      # torch's Gloo may abort a rank at exit otherwise
    sys.exit(0)
