"""Run a job on a slow link, on one machine: network namespaces and tc's token bucket
(``tc ... tbf``), created for the job and always removed afterwards.  Two modes:

**Shaped loopback** (``shaped_link``): one namespace whose loopback runs at RATE; run
``horovodrun`` inside it::

    sudo python -m hvd_compress.tools.shaped_link --rate 1gbit -- \\
        horovodrun -np 2 -H localhost:2 --gloo python train.py

    from hvd_compress.tools.shaped_link import shaped_link
    with shaped_link("100mbit") as prefix:          # ["ip", "netns", "exec", NAME]
        subprocess.run(prefix + ["horovodrun", ...], check=True)

**Two hosts** (``two_hosts``, ``run_on_hosts``, ``run_two_hosts``): one namespace per
"host", joined by a full-duplex link of RATE each way, and a launcher that starts one
worker per host, as ``horovodrun --gloo -H host0:1,host1:1`` would over ssh.  The
launcher *replaces* horovodrun: give it the training command itself::

    sudo python -m hvd_compress.tools.shaped_link --rate 1gbit --hosts 2 -- python train.py
    sudo python -m hvd_compress.tools.shaped_link --rate 100mbit --hosts 2 --per-host 2 \\
        -- python train.py        # 2 hosts x 2 workers: only the hosts' link is shaped

    from hvd_compress.tools.shaped_link import run_two_hosts
    rc = run_two_hosts(["python", "train.py"], "1gbit", np=2, timeout=600)

Why two modes.  A loopback is one device: both directions of every connection go
through its one bucket, like a shared (half-duplex) link, so a 2-worker ring, which
sends every byte once each way at the same time, pays twice for each byte: a shaped
loopback at 1 Gbit/s is slower than two hosts on a 1 Gbit/s full-duplex link.  Two
hosts have a veth pair between them, each end with its own bucket (a veth end's qdisc
shapes what leaves through it), so each direction has the full rate, as on a switched
Ethernet link.

What the shaped loopback sets up (root is needed: ``ip netns`` and ``tc``)::

    ip netns add NAME
    ip netns exec NAME ip link set lo up
    ip netns exec NAME ip link set lo mtu 9000
    ip netns exec NAME tc qdisc add dev lo root tbf rate RATE burst 1mb latency 2000ms

What two hosts set up (n=2; ``NAME-h0``, ``NAME-h1`` are the hosts)::

    ip netns add NAME-h0; ip netns add NAME-h1
    ip link add hvd0 netns NAME-h0 type veth peer name hvd0 netns NAME-h1
    # in each host i (address 10.77.0.(i+1)/24):
    ip link set lo up; ip link set hvd0 mtu 9000 up; ip addr add 10.77.0.(i+1)/24 dev hvd0
    tc qdisc add dev hvd0 root tbf rate RATE burst 1mb latency 2000ms
    /etc/netns/NAME-hi/hosts:  "10.77.0.(i+1) HOSTNAME" (+ localhost)

For n > 2 the hosts are joined through a bridge in a namespace ``NAME-sw`` (a switch):
host i's ``hvd0`` is peered with port ``p<i>`` of the bridge; ``hvd0`` is shaped (what
host i sends) and so is ``p<i>`` (what host i receives), so every host has RATE up and
RATE down, as on a switch with full-duplex ports.

Why the hosts file.  ``ip netns exec`` bind-mounts ``/etc/netns/NAME/hosts`` over
``/etc/hosts``; without it the machine's hostname resolves to the same address in every
namespace (here 127.0.0.1), and Horovod 0.28.1's per-process-set Gloo context ignores
``HOROVOD_GLOO_IFACE`` and listens on whatever the hostname resolves to: the workers
would tell each other to connect to 127.0.0.1, which in another namespace is nobody.

Facts behind the recipe (checked on this project's machines): the ``netem`` qdisc is
not available in their kernel, so there is no added delay, only a rate; with the default
64 KiB loopback MTU and a small burst, Gloo times out (a packet larger than the burst is
never sent), hence MTU 9000 and a 1 MB burst.
"""
import argparse
import ipaddress
import itertools
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field

RATE = re.compile(r"^\d+(\.\d+)?(bit|kbit|mbit|gbit|tbit|bps|kbps|mbps|gbps|tbps)$")
IFACE = "hvd0"                    # the link device's name inside every host namespace
NETNS_ETC = "/etc/netns"
_counter = itertools.count()


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


def _check_can_shape(what):
    if os.geteuid() != 0:
        raise PermissionError(
            f"{what} needs root: it creates network namespaces (ip netns add) and "
            "shapes their links (tc qdisc ... tbf). Run as root, or measure on the "
            "plain loopback (shaped_link(None)).")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise ShapedLinkError(f"{what} needs the '{tool}' command (Debian: iproute2)")


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
    _check_can_shape("shaped_link")
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


# --------------------------------------------------------------------------- two hosts

@dataclass
class Hosts:
    """What ``two_hosts`` set up: host ``i`` is namespace ``namespaces[i]`` with address
    ``addresses[i]`` on its device ``iface``; ``shaped`` lists the (namespace, device)
    pairs whose root qdisc is the link's token bucket (``set_rate`` changes them all)."""
    namespaces: list
    addresses: list
    iface: str
    rate: str
    hostname: str
    shaped: list = field(default_factory=list)
    burst: str = "1mb"
    latency: str = "2000ms"

    def prefix(self, i):
        """argv prefix that runs a command on host ``i``: ``ip netns exec NAME-hi``."""
        return ["ip", "netns", "exec", self.namespaces[i]]

    def set_rate(self, rate):
        """Change the link's rate now, while a job runs (``tc qdisc replace``, each
        direction).  ``rate=None`` removes the buckets (the veth's own speed)."""
        if rate is not None:
            rate = check_rate(rate)
        for ns, dev in self.shaped:
            if rate is None:
                subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev,
                                "root"], capture_output=True)
            else:
                _run(["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev,
                      "root", "tbf", "rate", rate, "burst", self.burst,
                      "latency", self.latency])
        self.rate = rate

    def run(self, argv, **kwargs):
        """``run_on_hosts(self, argv, **kwargs)``: one worker per host."""
        return run_on_hosts(self, argv, **kwargs)


def _hosts_file(own, hostname):
    """/etc/hosts of one host: the machine's hostname is this host's own address."""
    mine = f"{own}\t{hostname}\n" if hostname and hostname != "localhost" else ""
    return ("# written by hvd_compress.tools.shaped_link.two_hosts for this namespace\n"
            + mine +
            "127.0.0.1\tlocalhost\n"
            "::1\tlocalhost ip6-localhost ip6-loopback\n")


@contextmanager
def two_hosts(rate, n=2, name=None, network="10.77.0.0/24", burst="1mb", mtu=9000,
              latency="2000ms"):
    """Context manager: ``n`` "hosts" (network namespaces ``NAME-h0`` ...) joined by a
    full-duplex link of ``rate`` each way; yields a ``Hosts``.

    ``n == 2``: one veth pair, each end shaped by its own tbf.  ``n > 2``: each host
    peered with a port of a bridge in ``NAME-sw``, both ends shaped (RATE up and RATE
    down per host).  Addresses are the first ``n`` of ``network``, on device ``hvd0``
    in every host; each host's ``/etc/netns/NAME-hi/hosts`` resolves the machine's
    hostname to that host's own address (see the module's docstring for why).

    ``rate`` must be a tc rate (``"1gbit"``); ``rate=None`` is refused: for unshaped
    hosts say so with ``rate="unshaped"`` (no qdisc, the veth's own speed, many Gbit/s).
    Everything (namespaces, veths, hosts files) is removed on exit, also when the body
    raises or the set-up fails half-way.
    """
    if rate is None:
        raise ValueError("two_hosts needs a rate such as '1gbit' (rate=None is the plain "
                         "loopback of shaped_link; for two hosts without a bucket pass "
                         "rate='unshaped')")
    if rate != "unshaped":
        rate = check_rate(rate)
    if not isinstance(n, int) or n < 2:
        raise ValueError(f"two_hosts needs n >= 2 hosts, got {n!r}")
    addrs = list(ipaddress.ip_network(network).hosts())
    if len(addrs) < n:
        raise ValueError(f"network {network} has fewer than {n} addresses")
    prefixlen = ipaddress.ip_network(network).prefixlen
    _check_can_shape("two_hosts")
    name = name or f"hvdc{os.getpid()}-{next(_counter)}"
    hosts = [f"{name}-h{i}" for i in range(n)]
    switch = f"{name}-sw" if n > 2 else None
    wanted = hosts + ([switch] if switch else [])
    clash = set(wanted) & set(namespaces())
    if clash:
        raise ShapedLinkError(f"network namespace(s) {sorted(clash)} already exist")
    hostname = socket.gethostname()
    shaped = []                    # (namespace, device) with a tbf root qdisc
    created, etc_dirs = [], []
    try:
        for ns in wanted:
            _run(["ip", "netns", "add", ns])
            created.append(ns)
        for i, ns in enumerate(hosts):        # before the first `ip netns exec` into ns
            d = os.path.join(NETNS_ETC, ns)
            os.makedirs(d, exist_ok=True)
            etc_dirs.append(d)
            with open(os.path.join(d, "hosts"), "w") as f:
                f.write(_hosts_file(addrs[i], hostname))
        if switch is None:
            _run(["ip", "link", "add", IFACE, "netns", hosts[0], "type", "veth",
                  "peer", "name", IFACE, "netns", hosts[1]])
        else:
            sw = ["ip", "netns", "exec", switch]
            _run(sw + ["ip", "link", "add", "br0", "type", "bridge"])
            _run(sw + ["ip", "link", "set", "lo", "up"])
            for i, ns in enumerate(hosts):
                port = f"p{i}"
                _run(["ip", "link", "add", IFACE, "netns", ns, "type", "veth",
                      "peer", "name", port, "netns", switch])
                _run(sw + ["ip", "link", "set", port, "mtu", str(int(mtu))])
                _run(sw + ["ip", "link", "set", port, "master", "br0"])
                _run(sw + ["ip", "link", "set", port, "up"])
                shaped.append((switch, port))
            _run(sw + ["ip", "link", "set", "br0", "mtu", str(int(mtu))])
            _run(sw + ["ip", "link", "set", "br0", "up"])
        for i, ns in enumerate(hosts):
            ex = ["ip", "netns", "exec", ns]
            _run(ex + ["ip", "link", "set", "lo", "up"])
            _run(ex + ["ip", "link", "set", IFACE, "mtu", str(int(mtu))])
            _run(ex + ["ip", "addr", "add", f"{addrs[i]}/{prefixlen}", "dev", IFACE])
            _run(ex + ["ip", "link", "set", IFACE, "up"])
            shaped.insert(i, (ns, IFACE))
        result = Hosts(namespaces=hosts, addresses=[str(a) for a in addrs[:n]], iface=IFACE,
                       rate=None, hostname=hostname, shaped=shaped, burst=burst,
                       latency=latency)
        if rate != "unshaped":
            result.set_rate(rate)
        yield result
    finally:
        for ns in reversed(created):
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True)
        for d in etc_dirs:
            shutil.rmtree(d, ignore_errors=True)


from .launcher import run_on_hosts  # noqa: E402  (the hosts' launcher; re-exported)


def run_two_hosts(argv, rate, np=2, timeout=None, per_host=1, **kwargs):
    """Run ``argv`` on ``np // per_host`` fresh hosts joined by a ``rate`` full-duplex
    link, ``per_host`` workers per host (``two_hosts`` + ``run_on_hosts``); returns the
    largest exit code.  ``argv`` is the training command itself, without horovodrun."""
    if per_host < 1 or np % per_host:
        raise ValueError(f"per_host={per_host!r} must divide np={np!r}")
    with two_hosts(rate, n=np // per_host) as hosts:
        return run_on_hosts(hosts, argv, timeout=timeout, per_host=per_host, **kwargs)


def main(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m hvd_compress.tools.shaped_link",
        description="Run a command on a link shaped to RATE (network namespaces + tc tbf); "
                    "everything is removed afterwards. Needs root. Without --hosts: one "
                    "namespace whose loopback is shaped (both directions share the bucket); "
                    "run horovodrun inside it. With --hosts N: N namespaces joined by a "
                    "full-duplex link, and the COMMAND (no horovodrun: this replaces it) "
                    "runs once per host as a Horovod Gloo worker.")
    p.add_argument("--rate", required=True, help="e.g. 1gbit, 100mbit ('unshaped' with "
                                                 "--hosts: no bucket)")
    p.add_argument("--name", default=None, help="namespace name (default: hvdc-PID-RATE, "
                                                "with --hosts hvdcPID-K-h<i>)")
    p.add_argument("--hosts", type=int, default=None, metavar="N",
                   help="N hosts, launched by this tool (no horovodrun)")
    p.add_argument("--per-host", type=int, default=1, metavar="L",
                   help="with --hosts: L workers per host (their traffic inside the host "
                        "is not shaped), ranks host by host as horovodrun numbers them")
    p.add_argument("--timeout", type=float, default=None,
                   help="with --hosts: seconds before the workers are killed (exit 124)")
    p.add_argument("--verbose", action="store_true", help="with --hosts: print each command")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- command and arguments")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("give the command to run after --")
    if args.hosts is None and (args.timeout is not None or args.per_host != 1):
        p.error("--timeout and --per-host go with --hosts")
    if args.per_host < 1:
        p.error(f"--per-host must be >= 1, got {args.per_host}")
    # killed by SIGTERM: unwind through the finally blocks (workers stopped, namespaces and
    # hosts files removed) instead of dying on the spot
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        if args.hosts is None:
            with shaped_link(args.rate, name=args.name) as prefix:
                return subprocess.run(prefix + command).returncode
        with two_hosts(args.rate, n=args.hosts, name=args.name) as hosts:
            return run_on_hosts(hosts, command, timeout=args.timeout, verbose=args.verbose,
                                per_host=args.per_host)
    except subprocess.TimeoutExpired:
        print(f"shaped_link: the workers ran past --timeout {args.timeout:g} s and were "
              "killed", file=sys.stderr)
        return 124
    except (PermissionError, ShapedLinkError, ValueError) as e:
        print(f"shaped_link: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
