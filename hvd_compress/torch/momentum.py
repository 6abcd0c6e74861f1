"""Compressed-momentum Adam for PyTorch (``torch.optim.Adam``, ``AdamW``): the tensor
side of :mod:`hvd_compress.strategies.momentum` (the rule, its formula and papers are
there), shared by the Horovod optimizer and the DDP hook.

The glue calls, per step::

    if momentum.dense:                       # warm-up or refresh: plain Adam, dense
        <exchange p.grad uncompressed>; wrapped.step(); momentum.after_dense(transport)
    else:
        momentum.to_momentum(p, p.grad)      # each gradient -> this rank's momentum
        <exchange p.grad with the compressor>    # p.grad = the ranks' mean momentum
        momentum.apply()                     # the Adam update with the frozen variance

The momentum ``m`` and variance ``v`` stay in the wrapped optimizer's own state
(``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq`` with amsgrad, ``step``), so its
``state_dict`` holds them; :meth:`state_dict` adds the schedule.

Imports: torch, ``hvd_compress.strategies.momentum``.
"""
import torch

from ..strategies.momentum import MomentumGlue, coefficients, dgc_compressors
from .amp import all_finite

ADAM_FAMILY = (torch.optim.Adam, torch.optim.AdamW)


def check_dgc(compression, optimizer, schedule):
    """A sparsifier with DGC's momentum correction (``momentum=``) applies SGD's momentum
    inside the exchange: ValueError when the optimizer has its own momentum too, or with
    compressed momentum (``schedule`` not None)."""
    dgc = dgc_compressors(compression)
    if not dgc:
        return
    spec = dgc[0].spec
    if schedule is not None:
        raise ValueError(f"compression {spec!r} has DGC's momentum correction (momentum=); "
                         "compressed_momentum compresses Adam's momentum: use one of them")
    if isinstance(optimizer, torch.optim.SGD) and any(g.get("momentum", 0)
                                                      for g in optimizer.param_groups):
        raise ValueError(f"compression {spec!r} applies the momentum inside the exchange "
                         "(DGC's momentum correction): wrap SGD with momentum=0, not "
                         f"momentum={optimizer.param_groups[0]['momentum']}")


def warmup_entries(entries, params, schedule):
    """Bucket-plan entries (:func:`hvd_compress.buckets.plan`'s, one per parameter of
    ``params``) when compressed momentum's dense steps send the gradients through another
    compressor (``schedule.warmup_compression``): a bucket then holds tensors that share
    both compressors, and both must take several tensors in one call."""
    if schedule is None or schedule.warmup_compression == "none":
        return entries
    from types import SimpleNamespace
    from ..spec import resolve
    warm, pairs, out = resolve(schedule.warmup_compression), {}, []
    for (name, shape, c, dtype, size), p in zip(entries, params):
        w = warm.for_tensor(name, p)
        key = pairs.setdefault((id(c), id(w)),
                               SimpleNamespace(segmented=c.segmented and w.segmented))
        out.append((name, shape, key, dtype, size))
    return out


class AdamMomentum(MomentumGlue):
    """Compressed momentum for ``optimizer`` (an Adam or AdamW, or a subclass made by
    our glue) under ``schedule`` (a :class:`MomentumSchedule` or what
    ``compressed_momentum=`` accepts); ``compression``: the compressor whose state
    writes a skipped step must undo."""

    def __init__(self, optimizer, schedule, compression, rank=lambda: 0):
        if not isinstance(optimizer, ADAM_FAMILY):
            raise ValueError("compressed_momentum needs an optimizer of the Adam family "
                             "(torch.optim.Adam or AdamW), got "
                             f"{type(optimizer).__name__}")
        for group in optimizer.param_groups:
            if group.get("differentiable"):
                raise ValueError("compressed_momentum: differentiable=True is not supported")
        super().__init__(schedule, compression, rank)
        self.opt = optimizer
        self.decoupled = isinstance(optimizer, torch.optim.AdamW) or any(
            g.get("decoupled_weight_decay", False) for g in optimizer.param_groups)
        self.group_of = {p: g for g in optimizer.param_groups for p in g["params"]}

    # -- a compressed step --------------------------------------------------------
    def to_momentum(self, p, grad):
        """``grad <- b1 m + (1 - b1) (g + wd p)`` in place (the L2 term for Adam only;
        ``maximize`` flips ``g``): what this rank sends instead of its gradient."""
        group, state = self.group_of[p], self.opt.state[p]
        beta1 = group["betas"][0]
        if group.get("maximize"):
            grad.neg_()
        if group["weight_decay"] and not self.decoupled:
            grad.add_(p.detach(), alpha=group["weight_decay"])
        grad.mul_(1.0 - beta1).add_(state["exp_avg"], alpha=beta1)
        return grad

    def apply(self, params):
        """The update from the mean momentum in ``p.grad`` (module docstring).  Returns
        False, leaving everything as it was, when the aggregate has NaN/Inf."""
        grads = [p.grad for p in params if p.grad is not None]
        if grads and not all_finite(grads):
            self.skip()
            return False
        step = None
        with torch.no_grad():
            for p in params:
                if p.grad is None:
                    continue
                group, state = self.group_of[p], self.opt.state[p]
                state["step"] += 1
                step = float(state["step"])
                beta1, beta2 = group["betas"]
                lr, wd = group["lr"], group["weight_decay"]
                if wd and self.decoupled:
                    p.mul_(1.0 - lr * wd)
                step_size, scale, eps = coefficients(
                    lr, beta1, beta2, group["eps"], step, self.schedule.variance_step)
                v = state["max_exp_avg_sq"] if group.get("amsgrad") else state["exp_avg_sq"]
                m = state["exp_avg"]
                m.copy_(p.grad)
                p.addcdiv_(m, (v.sqrt() / scale).add_(eps), value=-step_size)
        self.compressed_done(step)
        return True

    # -- a dense step -------------------------------------------------------------
    def after_dense(self, params, transport):
        """After the wrapped optimizer's own step on the dense average: count it, and in
        the warm-up decide whether the variance freezes now (rank 0's decision, through
        ``transport``)."""
        state = self.opt.state[params[0]] if params else {}
        step = float(state.get("step", self.schedule.steps + 1))

        def variance_sum():
            with torch.no_grad():
                return float(sum(self.opt.state[p]["exp_avg_sq"].double().sum()
                                 for p in params if "exp_avg_sq" in self.opt.state[p]))

        beta2 = self.opt.param_groups[0]["betas"][1]
        if self.dense_done(step, beta2, variance_sum, transport):
            for p in params:          # a parameter that never had a gradient: start its state
                if "exp_avg" not in self.opt.state[p]:
                    self.opt.state[p].update(step=torch.tensor(step),
                                             exp_avg=torch.zeros_like(p),
                                             exp_avg_sq=torch.zeros_like(p))
                    if self.group_of[p].get("amsgrad"):
                        self.opt.state[p]["max_exp_avg_sq"] = torch.zeros_like(p)


def momentum_optimizer(optimizer, owner, schedule, rank=lambda: 0):
    """For the DDP hook: an :class:`AdamMomentum` for ``optimizer``, whose ``step()``
    from now on applies the rule (the plain step in dense steps, then the warm-up
    decision; :meth:`AdamMomentum.apply` in compressed steps).  The optimizer object is
    kept (so whoever holds it keeps working); its class becomes a subclass of its own,
    made on the fly as Horovod's DistributedOptimizer does.  ``owner``: what holds the
    compression and the ``transport``."""
    momentum = AdamMomentum(optimizer, schedule, owner.compression, rank)
    base = type(optimizer)
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]

    def step(self, closure=None):
        if momentum.dense:
            loss = plain_step(base.step)(self, closure)
            momentum.after_dense(params, owner.transport)
            return loss
        with torch.enable_grad():
            loss = closure() if closure is not None else None
        momentum.apply(params)
        return loss

    replace_step(optimizer, step)
    return momentum


def replace_step(optimizer, step):
    """From now on ``optimizer.step()`` is ``step(optimizer, closure=None)``: its class
    becomes a subclass of its own, made on the fly (as Horovod's DistributedOptimizer
    does, :func:`restore_step` undoes it), so whoever holds the object keeps working.

    An LR scheduler made before has put a wrapper of the *old* class's ``step`` on the
    instance (to see whether the optimizer stepped), which would bypass the new class:
    that wrapper is replaced by one of the new ``step`` that tells the scheduler the
    same.  torch's step hooks (``register_step_pre_hook``/``_post_hook``) run once, around
    ``step`` (which calls the wrapped optimizer's step through :func:`plain_step`), so a
    post hook sees the parameters every rank ends the step with.  ValueError for an
    optimizer whose step hvd_compress replaced already (a second ``register``)."""
    base = type(optimizer)
    if getattr(base, "_hvd_compress_step", False):
        raise ValueError(f"the {base.__name__} optimizer's step() is hvd_compress's already "
                         "(registered twice?): give each registration its own optimizer")
    step = torch.optim.Optimizer.profile_hook_step(step)
    step.hooked = True                       # what torch's Optimizer.__init__ would mark
    optimizer.__class__ = type(base.__name__, (base,), {"step": step, "_hvd_compress_step": True,
                                                        "__module__": base.__module__})
    if "step" in vars(optimizer):            # an LR scheduler's wrapper of base.step
        import weakref
        ref = weakref.ref(optimizer)

        def tracked(*args, **kwargs):
            opt = ref()
            opt._opt_called = True            # what the scheduler's own wrapper records
            return type(opt).step(opt, *args, **kwargs)

        tracked._wrapped_by_lr_sched = True
        optimizer.step = tracked


def plain_step(step):
    """The optimizer step function ``step`` (e.g. ``AdamW.step``) without torch's step
    hooks, which ``torch.optim.Optimizer`` wraps around every optimizer class's step
    (``profile_hook_step``).  The glues call the wrapped optimizer's step through this and
    run the hooks once, around their own step: otherwise every hook ran twice a step, and
    the first post hook saw this rank's local step, not the exchanged one."""
    if getattr(step, "__code__", None) is _HOOK_CODE:     # torch's wrapper itself, not a
        return step.__wrapped__                          # decorator that copied its marks
    return step


#: the code of torch's step-hook wrapper (``Optimizer.profile_hook_step``'s inner function)
_HOOK_CODE = torch.optim.Optimizer.profile_hook_step(lambda *args, **kwargs: None).__code__


def restore_step(optimizer):
    """Undo :func:`replace_step` (the registration failed after it)."""
    if getattr(type(optimizer), "_hvd_compress_step", False):
        optimizer.__class__ = type(optimizer).__mro__[1]
        vars(optimizer).pop("step", None)
