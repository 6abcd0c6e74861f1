"""Runs under ``torchrun --nproc_per_node 2`` (Gloo, CPU): mixed precision through the DDP
hook (``hvd_compress.torch.amp.register_ddp``, ``torch.autocast("cpu", bfloat16)``,
``torch.amp.GradScaler("cpu")``).  The same runs as the Horovod optimizer's "amp"
scenario (tests/workers/torch_surface_worker.py): three loss-scale schedules, rank 0's
input holds an Inf at step 5.  Writes ``$OUT_DIR/ddp_amp_rank<r>.npz``; checked by
tests/integration/test_ddp_amp.py.  No Horovod.
"""
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import hvd_compress
from hvd_compress.torch.amp import register_ddp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "examples"))
from mnist_common import exit_skipping_teardown  # noqa: E402

SPECS = ("topk:density=0.1", "laplace_topk:density=0.1", "twobit", "powersgd:rank=2")
STARTS = {"256": (2.0 ** 8, 2), "65536": (2.0 ** 16, 2), "const": (2.0 ** 12, 1000)}
STEPS, OVERFLOW = 10, 5


def run(spec, init, growth):
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    ddp = DDP(model)
    comp = hvd_compress.from_spec(spec)
    scaler = torch.amp.GradScaler("cpu", init_scale=init, growth_interval=growth)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    state = register_ddp(ddp, scaler, compression=comp)
    states = {}
    for step in range(STEPS):
        r = np.random.default_rng([rank, 8, step])
        x = torch.from_numpy(r.standard_normal((8, 16)).astype(np.float32))
        y = torch.from_numpy(r.standard_normal((8, 8)).astype(np.float32))
        if step == OVERFLOW and rank == 0:
            x[0, 0] = float("inf")
        if step == OVERFLOW:
            states["before"] = {k: v.numpy().copy() for k, v in comp.state_dict()["state"].items()}
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = ((ddp(x).float() - y) ** 2).mean()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 10.0)
        scaler.step(opt)
        scaler.update()
        if step in (OVERFLOW, OVERFLOW + 1):
            states["after" if step == OVERFLOW else "later"] = {
                k: v.numpy().copy() for k, v in comp.state_dict()["state"].items()}
    return model, states, state.amp.overflow_steps


def main():
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    out = {}
    for spec in SPECS:
        for start, (init, growth) in STARTS.items():
            key = f"{spec}|{start}"
            model, states, overflows = run(spec, init, growth)
            for k, v in model.state_dict().items():
                out[f"{key}|param|{k}"] = v.numpy().copy()
            out[f"{key}|overflows"] = np.array(overflows)
            out[f"{key}|residual_keys"] = np.array(sorted(states["before"]))
            for when, st in states.items():
                for k, v in st.items():
                    out[f"{key}|{when}|{k}"] = v
    np.savez(os.path.join(os.environ["OUT_DIR"], f"ddp_amp_rank{dist.get_rank()}.npz"), **out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_skipping_teardown()          # torch's Gloo may abort a rank at exit otherwise
