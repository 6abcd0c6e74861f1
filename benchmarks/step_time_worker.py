"""One horovodrun worker of benchmarks/step_time.py: trains one model for a few steps
with each compressor in turn and (rank 0) writes the median step time and its split.

    horovodrun -np 2 -H localhost:2 --gloo python benchmarks/step_time_worker.py \\
        --model cnn_mlp_large --specs "none;topk:density=0.01" --out result.json

Split of a step (PyTorch glue timers, see hvd_compress.stats):
  compute      forward + backward + optimizer step, minus the time spent compressing in
               backward's hooks
  compress     compressing every gradient: inside backward, as each gradient is ready,
               and in synchronize() the part after a first collective (``late``: a
               two-round exchange's second message, PowerSGD's Q; hier:'s compress
               between hosts)
  communicate  blocked on Horovod in synchronize(): communication backward did not hide
  decompress   decoding the aggregates
  other        the rest of synchronize() (launching late collectives, copying into .grad)

With ``cu:<spec>`` (``compressed_update=True``, SGD-momentum's local step and its update
compressed) the exchange runs inside ``step()``: compute is forward + backward + the
local step and the update's bookkeeping; compress, communicate and decompress as above.

On the harness's hosts (step_time.py ``-2host`` links), ``host_tx`` is the median of the
bytes each host sent per step through its link to the other hosts (the device's
counter, headers included), averaged over the hosts.

A link that changes mid-run (``--phase-dir DIR --phase-after N``, used by step_time.py
``--change-link``): for each compressor k, rank 0 asks the launching process for the
first rate by creating ``DIR/<k>.1`` before the warm-up, and for the second rate by
creating ``DIR/<k>.2`` after N measured steps; it waits for the launcher's
``DIR/<k>.<phase>.done`` (the rate is changed by then) and all ranks meet in an
allreduce before the next step, so no measured step straddles the change (the waits are
not measured).  The row then holds ``phases``: the medians of the first N steps and of
the steps after the change less the first ``--phase-skip``, and ``step_totals``.
"""
import sys
from pathlib import Path

sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]

import horovod.torch as hvd  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import hvd_compress.torch as hct  # noqa: E402


def make_model(name):
    """(model, input shape) for a model name of the benchmark."""
    import models
    if name == "mnist_cnn":
        from pytorch_mnist import Net
        return Net(), (1, 28, 28)
    if name == "vgg_small":
        return models.vgg_small(), (3, 32, 32)
    if name == "resnet_small":
        return models.ResNetSmall(), (3, 32, 32)
    if name == "cnn_mlp_large":
        return models.CNNMLPLarge(), (3, 32, 32)
    if name == "transformer":      # torch's own nn.TransformerEncoder: a model we did not write
        return TokenClassifier(), ("tokens", 64)
    raise ValueError(f"unknown model {name!r}")


class TokenClassifier(torch.nn.Module):
    """Embedding(5000, 256) -> torch.nn.TransformerEncoder (4 layers, 4 heads, 1024 wide)
    -> mean over tokens -> Linear(256, 10): 4.5M parameters in 40 tensors."""

    def __init__(self, vocab=5000, width=256):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        layer = torch.nn.TransformerEncoderLayer(width, 4, 1024, dropout=0.0, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
        self.head = torch.nn.Linear(width, 10)

    def forward(self, tokens):
        return self.head(self.encoder(self.embed(tokens)).mean(1))


def ask_for_phase(phase_dir, index, phase, timeout=300):
    """Rank 0: create ``<index>.<phase>`` in ``phase_dir`` and wait for the launcher's
    ``.done``; then every rank meets the others, so all start the next step on the new
    link."""
    if hvd.rank() == 0:
        path = os.path.join(phase_dir, f"{index}.{phase}")
        open(path, "w").close()
        deadline = time.monotonic() + timeout
        while not os.path.exists(path + ".done"):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {path}.done after {timeout} s: the launcher did "
                                   "not change the link")
            time.sleep(0.01)
    hvd.allreduce(torch.zeros(1), name=f"step_time.phase.{index}.{phase}")


def slow_link_bytes():
    """Bytes this host has sent through its link to the other hosts so far (the
    harness's ``$HOROVOD_GLOO_IFACE``, read in this host's network namespace), or None
    where there is no such link (horovodrun on one machine)."""
    iface = os.environ.get("HOROVOD_GLOO_IFACE")
    path = f"/sys/class/net/{iface}/statistics/tx_bytes"
    if not iface or not os.path.exists(path):
        return None
    with open(path) as f:
        return int(f.read())


def medians(rows):
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def measure(model_name, spec, steps, warmup, batch, index=0, phase_dir=None,
            phase_after=None, phase_skip=0):
    from mnist_common import build_compression
    torch.manual_seed(0)
    model, shape = make_model(model_name)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    spec, _, mb = spec.partition("@")    # "topk:density=0.01@0": with bucket_mb=0
    update = spec.startswith("cu:")      # "cu:<spec>": compressed_update=True
    spec = spec[3:] if update else spec
    if spec == "horovod":        # Horovod's own optimizer, no compression: the baseline
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    else:
        opt = hct.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                       compression=build_compression(spec, model),
                                       bucket_mb=float(mb) if mb else None,
                                       compressed_update=update)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    # auto: the warm-up lasts until its first decision
    auto = getattr(getattr(opt, "_driver", None), "auto", None)
    gen = torch.Generator().manual_seed(hvd.rank())
    if shape[0] == "tokens":
        x = torch.randint(0, 5000, (batch, shape[1]), generator=gen)
    else:
        x = torch.randn((batch, *shape), generator=gen)
    y = torch.randint(0, 10, (batch,), generator=gen)
    rows = []
    if phase_dir:
        ask_for_phase(phase_dir, index, 1)
    step = changed = 0
    while len(rows) < steps:
        if phase_dir and len(rows) == phase_after and not changed:
            ask_for_phase(phase_dir, index, 2)
            changed = 1
        tx0 = slow_link_bytes()
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        t1 = time.perf_counter()
        opt.synchronize()
        t2 = time.perf_counter()
        with opt.skip_synchronize():
            opt.step()
        t3 = time.perf_counter()
        step += 1
        if step <= warmup or (auto is not None and not auto.decisions and step < warmup + 200):
            continue
        if spec == "horovod":    # no timers inside Horovod: synchronize() is communication
            st = dict(last_compress_s=0.0, last_wait_s=t2 - t1, last_decompress_s=0.0,
                      last_compress_late_s=0.0,
                      last_sent=sum(4 * p.numel() for p in model.parameters()))
            st["last_dense"] = st["last_sent"]
        else:
            st = opt.stats.as_dict()
        compress, wait, decomp = st["last_compress_s"], st["last_wait_s"], st["last_decompress_s"]
        late = st["last_compress_late_s"]          # compress seconds in synchronize()
        if update:               # the whole exchange runs in step(), after the local step
            compute, other = (t1 - t0) + (t3 - t2) - compress - wait - decomp, t2 - t1
        else:
            compute = (t1 - t0) - (compress - late) + (t3 - t2)
            other = max(0.0, (t2 - t1) - wait - decomp - late)
        rows.append(dict(total=t3 - t0, compute=compute, compress=compress, communicate=wait,
                         decompress=decomp, other=other, sent=st["last_sent"],
                         dense=st["last_dense"]))
        if tx0 is not None:        # the host's link: every worker of the host, both sides
            rows[-1]["host_tx"] = float(slow_link_bytes() - tx0)
    for h in getattr(opt, "_hooks", []) + getattr(opt, "_grad_accs", []):
        if hasattr(h, "remove"):
            h.remove()
    out = medians(rows)
    if phase_dir:
        phases = [rows[:phase_after], rows[phase_after + phase_skip:]]
        out["phases"] = [dict(medians(sel), steps=len(sel)) for sel in phases]
        out["phase_skip"] = phase_skip
        out["step_totals"] = [r["total"] for r in rows]
    if auto is not None:         # what auto chose, and when (JSON-friendly)
        out["auto"] = [dict(d, alone_s=dict(d["alone_s"])) for d in auto.decisions]
        out["warmup"] = step - steps
    out["n_params"] = sum(p.numel() for p in model.parameters())
    out["n_tensors"] = sum(1 for p in model.parameters() if p.requires_grad)
    out["steps"] = steps
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--specs", required=True, help="compressor specs separated by ';'")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--out", required=True)
    p.add_argument("--phase-dir", default=None,
                   help="ask the launcher to change the link through files here (see above)")
    p.add_argument("--phase-after", type=int, default=None,
                   help="measured steps on the first rate")
    p.add_argument("--phase-skip", type=int, default=2,
                   help="steps after the change left out of the second phase's medians")
    args = p.parse_args()
    if (args.phase_dir is None) != (args.phase_after is None):
        p.error("--phase-dir and --phase-after go together")
    if args.phase_dir and args.steps <= args.phase_after + args.phase_skip:
        p.error("--steps must exceed --phase-after + --phase-skip")
    if any("hier" in spec for spec in args.specs.split(";")):
        from hvd_compress.hosts import process_sets    # the hosts' sets, registered up front
        hvd.init(process_sets=process_sets())
    else:
        hvd.init()
    torch.set_num_threads(1)
    results = []
    for index, spec in enumerate(args.specs.split(";")):
        row = measure(args.model, spec, args.steps, args.warmup, args.batch, index,
                      args.phase_dir, args.phase_after, args.phase_skip)
        # the step is as slow as the slower rank: keep the larger median of the two
        totals = hvd.allgather_object((row["total"], row.get("host_tx"), hvd.local_rank()),
                                      name=f"step_time.{spec}")
        row.update(spec=spec, model=args.model, total_max_rank=max(t for t, _, _ in totals))
        if row.get("host_tx") is not None:  # bytes per host per step over the slow link
            row["host_tx"] = statistics.mean(tx for _, tx, local in totals if local == 0)
        results.append(row)
        if hvd.rank() == 0 and "phases" in row:
            print(f"  {args.model:14s} {spec:45s} "
                  + " -> ".join(f"{1e3 * ph['total']:8.1f} ms" for ph in row["phases"]),
                  flush=True)
        elif hvd.rank() == 0:
            print(f"  {args.model:14s} {spec:45s} {1e3 * row['total']:8.1f} ms", flush=True)
    if hvd.rank() == 0:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
