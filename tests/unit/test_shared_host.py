"""The shared-memory collectives inside a host (hvd_compress/exchange/shared_host.py):
workers are threads here, each with its own SharedHost mapping the others' files in
/dev/shm (the same files and counters as between processes; through real horovodrun
processes: tests/integration/test_hier_horovod.py).  The base transport is the
in-process World's (rank, size and the fallback for tensors shared memory does not take)."""
import os
import threading

import numpy as np
import pytest
import torch

from hvd_compress import hosts
from hvd_compress.exchange import shared_host as sh
from hvd_compress.exchange.in_process import World
from hvd_compress.ops import torch_ops
from hvd_compress.torch.collectives import HOST_ARRAYS
from threads import run_ranks

pytestmark = pytest.mark.skipif(not sh.usable(), reason="shared memory needs Linux x86-64")


def _run(size, fn, timeout=5.0, token=None):
    token = token if token is not None else np.random.randint(1 << 30)
    world = World(size, torch_ops, timeout=30)
    transports = [sh.SharedHost(world.transport(r), token, *HOST_ARRAYS, timeout=timeout)
                  for r in range(size)]
    out, errors = run_ranks(size, lambda r: fn(r, transports[r]), timeout=60)
    for t in transports:
        t.close()
    return out, errors


def _done(gen):
    """A synchronous collective's result (it must not yield)."""
    try:
        next(gen)
    except StopIteration as stop:
        return stop.value
    raise AssertionError("a shared-memory collective yielded")


def _data(rank, step, n):
    return torch.from_numpy(np.random.RandomState(100 * step + rank).standard_normal(n)
                            .astype(np.float32))


@pytest.mark.parametrize("size", [2, 3])
def test_reducescatter_allgather_allreduce_match_numpy_and_grow(size):
    """Many collectives in a row, with sizes that grow past the first 1 MB slot (a new
    file per worker) and shrink again; shard sums in local-rank order, bit for bit."""
    lengths = [10, 300_000, 7, 1_000_000, 5]

    def fn(r, t):
        got = []
        for s, n in enumerate(lengths):
            x = _data(r, s, n)
            sizes = [n // size + (i < n % size) for i in range(size)]
            piece, sent, received = _done(t.reducescatter(x, "rs", sizes))
            (gathered,), _, _ = _done(t.allgather((piece,), "ag"))
            total, _, _ = _done(t.allreduce(x, "ar"))
            got.append((piece.numpy().copy(), gathered.numpy().copy(), total.numpy().copy(),
                        sent, received))
        return got

    out, errors = _run(size, fn)
    assert errors == [None] * size, errors
    for s, n in enumerate(lengths):
        every = [_data(r, s, n).numpy() for r in range(size)]
        want = every[0].copy()
        for e in every[1:]:
            want += e
        sizes = [n // size + (i < n % size) for i in range(size)]
        bounds = np.cumsum([0] + sizes)
        for r in range(size):
            piece, gathered, total, sent, received = out[r][s]
            assert np.array_equal(piece, want[bounds[r]:bounds[r + 1]]), (s, r)
            assert np.array_equal(gathered, want), (s, r)
            assert np.array_equal(total, want), (s, r)
            assert sent == received == 4 * n * (size - 1) // size


def test_allgather_of_different_lengths_and_2d_rows_in_rank_order():
    def fn(r, t):
        a = torch.arange(6 * (r + 1), dtype=torch.int64).reshape(r + 1, 6) + 100 * r
        (out,), _, _ = _done(t.allgather((a,), "rows"))
        return out.numpy()

    out, errors = _run(3, fn)
    assert errors == [None] * 3, errors
    want = np.concatenate([np.arange(6 * (r + 1)).reshape(r + 1, 6) + 100 * r
                           for r in range(3)])
    for got in out:
        assert np.array_equal(got, want)


def test_a_worker_with_nothing_to_send_gets_the_others_and_does_not_hang():
    def fn(r, t):
        a = torch.arange(5.0) + 10 * r if r != 1 else torch.zeros(0)
        (out,), _, _ = _done(t.allgather((a,), "maybe_empty"))
        piece, _, _ = _done(t.reducescatter(torch.ones(2), "tiny", [1, 1, 0]))
        return out.numpy(), piece.numpy()

    out, errors = _run(3, fn)
    assert errors == [None] * 3, errors
    want = np.concatenate([np.arange(5.0), np.arange(5.0) + 20])
    assert all(np.array_equal(o, want) for o, _ in out)
    assert [p.tolist() for _, p in out] == [[3.0], [3.0], []]


def test_tensors_shared_memory_does_not_take_go_through_the_base_transport():
    def fn(r, t):
        x = torch.full((4,), float(r + 1), dtype=torch.bfloat16)
        gen = t.allreduce(x, "bf16")
        w = next(gen)                 # the World's collective: a Wait
        try:
            gen.send(w.wait())
        except StopIteration as stop:
            return stop.value[0]

    out, errors = _run(2, fn)
    assert errors == [None] * 2, errors
    assert all(o.dtype == torch.bfloat16 and o.tolist() == [3.0] * 4 for o in out)


class _AtOnce:
    """A base transport whose collectives complete when called, as TensorFlow's do (not
    generators): the shared-memory transport must hand their results back as they are."""

    def __init__(self, inner):
        self.inner, self.rank, self.size, self.ops = inner, inner.rank, inner.size, inner.ops

    def allreduce(self, tensor, name, inplace_of=None):
        gen = self.inner.allreduce(tensor, name)
        try:
            gen.send(next(gen).wait())
        except StopIteration as stop:
            return stop.value


def test_a_base_whose_collectives_complete_at_once_tensorflows():
    world = World(2, torch_ops, timeout=30)
    token = np.random.randint(1 << 30)
    shared = [sh.SharedHost(_AtOnce(world.transport(r)), token, *HOST_ARRAYS)
              for r in range(2)]
    out, errors = run_ranks(2, lambda r: _done(shared[r].allreduce(
        torch.full((4,), float(r + 1), dtype=torch.bfloat16), "at_once"))[0], timeout=30)
    for t in shared:
        t.close()
    assert errors == [None, None], errors
    assert all(o.dtype == torch.bfloat16 and o.tolist() == [3.0] * 4 for o in out)


def test_a_peer_that_never_arrives_is_an_error_naming_it_not_a_hang():
    def fn(r, t):
        if r == 1:
            return None               # local rank 1 never starts the collective
        return _done(t.allreduce(torch.ones(3), "lonely"))

    out, errors = _run(2, fn, timeout=0.5)
    assert isinstance(errors[0], RuntimeError), errors
    assert "local rank 1 did not" in str(errors[0]) and "HVD_COMPRESS_SHARED_HOST=0" in \
        str(errors[0])


def test_files_leave_dev_shm_once_every_peer_has_mapped_them():
    """A worker killed after the first collectives leaves nothing behind: each file is
    removed once every peer has finished a collective that used it (the first file
    after collective 1, a grown one after the collective that grew it), while the
    mappings keep working."""
    token = np.random.randint(1 << 30)

    def files():
        return sorted(f for f in os.listdir(sh.DIRECTORY) if f.startswith(f"hvd_compress_{token}_"))

    def fn(r, t):
        seen = []
        for n in (10, 10, 400_000, 10, 10):          # the third grows every slot
            _done(t.allreduce(torch.ones(n), "x"))
            seen.append(len(files()))
        return seen

    out, errors = _run(2, fn, token=token)
    assert errors == [None] * 2, errors
    assert all(seen[0] >= 1 and seen[-1] == 0 for seen in out), out   # own file, then none
    assert files() == []


def test_every_worker_of_the_host_must_agree_or_the_host_keeps_horovods(monkeypatch):
    """One worker that cannot (or was told HVD_COMPRESS_SHARED_HOST=0): the whole host
    stays on the base transport; when all can, all switch."""
    real, local = sh.usable, threading.local()
    monkeypatch.setattr(sh, "usable", lambda: local.ok and real())   # per thread here

    def build(oks):
        world = World(2, torch_ops, timeout=30)

        def run(r):
            local.ok = oks[r]
            return hosts.shared_host(world.transport(r), HOST_ARRAYS)

        out, errors = run_ranks(2, run, timeout=30)
        assert errors == [None, None], errors
        return [type(o).__name__ for o in out], out

    assert build([True, False])[0] == ["LocalTransport", "LocalTransport"]
    names, out = build([True, True])
    assert names == ["SharedHost", "SharedHost"]
    assert out[0].prefix == out[1].prefix            # local rank 0's token, for both
    for t in out:
        t.close()


@pytest.mark.parametrize("spec", ["hier:topk:density=0.05", "hier:laplace_topk:density=0.02",
                                  "hier:twobit"])
def test_the_hierarchical_exchange_over_shared_memory_is_bit_for_bit_the_same(spec):
    """2 hosts x 2 workers: 3 steps of a bucket through the hierarchical exchange with the
    host's steps in shared memory give every rank the very aggregates (and residuals)
    of the same exchange over the in-process collectives."""
    import hvd_compress
    from hvd_compress import buckets
    from hvd_compress.exchange import Driver
    from hvd_compress.exchange.hierarchical import Hierarchy
    from hvd_compress.exchange.in_process import hosts as sim_hosts
    from hvd_compress.stats import Stats
    lay = buckets.layout(["a", "b", "c"], [(40, 30), (30, 20), (7,)])

    def run(shared):
        transports = sim_hosts([2, 2], torch_ops, timeout=30)
        tokens = [np.random.randint(1 << 30) for _ in range(2)]
        if shared:
            transports = [(g, Hierarchy(sh.SharedHost(h.local, tokens[r // 2], *HOST_ARRAYS),
                                        h.cross)) for r, (g, h) in enumerate(transports)]
        comps = [hvd_compress.from_spec(spec) for _ in range(4)]

        def rank(r):
            glob, hier = transports[r]
            d = Driver(glob, Stats(), average=False, hierarchy=hier)
            got = []
            for s in range(3):
                ex = d.launch(comps[r], lay, flat=_data(r, s, lay.total))
                d.finish([ex])
                d.end_step()
                got.append(ex.result.numpy().copy())
            return got

        out, errors = run_ranks(4, rank, timeout=60)
        assert errors == [None] * 4, errors
        if shared:
            for _, h in transports:
                h.local.close()
        return out, comps

    (a, ca), (b, cb) = run(False), run(True)
    for r in range(4):
        for s in range(3):
            assert np.array_equal(a[r][s], b[r][s]), (r, s)
        sa, sb = ca[r].state_dict()["state"], cb[r].state_dict()["state"]
        assert sa.keys() == sb.keys()
        assert all(torch.equal(sa[k], sb[k]) for k in sa if isinstance(sa[k], torch.Tensor))


def test_a_full_dev_shm_is_an_error_saying_so_not_a_crash(monkeypatch):
    import errno

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(sh.os, "posix_fallocate", full)
    token = np.random.randint(1 << 30)
    with pytest.raises(RuntimeError, match=r"cannot reserve 1\.0 MiB in /dev/shm.*shm-size"):
        sh.SharedHost(World(1, torch_ops).transport(0), token, *HOST_ARRAYS)
    assert not [f for f in os.listdir(sh.DIRECTORY) if f.startswith(f"hvd_compress_{token}_")]


def test_a_worker_that_cannot_make_its_files_keeps_the_whole_host_on_horovods(monkeypatch,
                                                                              caplog):
    import errno
    real, local = sh.os.posix_fallocate, threading.local()

    def maybe_full(fd, offset, length):
        if getattr(local, "full", False):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, offset, length)

    monkeypatch.setattr(sh.os, "posix_fallocate", maybe_full)
    world = World(2, torch_ops, timeout=30)

    def run(r):
        local.full = r == 1
        return hosts.shared_host(world.transport(r), HOST_ARRAYS)

    out, errors = run_ranks(2, run, timeout=30)
    assert errors == [None, None], errors
    assert [type(o).__name__ for o in out] == ["LocalTransport", "LocalTransport"]
    assert "not available on every worker" in caplog.text


@pytest.mark.parametrize("spec", ["bf16", "twobit", "laplace_topk:density=0.05,padded=1"])
def test_a_fixed_size_payload_through_shared_memory(spec):
    """A ``fixed_size`` compressor's flat exchange gathers with ``allgather_fixed``: one
    payload tensor (bf16) through shared memory, several through the base transport;
    both ranks get the in-process exchange's aggregate, bit for bit."""
    import hvd_compress
    from hvd_compress import buckets
    from hvd_compress.exchange import Driver
    from hvd_compress.stats import Stats
    lay = buckets.layout(["a", "b"], [(40, 30), (7,)])

    def exchange(r, t):
        d = Driver(t, Stats(), average=False)
        ex = d.launch(hvd_compress.from_spec(spec), lay, flat=_data(r, 0, lay.total))
        d.finish([ex])
        d.end_step()
        return ex.result.numpy().copy()

    shared, errors = _run(2, exchange)
    assert errors == [None, None], errors
    world = World(2, torch_ops, timeout=30)
    plain, errors = run_ranks(2, lambda r: exchange(r, world.transport(r)), timeout=60)
    assert errors == [None, None], errors
    for a, b in zip(shared, plain):
        assert np.array_equal(a.view(np.int32), b.view(np.int32))
