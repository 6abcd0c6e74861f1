"""Coded synchronous SGD (seed 003): placement, fixed point and both coded exchanges in
one process (n simulated workers).  Through real ``horovodrun -np 3`` and ``-np 4`` jobs
in both frameworks: tests/integration/test_coded_horovod.py."""
from math import ceil, comb

import numpy as np
import pytest
import torch

from reference import MAX, fixed_reference
from hvd_compress.coded import CodedBatchSampler, CodedExchange, placement
from hvd_compress.coded.exchange import HEADER, in_process
from hvd_compress.ops import torch_ops as o

# -- placement ----------------------------------------------------------------------------

@pytest.mark.parametrize("n,r", [(3, 1), (3, 2), (4, 2), (5, 3), (4, 4)])
def test_placement_counts(n, r):
    p = placement(n, r)
    assert p.num_parts == comb(n, r)
    assert len(p.groups) == (comb(n, r + 1) if r < n else 0)
    for w in range(n):
        assert len(p.worker_parts(w)) == comb(n - 1, r - 1)
    for q, part in enumerate(p.parts):
        assert len(part) == r and sum(p.holds(w, q) for w in range(n)) == r
    sizes = p.part_sizes(25)
    assert sum(sizes) == 25 and max(sizes) - min(sizes) <= 1


def test_placement_errors():
    with pytest.raises(ValueError, match="redundancy"):
        placement(3, 0)
    with pytest.raises(ValueError, match="redundancy"):
        placement(3, 4)
    with pytest.raises(ValueError, match="batch_size"):
        placement(4, 2).part_sizes(5)        # 6 parts
    with pytest.raises(ValueError, match="exchange"):
        CodedExchange(3, 0, 2, 10, exchange="allreduce")
    with pytest.raises(ValueError, match="value_range"):
        CodedExchange(3, 0, 2, 10, value_range=0)
    with pytest.raises(ValueError, match="nothing to exchange"):
        CodedExchange(3, 0, 2, 0)


def test_sampler_gives_each_worker_its_parts():
    n, r, B = 4, 2, 26
    samplers = [CodedBatchSampler(100, B, n, w, r, seed=3) for w in range(n)]
    batches = [list(s) for s in samplers]
    assert all(len(b) == 100 // B for b in batches)
    order = np.random.default_rng([3, 0]).permutation(100)
    p = placement(n, r)
    for step in range(len(batches[0])):
        glob = order[step * B:(step + 1) * B]
        for w in range(n):
            want = np.concatenate([glob[a:b] for q, (a, b) in enumerate(p.part_slices(B))
                                   if w in p.parts[q]])
            assert batches[w][step] == want.tolist()
        # every sample is computed by exactly r workers
        counts = np.bincount(np.concatenate([batches[w][step] for w in range(n)]), minlength=100)
        assert set(counts[glob]) == {r}


# -- fixed point --------------------------------------------------------------------------

def test_fixed_point_matches_the_paper():
    q, counts = o.fixed_encode(torch.tensor([10.0, -10.0, 0.0, 12.0, float("nan"),
                                             float("-inf")]), 10.0)
    assert q.tolist() == [0x7FFFFFFF, -0x7FFFFFFF, 0, 0x7FFFFFFF, 0, -0x7FFFFFFF]
    assert counts.tolist() == [1, 2]          # 12 clipped; NaN and -Inf non-finite
    assert int(q[1]) & 0xFFFFFFFF == 0x80000001
    assert o.fixed_decode(q[:2].long(), 10.0).tolist() == [10.0, -10.0]


def test_wrap_cancels_exactly_at_the_extremes():
    a = torch.tensor([MAX, -MAX, MAX, 5], dtype=torch.int64)
    b = torch.tensor([MAX, -MAX, -MAX, -7], dtype=torch.int64)
    packet = o.wrap_int32(a + b)                 # overflows int32 and wraps
    assert torch.equal(o.wrap_int32(packet.long() - b), a.int())


# -- the exchanges, n workers simulated in one process ------------------------------------

def simulate(n, r, grads, exchange, value_range=10.0, flags=None):
    """Each worker's int64 total (header included), from numpy part gradients; checks that
    every worker learns the NaN/Inf count of every other."""
    flags = list(range(n)) if flags is None else flags
    out = in_process(n, r, [torch.from_numpy(g) for g in grads], exchange, value_range, flags)
    for w, (total, nonfinite) in enumerate(out):     # r = n: every worker holds every part
        assert nonfinite == (flags[w] if r == n else sum(flags))
    return [total for total, _ in out]


@pytest.mark.parametrize("exchange", ["multicast", "multicast_alltoall", "reduce_scatter"])
@pytest.mark.parametrize("n,r", [(2, 1), (3, 1), (3, 2), (4, 1), (4, 2), (4, 3), (5, 2),
                                 (5, 3), (6, 3), (4, 4)])
def test_exchange_recovers_the_exact_fixed_point_sum(n, r, exchange):
    D = 101                                     # not a multiple of r or n: padding
    rng = np.random.default_rng([n, r])
    grads = np.clip(rng.standard_normal((comb(n, r), D)) * 4, -10, 10).astype(np.float32)
    if exchange != "reduce_scatter":    # the parts' sums wrap around int32 in the packets
        grads[:, :5] = [9.99, -9.99, 10.0, -10.0, 9.5]
    else:                           # reduce_scatter needs the *total* within the range
        grads /= len(grads)
        grads[:, :5] = 0
        grads[0, :5] = [9.99, -9.99, 10.0, -10.0, 9.5]
    want = fixed_reference(grads)
    for total in simulate(n, r, grads, exchange):
        assert int(total[0]) == int(total[1]) == 0
        got = o.fixed_decode(total[HEADER:HEADER + D], 10.0).numpy()
        assert np.array_equal(got.view(np.int32), want.view(np.int32))


def test_header_counts_clipped_and_nonfinite_over_all_parts():
    grads = np.zeros((3, 8), np.float32)
    grads[0, 0], grads[1, 1], grads[2, 2], grads[2, 3] = 11, -12, np.nan, np.inf
    for ex in ("multicast", "reduce_scatter"):
        for total in simulate(3, 2, grads, ex):
            assert total[:2].tolist() == [2, 2]


def test_reduce_scatter_saturates_and_counts_a_total_beyond_the_range():
    n, r = 4, 2
    grads = np.full((comb(n, r), 16), 6.0, np.float32)       # total 36 > 10
    ex = [CodedExchange(n, w, r, 16, exchange="reduce_scatter") for w in range(n)]
    coded = [{q: e.encode_part(o, torch.from_numpy(grads[q])) for q in e.my_parts} for e in ex]
    bufs = [e.scatter_buffer(o, coded[w]) for w, e in enumerate(ex)]
    counts = 0
    for i, e in enumerate(ex):
        recv = torch.cat([bufs[j][0][ex[j].receivers.index(i)] for j in range(n) if bufs[j][1][i]])
        mine = e.reduce_slice(o, coded[i], recv, torch.tensor(0))
        assert (mine[:e.slice][: max(0, min(e.slice, 16 + HEADER - i * e.slice))].abs() <= MAX).all()
        counts += int(mine[e.slice])
    assert counts >= 16        # every value saturated at least once (pre-sums and totals)


@pytest.mark.parametrize("exchange", ["multicast", "multicast_alltoall"])
@pytest.mark.parametrize("n,r", [(3, 1), (3, 2), (4, 2), (4, 3), (5, 2)])
def test_every_worker_sees_that_two_copies_of_a_part_differ(n, r, exchange):
    """One holder's copy of one part is off by one unit: every worker (holders and the
    others) must find out from the checksums in the packets, with no extra collective."""
    D = 50
    rng = np.random.default_rng([n, r, 1])
    grads = [torch.from_numpy(rng.standard_normal(D).astype(np.float32)) for _ in range(comb(n, r))]
    ex = [CodedExchange(n, w, r, D, exchange=exchange) for w in range(n)]
    for q, holders in enumerate(ex[0].placement.parts):
        if len(holders) < 2 and r > 1:
            continue
        coded = [{p: e.encode_part(o, grads[p]) for p in e.my_parts} for e in ex]
        if r > 1:                               # holders[-1] computed part q differently
            coded[holders[-1]][q] = coded[holders[-1]][q].clone()
            coded[holders[-1]][q][HEADER + 3] += 1
        sums = [e.checksums(o, coded[w]) for w, e in enumerate(ex)]
        pk = [e.packets(o, coded[w], torch.tensor(0), sums[w]) for w, e in enumerate(ex)]
        by = [dict(p) for p in pk]
        for w, e in enumerate(ex):
            assert pk[w][0][1].numel() == e.packet == e.segment + 1 + r
            _, _, differ = e.decode(o, coded[w], [torch.cat([by[m][g] for m in g])
                                                  for g in e.my_groups], sums[w])
            assert differ == (r > 1), (q, w)
        break


def test_formula_is_the_papers_load():
    for n, r in [(3, 1), (3, 2), (4, 2), (4, 3), (8, 3)]:
        f = CodedExchange(n, 0, r, 1000).formula()
        assert f["paper_load"] == pytest.approx(f["sent_parts"] / comb(n, r))


def test_batch_length_errors_name_both_lengths():
    e = CodedExchange(4, 1, 2, 10)
    assert e.is_global_batch([24, 24], 24) is True
    assert e.is_global_batch([12], 24) is False          # 3 of 6 parts of 4 samples
    with pytest.raises(ValueError, match="different lengths"):
        e.is_global_batch([24, 23], 24)
    with pytest.raises(ValueError, match=r"global mini-batch \(24 samples\).*parts \(12\), got 13"):
        e.is_global_batch([13], 24)
