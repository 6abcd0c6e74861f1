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
def decided(monkeypatch):
    """What each ``scatter_sum`` call would decide on CUDA, in call order."""
    seen = []
    real = torch_ops.scatter_sum

    def spy(n, idx, values, dtype=torch.float32, ordered=True, meeting=None):
        seen.append(torch_ops.sorted_sum(CUDA, ordered, meeting))
        return real(n, idx, values, dtype, ordered, meeting)
    monkeypatch.setattr(torch_ops, "scatter_sum", spy)
    return seen


@pytest.mark.parametrize("ranks", [2, 3, 8])
def test_the_exchange_decompresses_inside_its_number_of_ranks(ranks, decided):
    """The protocol's decompress of an allgathered aggregate: the sum would sort on CUDA
    from three ranks on, not at two; the ranks' results are the same bits."""
    g = torch.Generator().manual_seed(ranks)
    grads = [torch.randn(5000, generator=g) for _ in range(ranks)]
    outs, _ = in_process([hvd_compress.from_spec("topk:density=0.01") for _ in range(ranks)],
                         grads, "g")
    assert decided and set(decided) == {ranks > 2}
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
    assert torch_ops.sorted_sum(CUDA)                     # left as it was


def test_a_two_round_union_sums_distinct_indices_without_sorting(decided):
    """agg=union: the values at the union (distinct indices) need no sort at any size."""
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(5000, generator=g) for _ in range(4)]
    in_process([hvd_compress.from_spec("topk:density=0.01,agg=union") for _ in range(4)],
               grads, "g")
    assert decided and not any(decided)
