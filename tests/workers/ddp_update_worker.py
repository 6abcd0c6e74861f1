"""Compressed updates through the DDP hook (``hvd_compress.ddp.register(...,
compressed_update=True)``) in a real ``torchrun --nproc_per_node 2`` job (Gloo, CPU; no
Horovod).  Runs every scenario of update_scenarios.py through DDP, then DDP's own:
``scheduler_order`` (an LR scheduler made before ``register``, the optimizer's
parameters in another order on rank 1), ``features`` (find_unused_parameters,
gradient_as_bucket_view, a bfloat16 layer: two update buckets), ``errors`` (what it
cannot be combined with) and ``mismatch`` (one rank with compressed updates, one
without); each rank saves ``ddp_update_rank<r>.npz`` in $OUT_DIR for
tests/integration/test_compressed_update.py.
"""
import faulthandler
import os
import sys
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import hvd_compress.ddp
import update_scenarios
from tiny_mlp import Net, batch, flat
from update_scenarios import ADAMW, SPEC, one_step

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "examples"))
from mnist_common import exit_skipping_teardown  # noqa: E402

OUT = {}


class DDPGlue:
    rank = None          # set once the process group is up

    @staticmethod
    def build(spec, saved=None, model=None, optimizer=None, **kwargs):
        """``bucket_cap_mb`` small: DDP's buckets are several, which the hook answers
        with the local gradient; the step then sends the updates as one bucket."""
        ddp = DDP(Net() if model is None else model, bucket_cap_mb=0.0002)
        opt = (optimizer or (lambda ps: torch.optim.AdamW(ps, **ADAMW)))(ddp.parameters())
        state = hvd_compress.ddp.register(ddp, compression=spec, optimizer=opt,
                                          **dict(dict(compressed_update=True), **kwargs))
        if saved is not None:
            ddp.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])
            state.load_state_dict(saved["compression"])
        return ddp, opt, SimpleNamespace(compression=state.compression, stats=state.stats,
                                         updates=state.update)

    @staticmethod
    def start(model, opt):
        """Nothing: DDP broadcasts rank 0's parameters when it wraps the model."""


def scheduler_order():
    """The trace's first three steps (update_scenarios.trace), with a LambdaLR of factor
    1 made before ``register`` and rank 1's optimizer holding the parameters backwards."""
    ddp = DDP(Net(), bucket_cap_mb=0.0002)
    params = list(ddp.parameters())
    opt = torch.optim.AdamW(params[::-1] if DDPGlue.rank == 1 else params, **ADAMW)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    hvd_compress.ddp.register(ddp, SPEC, optimizer=opt, compressed_update=True)
    for step in range(1, 4):
        one_step(DDPGlue, ddp, opt, step)
        scheduler.step()
    OUT["scheduler_order/param"] = flat(ddp.parameters())


class Mixed(torch.nn.Module):
    """A float32 layer, a bfloat16 one and one never used."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = torch.nn.Linear(6, 16)
        self.fc2 = torch.nn.Linear(16, 3).to(torch.bfloat16)
        self.unused = torch.nn.Linear(3, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)).to(torch.bfloat16)).float()


def features():
    ddp = DDP(Mixed(), bucket_cap_mb=0.0002, find_unused_parameters=True,
              gradient_as_bucket_view=True)
    opt = torch.optim.AdamW(ddp.parameters(), lr=0.02)
    state = hvd_compress.ddp.register(ddp, "laplace_topk:density=0.3", optimizer=opt,
                                      compressed_update=True)
    x, y = batch(1, DDPGlue.rank)                 # one batch: its loss must go down
    losses = []
    for _ in range(6):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    OUT["features/loss"] = np.array(losses)
    OUT["features/param"] = flat(ddp.parameters())
    OUT["features/sent"] = np.array(state.stats.as_dict()["total_sent"])


def errors():
    def twice():
        model, opt, _ = DDPGlue.build(SPEC)
        hvd_compress.ddp.register(DDP(Net()), SPEC, optimizer=opt, compressed_update=True)

    def extra_param():
        ddp = DDP(Net())
        opt = torch.optim.AdamW(list(ddp.parameters()) + [torch.nn.Parameter(torch.ones(2))])
        hvd_compress.ddp.register(ddp, SPEC, optimizer=opt, compressed_update=True)
        one_step(DDPGlue, ddp, opt, 1)

    def param_group():
        model, opt, _ = DDPGlue.build(SPEC)
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))]})
        one_step(DDPGlue, model, opt, 1)

    for name, run in (("twice", twice), ("extra_param", extra_param),
                      ("param_group", param_group)):
        try:
            run()
            OUT[f"errors/{name}"] = np.array("")
        except ValueError as e:
            OUT[f"errors/{name}"] = np.array(str(e))
    cases = {"momentum": dict(compressed_momentum=3),
             "scaler": dict(grad_scaler=torch.amp.GradScaler("cpu")),
             "dgc": dict(spec="topk:density=0.1,momentum=0.9"),
             "value": dict(compressed_update="yes"), "sum": dict(op="sum"),
             "lbfgs": dict(optimizer=torch.optim.LBFGS), "no_optimizer": {}}
    for name, kwargs in cases.items():
        spec = kwargs.pop("spec", SPEC)
        try:
            if name == "no_optimizer":
                hvd_compress.ddp.register(DDP(Net()), SPEC, compressed_update=True)
            else:
                DDPGlue.build(spec, **kwargs)
            OUT[f"errors/{name}"] = np.array("")
        except ValueError as e:
            OUT[f"errors/{name}"] = np.array(str(e))


def mismatch():
    model, opt, _ = DDPGlue.build(SPEC, compressed_update=DDPGlue.rank == 0)
    OUT["mismatch/start"] = flat(model.parameters())
    try:
        one_step(DDPGlue, model, opt, 1)
        OUT["mismatch/error"] = np.array("")
    except ValueError as e:
        OUT["mismatch/error"] = np.array(str(e))
    OUT["mismatch/param"] = flat(model.parameters())


if __name__ == "__main__":
    if os.environ.get("DDP_WORKER_TIMEOUT"):     # a hang prints every thread's stack, then exits
        faulthandler.dump_traceback_later(float(os.environ["DDP_WORKER_TIMEOUT"]), exit=True)
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    DDPGlue.rank = dist.get_rank()
    for scenario in update_scenarios.ALL:
        scenario(DDPGlue, OUT)
    scheduler_order()
    features()
    errors()
    mismatch()                         # last: a failed configuration check ends the job
    np.savez(os.path.join(os.environ["OUT_DIR"], f"ddp_update_rank{DDPGlue.rank}.npz"), **OUT)
    print(f"rank {DDPGlue.rank} done", flush=True)
    exit_skipping_teardown()          # torch's Gloo may abort a rank at exit otherwise
