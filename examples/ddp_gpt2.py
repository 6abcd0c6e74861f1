"""Train a small GPT-2 (Hugging Face ``transformers``) with AdamW under PyTorch DDP and
hvd_compress (no Horovod), byte-level on real text that ships with Python.

    torchrun --nproc_per_node 2 examples/ddp_gpt2.py \\
        --compression laplace_topk:density=0.01 --compressed-update

``--compressed-update``: each rank runs AdamW on its own gradients and the *update* goes
through the compressor with error feedback (``hvd_compress.ddp.register(...,
optimizer=opt, compressed_update=True)``; docs/adam-adamw.md says why sparsified
gradients slow AdamW down and updates do not).  Without it the gradients are compressed.
``--hook none`` (DDP's own allreduce) and ``--hook torch_powersgd:rank=4`` (PyTorch's
``powerSGD_hook``) run the alternatives, as examples/ddp_mnist.py does.

The text and model are examples/gpt2_text.py's (Python's reference documentation; a
4-layer GPT-2 of width 256, 3.2M parameters); batches are drawn from a generator seeded
by (step, rank).  Every ``--eval-every`` steps rank 0 prints the validation loss (the
same 32 windows on every rank; the clock stops meanwhile), the bytes this rank sent
against a dense float32 allreduce, and the training seconds so far.
"""
import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import hvd_compress.ddp
from hvd_compress.stats import Stats, ring_received
from ddp_mnist import set_up_hook
from gpt2_text import corpus, make_model, train_batch, validation_loss, windows
from mnist_common import exit_skipping_teardown, progress


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compression", default="laplace_topk:density=0.01",
                   help="compressor spec (default laplace_topk:density=0.01)")
    p.add_argument("--compressed-update", action="store_true",
                   help="compress each rank's AdamW update, not its gradients")
    p.add_argument("--hook", default="hvd_compress",
                   help="hvd_compress[:start=S], none (DDP's allreduce), "
                        "torch_powersgd:rank=R[,start=S]")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0,
                   help="0: the recorded runs' initial weights and batches; another: others")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=8, help="per worker")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--bucket-cap-mb", type=float, default=25.0)
    p.add_argument("--json", default=None, help="write the loss curve and bytes here (rank 0)")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args()


def set_up(args, ddp, opt):
    """The gradients' hook, or hvd_compress with compressed updates; (label, stats)."""
    if args.compressed_update:
        if args.hook != "hvd_compress":
            raise ValueError(f"--compressed-update is hvd_compress's: drop --hook {args.hook}")
        state = hvd_compress.ddp.register(ddp, args.compression, optimizer=opt,
                                          compressed_update=True)
        return f"AdamW updates: hvd_compress.ddp {state.compression.spec}", state.stats
    label, stats = set_up_hook(args, ddp, ddp.module)
    return f"gradients: {label}", stats


def main():
    args = parse_args()
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    train, val = corpus()
    g = torch.Generator().manual_seed(12345)
    val_batch = windows(val, torch.randint(0, val.numel() - args.seq - 1, (32,), generator=g),
                        args.seq)
    model = make_model(args, args.seed)
    ddp = DDP(model, bucket_cap_mb=args.bucket_cap_mb)
    opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr, weight_decay=0.01)
    label, stats = set_up(args, ddp, opt)
    stats = stats or Stats()                 # DDP's own allreduce: dense float32
    dense = sum(p.numel() * 4 for p in model.parameters())
    if rank == 0:
        print(f"{label}; GPT-2 of {dense // 4:,} parameters, AdamW lr {args.lr}", flush=True)

    def validate():
        return validation_loss(model, val_batch)

    curve, seconds, step_s = [(0, 0.0, validate())], 0.0, []
    for step in progress(range(1, args.steps + 1), rank == 0 and not args.no_progress, "steps"):
        batch = train_batch(train, step, rank, args.batch, args.seq, args.seed)
        start = time.perf_counter()
        opt.zero_grad()
        ddp(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss.backward()
        opt.step()
        step_s.append(time.perf_counter() - start)
        seconds += step_s[-1]
        if args.hook == "none" and not args.compressed_update:
            stats.add(dense, dense, ring_received(dense, size), ring_received(dense, size))
            stats.end_step()
        if step % args.eval_every == 0 or step == args.steps:
            curve.append((step, seconds, validate()))
            dist.barrier()                   # the clock restarts together
            sent = stats.as_dict()["total_sent"]
            if rank == 0:
                print(f"step {step}: val loss {curve[-1][2]:.4f}  {seconds:.1f} s  sent "
                      f"{sent / 2 ** 20:.1f} MiB vs dense {dense * step / 2 ** 20:.1f} MiB "
                      f"({dense * step / max(sent, 1):.1f}x less)", flush=True)
    median_ms = 1000 * statistics.median(step_s)
    sent = stats.as_dict()["total_sent"]
    if rank == 0:
        print(f"done: {label} on {size} workers, val loss {curve[-1][2]:.4f} after "
              f"{args.steps} steps, {dense * args.steps / max(sent, 1):.1f}x fewer bytes than "
              f"dense float32, median step {median_ms:.1f} ms", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(label=label, args=vars(args), curve=curve, median_step_ms=median_ms,
                               step_s=step_s, total_sent=sent, dense_bytes_per_step=dense,
                               workers=size), f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_skipping_teardown()          # torch's Gloo may abort a rank at exit otherwise
