"""``auto``'s step model and decision: pure functions of measured seconds, unit-tested on
synthetic timings (tests/test_auto.py).

**The step model** (what overlaps what).  Backward runs on one thread (CPU) or stream
(GPU) and compressing bucket ``b`` runs on it too, so it delays the rest of backward by
``C_bc``; collectives run one at a time in launch order (Horovod's background thread),
each as soon as its bucket is compressed and the link is free; after backward,
``synchronize()`` waits for the buckets in order and decompresses each::

    shift_b  = sum_{b' <= b} C_b'c'                    (backward pushed back by compressing)
    finish_b = max(ready_b + shift_b, finish_{b-1}) + s * T_bc
    tail     = fold over b:  t = max(t, finish_b) + D_bc,   from t = shift_last
    step     = compute + tail

so the communication and compression of early buckets hide behind the rest of backward
and the last buckets are exposed.  ``s`` scales the measured link times (1 after a
calibration; see below).

**Decision**: the combination of candidates over buckets with the least predicted step
(every combination while there are at most 20000, else coordinate descent from each
single candidate); ties keep the earlier candidate.  It must beat the first candidate
everywhere (``none`` by default) by ``Auto.margin`` = 1% of the step, else that is kept:
noise cannot make auto compress.  First the ranks share their measurements (one named allgather):
a collective's time is the minimum over ranks (timed alone it also waits for the last
rank to arrive, which the last one does not), codec and compute times the maximum.  Rank
0 decides and broadcasts the choice (one named collective), so every rank uses the same
compressor per bucket, and prints the decision table.

Imports: the standard library only.
"""
import itertools
import math
import statistics
from typing import NamedTuple, Tuple


class BucketCost(NamedTuple):
    """What the model knows about one bucket (seconds; one entry per candidate)."""
    key: str
    ready: float                 #: when its gradients are ready, relative to backward's end
    compress: Tuple[float, ...]
    comm: Tuple[float, ...]
    decompress: Tuple[float, ...]
    nbytes: Tuple[float, ...] = ()   #: bytes its collective moved (sent + received)
    numel: int = 0


def predict(costs, choice, compute=0.0, scale=1.0):
    """Predicted step seconds of sending ``costs[i]`` with candidate ``choice[i]`` (see
    the module docstring); ``costs`` in launch order."""
    shift, link, finishes = 0.0, -math.inf, []
    for b, c in zip(costs, choice):
        shift += b.compress[c]
        link = max(b.ready + shift, link) + scale * b.comm[c]
        finishes.append(link)
    t = shift
    for b, c, finish in zip(costs, choice, finishes):
        t = max(t, finish) + b.decompress[c]
    return compute + t


def decide(costs, n, compute=0.0, scale=1.0, eps=1e-9, exhaustive=20000):
    """The choice (a candidate index per bucket) that minimises :func:`predict`.

    Every combination when there are at most ``exhaustive`` (in lexicographic order);
    else coordinate descent (each bucket tries every candidate with the others fixed,
    until nothing improves) from each single candidate everywhere, keeping the best.  A
    change must gain more than ``eps`` seconds, so ties keep the earlier candidate and the
    result does not depend on rounding noise (the same on every rank)."""
    if not costs:
        return []
    if n ** len(costs) <= exhaustive:
        best, choice = math.inf, None
        for trial in itertools.product(range(n), repeat=len(costs)):
            p = predict(costs, trial, compute, scale)
            if p < best - eps:
                best, choice = p, list(trial)
        return choice
    best, choice = math.inf, None
    for cur in [[start] * len(costs) for start in range(n)] + [first_measured(costs, n)]:
        cur_p = predict(costs, cur, compute, scale)
        for _ in range(10):
            changed = False
            for i in range(len(costs)):
                for c in range(n):
                    trial = cur[:i] + [c] + cur[i + 1:]
                    p = predict(costs, trial, compute, scale)
                    if p < cur_p - eps:
                        cur, cur_p, changed = trial, p, True
            if not changed:
                break
        if cur_p < best - eps:
            best, choice = cur_p, cur
    return choice


def warm(samples):
    """The samples less the first where there are several (it warms caches, kernels)."""
    samples = list(samples)
    return samples[1:] if len(samples) > 1 else samples


def median(samples):
    samples = list(samples)
    return statistics.median(samples) if samples else 0.0


def bucket_costs(samples, n):
    """The :class:`BucketCost` of every calibrated bucket, in launch order, from the
    calibration ``samples`` (key -> {"ready": [s], "c<i>": [[C, T, D, bytes]]}) of ``n``
    candidates (first sample left out, medians).  A candidate never measured on a bucket
    (one not sent at every calibration step: DDP's first step has buckets of its own)
    costs infinite compress seconds there, so that it is not chosen for it (not free, as
    zero seconds would make it)."""
    out = []
    for key, s in samples.items():
        parts = [[median(warm(x[j] for x in s[f"c{i}"]))
                  for j in range(4)] if s.get(f"c{i}") else [math.inf, 0.0, 0.0, 0.0]
                 for i in range(n)]
        out.append(BucketCost(key, median(warm(s["ready"])) if s["ready"] else 0.0,
                              tuple(p[0] for p in parts), tuple(p[1] for p in parts),
                              tuple(p[2] for p in parts), tuple(p[3] for p in parts)))
    return sorted(out, key=lambda b: (b.ready, b.key))


def first_measured(costs, n):
    """Each bucket's first candidate with finite costs (one measured on it)."""
    return [next((c for c in range(n) if math.isfinite(b.compress[c])), 0) for b in costs]


def fit_link(points):
    """Least-squares ``T = alpha + bytes / beta`` over ``points`` = [(bytes, seconds)]:
    ``(alpha s, beta bytes/s)``; beta is inf when the times do not grow with size."""
    if len(points) < 2:
        return (points[0][1], math.inf) if points else (0.0, math.inf)
    xs, ys = [float(b) for b, _ in points], [float(t) for _, t in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    if slope <= 0:
        return my, math.inf
    return my - slope * mx, 1.0 / slope


def combine(rows, costs, n, dense):
    """Every rank's measurements (``rows``: one per rank, as :meth:`Auto._combine` lays
    them out for ``costs``, sorted by key) as one table: a collective's time is the
    minimum over ranks (timed alone, it also waits for the last rank to arrive; the last
    one waits only for the transfer), compress, decompress and compute the maximum (the
    slowest rank sets the pace), ready times the median.  The link is fitted to the
    dense candidates' collectives (``dense``: their indices; all if none) of different
    sizes, and no collective is predicted faster than it (timing noise on tiny buckets
    must not pay for a codec).  Returns ``(costs in launch order, compute, (alpha,
    beta))``."""
    cols = list(zip(*rows))
    out, at = [], 1
    for b in costs:
        ready = statistics.median(cols[at])
        parts = [[f(cols[at + 1 + j * n + c]) for c in range(n)]
                 for j, f in enumerate((max, min, max, max))]
        out.append(b._replace(ready=ready, compress=tuple(parts[0]), comm=tuple(parts[1]),
                              decompress=tuple(parts[2]), nbytes=tuple(parts[3])))
        at += 1 + 4 * n
    dense = dense or list(range(n))
    points = [(b.nbytes[i], b.comm[i]) for b in out for i in dense
              if b.nbytes[i] > 0 and math.isfinite(b.comm[i])]
    link = alpha, beta = fit_link(points)
    sizes = [p[0] for p in points]
    if not (sizes and max(sizes) >= 4 * min(sizes) and math.isfinite(beta)):
        return sorted(out, key=lambda b: (b.ready, b.key)), max(cols[0]), link  # no line
    alpha = max(alpha, 0.0)
    fit = [i in dense and len(dense) < n for i in range(n)]
    out = [b._replace(comm=tuple(alpha + nb / beta if f and math.isfinite(t) else
                                 max(t, alpha + nb / beta)
                                 for t, nb, f in zip(b.comm, b.nbytes, fit)))
           for b in out]
    return sorted(out, key=lambda b: (b.ready, b.key)), max(cols[0]), link
