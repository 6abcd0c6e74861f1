"""Compressed updates: every rank runs the wrapped optimizer on its *own* gradients, and
the parameter change it would make goes through the compressor with error feedback.

Why: error-compensated *gradient* compression assumes an optimizer linear in the
gradient.  Adam is not: a coordinate that a sparsifier sends once every ``T`` steps
arrives as about ``T g`` (the residual it piled up), so Adam's ``m`` receives ``T g``
once and its ``v`` about ``T g^2`` per step on average; the coordinate then moves by
about ``T g / sqrt(T g^2) = sqrt(T)`` learning rates where dense Adam moves ``T``.  At a
density of 1% most coordinates learn several times more slowly, and the run falls behind
(``docs/adam-adamw.md``).  The *update* of Adam is already normalised (each coordinate
moves about ``lr`` a step): piled up over ``T`` steps and sent once, it moves the
coordinate ``T lr``, as dense Adam would.

The rule, every rank ``i``, every step (any ``torch.optim`` optimizer)::

    p_0 = p                                        (the same on every rank)
    the wrapped optimizer's own step on g_i        (its state m_i, v_i: this rank's)
    u_i = p - p_0                                  (with AdamW's decay, clipping, ...)
    U   = (1/P) sum_i D(C(u_i + e_i))              (any compressor; buckets as gradients')
    e_i = B (u_i + e_i - D(C(u_i + e_i)))          (error feedback, per rank)
    p   = p_0 + U                                  (the same on every rank)

``B``: the spec's ``ef_decay``, else ``max(0.9, 1 - 10 density)`` for a sparsifier of a
density but randomk (``DensitySparsifier.default_ef_decay``), else 1.

This is the worker side of Efficient-Adam (Chen, Shen, Liu and Luo, "Efficient-Adam:
Communication-Efficient Distributed Adam", arXiv:2205.14473, 2022: each worker's Adam
step on its own gradient, quantised with error feedback), without its server: the ranks'
payloads are aggregated by the same exchange as gradients, so the sum arrives exact.

What differs from dense training, and what a user sees:

- Each rank keeps the optimizer state of its own gradients (``opt.state_dict()`` is this
  rank's); the parameters stay the same on every rank.  ``hvd.broadcast_optimizer_state``
  still makes every rank start from rank 0's.  The residuals are in
  ``opt.compression.state_dict()``, under the parameters' names, as for gradients.
- The exchange starts after the local step, so nothing of it overlaps backward.
- ``synchronize()`` exchanges nothing (gradient clipping acts on the local gradients);
  ``step()`` always exchanges, also inside ``skip_synchronize()``.  ``step(closure)``
  evaluates the closure once, before the step (LBFGS is refused).
- A rank whose gradients hold NaN/Inf skips its local step (its optimizer state stays
  as it was, a warning says so) and sends no update of its own, only its residual (so
  nothing is lost); every rank applies the mean of what the ranks sent: no rank waits,
  and the parameters stay equal everywhere.  With a GradScaler: ``scaler.unscale_(opt)``,
  ``opt.step()``, ``scaler.update()`` (``scaler.step`` would skip the exchange on the
  overflowing rank alone, and the others would wait for it).
- Only ``op=hvd.Average``; no ``grad_scaler``/``set_loss_scale``; ``$HVD_COMPRESS_MOMENTUM``
  is ignored.

The Horovod optimizer (:mod:`hvd_compress.torch.optimizer`) calls :class:`LocalUpdates`
from its ``step()``; the DDP hook (:mod:`hvd_compress.torch.ddp`) sends each bucket's
local gradient back unchanged and gives the optimizer the step of
:func:`update_optimizer`.

Imports: torch, ``hvd_compress.log``, ``hvd_compress.torch.amp`` and ``.momentum``.
"""
import torch

from ..log import logger
from .amp import all_finite
from ..strategies.momentum import check_compressed_update
from .momentum import plain_step, replace_step


def check(compressed_update, schedule, grad_scaler, compression, average=True, optimizer=None,
          ops=("op=hvd.Average", "op=hvd.Sum"), ranks=None, rank_of=None):
    """ValueError for what ``compressed_update=True`` cannot be combined with: what every
    glue refuses (:func:`~hvd_compress.strategies.momentum.check_compressed_update`:
    compressed momentum, a sum, DGC's ``momentum=``), a ``grad_scaler`` (the update
    carries no loss scale) and LBFGS (its step calls the closure several times; the rule
    needs the gradients before the step).
    ``ranks``: the number of ranks, for the learning-rate hint it logs; ``rank_of``: this
    process's rank, for the compressor's checkpoints (``Compressor.bind_rank``).
    Returns ``compressed_update`` as a bool."""
    if not check_compressed_update(compressed_update, schedule, compression, average, ops,
                                   ranks, rank_of):
        return False
    if grad_scaler is not None:
        raise ValueError("compressed_update=True does not take grad_scaler: the update "
                         "carries no loss scale; with a GradScaler call scaler.unscale_(opt), "
                         "then opt.step() (not scaler.step(opt), which would skip the "
                         "exchange on an overflowing rank only), then scaler.update()")
    check_optimizer(optimizer)
    return True


def check_optimizer(optimizer):
    """ValueError for an optimizer compressed updates cannot wrap: LBFGS (its step
    evaluates the closure several times; the rule needs the gradients before the step)."""
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("compressed_update=True does not take LBFGS (its step evaluates "
                         "the closure several times)")


class LocalUpdates:
    """The tensor side of the rule (module docstring) for ``params``.  The glue calls
    ``updates.run(step, closure, exchange)`` each step, which is::

        saved, loss = updates.local_step(step, closure)   # p.grad <- u_i (p: p_0 + u_i)
        exchange()                                  # p.grad <- U (every p.grad, compressed)
        updates.apply(saved)                        # p <- p_0 + U; p.grad back to g_i

    Three passes over the parameters besides the wrapped step (copy ``p_0``, subtract,
    add), into buffers kept between steps.
    """

    def __init__(self, params, compression=None):
        self.params = list(params)
        self.start = None            #: p_0 of each parameter (buffers kept between steps)
        self.updates = None          #: u_i, then U (buffers kept between steps)
        self.skipped = 0             #: steps this rank skipped for NaN/Inf gradients
        #: the compressor's state writes of the step (its residuals), undone when the
        #: exchange fails (:class:`~hvd_compress.stores.Journal`: references, no copies;
        #: it keeps the old residuals alive until the exchange ends, so a bucket's
        #: exchange holds up to one residual-sized buffer more than without it)
        self.journal = None
        if compression is not None:
            from ..stores import Journal
            self.journal = Journal()
            compression.attach_journal(self.journal)

    def run(self, step, closure, exchange, cleanup=None):
        """One step of the rule (class docstring); returns the loss.  When ``exchange``
        raises, ``p`` goes back to ``p_0`` on this rank (:meth:`undo`; every rank's
        exchange raises alike), the compressor's residuals to what they were before the
        step, ``cleanup()`` runs, and the error goes on."""
        saved, loss = self.local_step(step, closure)
        try:
            exchange()
        except BaseException:
            if self.journal is not None:
                self.journal.rollback()
            self.undo(saved)
            if cleanup is not None:
                cleanup()
            raise
        if self.journal is not None:
            self.journal.clear()
        self.apply(saved)
        return loss

    def local_step(self, step, closure=None):
        """Run ``step()`` (the wrapped optimizer's) on this rank's gradients unless one
        holds NaN/Inf (a ``closure`` is evaluated first, once, and its gradients checked);
        put each parameter's update into its ``.grad``.  Returns the gradients to give
        back and the loss (the closure's, else what ``step()`` returned)."""
        params, loss = self.params, None
        if closure is not None:           # the gradients the step will use, checked below
            with torch.enable_grad():
                loss = closure()
        grads = [p.grad for p in params if p.grad is not None]
        finite = all_finite([g.coalesce().values() if g.is_sparse else g for g in grads])
        with torch.no_grad():
            if self.start is None:
                self.start = [torch.empty_like(p) for p in params]
                self.updates = [torch.empty_like(p) for p in params]
            for s, p in zip(self.start, params):
                s.copy_(p)
        if finite:
            stepped = step()
            loss = stepped if closure is None else loss
        else:
            self.skipped += 1
            logger.warning("hvd_compress: compressed_update: this rank's gradients hold "
                           "NaN/Inf; its optimizer step is skipped (%d so far) and it "
                           "sends no update of its own this step", self.skipped)
        saved = [p.grad for p in params]
        with torch.no_grad():
            for s, u, p in zip(self.start, self.updates, params):
                torch.sub(p, s, out=u)
                p.grad = u
        return saved, loss

    def apply(self, saved):
        """``p <- p_0 + U`` (``U`` in ``p.grad`` after the exchange); ``p.grad`` gets this
        rank's gradient back."""
        with torch.no_grad():
            for s, p, g in zip(self.start, self.params, saved):
                torch.add(s, p.grad, out=p)
                p.grad = g

    def undo(self, saved):
        """After a failed exchange: ``p <- p_0`` (the parameters stay the same on every
        rank; this rank's optimizer state keeps its step); ``p.grad`` gets this rank's
        gradient back."""
        with torch.no_grad():
            for s, p, g in zip(self.start, self.params, saved):
                p.copy_(s)
                p.grad = g


def update_optimizer(optimizer, exchange, compression=None):
    """For the DDP hook: from now on ``optimizer.step(closure=None)`` is this rank's own
    step, then ``exchange(params)`` (every ``p.grad``, holding ``u_i``, replaced by the
    ranks' mean ``U``), then ``p <- p_0 + U`` (the optimizer object is kept; its class
    becomes a subclass of its own, :func:`~hvd_compress.torch.momentum.replace_step`).
    A failed exchange undoes ``compression``'s residual writes (:meth:`LocalUpdates.run`).
    Returns the :class:`LocalUpdates` (its ``skipped`` counts NaN/Inf steps)."""
    params = trainable(optimizer)
    updates = LocalUpdates(params, compression)
    base = type(optimizer)

    def step(self, closure=None):
        if len(trainable(self)) != len(params):
            raise ValueError("compressed_update=True: the optimizer's parameters changed "
                             f"since it was registered ({len(params)} then, "
                             f"{len(trainable(self))} now: add_param_group?); give the hook "
                             "an optimizer that holds every parameter from the start")
        return updates.run(lambda: plain_step(base.step)(self), closure,
                           lambda: exchange(params))

    replace_step(optimizer, step)
    return updates


def trainable(optimizer):
    """The parameters ``optimizer`` steps that require a gradient, in its order."""
    return [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
