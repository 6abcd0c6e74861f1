"""Coded synchronous SGD (CSSGD, seed 003) on 5,000 real MNIST digits: a fully-connected
DNN, the paper's DNN set-up, trained by n workers with redundancy r.

    HOROVOD_DYNAMIC_PROCESS_SETS=1 horovodrun -np 3 -H localhost:3 --gloo \\
        python examples/cssgd_mnist.py --redundancy 2
    ... --exchange multicast_alltoall      # the same packets in one global alltoall
    ... --exchange reduce_scatter          # coded pre-sums on point-to-point TCP
    ... --exchange ssgd                    # uncoded reference: float32 ring allreduce
    ... --framework tf                     # the same with TensorFlow's tape

Every global mini-batch (--batch-size samples, the same on every rank) is cut into
C(n, r) parts; each worker computes the gradients of its C(n-1, r-1) parts, and the
exchange gives every worker the gradient of the whole mini-batch.  Prints per epoch the
test accuracy, the bytes this worker sent and received per step against Horovod's ring
allreduce of the same gradient, and the split of a step into compute and communication.
"""
import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mnist_common import load_mnist, progress  # noqa: E402

HIDDEN = (128, 64)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--framework", choices=("torch", "tf"), default="torch")
    p.add_argument("--redundancy", "-r", type=int, default=2,
                   help="r: every part is computed on r workers (1 <= r <= n)")
    p.add_argument("--exchange", default="multicast",
                   choices=("multicast", "multicast_alltoall", "reduce_scatter", "ssgd"),
                   help="multicast: the paper's coded packets, one process set per group; "
                        "multicast_alltoall: the same packets in one alltoall; "
                        "reduce_scatter: coded pre-sums; ssgd: uncoded float32 allreduce "
                        "(needs r = 1)")
    p.add_argument("--value-range", type=float, default=10.0,
                   help="R of the int32 fixed point [-R, R] (the paper's 10)")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=96, help="global mini-batch")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--target", type=float, default=0.9,
                   help="report the training time to this test accuracy")
    p.add_argument("--json", default=None, help="write the per-epoch log here (rank 0)")
    p.add_argument("--steps", type=int, default=None,
                   help="stop after this many steps (benchmarks/cssgd.py); the JSON then "
                        "holds every step's time (and its compute, encode+decode and "
                        "communication seconds) and the loopback bytes of steps 5 on")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args()


def loopback_bytes():
    """Bytes sent on this network namespace's loopback so far (all ranks' traffic: on one
    machine every worker talks through ``lo``)."""
    with open("/proc/net/dev") as f:
        for line in f:
            if line.strip().startswith("lo:"):
                return int(line.split(":")[1].split()[8])
    return 0


def torch_trainer(args, data):
    import horovod.torch as hvd
    import torch
    import hvd_compress.coded as coded
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    sizes = (784,) + HIDDEN + (10,)
    layers = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    model = torch.nn.Sequential(torch.nn.Flatten(), *layers[:-1])
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = coded.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9),
        model.named_parameters(), batch_size=args.batch_size, redundancy=args.redundancy,
        value_range=args.value_range, exchange=args.exchange)
    x, y, xt, yt = (torch.from_numpy(a) for a in data)
    loss_fn = lambda a, b: torch.nn.functional.cross_entropy(model(a), b)   # noqa: E731

    def step(idx):
        idx = torch.as_tensor(idx)
        opt.zero_grad()
        loss = opt.backward(loss_fn, x[idx], y[idx])
        opt.step()
        return loss

    def accuracy():
        with torch.no_grad():
            return (model(xt).argmax(1) == yt).float().mean().item()
    return hvd, step, accuracy, lambda: opt.stats


def tf_trainer(args, data):
    import horovod.tensorflow as hvd
    import tensorflow as tf
    import hvd_compress.coded as coded
    tf.random.set_seed(args.seed)
    model = tf.keras.Sequential([tf.keras.Input((1, 28, 28)), tf.keras.layers.Flatten()]
                                + [tf.keras.layers.Dense(h, activation="relu") for h in HIDDEN]
                                + [tf.keras.layers.Dense(10)])
    for v in model.variables:
        v.assign(hvd.broadcast(v, root_rank=0, name="init." + v.path))
    opt = tf.keras.optimizers.SGD(args.lr, momentum=0.9)
    grads = coded.CodedGradients(model.trainable_variables, batch_size=args.batch_size,
                                 redundancy=args.redundancy, value_range=args.value_range,
                                 exchange=args.exchange)
    x, y, xt, yt = data
    ce = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    loss_fn = lambda a, b: ce(b, model(a, training=True))   # noqa: E731

    def step(idx):
        loss, g = grads.gradient(loss_fn, tf.constant(x[idx]), tf.constant(y[idx]))
        opt.apply_gradients(zip(g, model.trainable_variables))
        return loss

    def accuracy():
        return float(np.mean(np.argmax(model(xt).numpy(), 1) == yt))
    return hvd, step, accuracy, lambda: grads.stats


def main():
    args = parse_args()
    if args.exchange == "ssgd":
        args.exchange = "allreduce"
    data = load_mnist(0, 1)                  # every rank holds all; the sampler picks parts
    if args.framework == "torch":
        import horovod.torch as hvd
    else:
        import horovod.tensorflow as hvd
    hvd.init()
    import hvd_compress.coded as coded
    hvd_, step, accuracy, stats = (torch_trainer if args.framework == "torch" else tf_trainer)(args, data)
    n, rank = hvd.size(), hvd.rank()
    sampler = coded.CodedBatchSampler(len(data[1]), args.batch_size, n, rank, args.redundancy,
                                      seed=args.seed)
    name = "SSGD (allreduce)" if args.exchange == "allreduce" else \
        f"CSSGD r={args.redundancy} ({args.exchange})"
    if rank == 0:
        print(f"{name}: {n} workers, {sampler.placement.num_parts} parts per mini-batch of "
              f"{args.batch_size}, {len(sampler.positions)} samples per worker per step",
              flush=True)
    rows, train_s, reached, step_s, wire, split = [], 0.0, None, [], [], []
    epochs = args.epochs if args.steps is None else -(-args.steps // len(sampler))
    for epoch in range(1, epochs + 1):
        sampler.set_epoch(epoch)
        losses = []
        for idx in progress(list(sampler), rank == 0 and not args.no_progress, f"epoch {epoch}"):
            if args.steps is not None and len(step_s) in (5, args.steps):
                wire.append(loopback_bytes())
            if args.steps is not None and len(step_s) == args.steps:
                break
            t0 = time.perf_counter()
            before = stats()["total_compute_s"]
            losses.append(step(np.asarray(idx)))
            step_s.append(time.perf_counter() - t0)
            train_s += step_s[-1]
            s = stats()
            split.append((s["total_compute_s"] - before, s["last_encode_s"] + s["last_decode_s"],
                          s["last_communicate_s"]))
        if args.steps is not None and len(step_s) == args.steps and len(wire) == 1:
            wire.append(loopback_bytes())        # the last step ended the epoch
        acc = accuracy()
        s = stats()
        steps = s["total_steps"]
        row = dict(epoch=epoch, train_s=train_s, loss=float(np.sum(losses) / len(losses)),
                   test_accuracy=acc, sent_per_step=s["total_sent"] / steps,
                   received_per_step=s["total_received"] / steps,
                   ring_per_step=s["total_ring"] / steps,
                   compute_s=s["total_compute_s"] / steps,
                   encode_s=s["total_encode_s"] / steps,
                   communicate_s=s["total_communicate_s"] / steps,
                   decode_s=s["total_decode_s"] / steps, clipped=s["total_clipped"])
        rows.append(row)
        if reached is None and acc >= args.target:
            reached = train_s
        if rank == 0:
            print(f"epoch {epoch}: loss {row['loss']:.4f}  test accuracy {100 * acc:.2f}%  "
                  f"per step: sent {row['sent_per_step'] / 1e3:.0f} kB, received "
                  f"{row['received_per_step'] / 1e3:.0f} kB (ring allreduce "
                  f"{row['ring_per_step'] / 1e3:.0f} kB); compute {1e3 * row['compute_s']:.1f} ms, "
                  f"communicate {1e3 * row['communicate_s']:.1f} ms", flush=True)
    if rank == 0:
        print(f"done: {name}, final test accuracy {100 * rows[-1]['test_accuracy']:.2f}%, "
              f"training time {train_s:.1f} s, to {100 * args.target:.0f}%: "
              + (f"{reached:.1f} s" if reached is not None else "not reached"), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                extra = {} if args.steps is None else dict(
                    step_s=step_s, step_split_s=split, loopback_bytes_per_step=(wire[-1] - wire[0]) / (args.steps - 5)
                    if len(wire) == 2 else None)
                json.dump(dict(vars(args), workers=n, time_to_target_s=reached, epochs_log=rows,
                               **extra), f, indent=1)


if __name__ == "__main__":
    main()
