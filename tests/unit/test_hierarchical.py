"""The hierarchical exchange (hvd_compress/exchange/hierarchical.py, issue 28) in one
process: H hosts x L workers are threads, each with its own Driver over the transports of
in_process.hosts (a global World, one World per host, one per local rank across hosts).
References are numpy, written here from the scheme: host sums, shards cut as Horovod's
reduce-scatter cuts (pieces of tensors named <tensor>/shard<l>), per-piece compression
with error feedback, the cross-host sum, the local gather."""
import math

import numpy as np
import pytest
import torch

import hvd_compress
from hvd_compress import buckets
from hvd_compress.exchange import Driver, Exchange
from hvd_compress.exchange.driver import find_auto
from hvd_compress.exchange.hierarchical import plan_shards, shard_sizes
from hvd_compress.exchange.in_process import World, hosts
from hvd_compress.ops import torch_ops
from hvd_compress.stats import Stats
from threads import run_ranks
from reference import (hier_pieces, hier_reference, powersgd_reference,
                       reference_contribution, topk_mask)

SHAPES = {"a.weight": (40, 30), "b.weight": (30, 20), "c.bias": (7,)}
LAY = buckets.layout(list(SHAPES), list(SHAPES.values()))
MATRICES = buckets.layout(["a.weight", "b.weight"], [(40, 30), (30, 20)])


def _grad(rank, step, lay=LAY):
    return np.random.RandomState(1000 * step + rank).standard_normal(lay.total).astype(np.float32)


def _run(transports, comps, steps, lay=LAY, first=0, average=False, tensor=False, stats=None):
    """Every rank runs ``steps`` steps (one bucket each) through its own Driver; returns,
    per rank, the list of (result numpy, exchange)."""
    def rank(r):
        glob, hier = transports[r]
        d = Driver(glob, stats[r] if stats else Stats(), average=average, hierarchy=hier,
                   auto=find_auto([comps[r]]))
        got = []
        for s in range(first, first + steps):
            g = torch.from_numpy(_grad(r, s, lay))
            if tensor:
                one = buckets.layout([lay.names[0]], [(lay.total,)])
                ex = d.launch(comps[r].for_tensor(one.names[0], g), one, tensor=g.clone())
            else:
                ex = d.launch(comps[r], lay, flat=g.clone())
            d.finish([ex])
            d.end_step()
            got.append((ex.result.numpy().copy(), ex))
        return got
    out, errors = run_ranks(len(transports), rank)
    for e in errors:
        if e is not None:
            raise e
    return out


def _hier(sizes, spec, steps, **kw):
    comps = [hvd_compress.from_spec(spec) for _ in range(sum(sizes))]
    return _run(hosts(sizes, torch_ops, timeout=30), comps, steps, **kw), comps


def _flat(size, spec, steps, **kw):
    comps = [hvd_compress.from_spec(spec) for _ in range(size)]
    world = World(size, torch_ops, timeout=30)
    return _run([(world.transport(r), None) for r in range(size)], comps, steps, **kw), comps


def _pieces(lay, parts):
    return hier_pieces(lay.names, lay.offsets, lay.numels, lay.total, parts)


def _reference(sizes, steps, contribution, lay=LAY):
    """The hierarchical scheme in numpy (tests/reference.py): per step, the aggregate
    (sum over P workers) and, at the end, each (host, piece)'s residual."""
    H, L = len(sizes), sizes[0]
    residual, outs = {}, []
    pieces = _pieces(lay, L)
    for s in range(steps):
        g = [_grad(r, s, lay) for r in range(H * L)]
        outs.append(hier_reference(g, H, pieces, contribution, residual))
    return outs, residual


def _topk(density):
    return lambda c: np.where(topk_mask(c, density), c, 0).astype(np.float32)


@pytest.mark.parametrize("sizes", [[2, 2], [3, 3], [1, 1, 1, 1], [4]])
@pytest.mark.parametrize("spec", ["topk:density=0.05", "laplace_topk:density=0.05,exact=1"])
def test_every_rank_ends_with_the_reference_aggregate(sizes, spec):
    steps = 3
    got, comps = _hier(sizes, "hier:" + spec, steps)
    want, residual = _reference(sizes, steps, _topk(0.05))
    L = sizes[0]
    for r, per_rank in enumerate(got):
        for s in range(steps):
            np.testing.assert_allclose(per_rank[s][0], want[s], rtol=1e-5, atol=1e-5,
                                       err_msg=f"rank {r} step {s}")
            np.testing.assert_array_equal(per_rank[s][0], got[0][s][0])     # every rank alike
        if len(sizes) > 1:                                 # residuals where compressed
            h, l = divmod(r, L)
            for shard, name, _, _ in _pieces(LAY, L):
                res = comps[r].residual(name)
                if shard == l:
                    np.testing.assert_allclose(res.numpy(), residual[(h, name)], rtol=1e-5,
                                               atol=1e-5, err_msg=f"rank {r} {name}")
                else:
                    assert res is None, (r, name)


def test_a_tensor_launched_alone_and_the_mean():
    sizes, steps = [2, 2], 2
    got, _ = _hier(sizes, "hier:topk:density=0.05", steps, tensor=True, average=True)
    one = buckets.layout([LAY.names[0]], [(LAY.total,)])
    want, _ = _reference(sizes, steps, _topk(0.05), lay=one)
    for per_rank in got:
        for s in range(steps):
            np.testing.assert_allclose(per_rank[s][0], want[s] / 4, rtol=1e-5, atol=1e-6)


def test_twobit_first_step_is_the_reference():
    got, _ = _hier([2, 2], "hier:twobit", 1)
    want, _ = _reference([2, 2], 1, lambda c: reference_contribution("twobit", c))
    for per_rank in got:
        np.testing.assert_allclose(per_rank[0][0], want[0], rtol=1e-5, atol=1e-5)


def test_laplace_topk_is_the_same_compressor_run_flat_on_the_host_summed_shards():
    sizes, steps, spec = [2, 2], 3, "laplace_topk:density=0.02"
    got, _ = _hier(sizes, "hier:" + spec, steps)
    plan = plan_shards(LAY, 2)
    flat = {(h, l): hvd_compress.from_spec(spec) for h in range(2) for l in range(2)}
    for s in range(steps):
        g = [torch.from_numpy(_grad(r, s)) for r in range(4)]
        want = []
        for l, (size, lay) in enumerate(plan):
            start = sum(p for p, _ in plan[:l])
            total = 0
            for h in range(2):
                shard = (g[2 * h] + g[2 * h + 1])[start:start + size].clone()
                payload, ctx = flat[(h, l)].compress_bucket(shard, lay)
                total = total + flat[(h, l)].decompress_bucket(payload, ctx)
            want.append(total)
        want = torch.cat(want).numpy()
        for per_rank in got:
            np.testing.assert_allclose(per_rank[s][0], want, rtol=1e-5, atol=1e-5)


def test_powersgd_shards_follow_tensor_boundaries():
    got, comps = _hier([2, 2], "hier:powersgd:rank=2", 1, lay=MATRICES)
    assert [lay.names for _, lay in plan_shards(MATRICES, 2, whole=True)] == \
        [("a.weight",), ("b.weight",)]
    g = [_grad(r, 0, MATRICES) for r in range(4)]
    want = []
    for name, o, m, shape in zip(MATRICES.names, MATRICES.offsets, MATRICES.numels,
                                 MATRICES.shapes):
        host = [(g[2 * h][o:o + m] + g[2 * h + 1][o:o + m]).reshape(shape) for h in range(2)]
        want.append(powersgd_reference(host, 2, name).reshape(-1))
    for per_rank in got:
        np.testing.assert_allclose(per_rank[0][0], np.concatenate(want), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("spec,lay", [("topk:density=0.05", LAY),
                                      ("laplace_topk:density=0.02", LAY), ("twobit", LAY),
                                      ("powersgd:rank=2", MATRICES),
                                      ("topk:density=0.1,agg=union", LAY)])
def test_one_worker_per_host_is_the_flat_exchange_bit_for_bit(spec, lay):
    steps = 3
    hier, hcomps = _hier([1, 1, 1, 1], "hier:" + spec, steps, lay=lay, average=True)
    flat, fcomps = _flat(4, spec, steps, lay=lay, average=True)
    for r in range(4):
        for s in range(steps):
            assert np.array_equal(hier[r][s][0], flat[r][s][0]), (r, s)
            assert (hier[r][s][1].sent, hier[r][s][1].received) == \
                (flat[r][s][1].sent, flat[r][s][1].received)
        hs, fs = hcomps[r].state_dict()["state"], fcomps[r].state_dict()["state"]
        assert _same_state(hs, fs)


def _same_state(a, b):
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and \
            all(_same_state(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


def test_one_worker_per_host_tensor_path_is_the_flat_exchange_bit_for_bit():
    hier, _ = _hier([1, 1, 1], "hier:laplace_topk:density=0.02", 2, tensor=True)
    flat, _ = _flat(3, "laplace_topk:density=0.02", 2, tensor=True)
    for r in range(3):
        for s in range(2):
            assert np.array_equal(hier[r][s][0], flat[r][s][0])


def test_one_host_is_a_dense_exchange():
    got, comps = _hier([4], "hier:topk:density=0.01", 2, average=True)
    for s in range(2):
        want = sum(_grad(r, s) for r in range(4)) / 4
        for per_rank in got:
            np.testing.assert_allclose(per_rank[s][0], want, rtol=1e-6, atol=1e-6)
            assert per_rank[s][1].sent == 0 and per_rank[s][1].local_sent > 0
    assert all(c.state_dict()["state"] == {} or not c.state_dict()["state"].get("residual")
               for c in comps)


@pytest.mark.parametrize("spec", ["topk:density=0.05", "laplace_topk:density=0.02", "twobit"])
def test_error_feedback_is_conserved_per_shard(spec):
    """Per rank and piece: sum over steps of what it sent + its residual = sum over steps
    of its host's sum of the piece."""
    steps, L = 3, 2
    got, comps = _hier([2, 2], "hier:" + spec, steps)
    for r in range(4):
        h, l = divmod(r, L)
        sent = 0
        came = np.zeros(LAY.total, np.float64)
        for s in range(steps):
            ex = got[r][s][1].cross
            inner = comps[r].inner
            sent = sent + inner.decode(ex.payload, ex.state, torch_ops).double().numpy()
            came += sum(_grad(h * L + j, s) for j in range(L)).astype(np.float64)
        at = 0
        for shard, name, lo, hi in _pieces(LAY, L):
            if shard != l:
                continue
            res = comps[r].residual(name).double().numpy()
            np.testing.assert_allclose(sent[at:at + hi - lo] + res, came[lo:hi], rtol=1e-5,
                                       atol=1e-4, err_msg=f"rank {r} {name}")
            at += hi - lo


@pytest.mark.parametrize("spec", ["topk:density=0.05", "powersgd:rank=2"])
def test_state_dict_round_trip_restores_bit_for_bit(spec):
    lay = MATRICES if spec.startswith("powersgd") else LAY
    transports = hosts([2, 2], torch_ops, timeout=30)
    comps = [hvd_compress.from_spec("hier:" + spec) for _ in range(4)]
    _run(transports, comps, 2, lay=lay)
    saved = [c.state_dict() for c in comps]
    after = _run(transports, comps, 1, lay=lay, first=2)
    fresh = [hvd_compress.from_spec("hier:" + spec) for _ in range(4)]
    for c, sd in zip(fresh, saved):
        c.load_state_dict(sd)
    again = _run(hosts([2, 2], torch_ops, timeout=30), fresh, 1, lay=lay, first=2)
    for r in range(4):
        assert np.array_equal(after[r][0][0], again[r][0][0]), r
    if spec.startswith("topk"):
        assert comps[1].residual("a.weight/shard1") is not None      # local rank 1's piece
        assert comps[1].residual("a.weight/shard0") is None
    with pytest.raises(ValueError, match="state_dict is for compressor 'hier:"):
        hvd_compress.from_spec(spec).load_state_dict(saved[0])


@pytest.mark.parametrize("sizes", [[2, 1], [1, 2], [3, 2, 1]])
def test_uneven_hosts_raise_on_every_rank(sizes):
    comps = [hvd_compress.from_spec("hier:topk:density=0.05") for _ in range(sum(sizes))]
    transports = hosts(sizes, torch_ops, timeout=30)

    def rank(r):
        d = Driver(transports[r][0], Stats(), average=True, hierarchy=transports[r][1])
        d.launch(comps[r], LAY, flat=torch.from_numpy(_grad(r, 0)))
    _, errors = run_ranks(len(comps), rank)
    for e in errors:
        assert isinstance(e, ValueError) and "uneven hosts" in str(e) and "hier:" in str(e), e


def test_mismatched_specs_raise_on_every_rank():
    specs = ["hier:topk:density=0.05"] * 3 + ["hier:topk:density=0.1"]
    comps = [hvd_compress.from_spec(s) for s in specs]
    transports = hosts([2, 2], torch_ops, timeout=30)

    def rank(r):
        d = Driver(transports[r][0], Stats(), average=True, hierarchy=transports[r][1])
        d.launch(comps[r], LAY, flat=torch.from_numpy(_grad(r, 0)))
    _, errors = run_ranks(4, rank)
    for e in errors:
        assert isinstance(e, ValueError) and "configured differently" in str(e), e


def test_without_hosts_information_hier_is_a_clear_error():
    c = hvd_compress.from_spec("hier:topk:density=0.05")
    world = World(1, torch_ops)
    d = Driver(world.transport(0), Stats(), average=True)
    with pytest.raises(ValueError, match="'hier:' needs the hosts' local and cross"):
        d.launch(c, LAY, flat=torch.from_numpy(_grad(0, 0)))
    with pytest.raises(ValueError, match="hier:"):
        Exchange(c, world.transport(0), "w", tensor=torch.ones(4))
    with pytest.raises(ValueError, match="hier:"):
        c.compress(torch.ones(4), "w")


def test_slow_link_bytes_are_the_cross_transport_and_a_host_sends_l_times_fewer():
    class LocalStats(Stats):
        local = []

        def add_local(self, sent, received):
            self.local.append((sent, received))

    stats = [LocalStats() for _ in range(4)]
    hier, _ = _hier([2, 2], "hier:topk:density=0.05", 1, stats=stats)
    flat, _ = _flat(4, "topk:density=0.05", 1)

    def k(n):
        return max(1, math.ceil(0.05 * n))
    for r in range(4):
        l = r % 2
        ex = hier[r][0][1]
        pieces = [hi - lo for shard, _, lo, hi in _pieces(LAY, 2) if shard == l]
        assert ex.sent == ex.cross_sent == 8 * sum(k(n) for n in pieces)
        assert ex.received == ex.cross_received == ex.sent            # the other host's
        assert stats[r].as_dict()["last_sent"] == ex.sent
        # a ring reduce-scatter sends (L-1)/L of the bucket; the gather, this rank's shard
        assert ex.local_sent == 4 * LAY.total // 2 + 4 * shard_sizes(LAY.total, 2)[l]
    assert len(LocalStats.local) == 4 and all(s > 0 for s, _ in LocalStats.local)
    per_host_hier = hier[0][0][1].sent + hier[1][0][1].sent
    per_host_flat = flat[0][0][1].sent + flat[1][0][1].sent
    assert per_host_hier * 2 <= per_host_flat + 8 * 4        # L = 2 times fewer (rounding of k)


def test_every_rank_of_a_set_starts_the_same_collectives_in_the_same_order():
    transports = hosts([2, 2], torch_ops, timeout=30)
    comps = [hvd_compress.from_spec("hier:topk:density=0.1,agg=union") for _ in range(4)]
    got = _run(transports, comps, 2)
    for r in range(4):                         # agg=union: two rounds across hosts
        assert all(np.array_equal(got[r][s][0], got[0][s][0]) for s in range(2))
        assert got[r][1][1].cross.compressor.collective == "two_round"
    for group in ([transports[0][1].local, transports[1][1].local],
                  [transports[0][1].cross, transports[2][1].cross]):
        logs = [[n for kind, n in t.world.log[t.rank] if kind == "start"] for t in group]
        assert logs[0] and logs[0] == logs[1]
        assert not group[0].world.started


def test_shards_are_horovods_even_cut_and_pieces_are_named_by_shard():
    assert shard_sizes(10, 3) == [4, 3, 3] and shard_sizes(2, 4) == [1, 1, 0, 0]
    plan = plan_shards(LAY, 2)
    assert [s for s, _ in plan] == [904, 903]
    assert plan[0][1].names == ("a.weight/shard0",) and plan[0][1].key == LAY.key + "/shard0"
    assert plan[1][1].names == ("a.weight/shard1", "b.weight", "c.bias")
    assert plan[1][1].shapes[1:] == ((30, 20), (7,))
    tiny = buckets.layout(["t"], [(2,)])
    assert plan_shards(tiny, 4)[3] == (0, None)


def test_an_empty_shard_sends_nothing_across_hosts():
    tiny = buckets.layout(["t"], [(3,)])
    got, _ = _hier([4, 4], "hier:topk:density=0.5", 1, lay=tiny)
    want = sum(_grad(r, 0, tiny) for r in range(8))
    for r, per_rank in enumerate(got):
        assert per_rank[0][1].sent == 0 or r % 4 < 3
        assert per_rank[0][0].shape == (3,)
        # each 1-value shard keeps its top-1: the dense sum
        np.testing.assert_allclose(per_rank[0][0], want, rtol=1e-5, atol=1e-5)


def test_spec_forms():
    c = hvd_compress.from_spec("hier:laplace_topk:density=0.01")
    assert c.hierarchical and c.inner.name == "laplace_topk" and c.spec.startswith("hier:")
    assert hvd_compress.from_spec(c.spec).spec == c.spec
    assert hvd_compress.from_spec("topk:density=0.01,hier=1").spec == \
        hvd_compress.from_spec("hier:topk:density=0.01").spec
    assert not getattr(hvd_compress.from_spec("topk:density=0.01,hier=0"), "hierarchical", False)
    assert c.collective == "allgather" and c.segmented
    for bad in ["hier:", "hier:hier:topk", "topk:hier=2", "hier:nope"]:
        with pytest.raises(ValueError):
            hvd_compress.from_spec(bad)


def test_a_glue_without_hosts_refuses_hier_naming_it():
    world = World(1, torch_ops, timeout=5)
    d = Driver(world.transport(0), Stats(), average=False)
    with pytest.raises(ValueError, match="'hier:' needs the hosts"):
        d.launch(hvd_compress.from_spec("hier:topk:density=0.1"), LAY,
                 flat=torch.zeros(LAY.total))


def test_the_ddp_hook_refuses_hier_at_construction():
    from hvd_compress.ddp import CompressionState
    with pytest.raises(ValueError, match="'hier:'.*DDP hook exchanges flat"):
        CompressionState(compression="hier:topk:density=0.01")


AUTO_SWITCHES = ["topk:density=0.05", "hier:topk:density=0.05", "laplace_topk:density=0.05",
                 "hier:twobit", "none"]
#: dct keeps its residuals' coefficients (@dct<block>:<n>/<name>): converted when carried
DCT_SWITCHES = ["dct:density=0.05,block=32", "topk:density=0.05", "hier:dct:density=0.05,block=32",
                "dct:density=0.05,block=64", "laplace_topk:density=0.05", "none"]


def _held(auto, lay, hosts):
    """Every residual this worker holds for ``lay``'s tensors, placed in the bucket."""
    from hvd_compress.exchange.hierarchical import residual_places
    out = np.zeros(lay.total, np.float64)
    for name, (offset, numel) in residual_places(lay, hosts).items():
        r = auto.residual(name)
        if r is not None:
            out[offset:offset + numel] += r.double().numpy()
    return out


@pytest.mark.parametrize("tensor,switches", [(False, AUTO_SWITCHES), (True, AUTO_SWITCHES),
                                             (False, DCT_SWITCHES)])
def test_auto_switches_between_flat_and_hier_candidates_and_loses_nothing(tensor, switches):
    """auto with flat and hier: candidates, calibrating one step each (topk, hier:topk,
    laplace_topk, hier:twobit, none): every rank gets the same aggregate each step, and
    after each step what was summed so far plus every residual held anywhere is the sum
    of every worker's gradients (a residual left by one scheme is sent by the next), so
    after the last step (none) nothing is left behind."""
    sizes, L, steps = [2, 2], 2, len(switches)
    lay = LAY if not tensor else buckets.layout(["w"], [(LAY.total,)])
    comps = [hvd_compress.Auto(candidates=switches, calibrate=steps, trial=0, every=0,
                               verbose=False) for _ in range(4)]
    got = _run(hosts(sizes, torch_ops, timeout=30), comps, steps, lay=lay, tensor=tensor)
    total = np.zeros(lay.total, np.float64)
    aggregate = np.zeros(lay.total, np.float64)
    for s in range(steps):
        for r in range(4):
            np.testing.assert_array_equal(got[r][s][0], got[0][s][0])
        assert got[0][s][1].hierarchical == switches[s].startswith("hier:"), s
        total += sum(_grad(r, s, lay).astype(np.float64) for r in range(4))
        aggregate += got[0][s][0]
    held = sum(_held(comps[r], lay, (r % L, L, 2)) for r in range(4))
    np.testing.assert_allclose(aggregate + held, total, rtol=1e-5, atol=1e-4)
    assert np.abs(held).max() == 0            # none, last, sent every residual


def test_auto_carries_pieces_and_other_shards_residuals_into_the_gradient():
    from hvd_compress.exchange.hierarchical import residual_names
    auto = hvd_compress.Auto(candidates=["topk:density=0.5", "hier:topk:density=0.5", "none"],
                             calibrate=3, trial=0, verbose=False)
    flat, hier, none = auto.members
    lay = buckets.layout(["a", "b"], [(3,), (5,)])        # 2 shards of 4: b is cut
    place = (1, 2, 2)                                     # local rank 1 of 2, 2 hosts
    assert residual_names(hier, lay, place) == {"b/shard1"}
    assert residual_names(flat, lay, place) == {"a", "b"}
    assert residual_names(hier, lay, (0, 2, 1)) == set()  # one host: nothing compressed
    assert residual_names(hier, lay, (0, 1, 3)) == {"a", "b"}   # L = 1: flat
    store = auto._state(torch_ops)
    store.set("residual/a", torch.tensor([1.0, 2.0, 3.0]))
    store.set("residual/b", torch.tensor([4.0, 5.0, 6.0, 7.0, 8.0]))
    g = torch.zeros(8)
    out = auto.carry(lay, g.clone(), hier, torch_ops, place)   # a and b are not its own
    torch.testing.assert_close(out, torch.arange(1.0, 9.0))
    assert auto.residual("a") is None and auto.residual("b") is None
    store.set("residual/b/shard1", torch.tensor([10.0, 20.0, 30.0, 40.0]))
    assert auto.carry(lay, g.clone(), hier, torch_ops, place).equal(g)   # its own piece
    out = auto.carry(lay, g.clone(), flat, torch_ops, place)           # flat: the piece goes
    torch.testing.assert_close(out, torch.tensor([0.0] * 4 + [10.0, 20.0, 30.0, 40.0]))
    assert auto.residual("b/shard1") is None


def test_auto_carries_and_reports_dct_coefficient_residuals():
    """dct keeps its residuals' coefficients (residual/@dct<block>:<numel>/<name>):
    auto.residual(name) converts them, and another candidate's carry sends them back in
    the gradient domain, padding dropped."""
    from hvd_compress.kernels import dct
    auto = hvd_compress.Auto(candidates=["dct:density=0.5,block=32", "topk:density=0.5"],
                             calibrate=2, trial=0, verbose=False)
    _, topk = auto.members
    lay = buckets.layout(["a", "b"], [(3,), (40,)])
    r = torch.arange(1.0, 44.0)
    store = auto._state(torch_ops)
    store.set("residual/@dct32:3/a", dct.dct(r[:3], 32))
    store.set("residual/@dct32:40/b", dct.dct(r[3:], 32))
    torch.testing.assert_close(auto.residual("b"), r[3:])
    out = auto.carry(lay, torch.zeros(43), topk, torch_ops)
    torch.testing.assert_close(out, r)
    assert auto.residual("a") is None and auto.residual("b") is None
    store.set("residual/@dct32:7/a", torch.zeros(32))     # a's size is 3: inconsistent
    with pytest.raises(ValueError, match="@dct32:7/a.*is of 7 values"):
        auto.carry(lay, torch.zeros(43), topk, torch_ops)


def test_auto_with_a_hier_candidate_needs_the_hosts():
    world = World(1, torch_ops, timeout=5)
    d = Driver(world.transport(0), Stats(), average=False)
    auto = hvd_compress.from_spec("auto:candidates=none|hier:topk:density=0.01")
    with pytest.raises(ValueError, match="'hier:' needs the hosts"):
        d.launch(auto, LAY, flat=torch.zeros(LAY.total))
    from hvd_compress import hosts as hosts_mod
    assert hosts_mod.wanted([auto]) and not hosts_mod.wanted(
        [hvd_compress.from_spec("auto:candidates=none|topk:density=0.01")])
