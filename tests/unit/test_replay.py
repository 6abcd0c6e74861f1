"""CUDA-graph replay of a bucket compress (``hvd_compress/compressors/replay.py``): when
it captures, replays or runs eagerly, what it keeps on the host, and what it puts back.

CUDA graphs cannot be captured here (no GPU), so these tests give ``replay.compress_bucket``
a stand-in for ``torch.cuda.graph`` (:class:`StandIn`) with a graph's semantics on
the CPU: capturing changes only the host's state (the compress runs, then every buffer
it could write is put back), and a replay computes what the capture recorded (the
compress run again on the state as the capture saw it, its payload written into the
captured payload's tensors) without changing the host's state.  The buffers the
bucket's input alternates between are the test's own (``A`` and ``B``), as PyTorch's
caching allocator hands them out on a GPU.  ``tests/gpu/test_gpu_replay.py`` captures
real graphs on CUDA, bit for bit against the eager compress."""
import logging

import numpy as np
import pytest
import torch

from hvd_compress.buckets import layout
from hvd_compress.compressors import replay
from hvd_compress.spec import from_spec

import counting  # tests/counting.py

LAY = layout(list("abcde"), [(48,), (16, 12), (64,), (3, 16), (80,)])
REPLAYABLE = ["twobit", "twobit:ef=0", "onebit", "signsgd", "rangefloat:bits=8",
              "laplace_topk:density=0.05,padded=1",
              "laplace_topk:density=0.05,padded=1,values=rangefloat8",
              "laplace_topk:density=0.05,padded=1,ef_decay=0.9"]


def grad(step, n=LAY.total):
    g = torch.from_numpy(np.random.default_rng(step).laplace(size=n).astype(np.float32))
    if step == 3:
        g[70] = float("nan")          # a step with NaN: error feedback keeps its residuals
    return g


def parts(t):
    return tuple(t) if isinstance(t, (tuple, list)) else (t,)


class StandIn:
    """``capture(fn) -> (replay, fn's result)`` with a CUDA graph's semantics on the CPU
    (see the module docstring); ``buffers``: every tensor a compress may write in place
    (the bucket's input buffers, which hold the residuals in turn)."""

    def __init__(self, c, buffers):
        self.c, self.buffers, self.captures = c, buffers, 0

    def __call__(self, fn):
        self.captures += 1
        store = self.c._store
        before = store.tables() if store is not None else None
        data = [b.clone() for b in self.buffers]
        out = fn()
        for b, d in zip(self.buffers, data):       # a capture computes nothing
            b.copy_(d)
        payload = out[0]

        def replay_():
            now = store.tables() if store is not None else None
            if store is not None:
                store.set_tables(before)            # the state the capture saw
            again = fn()[0]
            for mine, new in zip(parts(payload), parts(again)):
                mine.copy_(new)
            if store is not None:
                store.set_tables(now)               # a replay changes nothing on the host
        return replay_, out


@pytest.fixture(autouse=True)
def cuda_code_path(monkeypatch):
    """The CUDA code path (kernels in Triton's interpreter), the one a GPU captures: the
    CPU's own paths read NaN/Inf flags on the host, which a capture cannot."""
    monkeypatch.setenv("HVD_COMPRESS_BACKEND", "triton")


@pytest.fixture
def stats(monkeypatch):
    monkeypatch.setattr(replay, "STATS", dict.fromkeys(replay.STATS, 0))
    return replay.STATS


def run(spec, steps=6, moving=False, capture=None, restore_at=None):
    """Payloads of ``steps`` compresses with replay (the input alternating between two
    buffers, or a new buffer each step if ``moving``) and eagerly, and both compressors."""
    eager, replayed = from_spec(spec), from_spec(spec)
    buffers = [torch.empty(LAY.total), torch.empty(LAY.total)]
    held = []
    standin = capture or StandIn(replayed, buffers)
    if isinstance(standin, type):
        standin = standin(replayed, buffers)
    out = []
    for step in range(steps):
        if step in (restore_at if isinstance(restore_at, tuple) else (restore_at,)):
            saved = eager.state_dict()
            eager.load_state_dict(saved)
            replayed.load_state_dict(saved)
            held += buffers                        # the input's buffers move too
            buffers[:] = [torch.empty(LAY.total), torch.empty(LAY.total)]
        g = grad(step)
        if moving:
            flat = g.clone()
            held.append(flat)                      # every step's input at a new address
            standin.buffers = [flat] + held[-2:-1]
        else:
            flat = buffers[step % 2]
            flat.copy_(g)
        mine, _ = replay.compress_bucket(replayed, flat, LAY, capture=standin)
        theirs, _ = eager.compress_bucket(g.clone(), LAY)
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


@pytest.mark.parametrize("spec", REPLAYABLE)
def test_replayed_compress_gives_the_eager_bits_and_state(spec, stats):
    """Six steps (one with a NaN): the same payload bits as the eager compress at every
    step, the same residuals after; the first step eager, one graph per buffer pair,
    replayed at every later step."""
    out, eager, replayed, standin = run(spec)
    for step, (mine, theirs) in enumerate(out):
        assert same_bits(mine, theirs), (spec, step)
    same_state(eager, replayed)
    assert (stats["eager"], stats["captured"], stats["replayed"], stats["off"]) == (1, 2, 5, 0)
    assert standin.captures == 2


@pytest.mark.parametrize("spec", ["twobit", "laplace_topk:density=0.05,padded=1"])
def test_the_residuals_after_a_replay_are_views_of_its_input(spec, stats):
    """After a replayed compress the store holds what the eager compress leaves: the
    bucket's residuals, views of the input buffer end to end (``take_buffer``)."""
    _, _, replayed, _ = run(spec, steps=4)
    memory = replayed.error_feedback(replayed._ops)
    lay_parts = tuple(zip(LAY.names, LAY.numels))
    buffer = memory.bucket_buffer(lay_parts, torch.empty(1))
    assert buffer is not None and stats["replayed"] == 3
    assert all(memory.residual(n).data_ptr() == buffer.data_ptr() + 4 * o
               for n, o in zip(LAY.names, LAY.offsets))


def test_buffers_that_keep_moving_turn_replay_off(stats, caplog):
    """An input at a new address every step: MAX_GRAPHS captures, then eager for good,
    logged once, and still the eager bits."""
    caplog.set_level(logging.WARNING, logger="hvd_compress")
    out, eager, replayed, standin = run("twobit", steps=replay.MAX_GRAPHS + 4, moving=True)
    assert all(same_bits(m, t) for m, t in out)
    same_state(eager, replayed)
    assert standin.captures == replay.MAX_GRAPHS and stats["off"] == 1
    assert sum("eagerly from now on" in r.getMessage() for r in caplog.records) == 1
    assert f"new addresses {replay.MAX_GRAPHS} times in a row" in caplog.text


class Failing(StandIn):
    """A capture that fails after the compress's Python ran (its host effects done;
    nothing computed)."""

    def __call__(self, fn):
        self.captures += 1
        data = [b.clone() for b in self.buffers]
        fn()
        for b, d in zip(self.buffers, data):
            b.copy_(d)
        raise RuntimeError("operation not permitted when stream is capturing")


def test_a_failed_capture_puts_the_store_back_and_runs_eagerly(stats, caplog):
    caplog.set_level(logging.WARNING, logger="hvd_compress")
    out, eager, replayed, standin = run("twobit", capture=Failing)
    assert all(same_bits(m, t) for m, t in out)
    same_state(eager, replayed)
    assert standin.captures == 1 and stats["off"] == 1 and stats["replayed"] == 0
    assert "the capture failed: RuntimeError: operation not permitted" in caplog.text


def test_a_compress_that_keeps_its_residuals_elsewhere_is_not_replayed(stats, caplog):
    """dct's residuals live in the coefficient domain, not in the bucket's buffer: marked
    replayable by mistake, it runs eagerly, turned off (logged) after UNBUFFERED tries,
    and the check after a capture would have refused it too."""
    caplog.set_level(logging.WARNING, logger="hvd_compress")
    spec = "dct:density=0.05,padded=1"
    assert not from_spec(spec).replayable
    eager, c = from_spec(spec), from_spec(spec)
    c.replayable = True
    buffers = [torch.empty(LAY.total), torch.empty(LAY.total)]
    for step in range(5):
        flat = buffers[step % 2]
        flat.copy_(grad(step))
        before = c._store.tables() if c._store is not None else None
        mine, _ = replay.compress_bucket(c, flat, LAY, capture=StandIn(c, buffers))
        theirs, _ = eager.compress_bucket(grad(step), LAY)
        assert same_bits(parts(mine), parts(theirs)), step
    same_state(eager, c)
    assert stats["off"] == 1 and stats["replayed"] == 0 and stats["eager"] == 5
    assert "does not keep the residuals in one bucket buffer" in caplog.text
    assert "the compress replaced state it keeps on the host" in replay.host_effects(
        c, before, LAY, flat)


def test_restored_checkpoints_replace_the_least_recently_replayed_graphs(stats):
    """Three restores, each followed by two captures (new residual addresses): the bucket
    keeps MAX_GRAPHS graphs, the oldest dropped, and is never turned off."""
    out, eager, replayed, standin = run("twobit", steps=15, restore_at=(4, 8, 12))
    assert all(same_bits(m, t) for m, t in out)
    same_state(eager, replayed)
    assert stats["off"] == 0 and stats["eager"] == 4 and stats["captured"] == 8
    bucket, = replayed._replay_buckets.values()
    assert len(bucket.graphs) == replay.MAX_GRAPHS


def test_a_restored_checkpoint_runs_eagerly_once_then_replays(stats):
    """After ``load_state_dict`` the residuals are separate tensors, not one buffer: one
    eager compress makes them one again, then the graphs replay (new ones captured:
    the restored residual's address is new)."""
    out, eager, replayed, _ = run("twobit", steps=7, restore_at=3)
    assert all(same_bits(m, t) for m, t in out)
    same_state(eager, replayed)
    assert stats["eager"] == 2 and stats["off"] == 0 and stats["replayed"] == 5


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
