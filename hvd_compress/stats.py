"""Bytes on the wire: what this rank sent vs what a dense float32 allreduce would send,
and what it received.

Imports: nothing at import time.
"""

#: counted per step (``last_*``) and in total (``total_*``) besides sent/dense
EXCHANGE = ("received", "received_local", "union", "k")


class Stats:
    """Per-step and cumulative byte counts of one optimizer / tape.

    ``sent``: bytes of the payloads this rank contributed to collectives.
    ``dense``: bytes of the same gradients as float32 (what ``hvd.allreduce`` of the
    uncompressed float32 gradient would contribute).  ``ratio = dense / sent``.
    ``received``: bytes this rank received (allgather: the other ranks' payloads;
    allreduce: ``2 (P-1)/P`` of its size, a ring's share); ``received_local``: what it
    would have received with ``agg=local`` (every rank sending k pairs; equal to
    ``received`` for other strategies and compressors); ``union`` and ``k``: the
    aggregated index count and the target k of aggregation-aware selection
    (``union_over_k``; 0 and None where no union is formed).

    With the hierarchical exchange (``hier:``), ``sent`` and ``received`` count the slow
    link between hosts only; ``host_sent``/``host_received`` count the dense traffic
    inside the host (the reduce-scatter and allgather among its workers).
    """

    TIMES = ("compress_s", "wait_s", "decompress_s", "compress_late_s")

    def __init__(self):
        self.steps = 0
        self.last_sent = self.last_dense = 0
        self.total_sent = self.total_dense = 0
        self._sent = self._dense = 0
        self._exchange = dict.fromkeys(EXCHANGE, 0)
        self.last_exchange = dict.fromkeys(EXCHANGE, 0)
        self.total_exchange = dict.fromkeys(EXCHANGE, 0)
        #: Elastic Horovod: L2 norm of the residuals lost with lost workers (at the commit)
        self.lost_residual_norm = 0.0
        self._times = [0.0] * len(self.TIMES)
        self._host = [0, 0]
        self.last_host = self.total_host = (0, 0)
        self.last_times = dict.fromkeys(self.TIMES, 0.0)
        self.total_times = dict.fromkeys(self.TIMES, 0.0)
        #: ``auto``: bucket key -> the spec of the candidate that sends it now
        self.choices = {}

    def add(self, sent, dense, received=0, received_local=0, union=0, k=0):
        """Count one tensor's (or bucket's) exchange in the current step."""
        self._sent += int(sent)
        self._dense += int(dense)
        for key, v in zip(EXCHANGE, (received, received_local, union, k)):
            self._exchange[key] += int(v)

    def add_local(self, sent, received):
        """Count one hierarchical exchange's dense bytes inside the host."""
        self._host = [self._host[0] + int(sent), self._host[1] + int(received)]

    def add_time(self, compress_s, wait_s, decompress_s, compress_late_s):
        """Add one tensor's seconds (PyTorch glue: wall clock of the calling thread)."""
        for i, t in enumerate((compress_s, wait_s, decompress_s, compress_late_s)):
            self._times[i] += float(t)

    def end_step(self):
        """Close the current step: it becomes ``last_*`` and is added to the totals."""
        self.last_sent, self.last_dense = self._sent, self._dense
        self.total_sent += self._sent
        self.total_dense += self._dense
        self.steps += 1
        self._sent = self._dense = 0
        self.last_exchange = self._exchange
        for key, v in self._exchange.items():
            self.total_exchange[key] += v
        self._exchange = dict.fromkeys(EXCHANGE, 0)
        self.last_times = dict(zip(self.TIMES, self._times))
        for k, t in self.last_times.items():
            self.total_times[k] += t
        self._times = [0.0] * len(self.TIMES)
        self.last_host = tuple(self._host)
        self.total_host = tuple(a + b for a, b in zip(self.total_host, self._host))
        self._host = [0, 0]

    def as_dict(self):
        """Bytes (``last_*``, ``total_*``, ``ratio``) and, where the glue measures them
        (PyTorch), seconds: ``last_compress_s`` (compressing: inside backward's hooks,
        but for ``last_compress_late_s``, the part spent in ``synchronize()`` after a
        collective completed -- a two-round exchange's second message, ``hier:``'s
        compress between hosts), ``last_wait_s`` (blocked on Horovod in
        ``synchronize()``: communication that backward did not hide),
        ``last_decompress_s``, and their ``total_*``."""
        out = summarize(self.steps, self.last_sent, self.last_dense,
                        self.total_sent, self.total_dense, self.last_exchange,
                        self.total_exchange)
        for k in self.TIMES:
            out["last_" + k] = self.last_times[k]
            out["total_" + k] = self.total_times[k]
        out["lost_residual_norm"] = self.lost_residual_norm
        for when, (sent, received) in (("last", self.last_host), ("total", self.total_host)):
            out[f"{when}_host_sent"], out[f"{when}_host_received"] = sent, received
        if self.choices:
            out["choices"] = dict(self.choices)
        return out

    def scalars(self, prefix="compression/"):
        """The last step's numbers as plain floats keyed ``<prefix><name>``, for a
        metrics logger: ``sent_bytes``, ``dense_bytes``, ``received_bytes``,
        ``total_sent_bytes``, ``total_dense_bytes``, ``ratio`` and ``total_ratio`` (dense /
        sent; absent while nothing was sent), ``compress_s``, ``wait_s``,
        ``decompress_s``, ``compress_late_s``.  TensorBoard, each step::

            for k, v in opt.stats.scalars().items(): writer.add_scalar(k, v, step)
        """
        out = {"sent_bytes": self.last_sent, "dense_bytes": self.last_dense,
               "received_bytes": self.last_exchange["received"],
               "total_sent_bytes": self.total_sent, "total_dense_bytes": self.total_dense}
        if self.last_sent:
            out["ratio"] = self.last_dense / self.last_sent
        if self.total_sent:
            out["total_ratio"] = self.total_dense / self.total_sent
        out.update(self.last_times)
        return {prefix + k: float(v) for k, v in out.items()}

    def __repr__(self):
        d = self.as_dict()
        return (f"<Stats steps={d['steps']} sent={d['total_sent']}B "
                f"dense={d['total_dense']}B ratio={d['ratio']:.1f}x>")


# -- bytes one rank receives (python ints, or int64 tensors inside TensorFlow) -----------

def ring_received(nbytes, size):
    """A ring allreduce of ``nbytes``: ``2 (P-1)/P nbytes``."""
    return nbytes * (2 * (size - 1)) // size


def union_received(gathered, own, union, width, size):
    """agg=union/leader/hint: the other ranks' int32 indices (``gathered - own`` of
    them), then a ring allreduce of ``union`` values of ``width`` bytes."""
    return (gathered - own) * 4 + ring_received(union * width, size)


def local_received(k, width, size):
    """What agg=local would receive if every rank sent k (value, int32 index) pairs."""
    return (size - 1) * k * (4 + width)


def summarize(steps, last_sent, last_dense, total_sent, total_dense, last_exchange=None,
              total_exchange=None):
    """The dict that ``stats.as_dict()`` returns in both glue layers."""
    out = {
        "steps": int(steps),
        "last_sent": int(last_sent), "last_dense": int(last_dense),
        "last_ratio": last_dense / last_sent if last_sent else float("inf"),
        "total_sent": int(total_sent), "total_dense": int(total_dense),
        "ratio": total_dense / total_sent if total_sent else float("inf"),
    }
    for when, ex in (("last", last_exchange), ("total", total_exchange)):
        ex = ex or dict.fromkeys(EXCHANGE, 0)
        for key in EXCHANGE:
            out[f"{when}_{key}"] = int(ex[key])
        out[f"{when}_union_over_k"] = ex["union"] / ex["k"] if ex["k"] else None
    return out


def human_bytes(n):
    """``1536 -> '1.5 KiB'``."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
