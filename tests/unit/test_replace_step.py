"""hvd_compress.torch.momentum.replace_step: how the DDP hook's compressed momentum and
compressed updates take over an optimizer's ``step()`` (its class becomes a subclass of
its own), also when an LR scheduler was made before, and never twice."""
import warnings

import pytest
import torch

from hvd_compress.torch.momentum import replace_step, restore_step


def _optimizer():
    return torch.optim.AdamW([torch.nn.Parameter(torch.ones(3))], lr=0.1)


@pytest.mark.parametrize("scheduler_first", [False, True])
def test_the_new_step_runs_and_the_scheduler_sees_it(scheduler_first):
    opt, calls = _optimizer(), []
    if scheduler_first:                  # torch wraps the *old* class's step on the instance
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    replace_step(opt, lambda self, closure=None: calls.append(type(self).__mro__[1]))
    if not scheduler_first:
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # "lr_scheduler.step() before optimizer.step()"
        opt.step()
        scheduler.step()
    assert calls == [torch.optim.AdamW]
    assert isinstance(opt, torch.optim.AdamW)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)


def test_twice_is_refused_and_restore_undoes_it():
    opt = _optimizer()
    replace_step(opt, lambda self, closure=None: None)
    with pytest.raises(ValueError, match="registered twice"):
        replace_step(opt, lambda self, closure=None: None)
    restore_step(opt)
    assert type(opt) is torch.optim.AdamW
    replace_step(opt, lambda self, closure=None: None)      # a fresh registration again
