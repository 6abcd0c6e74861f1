"""Where does coded SGD (CSSGD, seed 003) win?  Step time and bytes of the MNIST DNN of
examples/cssgd_mnist.py under ``horovodrun -np n --gloo`` for n = 3 and 4 workers and
every redundancy r, against SSGD (Horovod's float32 ring allreduce) in the same run, on
plain loopback and on loopback shaped to 100 Mbit/s.

    python benchmarks/cssgd.py                   # everything (about 15-20 minutes)
    python benchmarks/cssgd.py --np 3 --links plain --steps 20 --no-target

Per (n, link): SSGD, the paper's ``multicast`` exchange for r = 1 … n, the same
packets in one alltoall (``multicast_alltoall``, r < n), and the ``reduce_scatter``
variant for r = 2 … n−1.  Reported per worker and step: median step
time; the medians of the measured compute, encode+decode and communication seconds;
bytes sent (a multicast packet counted once, the paper's load), bytes received, and the bytes that really crossed the
loopback (``/proc/net/dev`` of the namespace, all ranks' traffic divided by n: Gloo's
process-set allgather forwards packets around a ring, so a packet meant for r receivers
is sent r times).  The step times of the multicast runs (r < n) are fitted to the paper's
``t(r) = r·T_calc + T_comm/r`` (least squares), with its optimal r, and to this
transport's ``r·T_calc + C(n−1, r)·T_part``.  Then the time to a
target accuracy of SSGD and of the fastest CSSGD on the shaped link.

Workers share this machine's 2 cores (one thread each), so compute is slower with more
workers and absolute times are CPU times; ratios within a run are the result.  Writes
benchmarks/results/cssgd_<date>.json and .png.
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
from math import comb  # noqa: E402

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from hvd_compress.tools.shaped_link import shaped_link  # noqa: E402

LINKS = {"plain": None, "100mbit": "100mbit"}


def launch(prefix, n, extra, timeout=1800):
    """One horovodrun of examples/cssgd_mnist.py; returns its JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.json")
        python = sys.executable
        argv = prefix + [str(Path(python).with_name("horovodrun")), "-np", str(n), "-H",
                         f"localhost:{n}", "--gloo", python, str(ROOT / "examples/cssgd_mnist.py"),
                         "--no-progress", "--json", out, *extra]
        env = dict(os.environ, HOROVOD_DYNAMIC_PROCESS_SETS="1", OMP_NUM_THREADS="1",
                   TF_CPP_MIN_LOG_LEVEL="2")
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
        if done.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"horovodrun failed ({done.returncode}): {' '.join(extra)}\n"
                               + done.stderr[-3000:])
        with open(out) as f:
            return json.load(f)


def configs(n):
    yield "ssgd", 1
    for r in range(1, n + 1):
        yield "multicast", r
    for r in range(1, n):
        yield "multicast_alltoall", r
    for r in range(2, n):
        yield "reduce_scatter", r


def measure(prefix, link, n, steps):
    rows = []
    for exchange, r in configs(n):
        d = launch(prefix, n, ["--exchange", exchange, "-r", str(r), "--steps", str(steps)])
        last = d["epochs_log"][-1]
        split = np.array(d["step_split_s"][5:])      # per step: compute, encode+decode, comm.
        row = dict(link=link, n=n, exchange=exchange, r=r,
                   step_ms=1e3 * float(np.median(d["step_s"][5:])),
                   compute_ms=1e3 * float(np.median(split[:, 0])),
                   codec_ms=1e3 * float(np.median(split[:, 1])),
                   communicate_ms=1e3 * float(np.median(split[:, 2])),
                   sent_kB=last["sent_per_step"] / 1e3, received_kB=last["received_per_step"] / 1e3,
                   ring_kB=last["ring_per_step"] / 1e3,
                   wire_kB=d["loopback_bytes_per_step"] / n / 1e3,
                   paper_load=(1 / r) * (1 - r / n), parts=comb(n, r))
        rows.append(row)
        print(f"  [{link} n={n}] {exchange:14s} r={r}: {row['step_ms']:7.1f} ms/step  "
              f"compute {row['compute_ms']:6.1f}  communicate {row['communicate_ms']:6.1f}  "
              f"sent {row['sent_kB']:7.0f} kB  wire {row['wire_kB']:7.0f} kB", flush=True)
    base = next(r for r in rows if r["exchange"] == "ssgd")
    for r in rows:
        r["speedup_vs_ssgd"] = base["step_ms"] / r["step_ms"]
    return rows


def fit(rows):
    """Least squares over the multicast rows with r < n of two models of the step time:
    the paper's ``r·a + b/r`` (communication falls as 1/r: one multicast packet serves r
    receivers) and this transport's ``r·a + C(n−1, r)·b`` (point-to-point TCP: a worker
    moves C(n−1, r) whole parts' worth of bytes).  Each with its RMS residual."""
    sel = [r for r in rows if r["exchange"] == "multicast" and r["r"] < r["n"]]
    t = np.array([r["step_ms"] for r in sel])
    out = dict(points=len(sel))
    for name, col in (("paper", lambda r: 1 / r["r"]),
                      ("transport", lambda r: comb(r["n"] - 1, r["r"]))):
        A = np.array([[r["r"], col(r)] for r in sel], dtype=float)
        (a, b), *_ = np.linalg.lstsq(A, t, rcond=None)
        rms = float(np.sqrt(np.mean((A @ [a, b] - t) ** 2)))
        out[name] = dict(T_calc_ms=float(a), T_comm_ms=float(b), rms_ms=rms)
    p = out["paper"]
    out["r_opt"] = float(np.sqrt(p["T_comm_ms"] / p["T_calc_ms"])) \
        if p["T_calc_ms"] > 0 and p["T_comm_ms"] > 0 else None
    return out


def table(rows, fits):
    out = []
    for (link, n), f in fits.items():
        p, q = f["paper"], f["transport"]
        out.append(f"\n### {link}, n = {n}\n\nfit of the multicast step times: paper "
                   f"t(r) = {p['T_calc_ms']:.1f}·r + {p['T_comm_ms']:.1f}/r ms (RMS "
                   f"{p['rms_ms']:.1f} ms, optimal r "
                   + (f"{f['r_opt']:.2f}" if f["r_opt"] else "-") + f"); transport t(r) = "
                   f"{q['T_calc_ms']:.1f}·r + {q['T_comm_ms']:.1f}·C(n-1, r) ms (RMS "
                   f"{q['rms_ms']:.1f} ms)\n")
        out.append("| exchange | r | step ms | vs SSGD | compute ms | encode+decode ms | "
                   "communicate ms | sent kB | received kB | on the wire kB | ring allreduce kB "
                   "| paper load |")
        out.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            if (r["link"], r["n"]) != (link, n):
                continue
            out.append(f"| {r['exchange']} | {r['r']} | {r['step_ms']:.1f} | "
                       f"{r['speedup_vs_ssgd']:.2f}x | {r['compute_ms']:.1f} | {r['codec_ms']:.1f} | "
                       f"{r['communicate_ms']:.1f} | {r['sent_kB']:.0f} | {r['received_kB']:.0f} | "
                       f"{r['wire_kB']:.0f} | {r['ring_kB']:.0f} | {r['paper_load']:.3f} |")
    return "\n".join(out)


def plot(rows, fits, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    keys = list(fits)
    fig, axes = plt.subplots(1, len(keys), figsize=(4.5 * len(keys), 3.8), squeeze=False)
    for ax, key in zip(axes[0], keys):
        sel = [r for r in rows if (r["link"], r["n"]) == key]
        for ex, style in (("multicast", "o-"), ("multicast_alltoall", "^-"),
                          ("reduce_scatter", "s--")):
            pts = [(r["r"], r["step_ms"]) for r in sel if r["exchange"] == ex]
            if pts:
                ax.plot(*zip(*pts), style, label=ex)
        ssgd = next(r["step_ms"] for r in sel if r["exchange"] == "ssgd")
        ax.axhline(ssgd, color="k", lw=1, label="SSGD (ring allreduce)")
        f = fits[key]["paper"]
        rr = np.linspace(1, key[1] - 1, 50)
        ax.plot(rr, f["T_calc_ms"] * rr + f["T_comm_ms"] / rr, ":", color="gray",
                label="paper's fit r·T_calc + T_comm/r")
        f = fits[key]["transport"]
        ri = np.arange(1, key[1])
        ax.plot(ri, [f["T_calc_ms"] * r + f["T_comm_ms"] * comb(key[1] - 1, r) for r in ri],
                "x", color="gray", label="fit r·T_calc + C(n-1,r)·T_part")
        ax.set(title=f"{key[0]}, n = {key[1]}", xlabel="redundancy r", ylabel="ms per step")
        ax.set_xticks(range(1, key[1] + 1))
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--np", default="3,4", help="worker counts, e.g. 3,4")
    p.add_argument("--links", default=",".join(LINKS))
    p.add_argument("--steps", type=int, default=40, help="steps per run (the first 5 are warm-up)")
    p.add_argument("--target", type=float, default=0.9)
    p.add_argument("--epochs", type=int, default=8, help="at most, for the time to target")
    p.add_argument("--no-target", action="store_true", help="skip the time-to-target runs")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--from-json", default=None,
                   help="no measurement: table, fits and plot again from a results JSON")
    args = p.parse_args()
    if args.from_json:
        with open(args.from_json) as f:
            info = json.load(f)
        keys = sorted({(r["link"], r["n"]) for r in info["rows"]},
                      key=lambda k: (list(LINKS).index(k[0]), k[1]))
        fits = {k: fit([r for r in info["rows"] if (r["link"], r["n"]) == k]) for k in keys}
        info["fits"] = [dict(link=k[0], n=k[1], **v) for k, v in fits.items()]
        print(table(info["rows"], fits))
        with open(args.from_json, "w") as f:
            json.dump(info, f, indent=1)
        plot(info["rows"], fits, args.from_json[:-len(".json")] + ".png")
        return
    links = args.links.split(",")
    if any(LINKS.get(link) for link in links) and os.geteuid() != 0:
        print("not root: shaped links need a network namespace and tc; plain loopback only")
        links = ["plain"]
    rows, fits, targets = [], {}, []
    for link in links:
        with shaped_link(LINKS[link]) as prefix:
            for n in map(int, args.np.split(",")):
                sel = measure(prefix, link, n, args.steps)
                rows += sel
                fits[(link, n)] = fit(sel)
                if args.no_target or link != links[-1]:
                    continue
                best = min((r for r in sel if r["exchange"] != "ssgd" and r["r"] < n),
                           key=lambda r: r["step_ms"])
                for ex, r in (("ssgd", 1), (best["exchange"], best["r"])):
                    d = launch(prefix, n, ["--exchange", ex, "-r", str(r), "--epochs",
                                           str(args.epochs), "--target", str(args.target)])
                    targets.append(dict(link=link, n=n, exchange=ex, r=r,
                                        time_to_target_s=d["time_to_target_s"],
                                        final_accuracy=d["epochs_log"][-1]["test_accuracy"]))
                    print(f"  [{link} n={n}] time to {args.target:.0%}: {ex} r={r}: "
                          f"{d['time_to_target_s']} s", flush=True)
    import horovod
    import torch
    info = dict(date=datetime.date.today().isoformat(), torch=torch.__version__,
                horovod=horovod.__version__, cpus=os.cpu_count(), threads_per_worker=1,
                model="MNIST DNN 784-128-64-10 (examples/cssgd_mnist.py)", batch_size=96,
                steps=args.steps, rows=rows,
                fits=[dict(link=k[0], n=k[1], **v) for k, v in fits.items()],
                time_to_target=targets, target=args.target)
    print(table(rows, fits))
    for t in targets:
        print(f"time to {args.target:.0%} ({t['link']}, n={t['n']}): {t['exchange']} r={t['r']}: "
              f"{t['time_to_target_s']} s, final accuracy {100 * t['final_accuracy']:.2f}%")
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"cssgd_{info['date']}")
    with open(stem + ".json", "w") as f:
        json.dump(info, f, indent=1)
    plot(rows, fits, stem + ".png")
    print(f"\nwrote {stem}.json and .png")


if __name__ == "__main__":
    main()
