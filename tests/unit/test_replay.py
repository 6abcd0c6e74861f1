"""CUDA-graph replay of a bucket's compress and decompress
(``hvd_compress/compressors/replay.py``): when it captures, replays or runs eagerly,
what it keeps on the host, and what it puts back.

CUDA graphs cannot be captured here (no GPU), so these tests give ``replay`` a stand-in
for ``torch.cuda.graph`` with a graph's semantics on the CPU (tests/replay_standin.py):
capturing changes only the host's state, and a replay computes what the capture
recorded into the capture's own tensors without changing the host's state.
``tests/gpu/test_gpu_replay.py`` captures real graphs on CUDA, bit for bit against the
eager compress and decompress."""
import logging

import numpy as np
import pytest
import torch

from hvd_compress.buckets import layout
from hvd_compress.compressors import replay
from hvd_compress.ops import torch_ops
from hvd_compress.spec import from_spec

import counting  # tests/counting.py
from replay_standin import StandIn  # tests/replay_standin.py

LAY = layout(list("abcde"), [(48,), (16, 12), (64,), (3, 16), (80,)])
REPLAYABLE = ["twobit", "twobit:ef=0", "onebit", "signsgd", "rangefloat:bits=8",
              "laplace_topk:density=0.05,padded=1",
              "laplace_topk:density=0.05,padded=1,values=rangefloat8",
              "laplace_topk:density=0.05,padded=1,ef_decay=0.9",
              "laplace_topk:density=0.05,padded=1,warm=1",
              "dct:density=0.05,padded=1", "dct:density=0.05,padded=1,ef=0",
              "dct:density=0.05,padded=1,block=64,bits=12"]
DCT = "dct:density=0.05,padded=1"


def residual_parts(c, lay=None):
    """``(parts, like)`` of the buffer ``c`` keeps the residuals of ``lay`` in: the input's
    layout, or dct's coefficients' (float32)."""
    lay = lay or LAY
    domain = c.residual_buffer(lay, c._ops)
    if domain is None:
        return tuple(zip(lay.names, lay.numels)), torch.empty(1)
    return domain[0], torch.empty(1, dtype=domain[2])


def grad(step, n=LAY.total):
    g = torch.from_numpy(np.random.default_rng(step).laplace(size=n).astype(np.float32))
    if step == 3:
        g[70] = float("nan")          # a step with NaN: error feedback keeps its residuals
    return g


def parts(t):
    return tuple(t) if isinstance(t, (tuple, list)) else (t,)


@pytest.fixture(autouse=True)
def cuda_code_path(monkeypatch):
    """The CUDA code path (kernels in Triton's interpreter), the one a GPU captures: the
    CPU's own paths read NaN/Inf flags on the host, which a capture cannot."""
    monkeypatch.setenv("HVD_COMPRESS_BACKEND", "triton")


@pytest.fixture
def stats(monkeypatch):
    monkeypatch.setattr(replay, "STATS", dict.fromkeys(replay.STATS, 0))
    return replay.STATS


def run(spec, steps=6, capture=StandIn, restore_at=(), lay=LAY):
    """Payloads of ``steps`` compresses with replay and eagerly (each step's input a new
    tensor), and both compressors; a checkpoint restored into both at ``restore_at``."""
    eager, replayed = from_spec(spec), from_spec(spec)
    standin = capture()
    out = []
    for step in range(steps):
        if step in restore_at:
            saved = eager.state_dict()
            eager.load_state_dict(saved)
            replayed.load_state_dict(saved)
        mine, _ = replay.compress_bucket(replayed, grad(step, lay.total), lay, capture=standin)
        theirs, _ = eager.compress_bucket(grad(step, lay.total), lay)
        out.append(([t.clone() for t in parts(mine)], [t.clone() for t in parts(theirs)]))
    return out, eager, replayed, standin


def as_bytes(t):
    """``t``'s bits, comparable with torch.equal (NaN equal to the same NaN)."""
    t = torch.as_tensor(t).reshape(-1)
    return t.view(torch.uint8) if t.is_floating_point() else t


def same_bits(a, b):
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(as_bytes(x), as_bytes(y))
                                    for x, y in zip(a, b))


def same_state(c1, c2):
    s1, s2 = c1.state_dict()["state"], c2.state_dict()["state"]
    assert sorted(s1) == sorted(s2)
    for k in s1:
        assert torch.equal(as_bytes(s1[k]), as_bytes(s2[k])), k


ALONE = layout(["w"], [(24, 20)])      # a bucket of one tensor (the glue's when replayed)


@pytest.mark.parametrize("lay", [LAY, ALONE], ids=["bucket", "alone"])
@pytest.mark.parametrize("spec", REPLAYABLE)
def test_replayed_compress_gives_the_eager_bits_and_state(spec, lay, stats):
    """Six steps (one with a NaN), each input a new tensor: the same payload bits as the
    eager compress at every step, the same residuals after; the first step eager, one
    graph per role of the bucket's two buffers, replayed at every later step.  The same
    for a bucket of one tensor."""
    out, eager, replayed, standin = run(spec, lay=lay)
    for step, (mine, theirs) in enumerate(out):
        assert same_bits(mine, theirs), (spec, step)
    same_state(eager, replayed)
    assert (stats["eager"], stats["captured"], stats["replayed"], stats["off"]) == (
        (1, 1, 5, 0) if spec.endswith("ef=0") else (1, 2, 5, 0))
    assert standin.captures == stats["captured"]


@pytest.mark.parametrize("spec", ["twobit", "laplace_topk:density=0.05,padded=1", DCT])
def test_the_residuals_after_a_replay_are_views_of_the_buckets_buffer(spec, stats):
    """After a replayed compress the store holds what the eager compress leaves: the
    bucket's residuals, views of its input buffer end to end (``take_buffer``), here
    one of the bucket's own two, in turn (dct: of its two coefficient buffers, the
    input in a third)."""
    for steps in (4, 5):
        _, _, replayed, _ = run(spec, steps=steps)
        memory = replayed.error_feedback(replayed._ops)
        rparts, like = residual_parts(replayed)
        buffer = memory.bucket_buffer(rparts, like)
        bucket, = replayed._replay_buckets.values()
        assert buffer.data_ptr() == bucket.buffers[(steps - 1) % 2].data_ptr()
        at = buffer.data_ptr()
        for name, n in rparts:
            assert memory.residual(name).data_ptr() == at
            at += 4 * n
        assert (bucket.input is None) == (not spec.startswith("dct"))


@pytest.mark.parametrize("spec", ["twobit", "twobit:ef=0", "laplace_topk:density=0.05,padded=1",
                                  DCT, DCT + ",ef=0"])
def test_a_caller_that_writes_into_the_input_buffer_gets_the_eager_bits(spec, stats):
    """The glue's way: ``input_buffer`` (None for the first two steps, and at the step
    after a restore) is where the caller writes the step's input, which the compress
    then takes as it is; the residual ends in it (dct's: in a buffer of its own, the
    input in the same one every step); the eager bits throughout."""
    eager, c = from_spec(spec), from_spec(spec)
    standin, given = StandIn(), []
    for step in range(9):
        if step == 5:
            saved = eager.state_dict()
            eager.load_state_dict(saved)
            c.load_state_dict(saved)
        into = replay.input_buffer(c, LAY, torch.empty(0))
        given.append(into is not None)
        flat = into if into is not None else torch.empty(LAY.total)
        flat.copy_(grad(step))
        mine, _ = replay.compress_bucket(c, flat, LAY, capture=standin)
        theirs, _ = eager.compress_bucket(grad(step), LAY)
        assert same_bits(parts(mine), parts(theirs)), step
        if into is not None and c.ef:
            r = c.error_feedback(c._ops).bucket_buffer(*residual_parts(c))
            bucket, = c._replay_buckets.values()
            assert (r.data_ptr() == into.data_ptr()) == (bucket.input is None), step
            assert bucket.input is None or into is bucket.input, step
    same_state(eager, c)
    restored = 5 if c.ef else None              # (no residual to restore without ef)
    assert given == [False, False] + [step != restored for step in range(2, 9)]
    assert stats["off"] == 0


class Failing(StandIn):
    """A capture that fails after the compress's Python ran (its host effects done;
    nothing computed)."""

    def __call__(self, fn, written, store):
        self.captures += 1
        data = [t.clone() for t in written]
        fn()
        for t, d in zip(written, data):
            t.copy_(d)
        raise RuntimeError("operation not permitted when stream is capturing")


def test_a_failed_capture_puts_the_store_back_and_runs_eagerly(stats, caplog):
    caplog.set_level(logging.WARNING, logger="hvd_compress")
    out, eager, replayed, standin = run("twobit", capture=Failing)
    assert all(same_bits(m, t) for m, t in out)
    same_state(eager, replayed)
    assert standin.captures == 1 and stats["off"] == 1 and stats["replayed"] == 0
    assert "the capture failed: RuntimeError: operation not permitted" in caplog.text
    assert sum("eagerly from now on" in r.getMessage() for r in caplog.records) == 1


def test_a_compress_that_keeps_its_residuals_elsewhere_is_not_replayed(stats, caplog):
    """dct's residuals live in the coefficient domain, not in the bucket's input buffer:
    where it did not say so (``residual_buffer``), it runs eagerly, turned off (logged)
    after UNBUFFERED tries, and the check after a capture would have refused it too."""
    caplog.set_level(logging.WARNING, logger="hvd_compress")
    spec = "dct:density=0.05,padded=1"
    assert from_spec(spec).replayable and not from_spec("dct:density=0.05").replayable
    eager, c = from_spec(spec), from_spec(spec)
    c.residual_buffer = lambda layout, ops: None
    for step in range(5):
        flat = grad(step)
        before = c._store.tables() if c._store is not None else None
        mine, _ = replay.compress_bucket(c, flat, LAY, capture=StandIn())
        theirs, _ = eager.compress_bucket(grad(step), LAY)
        assert same_bits(parts(mine), parts(theirs)), step
    same_state(eager, c)
    assert stats["off"] == 1 and stats["replayed"] == 0 and stats["eager"] == 5
    assert "does not keep the residuals in one bucket buffer" in caplog.text
    assert "does not keep the residuals in the bucket's buffer" in replay.host_effects(
        c, before, LAY, flat)


@pytest.mark.parametrize("spec", ["twobit", DCT])
def test_restored_checkpoints_run_eagerly_once_then_replay_the_same_graphs(spec, stats):
    """After ``load_state_dict`` the residuals are separate tensors, not one buffer: one
    eager compress makes them one again, which the next compress moves into the
    bucket's first buffer; the two graphs go on replaying, none captured again."""
    out, eager, replayed, _ = run(spec, steps=15, restore_at=(3, 8, 12))
    assert all(same_bits(m, t) for m, t in out)
    same_state(eager, replayed)
    assert (stats["eager"], stats["captured"], stats["replayed"], stats["off"]) == (4, 2, 11, 0)


def test_brackets_restored_from_an_earlier_step_reach_the_graphs(stats):
    """``warm=1``'s brackets live in tensors the graphs read and write: a checkpoint of
    an earlier step restored into a bucket that replays is copied into them before the
    next replay, so the run goes on with the eager run's bits and state."""
    spec = "laplace_topk:density=0.05,padded=1,warm=1"
    eager, c, standin = from_spec(spec), from_spec(spec), StandIn()
    for step in range(10):
        if step == 2:
            saved = eager.state_dict()
        if step == 7:
            eager.load_state_dict(saved)
            c.load_state_dict(saved)
        mine, _ = replay.compress_bucket(c, grad(step), LAY, capture=standin)
        theirs, _ = eager.compress_bucket(grad(step), LAY)
        assert same_bits(parts(mine), parts(theirs)), step
        same_state(eager, c)
    assert (stats["eager"], stats["captured"], stats["off"]) == (2, 2, 0)


@pytest.mark.parametrize("spec", ["twobit", "laplace_topk:density=0.05,padded=1",
                                  "laplace_topk:density=0.05,padded=1,warm=1",
                                  "laplace_topk:density=0.05,padded=1,warm=1,ef=0", DCT])
def test_a_step_undone_by_the_journal_is_undone_in_replay_too(spec, stats):
    """A glue that drops a step (an overflow under a loss scale) rolls the compressor's
    journal back: the residuals are the step's before, views of the other buffer.  The
    next compress finds them there, no longer the bucket's last buffer: eager once, then
    replayed again; the eager run's bits and state throughout."""
    from hvd_compress.stores import Journal
    eager, c = from_spec(spec), from_spec(spec)
    journals = [Journal(), Journal()]
    eager.attach_journal(journals[0])
    c.attach_journal(journals[1])
    standin = StandIn()
    for step in range(10):
        for j in journals:
            j.clear()
        mine, _ = replay.compress_bucket(c, grad(step), LAY, capture=standin)
        theirs, _ = eager.compress_bucket(grad(step), LAY)
        assert same_bits(parts(mine), parts(theirs)), step
        if step in (3, 6):
            for j in journals:
                j.rollback()
    same_state(eager, c)
    # eager: the first step, and the step after each rollback; no capture after those
    # (without error feedback: one graph, replayed after a rollback too, the warm
    # brackets the rollback put back copied into its own tensor first)
    assert (stats["eager"], stats["captured"], stats["replayed"], stats["off"]) == (
        (1, 1, 9, 0) if spec.endswith("ef=0") else (3, 2, 7, 0))


@pytest.mark.parametrize("spec", list(counting.BUCKET_SYNCS))
def test_a_replayable_compressor_reads_nothing_back_and_draws_nothing(spec):
    """Every compressor marked ``replayable`` makes no host synchronisation in its bucket
    compress (the table the sync tests check) and keeps no step counter (random draws
    seeded on the host would be replayed unchanged)."""
    c = from_spec(spec)
    if c.replayable:
        assert counting.BUCKET_SYNCS[spec][0] == 0 and not c.uses_step and c.fixed_size


@pytest.mark.parametrize("spec", [s for s in counting.BUCKET_SYNCS
                                  if from_spec(s).replayable])
def test_the_eager_compress_of_a_replayable_compressor_passes_the_host_check(spec):
    """What the check after a capture asks, asked of two eager compresses on the CUDA
    code path: only the residuals changed, views of the input buffer."""
    c = from_spec(spec)
    c.compress_bucket(grad(0), LAY)
    before = c._store.tables() if c._store is not None else None
    flat = grad(1)
    c.compress_bucket(flat, LAY)
    if c.ef and c.residual_buffer(LAY, c._ops) is not None:    # (dct: its coefficients)
        flat = c.error_feedback(c._ops).bucket_buffer(*residual_parts(c))
    assert replay.host_effects(c, before, LAY, flat) is None


def test_cpu_tensors_are_not_replayed_and_the_setting_is_checked(stats, monkeypatch):
    monkeypatch.setenv(replay.ENV_VAR, "1")
    c = from_spec("twobit")
    for step in range(3):
        c.compress_bucket(grad(step), LAY)
    assert stats == dict.fromkeys(stats, 0)
    monkeypatch.setenv(replay.ENV_VAR, "yes")
    assert not replay.wanted(c, grad(0))          # CPU: the setting is not even read
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    with pytest.raises(ValueError, match="HVD_COMPRESS_CUDA_GRAPHS must be 0 or 1"):
        replay.wanted(c, grad(0))


def test_replay_is_on_unless_turned_off(monkeypatch):
    """On by default for CUDA tensors (since 2026-12-01); ``0`` turns it off.  (The test
    session sets ``0`` itself: tests/conftest.py.)"""
    c = from_spec("twobit")
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    monkeypatch.delenv(replay.ENV_VAR, raising=False)
    assert replay.enabled() and replay.wanted(c, grad(0))
    assert not replay.wanted(from_spec("topk:density=0.1"), grad(0))   # not replayable
    monkeypatch.setenv(replay.ENV_VAR, "0")
    assert not replay.enabled() and not replay.wanted(c, grad(0))


@pytest.mark.parametrize("spec", REPLAYABLE)
def test_a_lone_tensor_sends_on_its_own_path_what_a_bucket_of_one_sends(spec):
    """Where bucket exchanges are replayed, the glue sends a lone tensor as a bucket of
    one (``sends_alone``): the payload bits, the wire, the residuals and the sum of two
    ranks' aggregate are those of the tensor's own path, at every step (one with a
    NaN), so ranks and checkpoints of either path agree."""
    alone, bucket = from_spec(spec), from_spec(spec)
    peers = [from_spec(spec), from_spec(spec)]
    for step in range(5):
        g = grad(step, ALONE.total).reshape(ALONE.shapes[0])
        mine, ctx = alone.compress(g.clone(), "w")
        theirs, bctx = bucket.compress_bucket(g.clone().reshape(-1), ALONE)
        assert same_bits(parts(mine), parts(theirs)) and ctx.wire == bctx.wire, step
        if alone.ef:
            assert torch.equal(as_bytes(alone.residual("w")), as_bytes(bucket.residual("w")))
        other = grad(50 + step, ALONE.total).reshape(ALONE.shapes[0])
        sent = [parts(mine), parts(peers[0].compress(other, "w")[0])]
        agg = sent[0][0] + sent[1][0] if alone.collective == "allreduce" else aggregate(sent)
        total = alone.decompress(agg, ctx)
        assert total.shape == g.shape
        assert same_bits((total.reshape(-1),), (bucket.decompress_bucket(agg, bctx),)), step


def test_a_bucket_of_one_keeps_its_residual_in_its_buffer_only_where_replayed():
    """Not replayed, a bucket of one keeps its residual apart from its input, as a tensor
    alone does (the input may be a view of more: a shard of hier:'s sum, which a view
    would keep alive); replayed, in the input, as its graphs need."""
    whole = grad(0, 2 * ALONE.total)
    shard = whole[ALONE.total:]
    c = from_spec("twobit")
    c.compress_bucket_eager(shard.clone(), ALONE)            # (the residual made)
    c.compress_bucket_eager(shard, ALONE)
    r = c.residual("w")
    assert r.untyped_storage().data_ptr() != whole.untyped_storage().data_ptr()
    c.compress_bucket_eager(shard, ALONE, in_buffer=True)      # as replay calls it
    assert c.residual("w").data_ptr() == shard.data_ptr()


def test_a_lone_tensor_goes_as_a_bucket_of_one_only_where_replayed(monkeypatch):
    monkeypatch.setenv(replay.ENV_VAR, "1")
    g = grad(0)
    assert from_spec("twobit").sends_alone(g)                  # CPU tensors: never replayed
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    assert not from_spec("twobit").sends_alone(g)
    assert not from_spec("laplace_topk:density=0.05,padded=1").sends_alone(g)
    assert from_spec("topk:density=0.05").sends_alone(g)       # not replayable
    assert from_spec("laplace_topk:density=0.05").sends_alone(g)
    monkeypatch.setenv(replay.ENV_VAR, "0")
    assert from_spec("twobit").sends_alone(g)


# -- decompress ----------------------------------------------------------------------------

def aggregate(payloads):
    """The allgather of every rank's payload: each tensor concatenated in rank order."""
    return tuple(torch.cat(ts) for ts in zip(*map(parts, payloads)))


def exchanges(spec, steps=5, ranks=2, corrupt=None):
    """Each step's aggregate of ``ranks`` ranks' payloads, its eager decompress and its
    decompress through ``replay`` inside the deferred checks (settled after), or the
    ValueError the settle raised."""
    senders = [from_spec(spec) for _ in range(ranks)]
    eager, replayed = from_spec(spec), from_spec(spec)
    standin = StandIn()
    out = []
    for step in range(steps):
        sent = [c.compress_bucket_eager(grad(10 * step + r), LAY) for r, c in enumerate(senders)]
        ctx = sent[0][1]
        agg = aggregate([p for p, _ in sent])
        if corrupt is not None and step == corrupt:
            agg[-1][1] = LAY.total + 5               # an index past the bucket's end
        want = eager.decompress_bucket(agg, ctx) if step != corrupt else None
        sink = []
        try:
            with torch_ops.deferred_checks(sink):
                got = replay.decompress_bucket(replayed, agg, ctx, capture=standin)
            torch_ops.settle_checks(sink)
        except ValueError as e:
            got = e
        out.append((want, got if isinstance(got, ValueError) else got.clone()))
    return out, standin


@pytest.mark.parametrize("spec", REPLAYABLE)
def test_replayed_decompress_gives_the_eager_sum(spec, stats):
    """Five steps of two ranks' aggregates, each at a new address: the eager sum at every
    step; the first eager, one capture, replayed from then on."""
    out, standin = exchanges(spec)
    for step, (want, got) in enumerate(out):
        assert same_bits((want,), (got,)), (spec, step)
    assert (stats["eager"], stats["captured"], stats["replayed"], stats["off"]) == (1, 1, 4, 0)


def test_a_replayed_decompress_still_finds_a_malformed_index():
    """A payload index past the bucket's end at a replayed step: the deferred check the
    graph makes again raises at the settle, as the eager decompress's does."""
    out, _ = exchanges("laplace_topk:density=0.05,padded=1", steps=4, corrupt=3)
    assert not isinstance(out[2][1], ValueError)
    assert isinstance(out[3][1], ValueError) and "out of range" in str(out[3][1])


def test_a_decompress_outside_the_deferred_checks_or_of_a_new_shape_runs_eagerly(stats):
    c = from_spec("twobit")
    sent = [from_spec("twobit").compress_bucket_eager(grad(r), LAY) for r in range(3)]
    ctx = sent[0][1]
    for _ in range(3):                              # no sink: never replayed
        replay.decompress_bucket(c, aggregate([p for p, _ in sent[:2]]), ctx,
                                 capture=StandIn())
    assert stats["eager"] == 3 and stats["captured"] == 0
    for ranks in (2, 2, 3, 3, 2):                   # 2 ranks: eager, then captured;
        with torch_ops.deferred_checks([]):         # 3 ranks: the same, then 2 replayed
            got = replay.decompress_bucket(c, aggregate([p for p, _ in sent[:ranks]]), ctx,
                                           capture=StandIn())
        want = from_spec("twobit").decompress_bucket(aggregate([p for p, _ in sent[:ranks]]),
                                                     ctx)
        assert same_bits((want,), (got,)), ranks
    assert (stats["eager"], stats["captured"], stats["replayed"]) == (5, 2, 3)


def test_a_malformed_aggregate_raises_and_leaves_replay_on(stats):
    """An aggregate of a length no rank sends: the capture fails on it, the eager
    decompress raises the ValueError, and the bucket is not turned off."""
    c = from_spec("twobit")
    (codes, scales), ctx = from_spec("twobit").compress_bucket_eager(grad(0), LAY)
    with torch_ops.deferred_checks([]):
        for bad in (codes[:-1], codes[:-1]):       # the second: seen once, so captured
            with pytest.raises(ValueError, match="malformed"):
                replay.decompress_bucket(c, (bad, scales), ctx, capture=StandIn())
    assert stats["off"] == 0 and stats["replayed"] == 0


@pytest.mark.parametrize("spec", ["twobit", "rangefloat:bits=8",
                                  "laplace_topk:density=0.05,padded=1"])
def test_a_graph_holds_the_cached_tables_it_reads(spec):
    """The launchers' caches drop every table when full; a graph reads its tables at the
    addresses they had at its capture, so it holds each one its compress read: the
    same objects that an eager compress of the bucket is handed (kernels._held)."""
    from hvd_compress.kernels import _held
    c = from_spec(spec)
    for step in range(3):
        replay.compress_bucket(c, grad(step), LAY, capture=StandIn())
    with _held.recording() as eager:
        from_spec(spec).compress_bucket_eager(grad(9), LAY)
    bucket, = c._replay_buckets.values()
    assert eager and len(bucket.graphs) == 2
    for hit in bucket.graphs.values():
        assert {id(t) for t in hit[-1]} == {id(t) for t in eager}
