"""Runs under ``torchrun --nproc_per_node 2`` (CPU, Gloo): Hugging Face Accelerate's
``Accelerator(cpu=True).prepare(model, optimizer)`` wraps the model in
DistributedDataParallel, then ``hvd_compress.ddp.register(model, ...)`` adds the comm hook
and the loop is Accelerate's (``accelerator.backward``).  A few steps of a small CNN on
the MNIST-5k digits; each rank writes ``$OUT_DIR/accelerate_rank<r>.npz`` (parameters)
and ``.json`` (stats); tests/integration/test_accelerate.py checks them.
"""
import json
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

import hvd_compress.ddp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "examples"))
from mnist_common import exit_skipping_teardown, load_mnist  # noqa: E402

OUT = os.environ["OUT_DIR"]
STEPS = 5


def main():
    torch.set_num_threads(1)
    torch.manual_seed(3)
    acc = Accelerator(cpu=True)
    x, y, _, _ = load_mnist(0, 1)
    data = DataLoader(TensorDataset(torch.from_numpy(x[:1024]), torch.from_numpy(y[:1024])),
                      batch_size=32, shuffle=True)
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 5, stride=3), torch.nn.ReLU(),
                                torch.nn.Flatten(), torch.nn.Linear(4 * 8 * 8, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt, data = acc.prepare(model, opt, data)
    assert isinstance(model, DistributedDataParallel), type(model)
    state = hvd_compress.ddp.register(model, compression="topk:density=0.05")
    for step, (xb, yb) in zip(range(STEPS), data):
        loss = F.cross_entropy(model(xb), yb)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
    rank = acc.process_index
    params = {n: p.detach().numpy() for n, p in model.module.named_parameters()}
    np.savez(os.path.join(OUT, f"accelerate_rank{rank}.npz"), **params)
    with open(os.path.join(OUT, f"accelerate_rank{rank}.json"), "w") as f:
        json.dump(dict(stats=state.stats.as_dict(), rank=rank, world=acc.num_processes,
                       distributed_type=str(acc.distributed_type),
                       names=sorted(state.names.values())), f)
    acc.wait_for_everyone()
    # leave no Gloo thread running into interpreter shutdown: without this, a rank
    # sometimes aborted at exit ("terminate called without an active exception")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_skipping_teardown()          # torch's Gloo may abort a rank at exit otherwise
