"""The launcher of ``hvd_compress.tools.shaped_link``'s hosts: run a command once on every
host (network namespace), as ``horovodrun --gloo`` would, with Horovod's rendezvous
server on the first host (:func:`run_on_hosts`).  ``python -m hvd_compress.tools.shaped_link
--hosts N`` and :func:`hvd_compress.tools.shaped_link.run_two_hosts` use it.

Imports: the standard library (Horovod's rendezvous server runs in a child process).
"""
import os
import select
import signal
import subprocess
import sys
import threading
import time

_RENDEZVOUS = """
import sys
from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
from horovod.runner.http.http_server import RendezvousServer
server = RendezvousServer(0)
port = server.start()                       # listens on every address of this host
server.init(get_host_assignments(parse_hosts(sys.argv[1]), int(sys.argv[2])))
print(port, flush=True)
sys.stdin.read()                            # until the launcher closes our stdin
"""


def _pump(stream, out, tag, lock):
    """Copy ``stream`` to ``out`` line by line, each line prefixed with ``tag``."""
    for line in iter(stream.readline, ""):
        with lock:
            out.write(tag + line if line.endswith("\n") else tag + line + "\n")
            out.flush()
    stream.close()


def _stop(proc, grace=5.0):
    """SIGTERM the process group of ``proc``, SIGKILL it after ``grace`` seconds."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, grace)):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
        except subprocess.TimeoutExpired:
            pass


def _exit_code(rc):
    return 128 - rc if rc < 0 else rc        # killed by signal N: 128 + N, as shells say


def run_on_hosts(hosts, argv, timeout=None, env=None, cwd=None, stdout=None, stderr=None,
                 verbose=False, per_host=1):
    """Run ``argv`` ``per_host`` times on every host of ``hosts`` (a ``Hosts``), as
    ``horovodrun --gloo -np N -H h0:L,h1:L,...`` would: returns the largest exit code of
    the workers (0: all succeeded).

    ``per_host`` = L workers per host: rank ``h L + l`` is local rank l of host h
    (HOROVOD_LOCAL_RANK=l, LOCAL_SIZE=L, CROSS_RANK=h, CROSS_SIZE=H, as horovodrun
    numbers them).  Workers of one host reach each other at the host's own address,
    which the kernel routes through the host's loopback: traffic inside a host is not
    shaped, only what leaves through its link is.

    What it does: starts Horovod's ``RendezvousServer`` in a small Python process on
    host 0 (it listens on host 0's address; workers on the other hosts reach it over
    the shaped link), initialised with ``get_host_assignments(parse_hosts("ADDR0:1,
    ADDR1:1,..."), N)``; then starts worker ``i`` as ``ip netns exec NAME-hi argv`` with
    horovodrun's variables (HOROVOD_GLOO_RENDEZVOUS_ADDR/PORT, HOROVOD_CONTROLLER=gloo,
    HOROVOD_CPU_OPERATIONS=gloo, HOROVOD_GLOO_IFACE=hvd0, HOROVOD_HOSTNAME=ADDRi,
    HOROVOD_RANK/SIZE, HOROVOD_LOCAL_RANK/SIZE, HOROVOD_CROSS_RANK/SIZE,
    PYTHONUNBUFFERED=1) on top of ``env`` (default: this process's environment).
    Every line a worker prints goes to ``stdout``/``stderr`` (default: this process's)
    prefixed ``[rank]<stdout>:`` / ``[rank]<stderr>:``, as horovodrun prints it.

    When a worker fails the others are terminated (SIGTERM, then SIGKILL) and the code
    returned is the largest among the workers that ended by themselves (a worker killed
    by signal N counts 128 + N).  After ``timeout`` seconds every worker is killed and
    ``subprocess.TimeoutExpired`` is raised.
    """
    stdout = stdout or sys.stdout
    stderr = stderr or sys.stderr
    if not (isinstance(per_host, int) and per_host >= 1):
        raise ValueError(f"per_host must be an int >= 1, got {per_host!r}")
    n_hosts = len(hosts.namespaces)
    n = n_hosts * per_host
    argv = [str(a) for a in argv]
    plan = ",".join(f"{a}:{per_host}" for a in hosts.addresses)
    lock = threading.Lock()
    base_env = dict(os.environ if env is None else env)
    from .shaped_link import ShapedLinkError
    server = subprocess.Popen(hosts.prefix(0) + [sys.executable, "-c", _RENDEZVOUS, plan,
                                                 str(n)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env=base_env, start_new_session=True)
    workers, pumps, own_exit = [], [], {}
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        ready, _, _ = select.select([server.stdout], [], [], 60)
        line = server.stdout.readline() if ready else ""
        if not line.strip().isdigit():
            raise ShapedLinkError("the rendezvous server did not start on "
                                  f"{hosts.namespaces[0]} (printed {line!r})")
        port = line.strip()
        for rank in range(n):
            host, local = divmod(rank, per_host)
            wenv = dict(base_env,
                        HOROVOD_GLOO_RENDEZVOUS_ADDR=hosts.addresses[0],
                        HOROVOD_GLOO_RENDEZVOUS_PORT=port,
                        HOROVOD_CONTROLLER="gloo", HOROVOD_CPU_OPERATIONS="gloo",
                        HOROVOD_GLOO_IFACE=hosts.iface, NCCL_SOCKET_IFNAME=hosts.iface,
                        HOROVOD_HOSTNAME=hosts.addresses[host],
                        HOROVOD_RANK=str(rank), HOROVOD_SIZE=str(n),
                        HOROVOD_LOCAL_RANK=str(local), HOROVOD_LOCAL_SIZE=str(per_host),
                        HOROVOD_CROSS_RANK=str(host), HOROVOD_CROSS_SIZE=str(n_hosts),
                        PYTHONUNBUFFERED="1")
            cmd = hosts.prefix(host) + argv
            if verbose:
                print(f"[launcher] rank {rank}: {' '.join(cmd)}", file=stderr, flush=True)
            proc = subprocess.Popen(cmd, env=wenv, cwd=cwd, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True, errors="replace", bufsize=1,
                                    start_new_session=True)
            workers.append(proc)
            for stream, out, kind in ((proc.stdout, stdout, "stdout"),
                                      (proc.stderr, stderr, "stderr")):
                t = threading.Thread(target=_pump, args=(stream, out, f"[{rank}]<{kind}>:",
                                                         lock), daemon=True)
                t.start()
                pumps.append(t)
        while len(own_exit) < n:
            for rank, proc in enumerate(workers):
                if rank not in own_exit and proc.poll() is not None:
                    own_exit[rank] = _exit_code(proc.returncode)
            if any(own_exit.values()):
                failed = min(r for r, c in own_exit.items() if c)
                with lock:
                    print(f"Process {failed} exit with status code {own_exit[failed]}; "
                          "terminating the other workers.", file=stderr, flush=True)
                break
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(argv, timeout)
            time.sleep(0.05)
        return max(own_exit.values())
    finally:
        for proc in workers:
            _stop(proc)
        for t in pumps:
            t.join(5)
        if server.stdin:
            try:
                server.stdin.close()
            except OSError:
                pass
        _stop(server, grace=2.0)
        server.stdout.close()
