"""Mixed precision (loss scaling) for :mod:`hvd_compress.torch.optimizer`.

With a loss scaler (``torch.amp.GradScaler``) the gradients that reach the optimizer's
hooks are ``S * g``, and ``S`` changes during training (it grows every
``growth_interval`` clean steps and halves at an overflow).  A compressor with error
feedback keeps what it did not send, ``r``, and adds it to the next gradient: kept in
scaled units, ``r`` from a step at ``S`` lands on a gradient at ``2 S`` or ``S / 2``, and
an absolute threshold means something else at every scale.

So this glue takes the scale out around the exchange: each gradient is divided by the
step's ``S`` when it is launched (the compressor, its residuals, thresholds, PowerSGD's
``Q`` all see and keep unscaled gradients), and the aggregate is multiplied by ``S``
again when it is written into ``p.grad``; ``p.grad`` after ``synchronize()`` holds the
scaled average, as with Horovod, so ``scaler.unscale_(opt)``, clipping and
``scaler.step(opt)`` work unchanged.  ``S`` is a power of two for GradScaler: dividing
and multiplying are exact.  ``gradient_predivide_factor`` is the same kind of factor and
is taken out the same way (:class:`GradientUnits` holds both).

An *overflow step* (a gradient with Inf/NaN on any rank: the aggregate is non-finite on
every rank, every compressor passes non-finite values through, so GradScaler skips the
step everywhere): every state write the compressors made in that step (residuals, step
counters, PowerSGD's ``Q``) is undone (:class:`hvd_compress.stores.Journal`), so the
step leaves error feedback exactly as it was.

Imports: torch, ``hvd_compress.stores``, ``hvd_compress.log``.
"""
import math

import torch

from ..log import logger
from ..stores import Journal


def _check_scaler(scaler):
    if scaler is None:
        return None
    if not (callable(getattr(scaler, "get_scale", None)) and callable(getattr(scaler, "scale", None))):
        raise ValueError("grad_scaler must be a torch.amp.GradScaler (or an object with its "
                         f"get_scale() and scale()), got {type(scaler).__name__}")
    return scaler


def _check_scale(scale):
    if scale is None:
        return None
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1 or not scale.is_floating_point():
            raise ValueError("set_loss_scale: scale must be a number or a one-element "
                             f"floating tensor, got a tensor of shape {tuple(scale.shape)} "
                             f"and dtype {scale.dtype}")
        value = float(scale)
    else:
        try:
            value = float(scale)
        except (TypeError, ValueError):
            raise ValueError(f"set_loss_scale: scale must be a number > 0, got {scale!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"set_loss_scale: scale must be a finite number > 0, got {scale!r}")
    return scale.detach().reshape(()) if isinstance(scale, torch.Tensor) else value


def all_finite(tensors):
    """True when no dense tensor of ``tensors`` holds NaN/Inf, with one host
    synchronisation: each tensor's min and max (they propagate NaN, and are +-Inf when an
    entry is), without the mask ``isfinite`` makes (6.2M float32 values in 24 tensors, one
    thread: 14.8 -> 1.0 ms)."""
    ends = [torch.stack(torch.aminmax(t.reshape(-1))) for t in tensors if t.numel()]
    return not ends or bool(torch.isfinite(torch.stack(ends)).all())


class GradientUnits:
    """The factor a step's gradients carry, taken out before compression and put back
    after: the loss scale (from ``grad_scaler``, or set by :meth:`set_loss_scale`) times
    ``predivide`` (``gradient_predivide_factor``).  ``journal_of()`` gives the
    :class:`~hvd_compress.stores.Journal` that undoes an overflow step."""

    def __init__(self, grad_scaler=None, predivide=1.0):
        self.scaler = _check_scaler(grad_scaler)
        self.manual = None
        self.predivide = float(predivide)
        self.now = None                  #: this step's divisor (None: not started / 1)
        self.started = False
        self.overflow_steps = 0          #: steps whose aggregate had Inf/NaN (undone)
        self.journal = None

    @property
    def scaling(self):
        """True when gradients carry a loss scale (overflow steps are then undone)."""
        if self.manual is not None:
            return True
        if self.scaler is None:
            return False
        return bool(self.scaler.is_enabled()) if hasattr(self.scaler, "is_enabled") else True

    def set_loss_scale(self, scale):
        self.manual = _check_scale(scale)

    def loss_scale(self):
        """The scale the coming (or current) step's gradients carry: 1.0 without one."""
        if self.manual is not None:
            return self.manual
        if not self.scaling:
            return 1.0
        scale = getattr(self.scaler, "_get_scale_async", lambda: None)()
        if scale is None:                # no scale() call yet: its initial scale
            return float(self.scaler.get_scale())
        return scale.detach().reshape(())

    def begin(self):
        """At a step's first launch: fix its divisor."""
        if self.started:
            return self.now
        self.started = True
        scale = self.loss_scale()
        if isinstance(scale, torch.Tensor):
            self.now = scale * self.predivide if self.predivide != 1.0 else scale
        else:
            self.now = None if scale * self.predivide == 1.0 else scale * self.predivide
        return self.now

    def unscale_(self, grad):
        """``grad`` divided by this step's factor, in place (nothing without one)."""
        d = self.begin()
        return grad if d is None else grad.div_(d)

    def rescale_(self, out):
        """The aggregate multiplied by this step's factor again, in place."""
        return out if self.now is None else out.mul_(self.now)

    def journal_of(self, compression, momentum):
        """The journal that records this step's state writes when gradients carry a loss
        scale (compressed momentum's own, if it is on), else None."""
        if not self.scaling:
            return None
        if momentum is not None:
            return momentum.journal
        if self.journal is None:
            self.journal = Journal()
            compression.attach_journal(self.journal)
        return self.journal

    def end(self, outs, journal):
        """After the exchange: undo the step's state writes when any aggregate in ``outs``
        has Inf/NaN; True when the step was finite."""
        self.started, self.now = False, None
        if journal is None:
            if self.journal is not None:     # a loss scale no more: stop keeping entries
                self.journal.clear()
            return True
        finite = all_finite(outs)
        if finite:
            journal.clear()
            return True
        journal.rollback()
        self.overflow_steps += 1
        logger.debug("hvd_compress: Inf/NaN in the aggregated gradients (a loss-scale "
                     "overflow): the step's error-feedback writes are undone (%d so far)",
                     self.overflow_steps)
        return False

    def abort(self):
        """A step that will not finish (Elastic reset): forget its divisor."""
        self.started, self.now = False, None
        if self.journal is not None:
            self.journal.rollback()


# -- the DDP hook -----------------------------------------------------------------------
class _DDPScaled:
    """:func:`register_ddp`'s hook state: the :class:`~hvd_compress.torch.ddp.
    CompressionState` and the step's :class:`GradientUnits`."""

    def __init__(self, state, units):
        self.state, self.units, self.futures = state, units, []


def _ddp_hook(scaled, bucket):
    """:func:`hvd_compress.torch.ddp.compression_hook` on the unscaled bucket; the result
    multiplied by the scale again (no collective is started from the callback)."""
    from .ddp import compression_hook
    state, units = scaled.state, scaled.units
    journal = units.journal_of(state.compression, state.momentum)
    d = units.begin()
    if d is not None:
        bucket.buffer().div_(d)
    fut = compression_hook(state, bucket)
    if d is not None:
        fut = fut.then(lambda f: f.value().mul_(d))
    scaled.futures.append(fut)
    if bucket.is_last():               # every bucket of the step is finished by now
        outs = [f.wait() for f in scaled.futures]
        scaled.futures = []
        units.end(outs, journal)
    return fut


def register_ddp(ddp_model, grad_scaler, compression=None, process_group=None, op="average",
                 optimizer=None, compressed_momentum=None):
    """:func:`hvd_compress.ddp.register` for mixed precision: the same arguments, and
    ``grad_scaler`` (a ``torch.amp.GradScaler``) whose scale the gradients carry.  Each
    bucket is divided by the step's scale before compression and its aggregate multiplied
    by it again, so error feedback is kept in unscaled units; a step whose aggregate has
    Inf/NaN (GradScaler skips it on every rank) leaves every residual as it was.  Train
    as usual: ``scaler.scale(loss).backward(); scaler.step(opt); scaler.update()``.
    Returns the :class:`~hvd_compress.torch.ddp.CompressionState`; its ``amp``
    (a :class:`GradientUnits`) counts ``overflow_steps``; ``amp.set_loss_scale(s)`` for
    another loss scaler (``grad_scaler=None``)."""
    from .ddp import CompressionState
    state = CompressionState(ddp_model, compression, process_group, op, optimizer,
                             compressed_momentum)
    state.amp = GradientUnits(grad_scaler)
    ddp_model.register_comm_hook(_DDPScaled(state, state.amp), _ddp_hook)
    return state
