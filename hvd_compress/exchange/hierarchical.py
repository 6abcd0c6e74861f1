"""The hierarchical exchange: compress only across the slow link between hosts (issue 28).

P = H * L workers: H hosts of L workers each.  Every worker has two transports besides
the global one (:class:`Hierarchy`): ``local``, the L workers of its host (local rank
l = ``local.rank``), and ``cross``, the H workers of local rank l, one per host (host
index h = ``cross.rank``).  With g_{h,l} the bucket (flat, n values) of worker (h, l)::

    1. dense reduce-scatter inside the host:   s_{h,l} = sum_{l'} g_{h,l'}[shard l]
    2. compress shard l, exchange it across hosts with the workers of local rank l
       (the inner compressor's own protocol: allreduce, allgather or two rounds):
                                               a_l = sum_h D(C(s_{h,l} + e_{h,l}))
       error feedback per shard piece:         e_{h,l} <- s_{h,l} + e_{h,l} - D(C(...))
    3. decompress (the inner exchange does);
    4. dense allgather inside the host:        out = concat_l a_l   (/ P for a mean)

so out = sum over all P workers of what each host sent, and only the compressed payloads
of step 2 cross the slow link (:attr:`HierarchicalExchange.sent`/``received``; the
dense local traffic is ``local_sent``/``local_received``).

**Shards.**  The flat bucket is cut into L contiguous shards as Horovod's reduce-scatter
cuts a first dimension: shard l has ``n // L + (l < n % L)`` values
(:func:`shard_sizes`).  Compressors that need whole tensors (``powersgd``: matrices)
get shard boundaries on the layout's tensor boundaries instead (nearest to l n / L;
shards may then be uneven or empty).  The compressor sees shard l as a bucket of its
own (``compress_bucket``/``propose_bucket``, key ``"<bucket key>/shard<l>"``) whose
tensors are the pieces of the layout's tensors inside it: a tensor wholly inside keeps
its name and shape; a tensor cut by a boundary contributes the 1-D piece
``"<tensor name>/shard<l>"``.  Per-tensor semantics (k, thresholds, residuals) are thus
per piece, and error-feedback residuals are keyed by piece name on the worker that
compresses the piece: ``state_dict`` round trips exactly for the same H x L.  An empty
shard (n < L) sends nothing across hosts.

**Degenerate cases.**  L = 1: the inner compressor's flat exchange over ``cross`` on the
bucket's own layout, bit for bit today's flat exchange (same names, residual keys,
collectives).  H = 1: a dense reduce-scatter + allgather (a dense allreduce), nothing
compressed.  Hosts of different L: :func:`check_hosts` (run by the Driver before the
first hierarchical exchange) raises ValueError on every rank.

Imports: the framework-free parts of hvd_compress.
"""
import hashlib
from typing import Any, NamedTuple

from ..buckets import layout as make_layout
from ..log import info_rank0
from .protocol import Exchange, _collective

#: inner compressors whose tensors keep their shapes (shard on tensor boundaries)
WHOLE_TENSORS = frozenset({"powersgd"})


class Hierarchy(NamedTuple):
    """A worker's two transports: ``local`` (its host's workers, rank = local rank) and
    ``cross`` (the workers of its local rank on every host, rank = host index)."""
    local: Any
    cross: Any


def shard_sizes(n, parts):
    """Horovod's even cut of ``n`` values into ``parts``: ``n // parts + (l < n % parts)``."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts!r}")
    return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]


def _whole_sizes(layout, parts):
    """Shard sizes with boundaries on tensor boundaries, each the one nearest l n / parts."""
    ends = list(layout.offsets[1:]) + [layout.total]
    bounds = [0]
    for i in range(1, parts):
        target = i * layout.total / parts
        bounds.append(max(bounds[-1], min(ends, key=lambda b: (abs(b - target), b))))
    bounds.append(layout.total)
    return [b - a for a, b in zip(bounds, bounds[1:])]


def _cut(layout, sizes):
    """Per shard (cut into ``sizes``), its pieces ``[(name, shape, offset in the bucket,
    numel)]``: a tensor wholly inside keeps its name and shape, a tensor cut by a
    boundary contributes the 1-D piece ``<name>/shard<index>``."""
    out, a = [], 0
    for index, size in enumerate(sizes):
        b, pieces = a + size, []
        for name, shape, o, m in zip(layout.names, layout.shapes, layout.offsets, layout.numels):
            lo, hi = max(a, o), min(b, o + m)
            if hi <= lo:
                continue
            whole = (lo, hi) == (o, o + m)
            pieces.append((name if whole else f"{name}/shard{index}",
                           shape if whole else (hi - lo,), lo, hi - lo))
        out.append(pieces)
        a = b
    return out


def plan_shards(layout, parts, whole=False):
    """``[(size, Layout or None)]``, one per shard (module docstring: "Shards")."""
    sizes = _whole_sizes(layout, parts) if whole else shard_sizes(layout.total, parts)
    out = []
    for index, (size, pieces) in enumerate(zip(sizes, _cut(layout, sizes))):
        lay = make_layout([p[0] for p in pieces], [p[1] for p in pieces])._replace(
            key=f"{layout.key}/shard{index}") if pieces else None
        out.append((size, lay))
    return out


def residual_places(layout, hosts=None):
    """Where a residual of this bucket's tensors may sit on a worker: ``{name: (offset,
    numel)}`` in the bucket, for the tensors' own names (the flat exchange's keys) and,
    with ``hosts`` = ``(local rank, L, H)``, the pieces ``<name>/shard<l>`` of the
    hierarchical exchange's even cut into L shards (what ``auto`` moves between flat
    and ``hier:`` candidates: :meth:`~hvd_compress.strategies.auto.Auto.carry`)."""
    places = {n: (o, m) for n, o, m in zip(layout.names, layout.offsets, layout.numels)}
    if hosts is not None and hosts[1] > 1:
        for pieces in _cut(layout, shard_sizes(layout.total, hosts[1])):
            places.update((p[0], (p[2], p[3])) for p in pieces)
    return places


def residual_names(compressor, layout, hosts=None):
    """The residual names ``compressor`` keeps for this bucket on this worker (with
    ``hosts`` = ``(local rank, L, H)``): the tensors' names for a flat exchange (and for
    ``hier:`` with L = 1), the pieces of shard ``local rank`` for ``hier:`` (none when
    H = 1: nothing is compressed), none without error feedback."""
    if not compressor.ef:
        return set()
    if not getattr(compressor, "hierarchical", False) or hosts is None or hosts[1] == 1:
        return set(compressor.residual_names(layout))
    if hosts[2] == 1:
        return set()
    whole = compressor.inner.name in WHOLE_TENSORS
    lay = plan_shards(layout, hosts[1], whole)[hosts[0]][1]
    return set(compressor.residual_names(lay)) if lay is not None else set()


def _spec_hash(spec):
    return float(int(hashlib.sha256(spec.encode()).hexdigest()[:12], 16))   # < 2**48: exact


def check_hosts(transport, hierarchy, spec=""):
    """``(H, L)`` after checking, with one blocking float allgather on the global
    ``transport`` (so every rank sees the same and raises the same ValueError), that
    every host has the same number L of workers, that the cross groups have H = P / L,
    that (host, local rank) pairs are distinct, and that every rank's ``spec`` is the
    same."""
    local, cross = hierarchy
    every = transport.allgather_floats(
        [float(local.size), float(local.rank), float(cross.size), float(cross.rank),
         _spec_hash(spec)], "hier.check")
    rows = [tuple(int(v) for v in r[:4]) + (r[4],) for r in every]
    size = len(rows)
    lsizes = sorted({r[0] for r in rows})
    problems = []
    if len(lsizes) > 1:
        per = ", ".join(f"rank {i}: {r[0]}" for i, r in enumerate(rows))
        problems.append(f"uneven hosts: workers per host (local sizes) differ ({per}); "
                        "'hier:' needs the same number of workers on every host")
    else:
        lsize, csizes = lsizes[0], sorted({r[2] for r in rows})
        if len(csizes) > 1 or lsize * csizes[0] != size:
            problems.append(f"{size} workers are not hosts x local: local size {lsize}, "
                            f"cross sizes {csizes}")
        elif len({(r[3], r[1]) for r in rows}) != size:
            problems.append("two ranks claim the same (host, local rank)")
    if len({r[4] for r in rows}) > 1:
        problems.append("ranks configured differently: the 'hier:' compressor spec differs "
                        f"between ranks (this rank: {spec!r})")
    if problems:
        raise ValueError("hvd_compress hierarchical exchange (hier:): " + "; ".join(problems))
    info_rank0(transport.rank, "hierarchical exchange: %d hosts x %d workers, %s across hosts",
               rows[0][2], rows[0][0], spec)
    return rows[0][2], rows[0][0]


class HierarchicalExchange(Exchange):
    """One bucket (``flat`` + ``layout``) or one tensor (``tensor``, with its one-tensor
    ``layout``) through the hierarchical exchange (module docstring), driven like an
    :class:`~.protocol.Exchange` (``advance``, ``finish_all``).  ``compressor``: a
    :class:`~hvd_compress.compressors.hierarchical.Hierarchical`; ``hierarchy``: the
    worker's :class:`Hierarchy`; ``average``: divide by P = H L.

    When done, besides :class:`~.protocol.Exchange`'s attributes (``sent``,
    ``received`` ... counting the *cross* transport only: the slow link):
    :attr:`local_sent`, :attr:`local_received` (dense bytes inside the host),
    :attr:`cross` (the inner exchange over ``hierarchy.cross``, or None)."""

    hierarchical = True

    def __init__(self, compressor, hierarchy, name, tensor=None, flat=None, layout=None,
                 inplace=False, average=False):
        if layout is None:
            raise ValueError("layout is required: the hierarchical exchange cuts the bucket's "
                             "layout into shards")
        self.hierarchy = hierarchy
        self.local_sent = self.local_received = 0
        self.cross = None
        super().__init__(compressor, hierarchy.local, name, tensor=tensor, flat=flat,
                         layout=layout, inplace=inplace, average=average)

    def _steps(self):
        inner = self.compressor.inner
        local, cross = self.hierarchy
        parts, hosts = local.size, cross.size
        ops = local.ops
        if parts == 1:                                   # today's flat exchange
            ex = Exchange(inner, cross, self.name, tensor=self.tensor,
                          flat=None if self.tensor is not None else self.flat,
                          layout=None if self.tensor is not None else self.layout,
                          inplace=self.inplace, start=False)
            out = yield from ex._gen
            self._take(ex)
        else:
            flat = self.flat if self.tensor is None else ops.flatten(self.tensor)
            plan = plan_shards(self.layout, parts, whole=inner.name in WHOLE_TENSORS)
            sizes = [s for s, _ in plan]
            wire = local.wire(self.name)
            shard, sent1, received1 = yield from _collective(
                local.reducescatter(flat, f"{wire}.rs", sizes))
            lay = plan[local.rank][1]
            if hosts > 1 and lay is not None:            # compress across hosts
                ex = Exchange(inner, cross, lay.key, flat=shard, layout=lay, start=False)
                shard = yield from ex._gen
                self._take(ex)
            (out,), sent2, received2 = yield from _collective(
                local.allgather((shard,), f"{wire}.ag"))
            self.local_sent, self.local_received = sent1 + sent2, received1 + received2
            if self.tensor is not None:
                out = ops.reshape(out, self.layout.shapes[0])
        if self.average:
            out = local.divide(out, parts * hosts)
        return out

    def _take(self, ex):
        """The inner (cross-host) exchange's traffic and state are this exchange's."""
        self.cross = ex
        self.sent, self.received, self.received_local = ex.sent, ex.received, ex.received_local
        self.union, self.k, self.payload, self.state = ex.union, ex.k, ex.payload, ex.state

    @property
    def cross_sent(self):
        """Bytes this worker sent over the slow link (= :attr:`sent`)."""
        return self.sent

    @property
    def cross_received(self):
        """Bytes this worker received over the slow link (= :attr:`received`)."""
        return self.received
