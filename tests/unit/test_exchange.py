"""The exchange protocol and the step driver (hvd_compress/exchange), in one process:
ranks are threads, each with its own Driver over a LocalTransport of one World
(collectives complete when every rank has started them, in Horovod's pairing by name).
What runs over real Horovod and torch.distributed: tests/integration."""
import threading

import numpy as np
import pytest
import torch

import hvd_compress
from hvd_compress import buckets
from hvd_compress.exchange import Driver, Exchange, finish_all
from hvd_compress.exchange.in_process import World, run
from hvd_compress.ops import torch_ops
from hvd_compress.stats import Stats
from reference import reference_contribution

SHAPES = {"a.weight": (40, 30), "a.bias": (30,), "b.weight": (30, 20), "b.bias": (20,)}


def _grads(rank, step=0):
    g = np.random.RandomState(100 * rank + step)
    return {n: torch.from_numpy(g.standard_normal(s).astype(np.float32)) for n, s in SHAPES.items()}


def _step(world, rank, compression, stats, grads, average=True):
    """One training step of one rank as the glue runs it: a bucket per compressor kind
    (the two weights in one bucket, each bias alone), launched in order, then finished."""
    driver = Driver(world.transport(rank), stats, average=average)
    plan = [["a.weight", "b.weight"], ["a.bias"], ["b.bias"]]
    exchanges = []
    for names in plan:
        lay = buckets.layout(names, [SHAPES[n] for n in names])
        c = compression[rank].for_tensor(names[0], grads[names[0]])
        if len(names) == 1:
            exchanges.append(driver.launch(c, lay, tensor=grads[names[0]].clone()))
        else:
            flat = torch.cat([grads[n].reshape(-1) for n in names])
            exchanges.append(driver.launch(c, lay, flat=flat))
    driver.backward_done()
    outs = driver.finish(exchanges)
    driver.end_step()
    result = {}
    for names, out in zip(plan, outs):
        parts = [out] if len(names) == 1 else buckets.layout(
            names, [SHAPES[n] for n in names]).split(out, torch_ops)
        result.update({n: p.reshape(SHAPES[n]) for n, p in zip(names, parts)})
    return result


def _threads(size, fn):
    """Run ``fn(rank)`` for every rank in its own thread; re-raise the first error."""
    out, errors = [None] * size, []

    def target(r):
        try:
            out[r] = fn(r)
        except BaseException as e:       # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=target, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return out


@pytest.mark.parametrize("spec", ["none", "fp16", "topk:density=0.1", "twobit",
                                  "topk:density=0.1,agg=union", "powersgd:rank=2"])
def test_every_rank_starts_the_same_collectives_in_the_same_order(spec):
    size = 3
    world = World(size, torch_ops, timeout=20)
    comps = [hvd_compress.from_spec(spec) for _ in range(size)]
    stats = [Stats() for _ in range(size)]
    _threads(size, lambda r: [_step(world, r, comps, stats[r], _grads(r, s)) for s in range(2)])
    starts = [[name for kind, name in log if kind == "start"] for log in world.log]
    assert starts[0] and all(s == starts[0] for s in starts), starts
    assert len(set(starts[0][:len(starts[0]) // 2])) == len(starts[0]) // 2   # named apart
    assert not world.started                      # every collective completed on every rank


def test_two_round_exchanges_start_every_round_2_before_waiting_on_any():
    size = 2
    world = World(size, torch_ops, timeout=20)
    comps = [hvd_compress.from_spec("topk:density=0.1,agg=union") for _ in range(size)]
    _threads(size, lambda r: _step(world, r, comps, Stats(), _grads(r)))
    log = world.log[0]
    round2 = [i for i, (kind, name) in enumerate(log) if kind == "start" and name.endswith(".val")]
    waits2 = [i for i, (kind, name) in enumerate(log) if kind == "wait" and name.endswith(".val")]
    assert len(round2) == 3 and len(waits2) == 3, log
    assert max(round2) < min(waits2), log


@pytest.mark.parametrize("spec", ["none", "fp16", "topk:density=0.1"])
def test_the_driver_averages_what_an_independent_reference_sums(spec):
    size = 2
    world = World(size, torch_ops, timeout=20)
    comps = [hvd_compress.from_spec(spec) for _ in range(size)]
    grads = [_grads(r) for r in range(size)]
    outs = _threads(size, lambda r: _step(world, r, comps, Stats(), grads[r]))
    rtol = 2e-3 if spec == "fp16" else 1e-6       # fp16 payloads are summed in float16
    for name in SHAPES:
        want = sum(reference_contribution(spec, grads[r][name].numpy()) for r in range(size)) / size
        for r in range(size):
            np.testing.assert_allclose(outs[r][name].numpy(), want, rtol=rtol, atol=1e-7,
                                       err_msg=f"rank {r} {name}")


def test_stats_count_every_exchange_once_per_step():
    size = 2
    world = World(size, torch_ops, timeout=20)
    comps = [hvd_compress.from_spec("topk:density=0.1") for _ in range(size)]
    stats = [Stats() for _ in range(size)]
    _threads(size, lambda r: [_step(world, r, comps, stats[r], _grads(r, s)) for s in range(3)])
    dense = 4 * sum(int(np.prod(s)) for s in SHAPES.values())
    for s in stats:
        d = s.as_dict()
        assert d["steps"] == 3 and d["last_dense"] == dense and d["total_dense"] == 3 * dense
        # each tensor sends k (float32 value, int32 index) pairs, k = ceil(0.1 n)
        k = sum(int(np.ceil(0.1 * np.prod(shape))) for shape in SHAPES.values())
        assert d["last_sent"] == 8 * k
        assert d["last_received"] == 8 * k * (size - 1)


@pytest.mark.parametrize("spec,late", [("topk:density=0.1", False), ("powersgd:rank=2", True),
                                       ("topk:density=0.1,agg=union", True)])
def test_compress_after_a_collective_is_counted_apart(spec, late):
    """A two-round exchange agrees on its second message once its first collective is
    done, in synchronize(): those seconds are compress_s and compress_late_s both (the
    step-time split subtracts only the rest from backward's time); a one-round exchange
    compresses only where it is launched."""
    size = 2
    world = World(size, torch_ops, timeout=20)
    comps = [hvd_compress.from_spec(spec) for _ in range(size)]
    stats = [Stats() for _ in range(size)]
    _threads(size, lambda r: _step(world, r, comps, stats[r], _grads(r)))
    for s in stats:
        d = s.as_dict()
        assert d["last_compress_s"] > 0
        if late:
            assert 0 < d["last_compress_late_s"] < d["last_compress_s"], d
        else:
            assert d["last_compress_late_s"] == 0, d
        assert d["total_compress_late_s"] == d["last_compress_late_s"]
        assert s.scalars()["compression/compress_late_s"] == d["last_compress_late_s"]


def test_waiting_for_a_collective_another_rank_never_starts_is_an_error_not_a_hang():
    world = World(2, torch_ops, timeout=0.2)
    c = hvd_compress.from_spec("topk:density=0.1")
    ex = Exchange(c, world.transport(0), "w", tensor=torch.randn(10))    # rank 1 never comes
    with pytest.raises(RuntimeError, match="would hang"):
        finish_all([ex])


def test_run_in_lockstep_gives_every_rank_the_same_sum():
    comps = [hvd_compress.from_spec("topk:density=0.5,agg=union") for _ in range(3)]
    tensors = [torch.arange(8.0) * (r + 1) for r in range(3)]
    exchanges = run(comps, tensors, "x")
    assert all(e.done for e in exchanges)
    for e in exchanges[1:]:
        assert torch.equal(e.result, exchanges[0].result)
    assert e.sent > 0 and e.received > 0


def _corrupt(comp):
    """``comp``'s payloads with every index moved 10**6 out of range (a malformed peer)."""
    compress, compress_bucket = comp.compress, comp.compress_bucket

    def bad(payload):
        return payload[:-1] + (payload[-1] + 10 ** 6,)

    comp.compress = lambda *a, **k: (lambda p, ctx: (bad(p), ctx))(*compress(*a, **k))
    comp.compress_bucket = lambda *a, **k: (lambda p, ctx: (bad(p), ctx))(
        *compress_bucket(*a, **k))
    return comp


def test_the_driver_reads_every_index_check_of_a_step_back_at_once():
    """A step of three sparse buckets: their decompresses defer the indices' range checks,
    and ``finish`` reads them back in one host synchronisation (there were three), with
    the sums those of checks made at once."""
    from counting import CountSyncs              # tests/counting.py
    world = World(1, torch_ops)
    comp, grads = hvd_compress.from_spec("topk:density=0.1"), _grads(0)
    driver = Driver(world.transport(0), Stats(), average=False)
    plan = [["a.weight", "b.weight"], ["a.bias"], ["b.bias"]]
    exchanges = [driver.launch(comp, buckets.layout(names, [SHAPES[n] for n in names]),
                               flat=torch.cat([grads[n].reshape(-1) for n in names]))
                 for names in plan]
    with CountSyncs() as seen:
        outs = driver.finish(exchanges)
    assert dict(seen.syncs) == {"Tensor.tolist": 1}, seen.syncs
    assert not driver.checks
    for ex, out in zip(exchanges, outs):
        np.testing.assert_array_equal(out.numpy(), comp.decompress_bucket(
            ex.payload, ex.state).numpy())       # checked at once: the same sum


def test_a_malformed_peer_payload_fails_the_step_at_finish_on_every_rank():
    """Rank 1 sends indices out of range: both ranks' ``finish`` raise the clear
    ValueError (from the deferred checks' one readback), and no result is returned."""
    size = 2
    world = World(size, torch_ops, timeout=20)
    comps = [hvd_compress.from_spec("topk:density=0.1"),
             _corrupt(hvd_compress.from_spec("topk:density=0.1"))]
    errors = []

    def step(r):
        try:
            _step(world, r, comps, Stats(), _grads(r))
        except ValueError as e:
            errors.append(str(e))

    _threads(size, step)
    assert len(errors) == 2, errors
    assert all("payload index out of range" in e and "malformed" in e for e in errors), errors


def test_a_step_that_fails_at_once_leaves_no_check_for_the_next():
    """A bucket whose decompress raises at once (one index more than values) after one
    whose check was deferred: ``finish`` raises that error and drops the deferred check,
    so the next step does not raise an old step's error."""
    world = World(1, torch_ops)
    good = hvd_compress.from_spec("topk:density=0.1")
    bad = hvd_compress.from_spec("topk:density=0.1")
    compress_bucket = bad.compress_bucket
    bad.compress_bucket = lambda *a, **k: (lambda p, ctx: (
        (p[0], torch.cat([p[1], p[1][:1]])), ctx))(*compress_bucket(*a, **k))
    driver = Driver(world.transport(0), Stats(), average=False)
    grads = _grads(0)
    names = ["a.weight", "b.weight"]
    lay = buckets.layout(names, [SHAPES[n] for n in names])
    flat = torch.cat([grads[n].reshape(-1) for n in names])
    exchanges = [driver.launch(good, lay, flat=flat.clone()),
                 driver.launch(bad, lay, flat=flat.clone(), key="bad")]
    with pytest.raises(ValueError, match="values but .* indices"):
        driver.finish(exchanges)
    assert not driver.checks
