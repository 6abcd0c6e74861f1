"""What a failed machine does, and what a joining one needs, in the elastic workers (no
framework imported here)."""
import contextlib
import os
import time


def leave_and_die():
    """Remove this worker's host (``$HOROVOD_HOSTNAME``) from ``$HOSTS_FILE``, which the
    discovery script prints, and exit with a failure before this step's collectives:
    the other ranks' collectives fail."""
    hosts, me = os.environ["HOSTS_FILE"], os.environ["HOROVOD_HOSTNAME"]
    keep = [h for h in open(hosts).read().split() if not h.startswith(me + ":")]
    with open(hosts, "w") as f:
        f.write("\n".join(keep) + "\n")
    time.sleep(1)
    os._exit(7)


class LostWorker:
    """The part of a ``lost`` worker's loop around each step, for either framework:
    :meth:`before_step` makes rank 1 leave and die at step ``die`` while every worker
    that started is there, and, at the first step after a reset's sync, calls
    ``write_synced()`` (the state each rank synced to); :meth:`on_reset` (a reset
    callback, or called from one) marks the next step as that first step.  ``rank`` and
    ``size``: the framework's ``hvd.rank`` and ``hvd.size``."""

    def __init__(self, die, rank, size, write_synced):
        self.die, self.rank, self.size, self.write_synced = die, rank, size, write_synced
        self.started, self.synced = size(), True

    def on_reset(self):
        self.synced = False

    def before_step(self, step):
        if step == self.die and self.rank() == 1 and self.size() == self.started:
            leave_and_die()
        if not self.synced:                          # the first step after a reset's sync
            self.write_synced()
            self.synced = True


JOIN_AT, WAIT_FROM = 5, 8       #: the step a host is added at; alone from this one, wait


@contextlib.contextmanager
def join_step(state, size, commit_every):
    """Around one step of the ``join`` workers: before it, at step JOIN_AT and alone, add
    a second host to ``$HOSTS_FILE``; the step runs (and moves ``state.step`` on); after
    it, commit every ``commit_every`` steps and, still alone from step
    WAIT_FROM, commit every 0.5 s for up to 120 s (a slow machine's new worker): the
    commit raises HostsUpdatedInterrupt once the new worker is seen."""
    if state.step == JOIN_AT and size() == 1:
        with open(os.environ["HOSTS_FILE"], "a") as f:
            f.write("127.0.0.1:1\n")
    yield
    if state.step % commit_every == 0:
        state.commit()
    deadline = time.time() + 120
    while size() == 1 and state.step >= WAIT_FROM and time.time() < deadline:
        time.sleep(0.5)
        state.commit()
