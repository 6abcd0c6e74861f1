"""Where a sparse decompress's sum sorts (``ops.scatter_sum`` on CUDA): only where three
or more values can meet at an index.  Two values add to the same float in either order,
so an aggregate of two ranks (the exchange's ``summing_ranks``) or of distinct indices
(``meeting=1``) takes ``index_add_``'s atomics and saves the sort's host work (0.3-0.4
ms a call on the H200's host, 2026-11-30).  The decision is taken on the host, so it is
checked here for a CUDA device without one; tests/gpu/test_gpu_aggregate_order.py
checks the bits on a GPU."""
import threading

import pytest
import torch

import hvd_compress
from hvd_compress.compressors.aggregation import in_process
from hvd_compress.ops import torch_ops
from bucket_data import shared_pairs

CUDA = torch.device("cuda")          # (a device object: no GPU needed)


def test_the_sum_sorts_on_cuda_unless_at_most_two_values_meet():
    assert torch_ops.sorted_sum(CUDA)                       # unknown: any number
    assert not torch_ops.sorted_sum(torch.device("cpu"))    # index_add_ is in order there
    assert not torch_ops.sorted_sum(CUDA, ordered=False)
    assert not torch_ops.sorted_sum(CUDA, meeting=1)
    assert not torch_ops.sorted_sum(CUDA, meeting=2)
    assert torch_ops.sorted_sum(CUDA, meeting=3)


def test_summing_ranks_bounds_what_meets_and_nests():
    with torch_ops.summing_ranks(2):
        assert not torch_ops.sorted_sum(CUDA)
        assert torch_ops.sorted_sum(CUDA, meeting=8)        # an explicit bound wins
        with torch_ops.summing_ranks(8):
            assert torch_ops.sorted_sum(CUDA)
            assert not torch_ops.sorted_sum(CUDA, meeting=1)
        assert not torch_ops.sorted_sum(CUDA)
    assert torch_ops.sorted_sum(CUDA)


def test_summing_ranks_is_the_calling_threads_own():
    seen = []
    with torch_ops.summing_ranks(2):
        t = threading.Thread(target=lambda: seen.append(torch_ops.sorted_sum(CUDA)))
        t.start()
        t.join()
        assert not torch_ops.sorted_sum(CUDA)
    assert seen == [True]


@pytest.fixture
def spied(monkeypatch):
    """Each ``scatter_sum`` call's ``(would sort on CUDA, segments)``, in call order."""
    seen = []
    real = torch_ops.scatter_sum

    def spy(n, idx, values, dtype=torch.float32, ordered=True, meeting=None, segments=None):
        seen.append((torch_ops.sorted_sum(CUDA, ordered, meeting), segments))
        return real(n, idx, values, dtype, ordered, meeting, segments)
    monkeypatch.setattr(torch_ops, "scatter_sum", spy)
    return seen


@pytest.mark.parametrize("ranks", [2, 3, 8])
def test_the_exchange_decompresses_inside_its_number_of_ranks(ranks, spied):
    """The protocol's decompress of an allgathered aggregate: the sum would sort on CUDA
    from three ranks on, not at two; the ranks' results are the same bits."""
    g = torch.Generator().manual_seed(ranks)
    grads = [torch.randn(5000, generator=g) for _ in range(ranks)]
    outs, _ = in_process([hvd_compress.from_spec("topk:density=0.01") for _ in range(ranks)],
                         grads, "g")
    assert spied and {sort for sort, _ in spied} == {ranks > 2}
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
    assert torch_ops.sorted_sum(CUDA)                     # left as it was


def test_a_two_round_union_sums_distinct_indices_without_sorting(spied):
    """agg=union: the values at the union (distinct indices) need no sort at any size."""
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(5000, generator=g) for _ in range(4)]
    in_process([hvd_compress.from_spec("topk:density=0.01,agg=union") for _ in range(4)],
               grads, "g")
    assert spied and not any(sort for sort, _ in spied)


# -- rank by rank: the ranks' rows, where the exchange knows them ------------------------

def test_rank_rows_are_the_transports_or_equal_for_a_fixed_size_payload():
    assert torch_ops.rank_rows(0, 12) is None                        # outside an exchange
    with torch_ops.summing_ranks(3, rows=((4, 0, 8), (1, 1, 1))):
        assert torch_ops.rank_rows(0, 12) == [4, 0, 8]
        assert torch_ops.rank_rows(-1, 3) == [1, 1, 1]
        assert torch_ops.rank_rows(0, 13) is None                    # they do not add up
        assert torch_ops.rank_rows(2, 12) is None                    # no such tensor
    with torch_ops.summing_ranks(3, equal=True):
        assert torch_ops.rank_rows(1, 12) == [4, 4, 4]
        assert torch_ops.rank_rows(1, 13) is None
    with torch_ops.summing_ranks(3):
        assert torch_ops.rank_rows(0, 12) is None                    # Horovod's allgather


@pytest.mark.parametrize("ranks,pad", [(3, 0), (8, 0), (8, 5), (16, 2)])
def test_adding_rank_by_rank_gives_the_sequential_sums_bits(ranks, pad, monkeypatch):
    """Where the sum would sort (forced here: CUDA's choice, on the CPU), the ranks'
    parts are added one ``index_add_`` each: the bits of the CPU's sum in index order,
    padding zeros included; each rank's part once, not a sort."""
    idx, values, lengths = shared_pairs(ranks, 300, 2000, seed=ranks + pad, pad=pad)
    want = torch.zeros(2000).index_add_(0, idx, values)              # in order
    monkeypatch.setattr(torch_ops.core, "sorted_sum", lambda *a, **k: True)
    calls = []
    real = torch.Tensor.index_add_
    monkeypatch.setattr(torch.Tensor, "index_add_",
                        lambda self, *a: calls.append(len(a[1])) or real(self, *a))
    got = torch_ops.scatter_sum(2000, idx, values, segments=lengths)
    assert calls == lengths
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_past_sixteen_ranks_the_sum_sorts(monkeypatch):
    idx, values, lengths = shared_pairs(17, 50, 400, seed=1)
    monkeypatch.setattr(torch_ops.core, "sorted_sum", lambda *a, **k: True)
    calls = []
    real = torch.Tensor.index_add_
    monkeypatch.setattr(torch.Tensor, "index_add_",
                        lambda self, *a: calls.append(len(a[1])) or real(self, *a))
    got = torch_ops.scatter_sum(400, idx, values, segments=lengths)
    assert calls == [] and torch.allclose(got, torch.zeros(400).index_add_(0, idx, values))


@pytest.mark.parametrize("spec", ["topk:density=0.01", "laplace_topk:density=0.01,padded=1",
                                  "topk:density=0.01,values=rangefloat8"])
def test_the_exchange_tells_the_sum_each_ranks_pairs(spec, spied):
    """Three ranks through the protocol (the in-process transport tells each rank's rows,
    as the DDP hook's does; a fixed-size payload's are equal under any transport): the
    decompress's sum gets each rank's number of pairs, in rank order."""
    g = torch.Generator().manual_seed(5)
    grads = [torch.randn(5000, generator=g) * (1 + r) for r in range(3)]
    outs, _ = in_process([hvd_compress.from_spec(spec) for _ in range(3)], grads, "g")
    sent = [hvd_compress.from_spec(spec).compress(gr, "g")[0][-1].numel() for gr in grads]
    assert spied and all(sort and segments == sent for sort, segments in spied), (spied, sent)
    for out in outs[1:]:
        assert torch.equal(out, outs[0])


def _gather_rows(rank, size, store, out):
    import torch.distributed as dist
    from hvd_compress.exchange import Wait
    from hvd_compress.torch.ddp_bucket import TorchDistributed
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=size)
    try:
        t = TorchDistributed(dist.group.WORLD)
        payload = (torch.full((rank + 2,), rank, dtype=torch.int64),     # 2, 3, 4 rows
                   torch.ones(2 * rank, 3).bfloat16())                     # 0, 2, 4 rows
        gen = t.allgather(payload, "x")
        try:
            w = next(gen)
            while True:
                assert isinstance(w, Wait)
                w = gen.send(w.wait())
        except StopIteration as stop:
            got = stop.value[0]
        torch.save({"rows": got.rows, "shapes": [tuple(p.shape) for p in got]},
                   f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_the_ddp_transport_tells_each_ranks_rows(tmp_path):
    """Three real Gloo processes gather tensors of different lengths (a 2-D one too):
    the result says how many rows came from each rank."""
    import torch.multiprocessing as mp
    mp.start_processes(_gather_rows, args=(3, tmp_path / "store", tmp_path), nprocs=3,
                       start_method="spawn")
    for r in range(3):
        got = torch.load(tmp_path / f"rank{r}.pt")
        assert got["rows"] == ((2, 3, 4), (0, 2, 4)) and got["shapes"] == [(9,), (6, 3)]
