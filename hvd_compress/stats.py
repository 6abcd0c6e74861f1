"""Bytes on the wire: what this rank sent vs what a dense float32 allreduce would send."""


class Stats:
    """Per-step and cumulative byte counts of one optimizer / tape.

    ``sent``: bytes of the payloads this rank contributed to collectives.
    ``dense``: bytes of the same gradients as float32 (what ``hvd.allreduce`` of the
    uncompressed float32 gradient would contribute).  ``ratio = dense / sent``.
    """

    def __init__(self):
        self.steps = 0
        self.last_sent = self.last_dense = 0
        self.total_sent = self.total_dense = 0
        self._sent = self._dense = 0

    def add(self, sent, dense):
        """Count one tensor's payload in the current step."""
        self._sent += int(sent)
        self._dense += int(dense)

    def end_step(self):
        """Close the current step: it becomes ``last_*`` and is added to the totals."""
        self.last_sent, self.last_dense = self._sent, self._dense
        self.total_sent += self._sent
        self.total_dense += self._dense
        self.steps += 1
        self._sent = self._dense = 0

    def as_dict(self):
        return summarize(self.steps, self.last_sent, self.last_dense,
                         self.total_sent, self.total_dense)

    def __repr__(self):
        d = self.as_dict()
        return (f"<Stats steps={d['steps']} sent={d['total_sent']}B "
                f"dense={d['total_dense']}B ratio={d['ratio']:.1f}x>")


def summarize(steps, last_sent, last_dense, total_sent, total_dense):
    """The dict that ``stats.as_dict()`` returns in both glue layers."""
    return {
        "steps": int(steps),
        "last_sent": int(last_sent), "last_dense": int(last_dense),
        "last_ratio": last_dense / last_sent if last_sent else float("inf"),
        "total_sent": int(total_sent), "total_dense": int(total_dense),
        "ratio": total_dense / total_sent if total_sent else float("inf"),
    }


def human_bytes(n):
    """``1536 -> '1.5 KiB'``."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
