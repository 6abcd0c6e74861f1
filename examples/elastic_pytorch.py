"""Elastic Horovod + hvd_compress: MNIST-5k that goes on when a worker is lost.

One machine, two "hosts" (Horovod blacklists a host whose worker failed, so two names
for the loopback), a discovery script that prints the current ones:

    printf 'localhost:1\\n127.0.0.1:1\\n' > /tmp/hosts
    printf '#!/bin/sh\\ncat /tmp/hosts\\n' > /tmp/discover.sh && chmod +x /tmp/discover.sh
    horovodrun --network-interface lo -np 2 --min-np 1 --max-np 2 \\
        --host-discovery-script /tmp/discover.sh --gloo \\
        python examples/elastic_pytorch.py --compression topk:density=0.01 --kill-at 60

AdamW with compressed updates (the configuration docs/adam-adamw.md measured best):
``--optimizer adamw --lr 1e-3 --compressed-update``.

``--kill-at N``: rank 1 removes its host from the file named by ``--hosts`` and exits at
step N of epoch 2, as a failed machine would; rank 0 restores the last commit (model,
optimizer, its own error-feedback residuals) and finishes alone.  Without
``--network-interface lo`` an elastic job on one machine waits for a second host forever.

The training code is Horovod's own (TorchState, @hvd.elastic.run, state.commit());
``import hvd_compress.torch`` makes TorchState keep each rank's residuals.
"""
import argparse
import os
import time

import horovod.torch as hvd
import torch
import torch.nn.functional as F

import hvd_compress
import hvd_compress.torch as hct
from mnist_common import batches, load_mnist
from pytorch_mnist import Net


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compression", default=os.environ.get("HVD_COMPRESS", "topk:density=0.01"))
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--kill-at", type=int, default=None, help="rank 1 dies at this step of epoch 2")
    p.add_argument("--hosts", default="/tmp/hosts", help="the file the discovery script prints")
    p.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd",
                   help="sgd: momentum 0.9; adamw: AdamW (try --lr 1e-3 --compressed-update)")
    p.add_argument("--compressed-update", action="store_true",
                   help="compress each rank's optimizer update, not its gradient "
                        "(docs/adam-adamw.md); each rank keeps its own moments across resets")
    args = p.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(42)
    model = Net()
    inner = torch.optim.AdamW(model.parameters(), lr=args.lr) if args.optimizer == "adamw" \
        else torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    opt = hct.DistributedOptimizer(inner, model.named_parameters(),
                                   compression=hvd_compress.from_spec(args.compression),
                                   compressed_update=args.compressed_update)
    x_all, y_all, x_test, y_test = (torch.from_numpy(a) for a in load_mnist(0, 1))
    state = hvd.elastic.TorchState(model=model, optimizer=opt, epoch=1, batch=0)
    state.register_reset_callbacks([lambda: print(
        f"reset: {hvd.size()} worker(s), back to epoch {state.epoch} batch {state.batch}",
        flush=True)])

    @hvd.elastic.run
    def train(state):
        while state.epoch <= args.epochs:
            x, y = x_all[hvd.rank()::hvd.size()], y_all[hvd.rank()::hvd.size()]  # this world's shard
            steps = batches(len(y), args.batch_size, 42, state.epoch)
            while state.batch < len(steps):
                if (args.kill_at is not None and state.epoch == 2 and state.batch == args.kill_at
                        and hvd.rank() == 1 and hvd.size() == 2):
                    me = os.environ["HOROVOD_HOSTNAME"]
                    keep = [h for h in open(args.hosts).read().split() if not h.startswith(me + ":")]
                    with open(args.hosts, "w") as f:
                        f.write("\n".join(keep) + "\n")
                    time.sleep(1)
                    os._exit(1)
                idx = torch.from_numpy(steps[state.batch])
                opt.zero_grad()
                F.cross_entropy(model(x[idx]), y[idx]).backward()
                opt.step()
                state.batch += 1
                if state.batch % 20 == 0:
                    state.commit()
            with torch.no_grad():
                accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
            if hvd.rank() == 0:
                st = opt.stats.as_dict()
                print(f"epoch {state.epoch}: {hvd.size()} worker(s), test accuracy "
                      f"{100 * accuracy:.2f}%, {st['ratio']:.1f}x fewer bytes", flush=True)
            state.epoch, state.batch = state.epoch + 1, 0
            state.commit()

    train(state)
    if hvd.rank() == 0:
        print(f"done: {opt.stats.steps} steps on rank 0", flush=True)


if __name__ == "__main__":
    main()
