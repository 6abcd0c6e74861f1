"""Run a command on a slow link: a network namespace whose loopback is shaped by a
token bucket (``tc ... tbf``), created for the command and always removed afterwards.

Gradient compression pays on slow links; on one machine's loopback (tens of GB/s) it
rarely does.  To see what it does for *your* job at 1 Gbit/s or 100 Mbit/s::

    sudo python -m hvd_compress.shaped_link --rate 1gbit -- \\
        horovodrun -np 2 -H localhost:2 --gloo python train.py

or from Python::

    from hvd_compress.shaped_link import shaped_link
    with shaped_link("100mbit") as prefix:          # ["ip", "netns", "exec", NAME]
        subprocess.run(prefix + ["horovodrun", ...], check=True)

What it sets up (root is needed: ``ip netns`` and ``tc``)::

    ip netns add NAME
    ip netns exec NAME ip link set lo up
    ip netns exec NAME ip link set lo mtu 9000
    ip netns exec NAME tc qdisc add dev lo root tbf rate RATE burst 1mb latency 2000ms

Facts behind the recipe (checked on this project's machines): the ``netem`` qdisc is
not available in their kernel, so there is no added delay, only a rate; with the default
64 KiB loopback MTU and a small burst, Gloo times out (a packet larger than the burst is
never sent), hence MTU 9000 and a 1 MB burst.  Both directions of the loopback share the
one bucket, like a shared (half-duplex) link: a 2-worker ring pays twice for each byte,
so a shaped loopback at 1 Gbit/s is slower than two hosts on a 1 Gbit/s full-duplex link.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
from contextlib import contextmanager

RATE = re.compile(r"^\d+(\.\d+)?(bit|kbit|mbit|gbit|tbit|bps|kbps|mbps|gbps|tbps)$")


class ShapedLinkError(RuntimeError):
    """The namespace or the qdisc could not be set up (the message says why)."""


def check_rate(rate):
    """Return ``rate`` (a tc rate such as ``1gbit`` or ``100mbit``) or raise ValueError."""
    if not isinstance(rate, str) or not RATE.match(rate.lower()):
        raise ValueError(f"rate must be a tc rate such as '1gbit', '100mbit' or '500kbit', "
                         f"got {rate!r}")
    return rate.lower()


def _run(argv):
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise ShapedLinkError(f"{' '.join(argv)} failed ({done.returncode}): "
                              f"{(done.stderr or done.stdout).strip()}")


def namespaces():
    """Names of the network namespaces that exist now."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


@contextmanager
def shaped_link(rate, name=None, burst="1mb", mtu=9000, latency="2000ms"):
    """Context manager: a namespace ``name`` whose loopback runs at ``rate``.

    Yields the argv prefix that runs a command inside it (``ip netns exec NAME``).
    The namespace is removed on exit, also when the body raises.  ``rate=None``
    yields ``[]``: the plain loopback, nothing is set up.
    """
    if rate is None:
        yield []
        return
    rate = check_rate(rate)
    if os.geteuid() != 0:
        raise PermissionError(
            "shaped_link needs root: it creates a network namespace (ip netns add) and "
            "shapes its loopback (tc qdisc ... tbf). Run as root, or measure on the "
            "plain loopback (rate=None).")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise ShapedLinkError(f"shaped_link needs the '{tool}' command (Debian: iproute2)")
    name = name or f"hvdc-{os.getpid()}-{rate}"
    if name in namespaces():
        raise ShapedLinkError(f"network namespace {name!r} already exists")
    _run(["ip", "netns", "add", name])
    try:
        prefix = ["ip", "netns", "exec", name]
        _run(prefix + ["ip", "link", "set", "lo", "up"])
        _run(prefix + ["ip", "link", "set", "lo", "mtu", str(int(mtu))])
        _run(prefix + ["tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", rate,
                       "burst", burst, "latency", latency])
        yield prefix
    finally:
        subprocess.run(["ip", "netns", "delete", name], capture_output=True)


def run(argv, rate, **kwargs):
    """Run ``argv`` inside a fresh shaped namespace; returns its ``CompletedProcess``."""
    with shaped_link(rate) as prefix:
        return subprocess.run(prefix + list(argv), **kwargs)


def main(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m hvd_compress.shaped_link",
        description="Run a command on loopback shaped to RATE (network namespace + tc tbf); "
                    "the namespace is removed afterwards. Needs root.")
    p.add_argument("--rate", required=True, help="e.g. 1gbit, 100mbit")
    p.add_argument("--name", default=None, help="namespace name (default: hvdc-PID-RATE)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- command and arguments")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("give the command to run after --")
    try:
        with shaped_link(args.rate, name=args.name) as prefix:
            return subprocess.run(prefix + command).returncode
    except (PermissionError, ShapedLinkError, ValueError) as e:
        print(f"shaped_link: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
