"""Elastic Horovod with hvd_compress (tests/integration/test_elastic.py runs it).

``elastic SPEC``: under ``horovodrun --host-discovery-script`` with 2 (or 3) workers;
rank 1 removes its host from ``$HOSTS_FILE`` and dies at step DIE; the others reset and
finish.  Every rank writes each commit (model, optimizer, compression state, host), its
state after the reset's restore (``reset_rank*``) and after its sync (``synced_rank*``);
rank 0 writes its final parameters.

``join SPEC``: starts with one worker; a second host appears at step 5 and joins.

``killed SPEC``: plain ``horovodrun -np 2`` (no Elastic); rank 1 exits at step 3.

``SPEC``: a compressor spec, SGD with momentum; ``adamw:X``: AdamW with ``X`` on the
gradients; ``update:X``: AdamW with ``compressed_update=True`` and ``X``;
``momentum:X``: AdamW, its momentum compressed with ``X`` after 4 dense steps.

``refused SPEC``: building the optimizer under Elastic; prints the ValueError (``hier:``).

``reference SPEC COMMIT_FILE``: one process (plain ``python``, Horovod of size 1) that
starts from a commit written above and runs the remaining steps on rank 0's data.
"""
import os
import sys
import time

import horovod.torch as hvd
import torch

import hvd_compress
import hvd_compress.torch as hct
from lost_host import LostWorker, join_step

STEPS, DIE, COMMIT_EVERY = 24, 11, 4
OUT = os.environ.get("OUT_DIR", ".")


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 8, 3)
        self.fc = torch.nn.Linear(8 * 6 * 6, 10)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).flatten(1))


def build(spec):
    """SGD with momentum; ``adamw:SPEC``: AdamW (its default weight decay, 0.01);
    ``update:SPEC``: AdamW with ``compressed_update=True`` (each rank its own moments,
    the updates compressed with SPEC); ``momentum:SPEC``: AdamW with compressed momentum
    after a 4-step dense warm-up."""
    torch.manual_seed(0)
    model = Net()
    update, momentum = spec.startswith("update:"), spec.startswith("momentum:")
    adamw = spec.startswith(("update:", "adamw:", "momentum:"))
    spec = spec.split(":", 1)[1] if adamw else spec
    compression = hvd_compress.Hylo.from_model(model, min_size=64) if spec == "hylo" \
        else hvd_compress.from_spec(spec)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2) if adamw else \
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt = hct.DistributedOptimizer(inner, model.named_parameters(), compression=compression,
                                   compressed_update=update,
                                   compressed_momentum=4 if momentum else None)
    return model, opt


def one_step(model, opt, step):
    gen = torch.Generator().manual_seed(1000 * step + hvd.rank())
    x, y = torch.randn(16, 1, 8, 8, generator=gen), torch.randint(0, 10, (16,), generator=gen)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    return opt


def has_state(state_dict):
    """Any error-feedback tensor or counter in a compressor's (or policy's) state_dict?"""
    state = state_dict["state"]
    return any(has_state(s) for s in state) if isinstance(state, list) else bool(state)


def snapshot(model, opt, step):
    return {"step": step, "model": model.state_dict(), "opt": opt.state_dict(),
            "compression": opt.compression.state_dict(),
            "host": os.environ.get("HOROVOD_HOSTNAME")}


def elastic(spec):
    model, opt = build(spec)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)      # must not run a compressed step
    assert opt.stats.steps == 0 and not has_state(opt.compression.state_dict())
    state = hvd.elastic.TorchState(model=model, optimizer=opt, step=0)

    def save(name):
        torch.save(snapshot(model, opt, state.step), f"{OUT}/{name}_rank{hvd.rank()}.pt")
    lost = LostWorker(DIE, hvd.rank, hvd.size, lambda: save("synced"))

    def on_reset():
        save("reset")
        print(f"RESET size {hvd.size()} at step {state.step}", flush=True)
        lost.on_reset()
    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run
    def train(state):
        while state.step < STEPS:
            lost.before_step(state.step)
            one_step(model, opt, state.step)
            opt.step()
            state.step += 1
            if state.step % COMMIT_EVERY == 0:
                torch.save(snapshot(model, opt, state.step),
                           f"{OUT}/commit{state.step}_rank{hvd.rank()}.pt")
                state.commit()

    train(state)
    if hvd.rank() == 0:
        torch.save({"model": model.state_dict(), "size": hvd.size(), "steps": opt.stats.steps,
                    "lost": opt.stats.as_dict()["lost_residual_norm"]},
                   f"{OUT}/final_rank0.pt")
    print("ELASTIC_DONE", hvd.rank(), hvd.size(), flush=True)


def join(spec):
    """Starts alone; at step 5 rank 0 adds a second host; after the reset every rank
    writes its compression state at its first step in the world of 2."""
    model, opt = build(spec)
    state = hvd.elastic.TorchState(model=model, optimizer=opt, step=0)

    @hvd.elastic.run
    def train(state):
        written = False
        while state.step < STEPS:
            with join_step(state, hvd.size, COMMIT_EVERY):
                if hvd.size() == 2 and not written:
                    torch.save(snapshot(model, opt, state.step),
                               f"{OUT}/joined_rank{hvd.rank()}.pt")
                    written = True
                one_step(model, opt, state.step).step()
                state.step += 1

    train(state)
    torch.save(model.state_dict(), f"{OUT}/joined_final_rank{hvd.rank()}.pt")
    print("JOIN_DONE", hvd.rank(), hvd.size(), flush=True)


def killed(spec):
    """No Elastic: rank 1 exits at step 3; rank 0 must fail with Horovod's error."""
    model, opt = build(spec)
    for step in range(STEPS):
        if step == 3 and hvd.rank() == 1:
            print(f"DYING {time.time():.3f}", flush=True)
            os._exit(7)
        one_step(model, opt, step).step()
    print("KILLED_RUN_FINISHED", hvd.rank(), flush=True)   # must not be reached by rank 0


def reference(spec, commit_file):
    model, opt = build(spec)
    commit = torch.load(commit_file)
    model.load_state_dict(commit["model"])
    opt.load_state_dict(commit["opt"])
    opt.compression.load_state_dict(commit["compression"])
    for step in range(commit["step"], STEPS):
        one_step(model, opt, step).step()
    torch.save({"model": model.state_dict()}, f"{OUT}/reference.pt")


if __name__ == "__main__":
    hvd.init()
    torch.set_num_threads(1)
    if sys.argv[1] == "elastic":
        elastic(sys.argv[2])
    elif sys.argv[1] == "join":
        join(sys.argv[2])
    elif sys.argv[1] == "killed":
        killed(sys.argv[2])
    elif sys.argv[1] == "refused":
        try:
            build(sys.argv[2])
        except ValueError as e:
            print("REFUSED", e, flush=True)
    else:
        reference(sys.argv[2], sys.argv[3])
