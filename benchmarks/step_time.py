"""Does compression make a training step faster?  Median step time under
``horovodrun -np 2 --gloo`` per compressor and model, on plain loopback and on loopback
shaped to 1 Gbit/s and 100 Mbit/s, split into compute / compress / communicate /
decompress (see benchmarks/step_time_worker.py for what each part holds).  Links
``1gbit-2host`` and ``100mbit-2host`` put each worker on its own "host" (a network
namespace) joined by a full-duplex link of that rate, launched by
hvd_compress.tools.shaped_link.run_on_hosts instead of horovodrun; a shaped loopback sends both
directions through one bucket, so it is about 2x slower per byte than these.

    python benchmarks/step_time.py                     # everything (about 15-25 minutes)
    python benchmarks/step_time.py --links plain --models cnn_mlp_large --quick
    python benchmarks/step_time.py --links plain,1gbit --models transformer   # torch's own
                                                  # nn.TransformerEncoder, 4.5M parameters
    python benchmarks/step_time.py --specs "none;topk:density=0.01@0;topk:density=0.01"
                                                  # "@0": bucket_mb=0 (tensor by tensor)
    python benchmarks/step_time.py --specs "none;laplace_topk:density=0.01;cu:laplace_topk:density=0.01"
                                                  # "cu:": compressed_update=True
    python benchmarks/step_time.py --np 3 --links 1gbit --name step_time_agg \
        --specs "none;topk:density=0.01;topk:density=0.01,agg=leader"   # 3 workers
    python benchmarks/step_time.py --links 1gbit,1gbit-2host --models cnn_mlp_large
    python benchmarks/step_time.py --links 100mbit-2host --np 4 --per-host 2 \
        --models cnn_mlp_large --specs "none;laplace_topk:density=0.01;hier:laplace_topk:density=0.01"
                          # 2 hosts x 2 workers: flat vs hierarchical (issue 28)
    python benchmarks/step_time.py --change-link 1gbit:100mbit@8 --models cnn_mlp_large
                          # two hosts at 1 Gbit/s for 8 measured steps, then 100 Mbit/s

A link that changes mid-run (``--change-link R1:R2@N``, two hosts): for each compressor
the job runs N measured steps at R1, the benchmark lowers the link to R2 (``tc qdisc
replace`` on each host's device, from this process, while the job waits between two
steps), and the job runs ``--change-skip`` steps (not counted) and N more; the table
reports the median of each phase separately (rows "phase 1 (R1)" and "phase 2 (R2)").
Only the change link runs unless ``--links`` is given too.

Every compressor of a (link, model) pair runs in one launch (horovodrun, or the two-host
launcher), one after the other on the same processes.  ``horovod`` is Horovod's own
DistributedOptimizer without compression: the speed users have without this project.
Shaped links need root (network namespaces with ``tc ... tbf``,
hvd_compress/tools/shaped_link.py); without it the script says so and measures plain loopback
only.  Two workers share this machine's cores
(one thread each), so absolute times are CPU times; ratios between compressors of the
same run are the result.  Prints a table per link and writes
benchmarks/results/step_time_<date>.json and .png (stacked bars).
"""
import sys
from pathlib import Path

sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse  # noqa: E402
import datetime  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from hvd_compress.tools.shaped_link import (check_rate, run_on_hosts, shaped_link,  # noqa: E402
                                      two_hosts)

SPECS = ["horovod", "none", "fp16", "topk:density=0.01", "laplace_topk:density=0.01",
         "laplace_topk:density=0.01,values=rangefloat8", "dct:density=0.01,block=64",
         "twobit", "hylo", "rangefloat:bits=8",
         # peer baselines (hvd_compress.compressors.lowrank / stochastic / sign)
         "powersgd:rank=4", "qsgd", "terngrad", "signsgd", "onebit"]
MODELS = ["mnist_cnn", "vgg_small", "resnet_small", "cnn_mlp_large"]
LINKS = {"plain": None, "1gbit": "1gbit", "100mbit": "100mbit"}
# one worker per host, hosts joined by a full-duplex link (hvd_compress.tools.shaped_link.two_hosts)
TWO_HOST_LINKS = {"1gbit-2host": "1gbit", "100mbit-2host": "100mbit", "10mbit-2host": "10mbit"}
# (measured steps, warm-up steps) per link and model: more steps where steps are short,
# so that every median is of several seconds of training where it can be
STEPS = {"plain": {"mnist_cnn": (60, 5), "vgg_small": (20, 3), "resnet_small": (20, 3),
                   "cnn_mlp_large": (15, 3)},
         "1gbit": {"mnist_cnn": (40, 5), "vgg_small": (12, 3), "resnet_small": (12, 3),
                   "cnn_mlp_large": (10, 3)},
         "100mbit": {"mnist_cnn": (30, 5), "vgg_small": (8, 2), "resnet_small": (8, 2),
                     "cnn_mlp_large": (6, 2)},
         "10mbit": {"mnist_cnn": (10, 2), "vgg_small": (4, 1), "resnet_small": (4, 1),
                    "cnn_mlp_large": (6, 2)}}
PARTS = ["compute", "compress", "communicate", "decompress", "other"]
CHANGE = re.compile(r"^([0-9.]+[a-z]+):([0-9.]+[a-z]+)@(\d+)$")


def parse_change(text):
    """``"1gbit:100mbit@8"`` -> ("1gbit", "100mbit", 8)."""
    m = CHANGE.match(text.strip().lower()) if text else None
    if not m or int(m.group(3)) < 1:
        raise ValueError(f"--change-link wants RATE1:RATE2@N such as 1gbit:100mbit@8, "
                         f"got {text!r}")
    return check_rate(m.group(1)), check_rate(m.group(2)), int(m.group(3))


def horovodrun_launch(prefix, workers):
    """Launch function: ``prefix + horovodrun -np W -H localhost:W --gloo python ...``."""
    horovodrun = str(Path(sys.executable).with_name("horovodrun"))

    def launch(worker_argv, timeout):
        done = subprocess.run(prefix + [horovodrun, "-np", str(workers), "-H",
                                        f"localhost:{workers}", "--gloo"] + worker_argv,
                              capture_output=True, text=True, timeout=timeout)
        return done.returncode, done.stdout, done.stderr
    return launch


def hosts_launch(hosts, per_host=1):
    """Launch function: ``per_host`` workers per host of ``hosts`` (shaped_link.run_on_hosts)."""
    def launch(worker_argv, timeout):
        out, err = io.StringIO(), io.StringIO()
        rc = run_on_hosts(hosts, worker_argv, timeout=timeout, stdout=out, stderr=err,
                          per_host=per_host)
        return rc, out.getvalue(), err.getvalue()
    return launch


class LinkChanger(threading.Thread):
    """Serves the worker's requests (benchmarks/step_time_worker.py ``--phase-dir``):
    on ``<k>.1`` sets the hosts' link to ``rates[0]``, on ``<k>.2`` to ``rates[1]``, then
    answers ``<k>.<phase>.done``."""

    def __init__(self, hosts, rates, phase_dir):
        super().__init__(daemon=True)
        self.hosts, self.rates, self.dir = hosts, rates, phase_dir
        self.stop = threading.Event()
        self.log, self.error = [], None

    def run(self):
        served = set()
        try:
            while not self.stop.is_set():
                for name in sorted(os.listdir(self.dir)):
                    if name.endswith(".done") or name in served:
                        continue
                    phase = int(name.rsplit(".", 1)[1])
                    t0 = time.perf_counter()
                    self.hosts.set_rate(self.rates[phase - 1])
                    self.log.append(dict(request=name, rate=self.rates[phase - 1],
                                         seconds=time.perf_counter() - t0))
                    open(os.path.join(self.dir, name + ".done"), "w").close()
                    served.add(name)
                time.sleep(0.01)
        except Exception as e:        # reported by run_pair; the worker times out waiting
            self.error = e


def run_pair(launch, link, model, specs, steps, warmup, timeout, phase=None):
    """Run benchmarks/step_time_worker.py for every spec in one launch; returns its rows.
    ``phase``: (hosts, rate1, rate2, n, skip) for a link that changes mid-run."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        argv = [sys.executable, str(ROOT / "benchmarks" / "step_time_worker.py"),
                "--model", model, "--specs", ";".join(specs), "--steps", str(steps),
                "--warmup", str(warmup), "--out", out]
        changer = None
        if phase:
            hosts, rate1, rate2, n, skip = phase
            phase_dir = os.path.join(tmp, "phases")
            os.mkdir(phase_dir)
            argv += ["--phase-dir", phase_dir, "--phase-after", str(n),
                     "--phase-skip", str(skip)]
            changer = LinkChanger(hosts, (rate1, rate2), phase_dir)
            changer.start()
        try:
            rc, stdout, stderr = launch(argv, timeout)
        finally:
            if changer:
                changer.stop.set()
                changer.join()
        for line in stdout.splitlines():
            if "<stdout>:" in line:
                print(f"  [{link}]" + line.split("<stdout>:", 1)[1], flush=True)
        if rc != 0 or not os.path.exists(out):
            why = (f"\nchanging the link failed: {changer.error!r}"
                   if changer and changer.error else "")
            raise RuntimeError(f"the job failed ({rc}) for {link}/{model}:\n"
                               + stderr[-3000:] + why)
        with open(out) as f:
            rows = json.load(f)
    for r in rows:
        r["link"] = link
    if not phase:
        return rows
    split = []
    for k, r in enumerate(rows):      # one row per phase: the medians of its steps
        changes = [c for c in changer.log if c["request"].split(".")[0] == str(k)]
        for i, (rate, ph) in enumerate(zip((rate1, rate2), r["phases"]), start=1):
            step_totals = r["step_totals"][:n] if i == 1 else r["step_totals"][n + skip:]
            split.append(dict(r, **ph, phase=i, phase_rate=rate, step_totals=step_totals,
                              skipped=0 if i == 1 else skip, link_changes=changes))
            for key in ("phases", "total_max_rank"):   # the latter is over both phases
                del split[-1][key]
    return split


def label(r):
    return f"phase {r['phase']} ({r['phase_rate']})" if "phase" in r else None


def table(rows, link):
    sel_link = [r for r in rows if r["link"] == link]
    phased = any("phase" in r for r in sel_link)
    hosts = any("host_tx" in r for r in sel_link)
    lines = [f"\n### {link}\n",
             "| model | compressor | " + ("phase | " if phased else "") + "step ms | × vs none "
             "| compute | compress | communicate | decompress | other | bytes sent / step |"
             + (" link bytes / host / step |" if hosts else ""),
             "|---|---|---|---|---|---|---|---|---|---|" + ("---|" if phased else "")
             + ("---|" if hosts else "")]
    for model in dict.fromkeys(r["model"] for r in sel_link):
        sel = [r for r in sel_link if r["model"] == model]
        for r in sel:
            base = next((b["total"] for b in sel
                         if b["spec"] == "none" and b.get("phase") == r.get("phase")), None)
            ratio = f"{base / r['total']:.2f}×" if base else "-"
            lines.append(f"| {model} | {r['spec']} | " + (f"{label(r)} | " if phased else "")
                         + f"{1e3 * r['total']:.1f} | {ratio} | "
                         + " | ".join(f"{1e3 * r[p]:.1f}" for p in PARTS)
                         + f" | {r['sent']:,.0f} |"
                         + (f" {r.get('host_tx', 0):,.0f} |" if hosts else ""))
    return "\n".join(lines)


def short(r):
    """A row's bar label: its spec, shortened, and the rate of its phase if it has one."""
    spec = (r["spec"].replace(":density=0.01", "").replace(",values=rangefloat8", "+rf8")
            .replace(",block=64", ""))
    return spec + (f" @{r['phase_rate']}" if "phase" in r else "")


def plot(rows, links, models, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(links), len(models), figsize=(4.2 * len(models), 3.6 * len(links)),
                             squeeze=False)
    colors = dict(compute="#4c72b0", compress="#dd8452", communicate="#c44e52",
                  decompress="#8172b3", other="#bbbbbb")
    for i, link in enumerate(links):
        for j, model in enumerate(models):
            ax = axes[i][j]
            sel = [r for r in rows if r["link"] == link and r["model"] == model]
            bottom = [0.0] * len(sel)
            for part in PARTS:
                vals = [1e3 * r[part] for r in sel]
                ax.bar(range(len(sel)), vals, bottom=bottom, color=colors[part],
                       label=part if (i, j) == (0, 0) else None)
                bottom = [b + v for b, v in zip(bottom, vals)]
            ax.set_xticks(range(len(sel)), [short(r) for r in sel],
                          rotation=60, ha="right", fontsize=7)
            ax.set_title(f"{model} — {link}", fontsize=9)
            if j == 0:
                ax.set_ylabel("median step ms")
    narrow = len(models) == 1              # one column: the legend takes two lines
    fig.legend(loc="upper center", ncol=3 if narrow else len(PARTS), fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.97 - (0.06 / len(links) if narrow else 0)))
    fig.savefig(path, dpi=100)


def main():
    # killed by SIGTERM: unwind through the link helpers' clean-up (namespaces removed)
    import signal
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    # Gloo's 30 s per collective is less than broadcasting a 25 MB model at 10 Mbit/s
    os.environ.setdefault("HOROVOD_GLOO_TIMEOUT_SECONDS", "600")
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--links", default=None,
                   help=f"of {','.join([*LINKS, *TWO_HOST_LINKS])} (default: "
                        f"{','.join(LINKS)}; none with --change-link)")
    p.add_argument("--change-link", default=None, metavar="R1:R2@N",
                   help="two hosts at R1 for N measured steps, then at R2 for N more, per "
                        "compressor (e.g. 1gbit:100mbit@8); medians per phase")
    p.add_argument("--change-skip", type=int, default=2,
                   help="steps after the change left out of phase 2's medians")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--specs", default=";".join(SPECS), help="separated by ';'")
    p.add_argument("--quick", action="store_true",
                   help="3 steps after 1 warm-up (--change-link: its N, 1 warm-up)")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per launch")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--np", type=int, default=2, dest="workers",
                   help="workers (horovodrun -np), one thread each")
    p.add_argument("--per-host", type=int, default=1,
                   help="-2host links: workers per host (--np of them in all), e.g. --np 4 "
                        "--per-host 2 for 2 hosts x 2 workers")
    p.add_argument("--name", default="step_time", help="results file stem (before the date)")
    args = p.parse_args()
    try:
        change = parse_change(args.change_link) if args.change_link else None
    except ValueError as e:
        p.error(str(e))
    if args.links is None:
        links = [] if change else list(LINKS)
    else:
        links = [link for link in args.links.split(",") if link]
    unknown = [link for link in links if link not in LINKS and link not in TWO_HOST_LINKS]
    if unknown:
        p.error(f"unknown link(s) {unknown}: use {','.join([*LINKS, *TWO_HOST_LINKS])}")
    models, specs = args.models.split(","), args.specs.split(";")
    if args.per_host < 1 or args.workers % args.per_host:
        p.error(f"--per-host {args.per_host} must divide --np {args.workers}")
    if (change or any(LINKS.get(link) or link in TWO_HOST_LINKS for link in links)) \
            and os.geteuid() != 0:
        print("not root: shaped links need network namespaces and tc; measuring plain "
              "loopback only", flush=True)
        links, change = ["plain"], None
    rows = []
    for link in links:
        if link in TWO_HOST_LINKS:
            setup = two_hosts(TWO_HOST_LINKS[link], n=args.workers // args.per_host)
        else:
            setup = shaped_link(LINKS[link])
        with setup as where:
            launch = (hosts_launch(where, args.per_host) if link in TWO_HOST_LINKS
                      else horovodrun_launch(where, args.workers))
            for model in models:
                steps_of = STEPS[link.replace("-2host", "")]
                steps, warmup = (3, 1) if args.quick else steps_of.get(model, (10, 3))
                rows += run_pair(launch, link, model, specs, steps, warmup, args.timeout)
    if change:
        rate1, rate2, n = change
        link = f"{rate1}-then-{rate2}-2host"
        links.append(link)
        with two_hosts(rate1, n=args.workers) as hosts:
            for model in models:
                rows += run_pair(hosts_launch(hosts), link, model, specs,
                                 2 * n + args.change_skip, 1 if args.quick else 2,
                                 args.timeout, (hosts, rate1, rate2, n, args.change_skip))
    import torch
    import horovod
    info = dict(date=datetime.date.today().isoformat(), torch=torch.__version__,
                horovod=horovod.__version__, cpus=os.cpu_count(), workers=args.workers,
                per_host=args.per_host,
                threads_per_worker=1, links=links, change_link=args.change_link,
                change_skip=args.change_skip if change else None, rows=rows)
    for link in links:
        print(table(rows, link))
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"{args.name}_{info['date']}")
    with open(stem + ".json", "w") as f:
        json.dump(info, f, indent=1)
    plot(rows, links, models, stem + ".png")
    print(f"\nwrote {stem}.json and .png")


if __name__ == "__main__":
    main()
