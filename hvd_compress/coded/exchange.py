"""The coded gradient exchange of CSSGD (seed 003), written once for both frameworks.

Every worker holds the gradients of its parts (see :mod:`.placement`) as 1-D float
tensors scaled so that the sum over all parts is the mini-batch gradient.  They travel
as int32 fixed point (:func:`encode_part`: ``q = round(g·(2³¹−1)/R)``, so 0x7FFFFFFF
is R and 0x80000001 is −R; the paper's R = 10), each with a two-entry header
``[clipped, nonfinite]`` counting what the encoding had to saturate.  Integer sums are
exact and independent of order, so every rank ends with the same bits.

Three ways to exchange them (``exchange=``), each ending with every worker holding the
int64 sum of all ``C(n, r)`` parts:

``multicast`` (the paper's algorithms 3 and 4)
    Each part's vector is cut into ``r`` segments.  In every (r+1)-subset ``S`` of the
    workers, member ``j`` sends one packet to ``S∖{j}``::

        packet_j = Σ_{k ∈ S∖{j}} segment(part S∖{k}, position of j in S∖{k})   (mod 2³²)

    Receiver ``k'`` holds every part ``S∖{k}`` with ``k ≠ k'``, subtracts those
    segments and is left with ``segment(S∖{k'}, position of j)``: the r members of
    ``S∖{k'}`` each deliver one segment of the part ``k'`` lacks.  A packet is 1/r of a
    part; a worker sends ``C(n−1, r)`` of them, so its load, counted as the paper
    counts a multicast (once), is ``C(n−1, r)/r`` parts = ``(1/r)(1 − r/n)`` of all
    ``C(n, r)`` parts (the paper's eq. 19).  It receives ``C(n−1, r)`` whole parts.
    Horovod has no multicast: each group's packets travel as one allgather in a Horovod
    process set of the group, which Gloo runs over point-to-point TCP.

``multicast_alltoall``
    The same packets in one global alltoall: worker ``j`` sends ``k`` its packets of
    the groups it shares with ``k``, in group order.  The bytes on the wire are those of
    ``multicast`` (a process-set allgather forwards each packet to the r others too);
    the difference is one collective per step instead of ``C(n−1, r)`` process-set
    collectives, which Horovod schedules one after the other.

``reduce_scatter`` (the coding idea, on the transport we have)
    The gradient is cut into ``n`` slices; worker ``i`` owns slice ``i``.  Every part
    that ``i`` lacks is held by one of the ``n−r`` workers ``W_i = {i+1, …, i+n−r}``
    (mod n) — a part is an r-subset, so it cannot avoid all of them — and each of those
    sends ``i`` *one* slice: the int64 sum of its assigned parts (saturated to int32 and
    counted).  Worker ``i`` adds its own parts and allgathers its slice.  Per worker,
    ``(n−r)/n + (n−1)/n`` of one gradient each way, against ``2(n−1)/n`` for Horovod's
    ring allreduce: less from r = 2 on.

``allreduce`` (SSGD, the uncoded reference; r = 1 only)
    float32 allreduce (Sum) of the worker's part: Horovod's ring, no fixed point.

``r = n`` needs no exchange (every worker computes every part).

The framework's collectives come in through ``comm`` (see the glue in
``hvd_compress.torch.coded`` and ``hvd_compress.tensorflow.coded``); the arithmetic is
written on :mod:`hvd_compress.ops`.

Imports: the standard library, numpy; on first use, ``hvd_compress.ops``; and modules of
its own package.
"""
import time
import warnings
from functools import reduce
from math import ceil, comb

import numpy as np

from .placement import placement

HEADER = 2                       #: [clipped, nonfinite] in front of every encoded part
EXCHANGES = ("multicast", "multicast_alltoall", "reduce_scatter", "allreduce")
DEFAULT_RANGE = 10.0             #: the paper's [−10, 10]


def check_exchange(exchange, r):
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange must be one of {', '.join(EXCHANGES)}, got {exchange!r}")
    if exchange == "allreduce" and r != 1:
        raise ValueError(f"exchange='allreduce' (uncoded SSGD) needs redundancy=1, got {r}")
    return exchange


def check_range(value_range):
    v = float(value_range) if isinstance(value_range, (int, float, np.floating)) \
        and not isinstance(value_range, bool) else float("nan")
    if not np.isfinite(v) or v <= 0:
        raise ValueError(f"value_range must be a positive finite number, got {value_range!r}")
    return v


def _sum(ts):
    return reduce(lambda a, b: a + b, ts)


class CodedExchange:
    """What one worker needs to exchange its part gradients: the placement, the
    fixed-point range, the exchange variant, the padded lengths, and the byte and
    clipping counters (:attr:`stats`)."""

    def __init__(self, n, rank, redundancy, numel, value_range=DEFAULT_RANGE,
                 exchange="multicast", verify=True):
        self.placement = placement(n, redundancy)
        self.n, self.r, self.rank = self.placement.n, self.placement.r, int(rank)
        if not 0 <= self.rank < self.n:
            raise ValueError(f"rank must be in [0, {self.n}), got {rank!r}")
        if int(numel) < 1:
            raise ValueError(f"there is nothing to exchange: the gradient has {numel} entries")
        self.numel, self.range = int(numel), check_range(value_range)
        self.exchange = check_exchange(exchange, self.r)
        self.length = self.numel + HEADER
        #: multicast exchanges and r = n: every rank builds the total itself, from its own
        #: replicas of the parts; compare a checksum of it between ranks every step
        self.verify = bool(verify)
        self.segment = ceil(self.length / self.r)           # multicast: r segments
        #: a multicast packet: the coded segment, the sender's NaN/Inf count, and the
        #: checksums of the sender's copies of the r parts it coded
        self.packet = self.segment + 1 + self.r
        self.slice = ceil(self.length / self.n)             # reduce_scatter: n slices
        self.padded = max(self.segment * self.r, self.slice * self.n)
        self.my_parts = self.placement.worker_parts(self.rank)
        self.my_groups = self.placement.worker_groups(self.rank)
        self._plan_reduce_scatter()
        self.totals = dict(steps=0, sent=0, received=0, ring=0, clipped=0, nonfinite=0,
                           saturated=0, encode_s=0.0, communicate_s=0.0, decode_s=0.0)
        self.last = {}
        self._warned = False

    # -- the configuration every rank must share ---------------------------------------
    def config(self, batch_size):
        """int64 vector of what must agree between ranks (compared at the first step)."""
        return np.array([self.n, self.r, int(batch_size), self.numel,
                         EXCHANGES.index(self.exchange),
                         np.float64(self.range).view(np.int64)], dtype=np.int64)

    @staticmethod
    def check_config(gathered):
        """Raise ValueError (on every rank: all see the same ``gathered`` rows) naming
        each field where ranks differ."""
        rows = np.asarray(gathered, dtype=np.int64).reshape(-1, 6)
        names = ("n", "redundancy", "batch_size", "gradient numel", "exchange", "value_range")
        bad = []
        for f, name in enumerate(names):
            col = rows[:, f]
            if (col != col[0]).any():
                vals = col.view(np.float64) if name == "value_range" else col
                if name == "exchange":
                    vals = [EXCHANGES[v] if 0 <= v < len(EXCHANGES) else v for v in col]
                bad.append(f"{name} per rank: {list(vals)}")
        if bad:
            raise ValueError("coded SGD: ranks disagree: " + "; ".join(bad))

    def prepare(self, comm, batch_size):
        """First step: compare the configuration of every rank (ValueError on all of them
        when they differ, before any process set is touched), then let ``comm`` set up
        one process set per group (a collective over all ranks)."""
        self.check_config(comm.allgather_ints(self.config(batch_size), "config"))
        if self.exchange == "multicast" and self.r < self.n:
            comm.register_groups(self.placement.groups, self.my_groups)

    # -- fixed point ----------------------------------------------------------------------
    def encode_part(self, o, grad):
        """``[clipped, nonfinite, q_0 … q_{D−1}, 0 …]`` (int32, length :attr:`padded`)."""
        if o.numel(grad) != self.numel:
            raise ValueError(f"a part gradient has {o.numel(grad)} entries, expected "
                             f"{self.numel}")
        q, counts = o.fixed_encode(grad, self.range)
        return o.pad_to(o.concat([o.cast(counts, o.int32), q]), self.padded)

    # -- multicast (algorithms 3 and 4) ---------------------------------------------------
    def _segment(self, o, coded, group, k, j):
        """int64 segment of part ``group∖{k}`` at the position of ``j`` in it."""
        part = tuple(w for w in group if w != k)
        pos = part.index(j)
        return o.cast(coded[self.placement.part_of(part)][pos * self.segment:
                                                          (pos + 1) * self.segment], o.int64)

    def checksum(self, o, vec):
        """int32 hash of an encoded part (``Σ v_i·(2i+1)`` mod 2³²): replicas of a part
        must agree, or decoding mixes them (see :meth:`decode`)."""
        weights = o.cast(o.arange(self.padded, like=vec), o.int64) * 2 + 1
        return o.wrap_int32(o.reshape(o.reduce_sum_int(o.cast(vec, o.int64) * weights), [1]))

    def checksums(self, o, coded):
        """``{part: int32[1] checksum}`` of this worker's encoded parts (once per step)."""
        return {q: self.checksum(o, v) for q, v in coded.items()}

    def packets(self, o, coded, flag, sums):
        """``[(group, packet)]``: this worker's packet for each of its groups, in the
        groups' order (algorithm 3): :attr:`segment` coded int32 entries, ``flag`` (this
        worker's own count of NaN/Inf entries), then ``sums`` (:meth:`checksums`) of its
        copies of the r parts ``group∖{k}`` it coded (k in ``group∖{me}``, in order)."""
        me, flag = self.rank, o.reshape(o.cast(flag, o.int32), [1])
        out = []
        for g in self.my_groups:
            others = [k for k in g if k != me]
            value = o.wrap_int32(_sum([self._segment(o, coded, g, k, me) for k in others]))
            mine = [sums[self.placement.part_of([w for w in g if w != k])] for k in others]
            out.append((g, o.concat([value, flag] + mine)))
        return out

    def decode(self, o, coded, gathered, sums):
        """All parts from ``coded`` (this worker's) and ``gathered`` (per group, the
        members' packets in group order, concatenated; ``sums``: :meth:`checksums` of
        ``coded``): algorithm 4.  Also returns
        ``{sender: flag}`` for every worker this one shares a group with (all others), and
        whether any two copies of a part disagree.  Every worker sees every disagreement:
        the r holders of a part it lacks each send their copy's checksum, and a holder
        gets the checksums of every other holder's copy, so all ranks decide alike."""
        me, parts, flags, w, seg = self.rank, dict(coded), {}, self.packet, self.segment
        seen = {q: [int(v[0])] for q, v in sums.items()}
        for g, flat in zip(self.my_groups, gathered):
            lacking = tuple(j for j in g if j != me)             # the part this worker lacks
            segments = []
            for j in lacking:                                    # its r holders, in order
                at = g.index(j) * w
                packet = o.cast(flat[at:at + seg], o.int64)
                flags[j] = flat[at + seg]
                for i, k in enumerate(k for k in g if k != j):
                    q = self.placement.part_of([m for m in g if m != k])
                    seen.setdefault(q, []).append(int(flat[at + seg + 1 + i]))
                known = [self._segment(o, coded, g, k, j) for k in g if k not in (j, me)]
                segments.append(o.wrap_int32(packet - _sum(known)) if known
                                else o.wrap_int32(packet))
            parts[self.placement.part_of(lacking)] = o.pad_to(o.concat(segments), self.padded)
        return parts, flags, any(len(set(v)) > 1 for v in seen.values())

    def alltoall_chunks(self, packets):
        """``multicast_alltoall``: per receiver ``k`` (rank order), this worker's packets of
        the groups it shares with ``k`` in group order, and the alltoall splits."""
        chunks, splits, w = [], [0] * self.n, self.packet
        for k in range(self.n):
            mine = [p for g, p in packets if k in g and k != self.rank]
            if mine:
                chunks.extend(mine)
                splits[k] = len(mine) * w
        return chunks, splits

    def regroup(self, o, packets, received):
        """``multicast_alltoall``: the received packets laid out as :meth:`decode` takes
        them (per group, the members' packets in group order, this worker's own included)."""
        got, at, w = {}, 0, self.packet
        for j in range(self.n):
            for g in self.my_groups:
                if j != self.rank and j in g:
                    got[(g, j)] = received[at:at + w]
                    at += w
        own = dict(packets)
        return [o.concat([own[g] if m == self.rank else got[(g, m)] for m in g])
                for g in self.my_groups]

    # -- reduce_scatter -------------------------------------------------------------------
    def _plan_reduce_scatter(self):
        """``self.assigned[(j, i)]``: the parts sender j pre-sums for receiver i."""
        n, r, pl = self.n, self.r, self.placement
        self.assigned = {}
        for i in range(n):
            senders = [(i + 1 + t) % n for t in range(n - r)]
            for q, part in enumerate(pl.parts):
                if i not in part:
                    j = next(w for w in senders if w in part)
                    self.assigned.setdefault((j, i), []).append(q)
        self.senders_to_me = [j for j in range(n) if (j, self.rank) in self.assigned]
        self.receivers = [i for i in range(n) if (self.rank, i) in self.assigned]

    def _slice(self, o, t, i):
        return o.cast(t[i * self.slice:(i + 1) * self.slice], o.int64)

    def scatter_buffer(self, o, coded):
        """The alltoall send buffer (per receiver, the saturated int32 pre-sum of its slice
        of the assigned parts and the saturation count) and the splits, in rank order."""
        chunks, splits = [], [0] * self.n
        for i in self.receivers:
            v, sat = o.saturate_int32(_sum([self._slice(o, coded[q], i)
                                            for q in self.assigned[(self.rank, i)]]))
            chunks.append(o.concat([v, o.cast(o.reshape(sat, [1]), o.int32)]))
            splits[i] = self.slice + 1
        return chunks, splits

    def reduce_slice(self, o, coded, received, flag):
        """This worker's slice of the total (int32, saturated), the count of saturated
        entries so far and ``flag`` (its own NaN/Inf count), from its own parts and the
        received pre-sums."""
        me, w = self.rank, self.slice + 1
        got = [o.cast(received[t * w:(t + 1) * w], o.int64) for t in range(len(self.senders_to_me))]
        terms = [self._slice(o, coded[q], me) for q in self.my_parts] + [g[:self.slice] for g in got]
        v, sat = o.saturate_int32(_sum(terms))
        sat = _sum([o.cast(sat, o.int64)] + [g[self.slice] for g in got])
        return o.concat([v, o.cast(o.reshape(sat, [1]), o.int32),
                         o.cast(o.reshape(flag, [1]), o.int32)])

    # -- one step -------------------------------------------------------------------------
    def run(self, o, part_grads, comm):
        """Exchange this worker's ``part_grads`` (``{part: 1-D float tensor}``, exactly
        its parts) through ``comm``; returns the float32 sum of all parts' gradients
        (the fixed-point sum for the coded exchanges), identical on every rank.  Raises
        FloatingPointError on every rank when any part had NaN/Inf."""
        if sorted(part_grads) != list(self.my_parts):
            raise ValueError(f"rank {self.rank} computes parts {list(self.my_parts)}, "
                             f"got gradients for {sorted(part_grads)}")
        t0 = time.perf_counter()
        sat_extra, nonfinite, self._verify_s = 0, 0, 0.0
        if self.exchange == "allreduce":
            mine = _sum([o.cast(part_grads[q], o.float32) for q in self.my_parts])
            t1 = time.perf_counter()
            total = comm.allreduce_sum(mine)
            t2 = time.perf_counter()
            result, clipped = total, 0
            nonfinite = int(not bool(o.host_bool(o.all_finite(total))))
            sent = received = ring = 2 * (self.n - 1) * self.numel * 4 // self.n
        else:
            coded = {q: self.encode_part(o, part_grads[q]) for q in self.my_parts}
            # A worker's own NaN/Inf count travels beside the coded values: replicas of a
            # part can differ (one worker's NaN), and every rank must take the same decision.
            own_flag = o.saturate_int32(_sum([o.cast(coded[q][1], o.int64)
                                              for q in self.my_parts]))[0]
            t1 = time.perf_counter()
            if self.r == self.n:
                parts, sent, received = coded, 0, 0
                t2 = time.perf_counter()
                total = _sum([o.cast(parts[q], o.int64) for q in range(self.placement.num_parts)])
                nonfinite = int(own_flag)
                total, nonfinite = self._verified(o, comm, total, nonfinite)
            elif self.exchange in ("multicast", "multicast_alltoall"):
                sums = self.checksums(o, coded)
                packets = self.packets(o, coded, own_flag, sums)
                if self.exchange == "multicast":
                    gathered = comm.group_allgather(packets)
                else:
                    chunks, splits = self.alltoall_chunks(packets)
                    gathered = self.regroup(o, packets, comm.alltoall(chunks, splits))
                t2 = time.perf_counter()
                parts, flags, differ = self.decode(o, coded, gathered, sums)
                total = _sum([o.cast(parts[q], o.int64) for q in range(self.placement.num_parts)])
                nonfinite = int(own_flag) + sum(int(f) for f in flags.values())
                if differ and not nonfinite and self.verify:
                    raise self._replicas_differ()
                sent = len(packets) * self.packet * 4
                received = len(packets) * self.r * self.packet * 4
            else:
                chunks, splits = self.scatter_buffer(o, coded)
                received_buf = comm.alltoall(chunks, splits)
                mine = self.reduce_slice(o, coded, received_buf, own_flag)
                everyone = comm.allgather(mine)
                t2 = time.perf_counter()
                w = self.slice + 2
                total = o.cast(o.concat([everyone[i * w:i * w + self.slice] for i in range(self.n)]),
                               o.int64)
                sat_extra = sum(int(everyone[i * w + self.slice]) for i in range(self.n))
                nonfinite = sum(int(everyone[i * w + self.slice + 1]) for i in range(self.n))
                sent = sum(splits) * 4 + (self.n - 1) * w * 4
                received = len(self.senders_to_me) * (self.slice + 1) * 4 + (self.n - 1) * w * 4
            clipped = int(total[0])
            result = o.fixed_decode(total[HEADER:self.length], self.range)
            ring = 2 * (self.n - 1) * self.numel * 4 // self.n
        t3 = time.perf_counter()
        self.last = dict(sent=sent, received=received, ring=ring, clipped=clipped,
                         nonfinite=nonfinite, saturated=sat_extra, encode_s=t1 - t0,
                         communicate_s=t2 - t1 + self._verify_s,
                         decode_s=t3 - t2 - self._verify_s)
        self.totals["steps"] += 1
        for key, v in self.last.items():
            self.totals[key] += v
        if nonfinite:
            raise FloatingPointError(
                f"coded SGD: {nonfinite} NaN/Inf gradient entries this step (summed over all "
                "parts and workers); the step is not applied on any rank")
        if (clipped or sat_extra) and not self._warned:
            self._warned = True
            warnings.warn(f"coded SGD: {clipped} gradient entries outside [-{self.range:g}, "
                          f"{self.range:g}] were clipped this step"
                          + (f" and {sat_extra} partial sums saturated int32" if sat_extra else "")
                          + "; raise value_range (counted in stats['total_clipped'])",
                          RuntimeWarning, stacklevel=2)
        return result

    @staticmethod
    def _replicas_differ(detail=""):
        return RuntimeError(
            "coded SGD: the r copies of a part were not computed alike" + detail + ", so "
            "ranks would decode different gradients. Seed any randomness of the loss per "
            "part (the PyTorch optimizer does, for torch's RNG) and use deterministic "
            "kernels; the step is not applied on any rank")

    def _verified(self, o, comm, total, nonfinite):
        """r = n: every rank computed every part itself; compare an int64 checksum of the
        total, and the NaN/Inf counts, between ranks (one tiny allgather; the multicast
        exchanges compare the parts' checksums inside their packets instead).  Returns
        the total and the NaN/Inf count summed over ranks."""
        if not self.verify:
            return total, nonfinite
        start = time.perf_counter()
        weights = o.cast(o.arange(self.length, like=total), o.int64) * 2 + 1
        check = int(o.reduce_sum_int(total[:self.length] * weights))   # wraps: a hash
        rows = np.asarray(comm.allgather_ints(np.array([check, nonfinite], np.int64),
                                              "check")).reshape(-1, 2)
        self._verify_s = time.perf_counter() - start
        nonfinite = int(rows[:, 1].sum())
        if (rows[:, 0] != rows[0, 0]).any() and not nonfinite:
            raise self._replicas_differ(f" (checksums of the total {rows[:, 0].tolist()})")
        return total, nonfinite

    # -- accounting -----------------------------------------------------------------------
    def formula(self):
        """Bytes per worker per step predicted from (n, r): ``sent``, ``received``, and
        the paper's load ``(1/r)(1 − r/n)`` as a fraction of all parts."""
        n, r, D = self.n, self.r, self.numel
        return dict(paper_load=(1 / r) * (1 - r / n),
                    sent_parts=comb(n - 1, r) / r if r < n else 0.0,
                    received_parts=comb(n - 1, r) if r < n else 0,
                    ring_bytes=2 * (n - 1) * D * 4 // n)

    def stats(self, compute_s=0.0, handed=0):
        """``last_*`` and ``total_*`` counters (bytes, clip counts, seconds), with the
        glue's seconds of part gradients and bytes handed to Horovod."""
        out = {f"last_{k}": v for k, v in self.last.items()}
        out.update({f"total_{k}": v for k, v in self.totals.items()})
        out.update(total_compute_s=compute_s, total_handed_to_horovod=handed)
        return out

    def is_global_batch(self, lengths, batch_size):
        """True when the tensors given (``lengths``: their first dimensions) are the global
        mini-batch, False when they are this worker's samples; ValueError otherwise."""
        lengths = set(lengths)
        if len(lengths) != 1:
            raise ValueError(f"tensors have different lengths {sorted(lengths)}")
        length, mine = lengths.pop(), sum(self.placement.part_sizes(batch_size)[q]
                                         for q in self.my_parts)
        if length not in (batch_size, mine):
            raise ValueError(f"expected the global mini-batch ({batch_size} samples) or this "
                             f"worker's parts ({mine}), got {length}")
        return length == batch_size


def __getattr__(name):
    # ``in_process`` (the simulator of n workers) lives in :mod:`.simulate`; it imports
    # this module, so it is re-exported on first access rather than at import
    if name == "in_process":
        from .simulate import in_process
        return in_process
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
