"""One worker of benchmarks/time_to_loss.py: trains a small GPT-2 (Hugging Face
``transformers``, random init) byte-level on real text with AdamW, once per method, on
the same processes, and (rank 0) writes validation loss against steps and seconds.

    horovodrun -np 2 -H localhost:2 --gloo python benchmarks/time_to_loss_worker.py \\
        --methods "none;cm:laplace_topk:density=0.01" --steps 500 --out result.json

A method is a compressor spec; ``cm:<spec>`` sends the compressed *momentum* after a
dense warm-up (``compressed_momentum=--warmup``), ``cu:<spec>`` each rank's AdamW
*update* (``compressed_update=True``), the plain spec compresses gradients; a suffix
``@LR`` trains that method at learning rate LR.

The text: the Python reference documentation that every CPython install carries as plain
text (``pydoc_data.topics``, what ``help()`` prints: 465 KB of English prose and code
examples), so the benchmark needs no download and every machine trains on the same
bytes.  The last 10% is the validation set.  Batches are drawn from a generator seeded by
(step, rank), the same for every method.  Validation (the same 32 windows on every rank)
runs every ``--eval-every`` steps with the clock stopped, and all ranks meet before the
clock starts again, so the seconds are training seconds.
"""
import sys
from pathlib import Path

sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "benchmarks"))      # last: benchmarks/select.py is no stdlib
sys.path.append(str(ROOT / "examples"))        # gpt2_text

import horovod.torch as hvd  # noqa: E402
import torch  # noqa: E402

import hvd_compress.torch as hct  # noqa: E402
from gpt2_text import (corpus, make_model, method_lr, train_batch, validation_loss,  # noqa: E402
                       windows)


def run(label, args, train, val_batch):
    method, lr = method_lr(label, args.lr)           # METHOD@LR: its own learning rate
    momentum, update = method.startswith("cm:"), method.startswith("cu:")
    spec = method[3:] if momentum or update else method
    model = make_model(args, args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    schedule = dict(json.loads(args.momentum_args),
                    warmup=int(args.warmup) if args.warmup.isdigit() else args.warmup)
    opt = hct.DistributedOptimizer(opt, model.named_parameters(), compression=spec,
                                   compressed_momentum=schedule if momentum else None,
                                   compressed_update=update)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)

    def validate():
        return validation_loss(model, val_batch)

    curve = [(0, 0.0, validate())]
    seconds, steps_s, sent_after = 0.0, [], []
    frozen = None
    for step in range(1, args.steps + 1):
        batch = train_batch(train, step, hvd.rank(), args.batch, args.seq, args.seed)
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = model(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss
        loss.backward()
        opt.step()
        dt = time.perf_counter() - t0
        seconds += dt
        steps_s.append(dt)
        if momentum and frozen is None and not opt._momentum.schedule.warming_up:
            frozen = step
        if frozen is not None and step > frozen:
            sent_after.append(opt.stats.as_dict()["last_sent"])
        if step % args.eval_every == 0 or step == args.steps:
            curve.append((step, seconds, validate()))
            hvd.allreduce(torch.zeros(1), name="ttl.meet")      # the clock restarts together
            if hvd.rank() == 0:
                print(f"{label}: step {step} {seconds:.1f}s val loss {curve[-1][2]:.4f}",
                      flush=True)
    stats = opt.stats.as_dict()
    dense = sum(p.numel() * 4 for p in model.parameters())
    return dict(method=label, lr=lr, spec=spec, compressed_momentum=momentum,
                compressed_update=update, curve=curve,
                step_s=steps_s, warmup_steps=frozen if momentum else None,
                total_sent=stats["total_sent"], total_dense=stats["total_dense"],
                dense_bytes_per_step=dense,
                sent_per_step_after_warmup=(sum(sent_after) / len(sent_after)
                                            if sent_after else None),
                params=sum(p.numel() for p in model.parameters()),
                variance_checks=opt._momentum.schedule.history if momentum else None)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--methods", required=True, help="separated by ';'")
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--warmup", default="auto", help="compressed_momentum: steps or 'auto'")
    p.add_argument("--momentum-args", default="{}",
                   help="compressed_momentum: more MomentumSchedule arguments, as JSON")
    p.add_argument("--seed", type=int, default=0, help="gpt2_text.make_model's and batches'")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    train, val = corpus()
    g = torch.Generator().manual_seed(12345)
    val_batch = windows(val, torch.randint(0, val.numel() - args.seq - 1, (32,), generator=g),
                        args.seq)
    rows = [run(m, args, train, val_batch) for m in args.methods.split(";") if m]
    if hvd.rank() == 0:
        with open(args.out, "w") as f:
            json.dump(rows, f)


if __name__ == "__main__":
    main()
