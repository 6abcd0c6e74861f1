"""Compressed-momentum Adam: dense Adam for a warm-up, then the variance frozen and each
worker's *momentum* exchanged through a compressor with error feedback.

Why: Adam is non-linear in the gradient (``g / sqrt(v)``), so error-compensated gradient
compression does not carry over to it: with AdamW and top-k at 1% a small GPT-2 stops
improving while the dense run keeps going (issue 25).  Once Adam's variance ``v`` has
settled it acts as a fixed per-coordinate preconditioner, and the update is linear in
the momentum again, which error feedback handles (Tang et al., "1-bit Adam:
Communication Efficient Large-Scale Training with Adam's Convergence Speed", ICML
2021; Lu et al., "Maximizing Communication Efficiency for Large-scale Training via 0/1
Adam", ICLR 2023).

The rule, for step ``t`` (1-based, the wrapped optimizer's own count), every rank::

    warm-up (t <= T_w) and refresh steps:  plain Adam/AdamW on the dense average
        g = mean_ranks(g_i)
        m = b1 m + (1 - b1) g          v = b2 v + (1 - b2) g^2        T_v = t
    compressed steps:
        m_i = b1 m + (1 - b1) g_i                       (local momentum; Adam's L2
                                                         weight decay is in g_i)
        m   = (1/P) sum_i D(C(m_i + e_i))               (any compressor)
        e_i = m_i + e_i - D(C(m_i + e_i))               (error feedback, per rank)
        v   unchanged (frozen since step T_v)
        p  <- p (1 - lr wd)                             (AdamW's decoupled decay)
        p  <- p - lr / (1 - b1^t) * m / (sqrt(v / (1 - b2^T_v)) + eps)

Bias correction is the wrapped optimizer's: ``1 - b1^t`` goes on with the momentum's
steps, ``1 - b2^T_v`` stays at the step the variance was last updated (the frozen
``v`` is the average of ``T_v`` squares).  Every rank ends a step with the same
``m`` (the aggregate), so the momentum each rank starts the next step from agrees.

**When the warm-up ends** (:class:`MomentumSchedule`): after ``warmup`` steps (an int),
or with ``warmup="auto"`` when the variance has settled: every ``check`` dense steps the
sum of the bias-corrected variance ``S_t = sum(v) / (1 - b2^t)`` is compared with the
previous check's, and the warm-up ends once ``|S_t - S_{t-check}| / S_t < tol`` (a
scalar test of our own in the spirit of 1-bit Adam's observation that ``v`` settles
early; at most ``max_warmup`` steps).  Rank 0's decision is broadcast by the glue.

**Refreshing the variance** (``refresh=R > 0``, as 0/1 Adam's variance updates at
exponentially spaced steps): dense Adam steps at ``T_w + R, T_w + 3R, T_w + 7R, ...``
(gaps ``R, 2R, 4R, ...``) update ``v`` (and ``T_v``) again; the residuals wait.

**The warm-up's exchange** (``warmup_compression``, default ``"none"``): the dense
Adam steps (warm-up and refreshes) send their *gradients* through this compressor
instead of a plain allreduce, e.g. ``"powersgd:rank=4"`` (low-rank gradients with error
feedback, which kept AdamW's loss per step in ``benchmarks/time_to_loss.py``) or
``"fp16"``.  On a slow link the dense warm-up is what costs: at 100 Mbit/s a dense
step of the benchmark's GPT-2 took 1134 ms against 200 ms for a compressed-momentum
step, so a 100-step dense warm-up alone costs as long as 570 compressed steps.  The
variance ``v`` is then Adam's variance of the aggregate this compressor delivers.

**A step with NaN/Inf** in the aggregate momentum is skipped as a GradScaler skips one:
``m``, ``v``, the parameters, the step count and every error-feedback residual stay as
they were (the glue undoes the residual writes with a :class:`hvd_compress.stores.Journal`).

This module imports only the standard library and ``hvd_compress.compressors.base``'s
``leaves`` (and, lazily, ``hvd_compress.log`` and ``auto``'s candidates): the frameworks'
glue (``hvd_compress.torch.momentum``) does the tensor arithmetic with the coefficients
:func:`coefficients` returns.
"""
import math

from ..compressors.base import leaves

#: what ``compressed_momentum=`` accepts besides a :class:`MomentumSchedule`
ACCEPTED = "True, an int (warm-up steps), 'auto', a dict of MomentumSchedule's arguments"


class MomentumSchedule:
    """When a step is dense (warm-up, refresh) and when it sends compressed momentum.

    ``warmup``: dense Adam steps before the variance freezes (int >= 1), or ``"auto"``
    (the variance-stability test of the module docstring: ``check``, ``tol``,
    ``min_warmup``, ``max_warmup``).  ``refresh``: 0 (never) or the first gap ``R`` of
    the variance refreshes at ``T_w + R, T_w + 3R, ...``.  ``warmup_compression``: a
    compressor spec for the gradients of the dense steps (default ``"none"``: a plain
    allreduce; the module docstring says why ``"powersgd:rank=4"`` pays on slow links).
    """

    def __init__(self, warmup="auto", refresh=0, tol=0.05, check=10, min_warmup=20,
                 max_warmup=1000, warmup_compression="none"):
        if warmup != "auto":
            if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
                raise ValueError(f"compressed_momentum: warmup must be 'auto' or an int >= 1 "
                                 f"(dense Adam steps before the variance freezes), got {warmup!r}")
        for name, value in (("refresh", refresh), ("check", check), ("min_warmup", min_warmup),
                            ("max_warmup", max_warmup)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"compressed_momentum: {name} must be an int >= 0, got {value!r}")
        if check < 1 or max_warmup < 1:
            raise ValueError("compressed_momentum: check and max_warmup must be >= 1")
        if not (isinstance(tol, (int, float)) and 0 < tol < 1):
            raise ValueError(f"compressed_momentum: tol must be in (0, 1), got {tol!r}")
        if not isinstance(warmup_compression, str) or not warmup_compression.strip():
            raise ValueError("compressed_momentum: warmup_compression must be a compressor "
                             f"spec string such as 'none' or 'powersgd:rank=4', got "
                             f"{warmup_compression!r}")
        self.warmup_compression = warmup_compression.strip()
        self.warmup, self.refresh, self.tol, self.check = warmup, refresh, float(tol), check
        self.min_warmup, self.max_warmup = min_warmup, max_warmup
        self.steps = 0            #: steps taken under this schedule
        self.frozen_at = None     #: T_w: the last warm-up step (None: still warming up)
        self.variance_step = None  #: T_v: the optimizer step of the last variance update
        self.last_sum = None      #: S at the previous check (warmup="auto")
        self.history = []         #: (step, relative change) of each check

    @classmethod
    def build(cls, value):
        """A schedule from what ``compressed_momentum=`` accepts (None/False: None)."""
        if value is None or value is False:
            return None
        if isinstance(value, cls):
            return value
        if value is True or value == "auto":
            return cls()
        if isinstance(value, int) and not isinstance(value, bool):
            return cls(warmup=value)
        if isinstance(value, dict):
            return cls(**value)
        raise ValueError(f"compressed_momentum must be one of {ACCEPTED}; got {value!r}")

    @property
    def spec(self):
        """What every rank must agree on (for the glue's configuration check)."""
        return (f"momentum(warmup={self.warmup},refresh={self.refresh},tol={self.tol},"
                f"check={self.check},min={self.min_warmup},max={self.max_warmup}"
                + (f",warmup_compression={self.warmup_compression})"
                   if self.warmup_compression != "none" else ")"))

    @property
    def warming_up(self):
        return self.frozen_at is None

    def dense(self, step=None):
        """True when step ``step`` (default: the next one) is a dense Adam step."""
        step = self.steps + 1 if step is None else step
        if self.frozen_at is None:
            return True
        if self.refresh <= 0:
            return False
        k = (step - self.frozen_at) / self.refresh + 1     # T_w + (2^j - 1) R
        return k >= 2 and k == int(k) and (int(k) & (int(k) - 1)) == 0

    def wants_check(self):
        """True when the step just taken ends a check period of ``warmup='auto'``."""
        return (self.frozen_at is None and self.warmup == "auto"
                and self.steps % self.check == 0)

    def observe(self, variance_sum, beta2, optimizer_step):
        """After a dense warm-up step (counted by :meth:`step_done`): ``variance_sum`` =
        sum of ``v`` on a check step of ``warmup='auto'`` (else None), ``optimizer_step``
        the wrapped optimizer's step count.  True when the warm-up should end now (the
        glue broadcasts rank 0's answer, then calls :meth:`freeze`)."""
        if self.warmup != "auto":
            return self.steps >= self.warmup
        if variance_sum is None:
            return False
        s = variance_sum / (1.0 - beta2 ** optimizer_step)
        change = None if self.last_sum is None or s <= 0 else abs(s - self.last_sum) / s
        self.last_sum = s
        if change is not None:
            self.history.append((self.steps, change))
        if self.steps >= self.max_warmup:
            return True
        return change is not None and self.steps >= self.min_warmup and change < self.tol

    def step_done(self, dense, optimizer_step):
        """Count a step; ``dense``: it updated the variance, at ``optimizer_step``."""
        self.steps += 1
        if dense:
            self.variance_step = optimizer_step

    def freeze(self):
        """The step just taken was the last of the warm-up: the variance freezes."""
        if self.frozen_at is None:
            self.frozen_at = self.steps

    # -- checkpoints --------------------------------------------------------------
    _FIELDS = ("steps", "frozen_at", "variance_step", "last_sum", "history")

    def state_dict(self):
        return {"spec": self.spec, **{k: getattr(self, k) for k in self._FIELDS}}

    def load_state_dict(self, state):
        if state.get("spec") != self.spec:
            raise ValueError(f"compressed_momentum state is for {state.get('spec')!r}, "
                             f"not {self.spec!r}")
        for k in self._FIELDS:
            setattr(self, k, state[k])
        self.history = [tuple(h) for h in self.history]


class MomentumGlue:
    """What every framework's compressed-momentum adapter shares (each subclass adds its
    tensor arithmetic): the :class:`MomentumSchedule`, the journal that undoes a skipped
    step's error-feedback writes, the count of skipped steps, the warm-up decision and
    the checkpoint, and :attr:`warmup_compressor` (what the dense steps send their
    gradients through).  ``compression``: the compressor whose writes are journaled;
    ``rank()``: this rank (rank 0 logs the phase change)."""

    framework = "torch"          #: for restoring the warm-up compressor's state

    def __init__(self, schedule, compression, rank=lambda: 0):
        from ..stores import Journal
        from ..spec import resolve
        self.schedule = MomentumSchedule.build(schedule)
        #: the compressor of the dense steps' gradients (``warmup_compression``)
        self.warmup_compressor = resolve(self.schedule.warmup_compression)
        self.journal = Journal()
        compression.attach_journal(self.journal)
        self.skipped = 0          #: compressed steps skipped for NaN/Inf
        self.rank = rank

    @property
    def dense(self):
        """True when the coming step is a dense Adam step (warm-up or refresh)."""
        return self.schedule.dense()

    @property
    def spec(self):
        return self.schedule.spec

    def skip(self):
        """The aggregate had NaN/Inf: undo the step's state writes and count it."""
        from ..log import logger
        self.journal.rollback()
        self.skipped += 1
        logger.warning("compressed_momentum: NaN/Inf in the aggregated momentum; step "
                       "skipped (momentum, variance, parameters and error feedback "
                       "unchanged; %d skipped so far)", self.skipped)

    def compressed_done(self, optimizer_step):
        self.journal.clear()
        self.schedule.step_done(False, optimizer_step)

    def dense_done(self, optimizer_step, beta2, variance_sum, transport):
        """After a dense step at ``optimizer_step``: count it, and in the warm-up decide
        whether the variance freezes now.  ``variance_sum()``: the sum of ``v`` (asked
        on check steps only); ``transport``: the glue's
        :class:`~hvd_compress.exchange.Transport`, whose ``broadcast_floats`` gives every
        rank rank 0's decision.  True when the variance froze now."""
        from ..log import info_rank0
        self.journal.clear()
        self.schedule.step_done(True, optimizer_step)
        if not self.schedule.warming_up:
            return False
        total = variance_sum() if self.schedule.wants_check() else None
        flag = float(self.schedule.observe(total, beta2, optimizer_step))
        if transport.broadcast_floats([flag], "momentum.freeze")[0] < 0.5:
            return False
        self.schedule.freeze()
        info_rank0(self.rank(), "compressed_momentum: variance frozen after %d dense steps; "
                   "the momentum is compressed from now on", self.schedule.steps)
        return True

    def state_dict(self):
        out = {**self.schedule.state_dict(), "skipped": self.skipped}
        if self.schedule.warmup_compression != "none":
            out["warmup_compression"] = self.warmup_compressor.state_dict()
        return out

    def load_state_dict(self, state, entry="compressed_momentum"):
        """Restore :meth:`state_dict`; ``state`` None (the checkpoint has no ``entry``)
        is a ValueError naming it."""
        if state is None:
            raise ValueError("load_state_dict: this optimizer uses compressed_momentum but "
                             f"the state_dict has no {entry!r} entry")
        state = dict(state)
        self.skipped = state.pop("skipped", 0)
        warm = state.pop("warmup_compression", None)
        self.schedule.load_state_dict(state)
        if warm is not None:
            self.warmup_compressor.load_state_dict(warm, self.framework)
        self.journal.clear()


def dgc_compressors(compression):
    """The compressors of ``compression`` (a Policy's, an auto's candidates included) that
    apply DGC's momentum correction (``momentum=``)."""
    return [c for c in leaves(compression) if getattr(c, "momentum", None)]


def check_compressed_update(compressed_update, schedule, compression, average, ops,
                            ranks=None, rank_of=None):
    """What every glue refuses with ``compressed_update=True`` (the rule:
    :mod:`hvd_compress.torch.compressed_update`): ValueError for a value not a bool,
    compressed momentum (``schedule`` not None), a sum (``average`` False: P ranks'
    updates summed would move the parameters P times as far; ``ops``: how the caller
    spells average and sum) and DGC's momentum correction (``momentum=``: it would add
    momentum to updates).  Then marks what the compressor's residuals hold, updates or
    gradients (:meth:`~hvd_compress.compressors.base.Compressor.mark_residuals`: its
    checkpoints record it; ValueError when one restored before held the other).  Returns
    ``compressed_update``.  ``rank_of``: how the glue numbers this process, for the
    compressor's checkpoints (:meth:`~hvd_compress.compressors.base.Compressor.bind_rank`).

    Logs the decay it chose for the updates' sparsifiers and, given the number of
    ``ranks`` P > 1, the learning rate measured best for them: about ``sqrt(P)`` times
    dense training's (docs/adam-adamw.md; the optimizer's own rate is used as given)."""
    if not isinstance(compressed_update, bool):
        raise ValueError(f"compressed_update must be True or False, got {compressed_update!r}")
    if compressed_update:
        if schedule is not None:
            raise ValueError("compressed_update=True and compressed_momentum: use one of them "
                             "(compressed_update sends the whole update, momentum included)")
        if not average:
            raise ValueError(f"compressed_update=True needs {ops[0]}: the ranks' updates are "
                             f"averaged ({ops[1]} would move the parameters world-size times "
                             "as far)")
        dgc = dgc_compressors(compression)
        if dgc:
            raise ValueError(f"compressed_update=True: compression {dgc[0].spec!r} applies "
                             "SGD's momentum inside the exchange (momentum=); drop momentum= "
                             "(the wrapped optimizer's own momentum is in the update)")
    if hasattr(compression, "mark_residuals"):
        compression.mark_residuals("updates" if compressed_update else "gradients")
        if rank_of is not None:
            compression.bind_rank(rank_of)
    decayed = _decayed(compression)
    if compressed_update and decayed:
        from ..log import logger
        logger.info("hvd_compress: compressed_update=True: error feedback keeps %s of what "
                    "is not sent (the default for updates, docs/adam-adamw.md; ef_decay=1 "
                    "in the spec for plain error feedback)",
                    ", ".join(f"ef_decay={c.ef_decay:g} ({c.spec})" for c in decayed))
        learning_rate_hint(compression, ranks)
    return compressed_update


def _decayed(compression):
    """The sparsifiers of ``compression`` whose residual decays by the updates' default."""
    return [c for c in leaves(compression) if c.ef and not c.ef_decay_given and
            c.ef_decay != 1.0]


def learning_rate_hint(compression, ranks):
    """Logs, for compressed updates through sparsifiers at their default decay on
    ``ranks`` P > 1, the learning rate measured best for them: about ``sqrt(P)`` times
    dense training's (docs/adam-adamw.md).  :func:`check_compressed_update` calls it; a
    glue that learns P only later (Lightning's strategy) calls it then."""
    if ranks is not None and ranks > 1 and _decayed(compression):
        from ..log import logger
        logger.info("hvd_compress: compressed_update=True on %d ranks: sparsified AdamW "
                    "updates trained best at about sqrt(%d) = %.1f times dense "
                    "training's learning rate (docs/adam-adamw.md); the optimizer's own "
                    "rate is used as given", ranks, ranks, math.sqrt(ranks))


def adam_defaults(compression, optimizer_name):
    """An Adam-family optimizer that compresses its *gradients*: ``auto`` with default
    candidates keeps only the ones that keep Adam's convergence
    (:func:`hvd_compress.strategies.auto.candidates.for_adam`); any other lossy
    compressor gets a warning pointing at the README's measurements."""
    from ..log import logger
    from .auto.candidates import ADAM_CANDIDATES, for_adam
    if for_adam(compression):
        logger.info("hvd_compress: %s sends gradients: auto chooses among %s (pass "
                    "compressed_momentum=True, or compressed_update=True to "
                    "hvd_compress.torch.DistributedOptimizer, hvd_compress.ddp.register or "
                    "hvd_compress.keras.DistributedOptimizer, to compress the momentum or "
                    "the update)",
                    optimizer_name, "|".join(ADAM_CANDIDATES))
    elif compression.name not in ("none", "fp16", "bf16", "auto", "powersgd"):
        logger.warning("hvd_compress: %s with lossy gradient compression (%s) may converge "
                       "more slowly than dense Adam; compressed_update=True (hvd_compress.torch."
                       "DistributedOptimizer, hvd_compress.ddp.register, hvd_compress.keras."
                       "DistributedOptimizer) sends each rank's update instead; see "
                       "docs/adam-adamw.md for what was measured",
                       optimizer_name, compression.spec)


def coefficients(lr, beta1, beta2, eps, step, variance_step):
    """``(step_size, denominator_scale, eps)`` of a compressed step: the parameter moves
    by ``-step_size * m / (sqrt(v) / denominator_scale + eps)``, i.e.
    ``step_size = lr / (1 - b1^t)`` and ``denominator_scale = sqrt(1 - b2^T_v)``."""
    return lr / (1.0 - beta1 ** step), math.sqrt(1.0 - beta2 ** variance_step), eps


def momentum_from_env():
    """What ``$HVD_COMPRESS_MOMENTUM`` asks for (None: unset or off)."""
    import os
    text = os.environ.get("HVD_COMPRESS_MOMENTUM", "").strip().lower()
    if text in ("", "0", "false", "off", "no"):
        return None
    if text in ("1", "true", "on", "yes", "auto"):
        return "auto" if text == "auto" else True
    try:
        return int(text)
    except ValueError:
        raise ValueError("$HVD_COMPRESS_MOMENTUM must be 0/1, 'auto' or a number of warm-up "
                         f"steps, got {text!r}") from None
