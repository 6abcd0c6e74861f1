"""Train a small CNN on 5,000 real MNIST digits with PyTorch DDP and hvd_compress (no Horovod).

    torchrun --nproc_per_node 2 examples/ddp_mnist.py --compression topk:density=0.01

hvd_compress runs as a DDP communication hook (``hvd_compress.ddp.register``); the
model, data, seed and command line are those of examples/pytorch_mnist.py (Gloo, CPU).
Prints per epoch the test accuracy and the bytes this rank sent vs a dense float32
allreduce, and at the end the median time of a training step.

``--hook`` picks what reduces the gradients instead, for comparison:
  hvd_compress[:start=S] (default)
                             hvd_compress.ddp with --compression; start=S: DDP's allreduce
                             for the first S steps, as PyTorch's start_powerSGD_iter
  none                       DDP's own allreduce (no hook)
  torch_fp16                 PyTorch's fp16_compress_hook
  torch_powersgd:rank=R[,start=S]
                             PyTorch's powerSGD_hook (PowerSGDState with
                             matrix_approximation_rank=R, start_powerSGD_iter=S,
                             default 2: the smallest it allows with error feedback)
``--bucket-cap-mb``: DDP's bucket_cap_mb (default 25, DDP's).
"""
import argparse
import statistics
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

import hvd_compress.ddp
from hvd_compress.stats import Stats, ring_received
from models import MnistNet as Net
from mnist_common import (Report, batches, build_compression, exit_skipping_teardown, load_mnist,
                          parse_args, progress)


def own_args():
    """--hook and --bucket-cap-mb; the rest is mnist_common's command line."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--hook", default="hvd_compress")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0)
    ours, rest = p.parse_known_args()
    sys.argv[1:] = rest
    return ours


def counted(hook, stats, run):
    """``hook`` with its bytes counted in ``stats`` as hvd_compress.ddp counts its own:
    ``run(state, bucket, call)`` calls the hook (``call()``) and returns (bytes this rank
    sent, the hook's Future); a step ends with the last bucket."""
    def wrapped(state, bucket):
        dense = bucket.buffer().numel() * 4
        sent, future = run(state, bucket, lambda: hook(state, bucket))
        received = ring_received(sent, dist.get_world_size())
        stats.add(sent, dense, received, received)
        if bucket.is_last():
            stats.end_step()
        return future
    return wrapped


def set_up_hook(args, ddp, model):
    """Register the comm hook ``args.hook`` names; returns (label, stats or None)."""
    name, _, params = args.hook.partition(":")
    kv = dict(p.split("=") for p in params.split(",") if p)
    if name == "hvd_compress":
        compression = build_compression(args.compression, model, verbose=dist.get_rank() == 0)
        start = int(kv.get("start", 0))
        if not start:
            state = hvd_compress.ddp.register(ddp, compression)
            return f"hvd_compress.ddp {state.compression.spec}", state.stats
        state, steps = hvd_compress.ddp.CompressionState(ddp, compression), [0]
        allreduce = counted(lambda _, bucket: default_hooks.allreduce_hook(None, bucket),
                            state.stats, lambda _, bucket, call: (bucket.buffer().numel() * 4,
                                                                  call()))

        def dense_first(state, bucket):
            if steps[0] >= start:
                return hvd_compress.ddp.compression_hook(state, bucket)
            steps[0] += bucket.is_last()
            return allreduce(state, bucket)
        ddp.register_comm_hook(state, dense_first)
        return f"hvd_compress.ddp {state.compression.spec} start={start}", state.stats
    if name == "none":
        return "DDP allreduce (no hook)", None
    stats = Stats()
    if name == "torch_fp16":
        def fp16_bytes(state, bucket, call):
            return bucket.buffer().numel() * 2, call()
        ddp.register_comm_hook(None, counted(default_hooks.fp16_compress_hook, stats, fp16_bytes))
        return "torch fp16_compress_hook", stats
    if name == "torch_powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=int(kv.get("rank", 1)),
            start_powerSGD_iter=int(kv.get("start", 2)))

        def powersgd_bytes(state, bucket, call):
            before = state.total_numel_after_compression
            fut = call()
            after = state.total_numel_after_compression    # unchanged: a vanilla allreduce
            return (after - before or bucket.buffer().numel()) * 4, fut
        ddp.register_comm_hook(state, counted(powerSGD_hook.powerSGD_hook, stats, powersgd_bytes))
        return (f"torch powerSGD_hook rank={state.matrix_approximation_rank} "
                f"start={state.start_powerSGD_iter}"), stats
    raise ValueError(f"unknown --hook {args.hook!r}: hvd_compress[:start=S], none, "
                     "torch_fp16, torch_powersgd:rank=R[,start=S]")


def main():
    ours = own_args()
    args = parse_args(__doc__.splitlines()[0])
    args.hook, args.bucket_cap_mb = ours.hook, ours.bucket_cap_mb
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    x_train, y_train, x_test, y_test = load_mnist(rank, size)
    x_train, y_train = torch.from_numpy(x_train), torch.from_numpy(y_train)
    x_test, y_test = torch.from_numpy(x_test), torch.from_numpy(y_test)

    model = Net()
    ddp = DDP(model, bucket_cap_mb=args.bucket_cap_mb)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    label, stats = set_up_hook(args, ddp, model)
    if stats is None:                        # DDP's own allreduce: dense float32
        stats = Stats()
    dense_step = sum(p.numel() * 4 for p in model.parameters())
    report = Report(args, "pytorch-ddp", size)
    report.header.update(hook=args.hook, bucket_cap_mb=args.bucket_cap_mb)
    if args.hook != "hvd_compress":
        report.header["compression"] = label
    if rank == 0:
        print(f"gradients: {label}", flush=True)

    step_s = []
    for epoch in range(1, args.epochs + 1):
        model.train()
        losses = []
        steps = batches(len(y_train), args.batch_size, args.seed, epoch)
        for idx in progress(steps, rank == 0 and not args.no_progress, f"epoch {epoch}"):
            idx = torch.from_numpy(idx)
            start = time.perf_counter()
            opt.zero_grad()
            loss = F.cross_entropy(ddp(x_train[idx]), y_train[idx])
            loss.backward()
            opt.step()
            step_s.append(time.perf_counter() - start)
            if args.hook == "none":
                stats.add(dense_step, dense_step, ring_received(dense_step, size),
                          ring_received(dense_step, size))
                stats.end_step()
            losses.append(loss.item())
        model.eval()
        with torch.no_grad():
            accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
        if rank == 0:
            report.epoch(epoch, np.mean(losses), accuracy, stats.as_dict())
    median_ms = 1000 * statistics.median(step_s)
    report.header.update(median_step_ms=median_ms, steps=len(step_s),
                         stats=stats.as_dict())
    if rank == 0:
        print(f"median step {median_ms:.1f} ms over {len(step_s)} steps", flush=True)
        report.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_skipping_teardown()          # torch's Gloo may abort a rank at exit otherwise
