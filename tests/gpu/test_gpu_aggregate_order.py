"""A sparse aggregate of 8 ranks on CUDA: every rank's decompress of the allgathered
payload holds the same bits, every time, and the CPU's.  Each rank sums the ranks'
(value, index) pairs itself, so where three or more ranks sent an index, the order of
the additions decides the last bit of its sum; ``index_add_`` on CUDA adds with atomics
in no fixed order, and replicas whose gradients differ in a bit drift apart.
``ops.scatter_sum`` adds each index's values in rank order there (``index_put_``'s
accumulation: a stable sort, then a sequential sum per index below 32 values).
Where the exchange knows each rank's number of pairs (the DDP hook's transport, the
in-process one, any fixed-size payload), it adds rank by rank instead: an ``index_add_``
a rank, whose atomics never meet (``segments``).
Eight simulated ranks (``aggregation.in_process``: the allgather is the concatenation
in rank order, as the glue's, with each rank's rows), gradients sharing most of their
largest entries; two ranks sum with atomics (at most two values at an index: the same
float either way)."""
import pytest
import torch

import hvd_compress
from hvd_compress.compressors.aggregation import in_process
from gpu_helpers import CUDA_ONLY, DEV, GPU, assert_same_bits, laplace

pytestmark = GPU

RANKS, N = 8, 1 << 18


def grads(device):
    """Rank ``r``'s gradient: a shared Laplace part and a small one of its own (the top 1%
    of each rank mostly the same indices), values of many scales (sums that round)."""
    shared = laplace(N, seed=7).to(device)
    return [shared * (1 + 0.01 * r) + 0.05 * laplace(N, seed=100 + r).to(device)
            for r in range(RANKS)]


@pytest.mark.parametrize("spec", ["topk:density=0.01", "laplace_topk:density=0.01,fused=1"])
def test_eight_ranks_decompress_the_same_bits_as_the_cpu(spec):
    outs, info = in_process([hvd_compress.from_spec(spec) for _ in range(RANKS)],
                            grads(DEV), "g")
    assert info["union"] < RANKS * info["k"] // 2          # indices shared by many ranks
    for r in range(1, RANKS):
        assert_same_bits(outs[0], outs[r], f"{spec}: rank 0 against rank {r}")
    cpu, _ = in_process([hvd_compress.from_spec(spec) for _ in range(RANKS)],
                        grads("cpu"), "g")
    if spec.startswith("topk"):                  # the same selection on both devices
        assert_same_bits(cpu[0], outs[0], f"{spec}: CPU against {DEV}")


def test_two_ranks_sum_with_atomics_and_the_cpus_bits():
    """Two ranks (the exchange's ``summing_ranks(2)``): no sort, ``index_add_``'s
    atomics, and still the CPU's bits every time (``0 + a + b`` is ``0 + b + a``)."""
    from hvd_compress.ops import torch_ops
    with torch_ops.summing_ranks(2):
        assert not torch_ops.sorted_sum(torch.device(DEV))
    cpu, _ = in_process([hvd_compress.from_spec("topk:density=0.01") for _ in range(2)],
                        grads("cpu")[:2], "g")
    for _ in range(5):
        outs, _ = in_process([hvd_compress.from_spec("topk:density=0.01") for _ in range(2)],
                             grads(DEV)[:2], "g")
        assert_same_bits(outs[0], outs[1], "rank 0 against rank 1")
        assert_same_bits(cpu[0], outs[0], f"CPU against {DEV}")


def pairs(n_idx, per_index, seed):
    """``(indices, values)``: about ``per_index`` values at each of ``n_idx`` indices, in
    random order, of magnitudes 1e-3 to 1e3 (sums that round)."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, n_idx, (per_index * n_idx,), generator=g, dtype=torch.int64)
    scale = torch.logspace(-3, 3, idx.numel())[torch.randperm(idx.numel(), generator=g)]
    return idx, (torch.randn(idx.numel(), generator=g) * scale).float()


@CUDA_ONLY
def test_scatter_sum_adds_in_rank_order_every_time(record):
    """The same gathered pairs (8 a index on average, at most some 20) summed 20 times:
    ``scatter_sum``'s bits each time, the CPU's sequential sum; how often
    ``index_add_``'s atomics gave other bits is recorded (the reason for the sorted sum),
    not asserted."""
    from hvd_compress.ops import torch_ops
    idx, values = pairs(4096, RANKS, seed=3)
    want = torch_ops.scatter_sum(4096, idx, values)                   # CPU: in order
    ic, vc = idx.cuda(), values.cuda()
    atomics = 0
    for _ in range(20):
        assert_same_bits(want, torch_ops.scatter_sum(4096, ic, vc), "scatter_sum on CUDA")
        plain = torch.zeros(4096, device="cuda").index_add_(0, ic, vc)
        atomics += not torch.equal(plain.cpu().view(torch.int32), want.view(torch.int32))
    record("aggregate_order", "index_add_trials_off_the_ordered_sum_of_20", atomics)


@CUDA_ONLY
def test_scatter_sum_of_many_values_at_an_index_is_the_same_every_time():
    """64 values a index on average (past a warp: ``index_put_`` sums a run of 32 or more
    in a fixed tree, not the CPU's order): the same bits in 10 runs."""
    from hvd_compress.ops import torch_ops
    idx, values = pairs(256, 64, seed=4)
    ic, vc = idx.cuda(), values.cuda()
    first = torch_ops.scatter_sum(256, ic, vc)
    for _ in range(9):
        assert_same_bits(first, torch_ops.scatter_sum(256, ic, vc), "64 a index")


@CUDA_ONLY
@pytest.mark.parametrize("ranks,pad", [(3, 0), (8, 0), (8, 5)])
def test_rank_by_rank_sum_is_the_cpus_bits_every_time(ranks, pad):
    """Each rank's pairs (distinct indices, most shared; ``pad`` zeros at its first index
    as ``padded=1`` sends) added one ``index_add_`` a rank on CUDA: the CPU's sequential
    sum's bits in 20 runs, and the sorted sum's."""
    from hvd_compress.ops import torch_ops
    from bucket_data import shared_pairs
    idx, values, lengths = shared_pairs(ranks, 3000, 1 << 16, seed=ranks + pad, pad=pad)
    want = torch_ops.scatter_sum(1 << 16, idx, values)                 # CPU: in order
    ic, vc = idx.cuda(), values.cuda()
    assert_same_bits(want, torch_ops.scatter_sum(1 << 16, ic, vc), "sorted, on CUDA")
    for _ in range(20):
        assert_same_bits(want, torch_ops.scatter_sum(1 << 16, ic, vc, segments=lengths),
                         "rank by rank, on CUDA")
