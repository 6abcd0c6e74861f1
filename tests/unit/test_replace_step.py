"""hvd_compress.torch.momentum.replace_step: how the DDP hook's compressed momentum and
compressed updates take over an optimizer's ``step()`` (its class becomes a subclass of
its own), also when an LR scheduler was made before, and never twice."""
import warnings

import pytest
import torch

from hvd_compress.torch.momentum import plain_step, replace_step, restore_step


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


def test_step_hooks_run_once_around_the_new_step():
    """torch wraps every optimizer class's step with its step hooks; the new step calls
    the wrapped optimizer's step through plain_step, so each hook runs once a step and
    the post hook sees what the new step did after it (the exchange, in the glues)."""
    opt, seen = _optimizer(), []
    param = opt.param_groups[0]["params"][0]

    def step(self, closure=None):
        plain_step(torch.optim.AdamW.step)(self, closure)     # the local step
        with torch.no_grad():
            param.fill_(7.0)                                  # what the exchange would do

    replace_step(opt, step)
    opt.register_step_pre_hook(lambda *args: seen.append(("pre", param.tolist())))
    opt.register_step_post_hook(lambda *args: seen.append(("post", param.tolist())))
    param.grad = torch.ones(3)
    opt.step()
    assert seen == [("pre", [1.0] * 3), ("post", [7.0] * 3)]
    assert opt.state[param]["step"] == 1                      # the local step ran
    assert plain_step(torch.optim.AdamW.step) is not torch.optim.AdamW.step
    assert plain_step(step) is step                           # no hooks: unchanged


def test_plain_step_leaves_a_decorator_over_torchs_wrapper():
    """A step decorated over torch's hooked one copies its marks (functools.wraps):
    plain_step strips torch's wrapper only, never the user's decorator."""
    import functools

    def decorated(fn):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            return fn(*args, **kwargs)
        return inner

    torch.optim.AdamW([torch.nn.Parameter(torch.ones(1))])     # AdamW.step hooked now
    user = decorated(torch.optim.AdamW.step)
    assert getattr(user, "hooked", False)                      # the copied mark
    assert plain_step(user) is user
    assert plain_step(torch.optim.AdamW.step) is torch.optim.AdamW.step.__wrapped__
