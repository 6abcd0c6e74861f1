"""Runs under ``torchrun --nproc_per_node 2 --max-restarts 3`` (Gloo, CPU; no Horovod): a
user's DDP training with hvd_compress.ddp that checkpoints after step 4 of 8, a worker
killed after step 6, and torchrun restarting every worker, which go on from the
checkpoint.  tests/integration/test_ddp_restart.py compares what each run ends with.

Runs, one after the other in the same launch (a run that ended is skipped after a
restart; before killing itself rank 1 leaves a marker, so each run is killed once):

- ``straight``: the 8 steps, no fault;
- ``restart``: each rank saves its own checkpoint (model, optimizer, the hook's
  ``state.state_dict()``) to a file of its own, as docs/frameworks/ddp.md says;
- ``lost``: the same without the hook's state (its residuals start afresh after the
  restart): what the checkpoint of the hook's state is for;
- ``rank0``: only rank 0 saves, and every rank loads its file (DDP's usual idiom for the
  model), so after the restart rank 1 is given rank 0's residuals: its
  ``load_state_dict`` must refuse them.  The ranks then agree (one all_gather) to stop,
  so the one whose load succeeded does not wait for the other in a collective.

Each rank writes ``$OUT_DIR/<run>_rank<r>.npz`` (final parameters, the residual norm at
the checkpoint, the attempt it ended in) or ``<run>_error_rank<r>.txt``.
"""
import faulthandler
import os
import signal
import sys

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import hvd_compress.ddp
from hvd_compress.memory import residual_norm

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "examples"))
from mnist_common import exit_skipping_teardown  # noqa: E402

RUNS = ("straight", "restart", "lost", "rank0")
SPEC = "topk:density=0.1"
STEPS, SAVE_AFTER, KILL_AFTER = 8, 4, 6


def batch(step, rank):
    """The data of ``step`` on ``rank``: the same whether a run was restarted or not."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 20, generator=g), torch.randn(16, 4, generator=g)


def checkpoint_path(out, run, rank):
    return os.path.join(out, f"ckpt_{run}.pt" if run == "rank0" else f"ckpt_{run}_rank{rank}.pt")


def train(run, out, rank, attempt):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(20, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    model = DDP(net, bucket_cap_mb=0.001)
    state = hvd_compress.ddp.register(model, SPEC)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    path, start, saved_norm, error = checkpoint_path(out, run, rank), 0, 0.0, None
    if os.path.exists(path):
        ckpt = torch.load(path, weights_only=False)
        net.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        start, saved_norm = ckpt["step"], ckpt["norm"]
        try:
            if run != "lost":
                state.load_state_dict(ckpt["compression"])
        except ValueError as e:
            error = str(e)
    failed = [None, None]
    dist.all_gather_object(failed, error)              # every rank stops if one failed
    if any(failed):
        if error:
            with open(os.path.join(out, f"{run}_error_rank{rank}.txt"), "w") as f:
                f.write(error)
        return
    for step in range(start, STEPS):
        x, y = batch(step, rank)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        if step + 1 == SAVE_AFTER and run != "straight" and (run != "rank0" or rank == 0):
            compression = state.state_dict()
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "step": step + 1,
                        "compression": compression, "norm": residual_norm(compression)}, path)
        killed = os.path.join(out, f"killed_{run}")
        if step + 1 == KILL_AFTER and run != "straight" and rank == 1 \
                and not os.path.exists(killed):
            open(killed, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)          # no cleanup, as a crash
    np.savez(os.path.join(out, f"{run}_rank{rank}.npz"), attempt=attempt, start=start,
             saved_norm=saved_norm, **{k: v.detach().numpy() for k, v in net.state_dict().items()})


def main():
    if os.environ.get("DDP_WORKER_TIMEOUT"):   # a hang prints every thread's stack, then exits
        faulthandler.dump_traceback_later(float(os.environ["DDP_WORKER_TIMEOUT"]), exit=True)
    out = os.environ["OUT_DIR"]
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for run in RUNS:
        done = [os.path.exists(os.path.join(out, f"{run}_{what}rank{r}.{ext}"))
                for r in range(2) for what, ext in (("", "npz"), ("error_", "txt"))]
        if any(done):
            continue
        dist.barrier()                             # (both see the same files)
        train(run, out, rank, attempt)
    dist.barrier()
    exit_skipping_teardown()       # (torch 2.13's Gloo may abort in its teardown)


if __name__ == "__main__":
    main()
