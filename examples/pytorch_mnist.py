"""Train a small CNN on 5,000 real MNIST digits with Horovod and hvd_compress.

    horovodrun -np 2 -H localhost:2 --gloo python examples/pytorch_mnist.py \\
        --compression topk:density=0.01

Prints per epoch the test accuracy and the bytes this rank sent vs a dense float32
allreduce.  ``HVD_COMPRESS=...`` picks the compressor when --compression is not given.
"""
import numpy as np
import horovod.torch as hvd
import torch
import torch.nn.functional as F

import hvd_compress.torch as hct
from models import MnistNet as Net  # noqa: F401 (benchmarks import Net from here)
from mnist_common import Report, batches, build_compression, load_mnist, parse_args, progress


def main():
    args = parse_args(__doc__.splitlines()[0])
    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    x_train, y_train, x_test, y_test = load_mnist(hvd.rank(), hvd.size())
    x_train, y_train = torch.from_numpy(x_train), torch.from_numpy(y_train)
    x_test, y_test = torch.from_numpy(x_test), torch.from_numpy(y_test)

    model = Net()
    compression = build_compression(args.compression, model, verbose=hvd.rank() == 0)
    # DGC's recipe (a sparsifier's momentum=, e.g. "topk:density=0.01,momentum=0.9")
    # applies SGD's momentum inside the exchange: the optimizer then has none of its own
    dgc = bool(getattr(compression, "momentum", None))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.0 if dgc else 0.9)
    opt = hct.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    report = Report(args, "pytorch", hvd.size())
    if hvd.rank() == 0:
        print(f"compression: {opt.compression.spec}", flush=True)

    for epoch in range(1, args.epochs + 1):
        model.train()
        losses = []
        steps = batches(len(y_train), args.batch_size, args.seed, epoch)
        for idx in progress(steps, hvd.rank() == 0 and not args.no_progress, f"epoch {epoch}"):
            idx = torch.from_numpy(idx)
            opt.zero_grad()
            loss = F.cross_entropy(model(x_train[idx]), y_train[idx])
            loss.backward()
            opt.step()
            losses.append(loss.item())
        model.eval()
        with torch.no_grad():
            accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
        if hvd.rank() == 0:
            report.epoch(epoch, np.mean(losses), accuracy, opt.stats.as_dict())
    if hvd.rank() == 0:
        report.finish()


if __name__ == "__main__":
    main()
