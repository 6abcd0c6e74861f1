"""Compressed updates (``compressed_update=True``) through real ``horovodrun -np 2
--gloo`` (hvd_compress.torch.DistributedOptimizer).  One launch runs every scenario of
update_scenarios.py through the Horovod glue, and the Horovod-only ones here; each rank
saves ``update_rank<r>.npz`` in $OUT_DIR for tests/integration/test_compressed_update.py,
which computes the expected values itself.

Here: ``clip`` (synchronize, clip, skip_synchronize: the update still goes), ``errors``
(what it cannot be combined with), ``mismatch`` (one rank with compressed updates, one
without).
"""
import os
import sys
from types import SimpleNamespace

import numpy as np
import torch
import horovod.torch as hvd

import hvd_compress.torch as hc
import update_scenarios
from tiny_mlp import Net, batch, flat
from update_scenarios import ADAMW, SPEC, one_step

hvd.init()
torch.set_num_threads(1)
OUT = {}


class HorovodGlue:
    rank = hvd.rank()

    @staticmethod
    def build(spec, saved=None, model=None, optimizer=None):
        model = Net() if model is None else model
        make = optimizer or (lambda ps: torch.optim.AdamW(ps, **ADAMW))
        opt = hc.DistributedOptimizer(make(model.parameters()), model.named_parameters(),
                                      compression=spec, compressed_update=True)
        if saved is not None:
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])
            opt.compression.load_state_dict(saved["compression"])
        return model, opt, SimpleNamespace(compression=opt.compression, stats=opt.stats,
                                           updates=opt._update)

    @staticmethod
    def start(model, opt):
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt, root_rank=0)


RANK = HorovodGlue.rank


def build(spec=SPEC):
    model, opt, _ = HorovodGlue.build(spec)
    return model, opt


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
    OUT["mismatch/start"] = flat(model.parameters())
    try:
        one_step(HorovodGlue, model, opt, 1)
        OUT["mismatch/error"] = np.array("")
    except ValueError as e:
        OUT["mismatch/error"] = np.array(str(e))
    OUT["mismatch/param"] = flat(model.parameters())


if __name__ == "__main__":
    for scenario in update_scenarios.ALL:
        scenario(HorovodGlue, OUT)
    clip()
    errors()
    mismatch()                         # last: a failed configuration check ends the job
    np.savez(os.path.join(os.environ["OUT_DIR"], f"update_rank{RANK}.npz"), **OUT)
    print(f"rank {RANK} done", flush=True)
    sys.exit(0)
