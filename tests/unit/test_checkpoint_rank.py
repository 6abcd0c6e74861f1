"""A compressor's checkpoint records the rank its glue says this process is
(``Compressor.bind_rank``), and restoring another rank's is refused: error feedback's
residuals are each rank's own (what it has not sent yet).  In-process; the glues' own
binding runs through real torchrun and horovodrun jobs (test_ddp_restart.py)."""
import pytest
import torch

import hvd_compress
from hvd_compress.elastic import CompressionCommit


def build(spec):
    """A compressor, or for ``"policy"`` a Policy of two members."""
    if spec == "policy":
        return hvd_compress.Policy({"w": "topk:density=0.1"}, default="twobit")
    return hvd_compress.from_spec(spec)


def trained(spec, rank, steps=2):
    """A compressor bound to ``rank`` that has compressed two tensors ``steps`` times."""
    c = build(spec)
    c.bind_rank(lambda: rank)
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        for name, n in (("w", 300), ("b", 40)):
            t = torch.randn(n, generator=g)
            c.for_tensor(name, t).compress(t, name)
    return c


@pytest.mark.parametrize("spec", ["topk:density=0.1", "twobit", "policy"])
def test_a_checkpoint_records_its_rank_and_another_rank_refuses_it(spec):
    saved = trained(spec, 1).state_dict()
    assert saved["rank"] == 1
    other = build(spec)
    other.bind_rank(lambda: 0)
    with pytest.raises(ValueError, match="error feedback of rank 1, but this is rank 0"):
        other.load_state_dict(saved)
    same = build(spec)
    same.bind_rank(lambda: 1)
    same.load_state_dict(saved)
    for name in ("w", "b"):
        assert torch.equal(same.residual(name), trained(spec, 1).residual(name))


def test_a_checkpoint_restored_before_a_glue_takes_the_compressor_is_checked_then():
    saved = trained("topk:density=0.1", 3).state_dict()
    early = hvd_compress.from_spec("topk:density=0.1")
    early.load_state_dict(saved)                     # no rank known yet: remembered
    with pytest.raises(ValueError, match="rank 3, but this is rank 2"):
        early.bind_rank(lambda: 2)
    fine = hvd_compress.from_spec("topk:density=0.1")
    fine.load_state_dict(saved)
    fine.bind_rank(lambda: 3)


def test_checkpoints_without_a_rank_load_anywhere():
    """Saved before any glue took the compressor, or before 2026-11-30: not checked; a
    glue that cannot tell its rank yet (``rank_of()`` None) records none."""
    unbound = trained("topk:density=0.1", None).state_dict()
    assert "rank" not in unbound
    c = hvd_compress.from_spec("topk:density=0.1")
    c.bind_rank(lambda: 5)
    c.load_state_dict(unbound)
    old = dict(trained("topk:density=0.1", 1).state_dict())
    del old["rank"]
    c.load_state_dict(old)


def test_an_elastic_commit_comes_back_whatever_the_rank_is_called_after_a_reset():
    """Elastic Horovod renumbers the ranks after a worker is lost: a survivor's own commit
    (``CompressionCommit``: snapshot at commit, restore after the reset) is restored
    although its rank changed in between (no collective here: ``hvd`` unused)."""
    rank = [2]
    c = trained("topk:density=0.1", None)
    c.bind_rank(lambda: rank[0])
    commit = CompressionCommit(c, None, "torch")     # (snapshot at the commit)
    kept = c.residual("w").clone()
    c.compress(torch.randn(300), "w")              # (the step the failure undid)
    rank[0] = 1                                       # the reset renumbered this rank
    commit.restore()
    assert torch.equal(c.residual("w"), kept)
    assert c.state_dict()["rank"] == 1
