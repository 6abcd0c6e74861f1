"""What a failed machine does in the elastic workers (no framework imported here)."""
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
