"""Time to a target loss: a small GPT-2 (Hugging Face ``transformers``, 4 layers, 256
wide, random init) trained byte-level with AdamW under ``horovodrun -np 2 --gloo``, per
method, on plain loopback and on two hosts joined by 1 Gbit/s and 100 Mbit/s links.

    python benchmarks/time_to_loss.py                        # everything (~40 minutes)
    python benchmarks/time_to_loss.py --links plain --steps 200 --quick-methods
    python benchmarks/time_to_loss.py --links 100mbit-2host --steps 300 \\
        --methods "none;cm:laplace_topk:density=0.01"

Methods: a compressor spec compresses the gradients (what AdamW users get from plain
gradient compression); ``cm:<spec>`` is compressed-momentum Adam
(``compressed_momentum=``: dense warm-up, frozen variance, momentum through the
compressor with error feedback; hvd_compress/strategies/momentum.py); ``cu:<spec>``
sends each rank's AdamW *update* through the compressor (``compressed_update=True``;
hvd_compress/torch/compressed_update.py).  Every method of a
link runs in one launch, one after the other on the same processes
(benchmarks/time_to_loss_worker.py: the text, the batches and the clock).

``--glue ddp`` runs the same through PyTorch DDP instead of Horovod: one launch per
method of examples/ddp_gpt2.py (the same text, batches, model and clock), by ``torchrun``
on plain loopback and by an ``env://`` rendezvous at host 0 on two hosts.  There a method
is ``none`` (DDP's own allreduce), ``torch_powersgd:rank=R`` (PyTorch's
``powerSGD_hook``), a spec (hvd_compress's hook on the gradients) or ``cu:<spec>``
(``hvd_compress.ddp.register(..., compressed_update=True)``).

Reported per link: the validation loss at the last step and its ratio to dense
(``none``); the bytes sent per step after the warm-up and the ratio to dense; the
*target* = dense's validation loss at ``--target-step``, and the training seconds each
method needs to reach it (first evaluation at or below it; "never" if it does not within
the run) and the speed-up over dense.  Writes
benchmarks/results/time_to_loss_<date>.json and .png (validation loss against seconds,
one curve per method, a panel per link; and against steps).  Shaped links need root
(hvd_compress/tools/shaped_link.py); without it only plain loopback is measured.  The
two workers share this machine's cores (one thread each): absolute seconds are CPU
seconds, the ratios between methods of one run are the result.

``METHOD@LR`` trains that method at learning rate LR (default ``--lr``, 1e-3).
``--np N`` runs N workers (on a shaped link N hosts, each host's link shaped both ways:
the ``-2host`` links' names stay), ``--width`` and ``--layers`` another GPT-2:

    python benchmarks/time_to_loss.py --glue ddp --links 1gbit-2host --np 4 --steps 300 \
        --methods "none;cu:laplace_topk:density=0.01"
"""
import sys
from pathlib import Path

sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "benchmarks"))      # last: benchmarks/select.py is no stdlib
sys.path.append(str(ROOT / "examples"))        # gpt2_text
from gpt2_text import method_lr  # noqa: E402
from hvd_compress.tools.shaped_link import shaped_link, two_hosts  # noqa: E402
from step_time import horovodrun_launch, hosts_launch  # noqa: E402

METHODS = ["none", "laplace_topk:density=0.01", "topk:density=0.1", "powersgd:rank=4",
           "cm:laplace_topk:density=0.01", "cm:onebit"]
QUICK = ["none", "laplace_topk:density=0.01", "cm:laplace_topk:density=0.01", "cm:onebit"]
LINKS = {"plain": None, "1gbit-2host": "1gbit", "100mbit-2host": "100mbit"}


def ddp_launch(where, hosts, np=2):
    """Launch function of ``--glue ddp``: ``np`` workers of ``argv`` (a python command), by
    torchrun behind ``where`` (an argv prefix) on one machine, or one on each of
    ``hosts`` (``shaped_link.Hosts``) meeting at host 0 (``env://``, Gloo on the link)."""
    torchrun = str(Path(sys.executable).with_name("torchrun"))

    def launch(argv, timeout):
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        if hosts is None:
            done = subprocess.run(where + [torchrun, "--nproc_per_node", str(np), "--standalone"]
                                  + argv[1:], capture_output=True, text=True, timeout=timeout,
                                  env=env)
            return done.returncode, done.stdout, done.stderr
        with tempfile.TemporaryDirectory() as tmp:
            procs = []
            for i in range(np):
                host_env = dict(env, RANK=str(i), WORLD_SIZE=str(np), LOCAL_RANK="0",
                                MASTER_ADDR=hosts.addresses[0], MASTER_PORT="29533",
                                GLOO_SOCKET_IFNAME=hosts.iface)
                with open(os.path.join(tmp, f"{i}.out"), "w") as out, \
                        open(os.path.join(tmp, f"{i}.err"), "w") as err:
                    procs.append(subprocess.Popen(hosts.prefix(i) + argv, env=host_env,
                                                  stdout=out, stderr=err))
            rcs = [p.wait(timeout=timeout) for p in procs]
            text = [open(os.path.join(tmp, f"{i}.{k}")).read() for i in range(np)
                    for k in ("out", "err")]
        return max(rcs, key=abs), text[0], "".join(text[1:])
    return launch


def ddp_row(label, args, launch, link):
    """One method through examples/ddp_gpt2.py; its JSON as a row of the Horovod worker's."""
    method, lr = method_lr(label, args.lr)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "row.json")
        argv = [sys.executable, str(ROOT / "examples" / "ddp_gpt2.py"), "--steps",
                str(args.steps), "--eval-every", str(args.eval_every), "--json", out,
                "--no-progress", "--seed", str(args.seed), "--lr", str(lr)] + model_args(args)
        if method.startswith("cu:"):
            argv += ["--compressed-update", "--compression", method[3:]]
        elif method == "none" or method.startswith("torch_"):
            argv += ["--hook", method]
        else:
            argv += ["--compression", method]
        rc, stdout, stderr = launch(argv, args.timeout)
        for line in stdout.splitlines():
            if line.startswith(("step ", "done:")):
                print(f"  [{link}] {label}: {line}", flush=True)
        if rc != 0 or not os.path.exists(out):
            raise RuntimeError(f"{label} failed ({rc}) on {link}:\n{stderr[-3000:]}")
        with open(out) as f:
            r = json.load(f)
    return dict(method=label, lr=lr, spec=r["label"], compressed_momentum=False,
                compressed_update=method.startswith("cu:"), curve=r["curve"],
                step_s=r["step_s"], warmup_steps=None, total_sent=r["total_sent"],
                total_dense=r["dense_bytes_per_step"] * len(r["step_s"]),
                dense_bytes_per_step=r["dense_bytes_per_step"],
                sent_per_step_after_warmup=None, link=link)


def run_link(link, methods, args):
    rate = LINKS[link]
    if args.glue == "ddp":
        with (two_hosts(rate, n=args.np) if rate else shaped_link(None)) as where:
            launch = (ddp_launch(None, where, args.np) if rate
                      else ddp_launch(where, None, args.np))
            return [ddp_row(m, args, launch, link) for m in methods]
    setup = two_hosts(rate, n=args.np) if rate else shaped_link(None)
    with setup as where, tempfile.TemporaryDirectory() as tmp:
        launch = hosts_launch(where) if rate else horovodrun_launch(where, args.np)
        out = os.path.join(tmp, "rows.json")
        argv = [sys.executable, str(ROOT / "benchmarks" / "time_to_loss_worker.py"),
                "--methods", ";".join(methods), "--steps", str(args.steps),
                "--eval-every", str(args.eval_every), "--warmup", args.warmup,
                "--momentum-args", args.momentum_args, "--seed", str(args.seed),
                "--lr", str(args.lr), "--out", out] + model_args(args)
        rc, stdout, stderr = launch(argv, args.timeout)
        for line in stdout.splitlines():
            if "<stdout>:" in line:
                print(f"  [{link}]" + line.split("<stdout>:", 1)[1], flush=True)
        if rc != 0 or not os.path.exists(out):
            raise RuntimeError(f"the job failed ({rc}) on {link}:\n{stderr[-3000:]}")
        with open(out) as f:
            rows = json.load(f)
    for r in rows:
        r["link"] = link
    return rows


def model_args(args):
    """The GPT-2's shape, for the worker or examples/ddp_gpt2.py."""
    return ["--width", str(args.width), "--layers", str(args.layers)]


def time_to(curve, target):
    """Training seconds of the first evaluation at or below ``target`` (None: never)."""
    return next((s for _, s, loss in curve if loss <= target), None)


def summarise(rows, target_step):
    """Per link: target from dense, then each method's figures (mutates rows)."""
    for link in {r["link"] for r in rows}:
        sel = [r for r in rows if r["link"] == link]
        dense = next((r for r in sel if r["method"] == "none"), None)
        if dense is None:
            continue
        target = next(loss for step, _, loss in dense["curve"] if step >= target_step)
        base_t = time_to(dense["curve"], target)
        for r in sel:
            r["target_loss"], r["target_step"] = target, target_step
            r["final_loss"] = r["curve"][-1][2]
            r["final_vs_dense"] = r["final_loss"] / dense["curve"][-1][2]
            r["time_to_target_s"] = t = time_to(r["curve"], target)
            r["speedup_vs_dense"] = base_t / t if t else None
            sent = r["sent_per_step_after_warmup"] or r["total_sent"] / len(r["step_s"])
            r["bytes_ratio_after_warmup"] = r["dense_bytes_per_step"] / sent if sent else None
            r["median_step_s"] = sorted(r["step_s"])[len(r["step_s"]) // 2]
            after = sorted(r["step_s"][r["warmup_steps"] or 0:]) or [0.0]
            r["median_step_after_warmup_s"] = after[len(after) // 2]


def table(rows, link):
    sel = [r for r in rows if r["link"] == link]
    if not sel:
        return ""
    t = sel[0].get("target_loss")
    lines = [f"\n### {link} (target: dense loss at step {sel[0].get('target_step')} = "
             f"{t:.4f})\n" if t else f"\n### {link}\n",
             "| method | warm-up steps | val loss at end | × dense | bytes/step after warm-up "
             "| × fewer | median step ms after warm-up | s to target | speed-up |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in sel:
        ttt = r.get("time_to_target_s")
        sp = r.get("speedup_vs_dense")
        lines.append(
            f"| {r['method']} | {r['warmup_steps'] or '-'} | {r['final_loss']:.4f} | "
            f"{r['final_vs_dense']:.3f} | {(r['sent_per_step_after_warmup'] or r['total_sent'] / len(r['step_s'])):,.0f} | "
            f"{r['bytes_ratio_after_warmup']:.1f} | {1000 * r['median_step_after_warmup_s']:.0f} | "
            f"{'never' if ttt is None else f'{ttt:.1f}'} | {'-' if sp is None else f'{sp:.2f}x'} |")
    return "\n".join(lines)


def plot(rows, links, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, len(links), figsize=(6 * len(links), 8), squeeze=False)
    for j, link in enumerate(links):
        for r in [r for r in rows if r["link"] == link]:
            steps, secs, loss = zip(*r["curve"])
            axes[0][j].plot(secs, loss, marker=".", label=r["method"])
            axes[1][j].plot(steps, loss, marker=".", label=r["method"])
        t = next((r.get("target_loss") for r in rows if r["link"] == link), None)
        for i, xl in enumerate(("training seconds", "step")):
            ax = axes[i][j]
            if t:
                ax.axhline(t, color="gray", linestyle=":", label="target")
            ax.set_xlabel(xl)
            ax.set_ylabel("validation loss")
            ax.set_title(link)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    import signal
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--links", default=",".join(LINKS))
    p.add_argument("--glue", choices=("horovod", "ddp"), default="horovod",
                   help="horovodrun with hvd_compress.torch.DistributedOptimizer, or "
                        "PyTorch DDP with examples/ddp_gpt2.py")
    p.add_argument("--methods", default=None, help="separated by ';' (default: all)")
    p.add_argument("--quick-methods", action="store_true", help=f"only {';'.join(QUICK)}")
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--steps-100mbit", type=int, default=300,
                   help="steps on 100mbit-2host (dense takes ~1 s a step there)")
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--target-step", type=int, default=250,
                   help="the target is dense's validation loss at this step")
    p.add_argument("--warmup", default="100",
                   help="compressed_momentum's warm-up: dense steps, or 'auto'")
    p.add_argument("--momentum-args", default="{}",
                   help='more of compressed_momentum\'s arguments, as JSON: \'{"refresh": 25}\'')
    p.add_argument("--seed", type=int, default=0,
                   help="initial weights and batches (examples/gpt2_text.py): 0, the recorded "
                        "runs'; another, others (one seed does not rank methods whose losses "
                        "differ by less than ~0.2)")
    p.add_argument("--np", type=int, default=2,
                   help="workers; on a shaped link each is its own host, every host's link "
                        "shaped to the rate both ways (2 CPU cores here: more workers, "
                        "slower steps for every method alike)")
    p.add_argument("--lr", type=float, default=1e-3,
                   help="AdamW's learning rate; a method's own: METHOD@LR")
    p.add_argument("--width", type=int, default=256, help="the GPT-2's width")
    p.add_argument("--layers", type=int, default=4, help="the GPT-2's layers")
    p.add_argument("--timeout", type=int, default=3600)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--name", default="time_to_loss")
    args = p.parse_args()
    links = [link for link in args.links.split(",") if link]
    bad = [link for link in links if link not in LINKS]
    if bad:
        p.error(f"unknown link(s) {bad}: use {','.join(LINKS)}")
    if args.np < 2:
        p.error(f"--np must be at least 2 workers, got {args.np}")
    methods = args.methods.split(";") if args.methods else (QUICK if args.quick_methods
                                                             else METHODS)
    for m in methods:
        try:
            method_lr(m, args.lr)
        except ValueError as e:
            p.error(str(e))
    if any(LINKS[link] for link in links) and os.geteuid() != 0:
        print("not root: shaped links need network namespaces and tc; plain loopback only")
        links = ["plain"]
    rows = []
    steps = args.steps
    for link in links:
        args.steps = args.steps_100mbit if link == "100mbit-2host" else steps
        rows += run_link(link, methods, args)
    summarise(rows, args.target_step)
    import torch
    import transformers
    info = dict(date=datetime.date.today().isoformat(), torch=torch.__version__,
                transformers=transformers.__version__, cpus=os.cpu_count(), workers=args.np,
                width=args.width, layers=args.layers, threads_per_worker=1, glue=args.glue,
                links=links, steps=steps,
                steps_100mbit=args.steps_100mbit, warmup=args.warmup,
                momentum_args=args.momentum_args, seed=args.seed, lr=args.lr,
                target_step=args.target_step, rows=rows)
    for link in links:
        print(table(rows, link))
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"{args.name}_{info['date']}")
    with open(stem + ".json", "w") as f:
        json.dump(info, f, indent=1)
    plot(rows, links, stem + ".png")
    print(f"\nwrote {stem}.json and .png")


if __name__ == "__main__":
    main()
