"""Mixed precision through the DDP hook (``hvd_compress.torch.amp.register_ddp``) in one
real ``torchrun --nproc_per_node 2`` launch (Gloo, CPU) of workers/ddp_amp_worker.py:
runs starting at loss scales 2^8 and 2^16 (growing every 2 steps) and 2^12 (constant),
with an overflow at step 5, end with the same parameters, and the overflow step leaves
every residual as it was.  No Horovod."""
import numpy as np
import pytest

from launch import ROOT, torchrun

SPECS = ("topk:density=0.1", "laplace_topk:density=0.1", "twobit", "powersgd:rank=2")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp_amp")
    rc, log = torchrun([ROOT / "tests/workers/ddp_amp_worker.py"], out, timeout=300)
    assert rc == 0, log[-6000:]
    return [dict(np.load(out / f"ddp_amp_rank{r}.npz")) for r in range(2)]


def _params(r, key):
    return {k.split("|param|")[1]: v for k, v in r.items() if k.startswith(key + "|param|")}


@pytest.mark.parametrize("spec", SPECS)
def test_ddp_amp_loss_scale_does_not_change_the_result(ranks, spec):
    for r in ranks:
        ref = _params(r, f"{spec}|256")
        for start in ("65536", "const"):
            for k, v in _params(r, f"{spec}|{start}").items():
                np.testing.assert_allclose(v, ref[k], rtol=1e-6, atol=1e-7, err_msg=f"{start} {k}")
            assert int(r[f"{spec}|{start}|overflows"]) == 1
    for k, v in _params(ranks[0], f"{spec}|256").items():
        np.testing.assert_array_equal(v, _params(ranks[1], f"{spec}|256")[k])


@pytest.mark.parametrize("spec", SPECS)
def test_ddp_amp_overflow_step_leaves_every_residual_unchanged(ranks, spec):
    for r in ranks:
        for start in ("256", "65536", "const"):
            key = f"{spec}|{start}|"
            names = list(r[key + "residual_keys"])
            assert names
            for n in names:
                np.testing.assert_array_equal(r[key + "after|" + n], r[key + "before|" + n])
            assert any(not np.array_equal(r[key + "later|" + n], r[key + "after|" + n])
                       for n in names if n.startswith("residual/"))
