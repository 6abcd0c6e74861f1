"""``laplace_topk:warm=1``: the fused search of every bucket starts at the brackets its
previous search ended with (``fused_search.select_histogram``, ``ops.warm_brackets``),
kept as state.  What a user relies on: the selection stays within tolerance (exact with
``exact=1``, the same indices as a cold start), the brackets go into ``state_dict()`` and
come back bit for bit (the run goes on as if never stopped), a journal's rollback puts
them back, a NaN/Inf bucket sends everything and the next search starts cold, and bad
settings are refused by name.  Both backends: the kernels under TRITON_INTERPRET=1
(``HVD_COMPRESS_BACKEND=triton``, conftest.py) and the torch references.  CUDA-graph
replay of a warm bucket: tests/unit/test_replay.py."""
import io

import numpy as np
import pytest
import torch

from hvd_compress.buckets import layout
from hvd_compress.compressors.fused_search import WARM_KEY
from hvd_compress.spec import from_spec
from hvd_compress.stores import Journal

from bucket_data import same_bits  # tests/bucket_data.py

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LAY = layout(["a", "b", "c", "d"], [(3000,), (40, 50), (5000,), (1200,)])
WARM = "laplace_topk:density=0.01,warm=1"


@pytest.fixture(params=["triton", "torch"], autouse=True)
def backend(request, monkeypatch):
    monkeypatch.setenv("HVD_COMPRESS_BACKEND", request.param)
    return request.param


def grad(step, scale=1.05):
    """Laplace data whose top-1% threshold grows by ``scale`` a step (within the warm
    window: a factor 1.13)."""
    x = np.random.default_rng(step).laplace(size=LAY.total) * scale ** step
    return torch.from_numpy(x.astype(np.float32)).to(DEVICE)


def run(c, steps, start=0, grads=grad):
    """Each step's ``(values, indices)``, cloned."""
    return [tuple(t.clone() for t in c.compress_bucket(grads(s), LAY)[0])
            for s in range(start, start + steps)]


def same(a, b):
    """The same steps' payloads, bit for bit (bucket_data.same_bits)."""
    return len(a) == len(b) and all(same_bits(x, y) for p, q in zip(a, b)
                                    for x, y in zip(p, q))


def brackets(c):
    return c.state_dict()["state"][WARM_KEY + LAY.key]


def test_warm_implies_fused_and_bad_settings_are_refused_by_name():
    c = from_spec(WARM)
    assert c.fused and c.warm and from_spec(c.spec).spec == c.spec
    assert from_spec("laplace_topk:density=0.01,padded=1,warm=1").padded
    with pytest.raises(ValueError, match="warm=1 .*fused=0"):
        from_spec("laplace_topk:density=0.01,warm=1,fused=0")
    with pytest.raises(ValueError, match="warm=1 .*agg=union"):
        from_spec("laplace_topk:density=0.01,warm=1,agg=union")
    assert from_spec("laplace_topk:density=0.01,fused=1").in_place_state(LAY) == ()
    assert c.in_place_state(LAY) == (WARM_KEY + LAY.key,)


@pytest.mark.parametrize("spec", [WARM + ",ef=0", "laplace_topk:density=0.01,padded=1,"
                                  "warm=1,ef=0"])
def test_a_warm_search_stays_within_tolerance_and_sends_the_largest(spec):
    """Six steps, the threshold moving 5% a step, then 50% (past the window): each
    tensor's count within ``floor(0.01 k)`` of ``k`` and no unsent magnitude above a sent
    one; the brackets kept after every step (no tensor cold)."""
    c = from_spec(spec)
    scales = [1.05] * 6 + [1.5]
    for step, scale in enumerate(scales):
        g = grad(step, scale)
        values, idx = c.compress_bucket(g.clone(), LAY)[0]
        real = values != 0 if c.padded else torch.ones_like(values, dtype=torch.bool)
        idx = idx[real].long()
        assert torch.equal(g[idx], values[real])
        for name, at, n in zip(LAY.names, LAY.offsets, LAY.numels):
            mine = idx[(idx >= at) & (idx < at + n)] - at
            k = max(1, int(0.01 * n))
            assert abs(mine.numel() - k) <= int(0.01 * k), (step, name, mine.numel(), k)
            mags = g[at:at + n].abs()
            unsent = torch.ones(n, dtype=torch.bool, device=DEVICE)
            unsent[mine] = False
            assert mags[unsent].max() <= mags[mine].min(), (step, name)
        assert bool((brackets(c)[0] >= 0).all()), step


def test_exact_selection_is_the_cold_searchs_whatever_the_start():
    """``exact=1``: the k largest (ties by lowest index), so a warm start and a cold one
    send the same bits at every step, error feedback included, and keep the same
    residuals."""
    warm, cold = from_spec(WARM + ",exact=1"), from_spec("laplace_topk:density=0.01,fused=1,exact=1")
    scale = lambda s: grad(s, 1.3 if s % 2 else 0.8)      # noqa: E731  (past the window too)
    assert same(run(warm, 5, grads=scale), run(cold, 5, grads=scale))
    for name in LAY.names:
        assert torch.equal(warm.residual(name), cold.residual(name)), name


def test_the_brackets_go_through_a_checkpoint_bit_for_bit():
    """Three steps, a checkpoint through ``torch.save``, a new compressor restored from it:
    its next three steps send the bits of the run that never stopped and end with its
    brackets and residuals; a checkpoint without the brackets (an older one) restores
    too and starts cold, within tolerance."""
    whole = from_spec(WARM)
    want = run(whole, 6)
    first = from_spec(WARM)
    run(first, 3)
    saved = first.state_dict()
    assert WARM_KEY + LAY.key in saved["state"]
    buf = io.BytesIO()
    torch.save(saved, buf)
    buf.seek(0)
    again = from_spec(WARM)
    again.load_state_dict(torch.load(buf))
    assert same(run(again, 3, start=3), want[3:])
    a, b = whole.state_dict()["state"], again.state_dict()["state"]
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    older = dict(saved, state={k: v for k, v in saved["state"].items()
                               if not k.startswith(WARM_KEY)})
    cold = from_spec(WARM)
    cold.load_state_dict(older)
    values, idx = run(cold, 1, start=3)[0]
    assert abs(idx.numel() - 112) <= 1 and bool((brackets(cold)[0] >= 0).all())


def test_a_rollback_puts_the_brackets_back():
    """A journal's rollback (a step a glue drops) puts back the brackets of the step
    before, bit for bit, and the step run again sends what it sent the first time; a
    rollback of the first step leaves no brackets (the next starts cold)."""
    c, j = from_spec(WARM), Journal()
    c.attach_journal(j)
    first = run(c, 1)
    assert j.entries
    j.rollback()
    assert WARM_KEY + LAY.key not in c.state_dict()["state"]
    assert same(run(c, 1), first)
    j.clear()
    before = brackets(c).clone()
    sent = run(c, 1, start=1)
    assert not torch.equal(brackets(c), before)
    j.rollback()
    assert torch.equal(brackets(c), before)
    j.clear()
    assert same(run(c, 1, start=1), sent)


def test_after_a_nan_bucket_the_next_search_starts_cold():
    """A bucket holding NaN sends every entry (as cold); its brackets become -1, so the
    next search starts at the Laplace fit: within tolerance, brackets set again."""
    c = from_spec(WARM + ",ef=0")
    run(c, 2)
    bad = grad(2)
    bad[7] = float("nan")
    values, idx = c.compress_bucket(bad, LAY)[0]
    assert idx.numel() == LAY.total
    assert bool((brackets(c)[0] == -1).all())
    values, idx = c.compress_bucket(grad(3), LAY)[0]
    assert abs(idx.numel() - 112) <= 1 and bool((brackets(c)[0] >= 0).all())


def test_a_checkpoint_of_another_layout_under_the_key_starts_cold():
    """Brackets of another shape under the bucket's key (a checkpoint of another model
    whose bucket had the same name) are not read: the search starts cold."""
    c = from_spec(WARM + ",ef=0")
    run(c, 1)
    state = c.state_dict()
    state["state"][WARM_KEY + LAY.key] = torch.zeros(2, 3, dtype=torch.int64)
    c.load_state_dict(state)
    values, idx = run(c, 1, start=1)[0]
    assert abs(idx.numel() - 112) <= 1 and brackets(c).shape == (2, len(LAY.names))


@pytest.mark.parametrize("backend", ["none"])          # (neither runs on TensorFlow)
def test_tensorflow_is_told_to_leave_warm_unset(backend):
    """The fused search runs on PyTorch tensors only: TensorFlow's compress names the
    setting to drop."""
    tf = pytest.importorskip("tensorflow")
    c = from_spec(WARM)
    with pytest.raises(ValueError, match="warm=1 imply.*leave fused, padded and warm unset"):
        c.compress_bucket(tf.random.normal([LAY.total]), LAY)
