"""``CompressionState.take_optimizer``: compressed updates for a state made before the
optimizer exists (how :class:`hvd_compress.lightning.DDPStrategy` gives it the optimizer
that ``configure_optimizers()`` returns).  One process, a Gloo group of one, real DDP:
until it has an optimizer the hook refuses to train; given one, ``step()`` exchanges the
update; what it cannot take is a clear error."""
import pytest
import torch
import torch.distributed as dist

from hvd_compress.ddp import CompressionState, compression_hook

SPEC = "topk:density=0.2"


@pytest.fixture
def group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


def _model():
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    return module, torch.nn.parallel.DistributedDataParallel(module)


def _backward(ddp):
    ddp(torch.randn(4, 6, generator=torch.Generator().manual_seed(1))).square().sum().backward()


def test_without_an_optimizer_the_hook_refuses_to_train(group):
    _, ddp = _model()
    state = CompressionState(compression=SPEC, compressed_update=True)
    ddp.register_comm_hook(state, compression_hook)
    with pytest.raises(ValueError, match="take_optimizer"):
        _backward(ddp)


def test_the_optimizer_given_later_exchanges_the_update(group):
    module, ddp = _model()
    state = CompressionState(compression=SPEC, compressed_update=True)
    ddp.register_comm_hook(state, compression_hook)
    opt = torch.optim.AdamW(module.parameters(), lr=0.1)
    updates = state.take_optimizer(opt)
    before = [p.detach().clone() for p in module.parameters()]
    _backward(ddp)
    opt.step()
    assert state.update is updates and state.stats.steps == 1
    # one rank: the update, top-k at 20% with error feedback, applied; the rest kept
    residuals = state.compression.state_dict()["state"]
    assert any(k.startswith("residual/") for k in residuals)
    assert all(not torch.equal(b, p) for b, p in zip(before, module.parameters()))
    assert 0 < state.stats.as_dict()["total_sent"] < state.stats.as_dict()["total_dense"]
    with pytest.raises(ValueError, match="has an optimizer already"):
        state.take_optimizer(opt)


def test_what_take_optimizer_refuses(group):
    module, ddp = _model()
    with pytest.raises(ValueError, match="compressed_update=False"):
        CompressionState(compression=SPEC).take_optimizer(torch.optim.SGD(module.parameters(),
                                                                          lr=0.1))
    with pytest.raises(ValueError, match="LBFGS"):
        CompressionState(compression=SPEC, compressed_update=True).take_optimizer(
            torch.optim.LBFGS(module.parameters()))
    with pytest.raises(ValueError, match="needs optimizer="):      # with the model: at once
        CompressionState(ddp, compression=SPEC, compressed_update=True)
