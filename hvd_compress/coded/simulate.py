"""Coded SGD's exchange of ``n`` simulated workers in one process, with the collectives
done by hand (tests, studies, the GPU check); also ``hvd_compress.coded.exchange.in_process``.

Imports: the standard library, :mod:`.exchange`; tensors through :mod:`hvd_compress.ops`.
"""
from .exchange import DEFAULT_RANGE, CodedExchange, _sum


def in_process(n, r, grads, exchange="multicast", value_range=DEFAULT_RANGE, flags=None):
    """The exchange of ``n`` simulated workers in one process, with the collectives done
    by hand (tests, studies, the GPU check): ``grads`` holds every part's 1-D gradient
    (``C(n, r)`` of them, one framework), ``flags`` each worker's NaN/Inf count (default
    0).  Returns per worker ``(total, nonfinite)``: the int64 sum of the encoded parts,
    header included (slice-wise saturated for ``reduce_scatter``), and the NaN/Inf count
    that worker would act on."""
    from ..ops import ops_for
    o = ops_for(grads[0])
    ex = [CodedExchange(n, w, r, o.numel(grads[0]), value_range, exchange) for w in range(n)]
    flags = [0] * n if flags is None else list(flags)
    own = [o.cast(o.scalar(f, o.cast(grads[0], o.float32)), o.int64) for f in flags]
    coded = [{q: e.encode_part(o, grads[q]) for q in e.my_parts} for e in ex]
    P = ex[0].placement.num_parts
    if r == n:
        return [(_sum([o.cast(c[q], o.int64) for q in range(P)]), flags[w])
                for w, c in enumerate(coded)]
    if exchange == "allreduce":
        raise ValueError("in_process simulates the coded exchanges, not allreduce")
    if exchange == "reduce_scatter":
        bufs = [e.scatter_buffer(o, coded[w]) for w, e in enumerate(ex)]
        slices = []
        for i, e in enumerate(ex):
            recv = [bufs[j][0][ex[j].receivers.index(i)] for j in range(n) if bufs[j][1][i]]
            slices.append(e.reduce_slice(o, coded[i], o.concat(recv), own[i]))
        s = ex[0].slice
        total = o.cast(o.concat([x[:s] for x in slices]), o.int64)
        nonfinite = sum(int(x[s + 1]) for x in slices)
        return [(total, nonfinite)] * n
    sums = [e.checksums(o, coded[w]) for w, e in enumerate(ex)]
    packets = [e.packets(o, coded[w], own[w], sums[w]) for w, e in enumerate(ex)]
    out = []
    for w, e in enumerate(ex):
        if exchange == "multicast":          # what each group's allgather delivers
            by = [dict(p) for p in packets]
            gathered = [o.concat([by[m][g] for m in g]) for g in e.my_groups]
        else:                                # what the alltoall delivers, senders in order
            recv = []
            for j in range(n):
                chunks, splits = ex[j].alltoall_chunks(packets[j])
                if splits[w]:
                    at = sum(splits[:w])
                    recv.append(o.concat(chunks)[at:at + splits[w]])
            gathered = e.regroup(o, packets[w], o.concat(recv))
        parts, fl, _ = e.decode(o, coded[w], gathered, sums[w])
        out.append((_sum([o.cast(parts[q], o.int64) for q in range(P)]),
                    flags[w] + sum(int(f) for f in fl.values())))
    return out
