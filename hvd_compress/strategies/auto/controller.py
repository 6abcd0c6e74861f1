"""``auto``'s controller: the :class:`Auto` compressor, which the exchange driver
(:mod:`hvd_compress.exchange.driver`) asks for each bucket's candidate and tells what
each exchange cost; its phases (calibrate, trial, run, check), measurements, decisions,
residuals across switches and checkpoint state.

**Calibration** (the first ``calibrate`` steps, default 20).  Every bucket is sent with
candidate 0 for ``calibrate // n`` consecutive steps, then candidate 1, and so on, and the
glue completes each bucket's exchange as soon as it is launched (inside backward), so
that each part is timed alone on the real gradients, device and link.  Consecutive steps,
not candidates in turn: a link's token bucket (``tc tbf``, a switch's buffers) refills
while the others send few bytes, and the first dense steps after it get through at burst
speed; the steps after show the sustained rate.  What is timed:

- ``ready_b``: when bucket ``b``'s last gradient is ready, relative to the end of
  backward, counting compute only (our own time inside backward is subtracted);
- ``C_bc``, ``D_bc``: compress and decompress seconds of candidate ``c`` on bucket ``b``;
- ``T_bc``: its collective's seconds, and the bytes it moved (sent + received); the
  link is fitted as ``T = alpha + bytes / beta`` to the dense (``none``) collectives of
  the buckets' different sizes; where those sizes span at least 4x (else the line is
  not determined and measurements are used as they are), the dense collectives are
  predicted by that line (it
  smooths their timing noise), and no other is predicted faster than it (so noise on a
  tiny bucket cannot pay for a codec);
- ``compute``: the rest of the step (forward, backward, optimizer, data).

The first sample of each candidate is dropped where there are several (it warms caches,
kernels, and the link's burst), and the medians of the rest are taken.

**Trial**: the model does not see everything (on a CPU, collectives running during
backward also take cores from it; a token bucket's burst flatters a dense collective
timed alone), so the combinations it predicts within ``1 + window`` (1.5x) of its choice
(its choice, the current one, each candidate alone; the first candidate everywhere, the
reference, within ``1 + reference`` (3x); at most ``1 + tries``) are each run for real,
overlapped as in training, for ``trial`` steps (default 5; 0: trust the model); the
model's choice is kept unless another was measured ``trial_margin`` (5%) faster (median
step of the slowest rank, the first step of each left out), and a choice that compresses
must also be measured ``trial_margin`` faster than the first candidate everywhere where
that was tried (a tie keeps ``none``).  The table shows predicted and measured step
times.

**Watch**: every 10 steps the measured step (median, slowest rank) is compared with the
one the decision expected.  Slower by more than ``drift``: that figure becomes the
choice's (a trial can be flattered, e.g. by a token bucket's burst) and the options are
tried again; faster by more than ``drift``: everything is calibrated again.

**Re-decision**: every ``every`` steps (0: never) one *check step* times the chosen
candidates' collectives alone again (minimum over ranks), and rank 0 compares them with
the prediction: their ratio ``m`` scales the link (``s <- s m``) and the choice is made
again (with a trial of the current choice against the new ones); when the link
moved by more than ``drift`` (``m > 1 + drift`` or ``m < 1 / (1 + drift)``: a congested
link, a changed placement) everything is calibrated again.

**Switching keeps nothing behind**: all candidates share one error-feedback store, so a
tensor's residual goes on with the next candidate; a candidate without error feedback
(none, fp16) adds the residual to the next gradient it sends, and between flat and
``hier:`` candidates the residuals the next one keys differently travel the same way
(:mod:`.residuals`).  ``state_dict()`` holds
the residuals, the decision and the calibration: a restored run resumes with the same
choices.

Imports: the standard library, :mod:`hvd_compress.compressors.base`, :mod:`.residuals`,
``spec``, ``buckets``, ``log`` and the step model (:mod:`.model`); no framework.
"""
import math
import time

from ...compressors.base import Compressor, register
from ...compressors.dct import stored_residual
from ...log import info_rank0
from . import report, residuals
from .candidates import DEFAULT_CANDIDATES, label, parse  # noqa: F401 (re-exported)
from .model import BucketCost, bucket_costs, combine, decide, first_measured, median, predict, \
    warm


def _label(option):
    """A combination (bucket key -> candidate index) as a plain string key."""
    return ";".join(f"{k}={v}" for k, v in sorted(option.items()))


@register
class Auto(Compressor):
    """Per-bucket choice among ``candidates`` from measured step parts (module docstring).

    ``candidates``: compressors or specs the user accepts (a spec string separates them
    with ``|`` and a candidate's parameters with ``+``:
    ``auto:candidates=none|topk:density=0.01+ef=1``); default none, fp16,
    laplace_topk:density=0.01 and laplace_topk:density=0.01,values=rangefloat8.  Each must
    take buckets (``segmented``) and need one collective (no two-round exchange).
    ``calibrate``: calibration steps (at least one per candidate); ``every``: steps
    between check steps (0: decide once); ``drift``: the fraction by which the link may
    move before everything is calibrated again; ``bucket_mb``: the bucket size the
    Horovod glue uses with auto unless ``bucket_mb=`` or ``$HVD_COMPRESS_BUCKET_MB`` is
    given (default 1 MB, DDP's first bucket: small enough that most models have several
    buckets to choose for, and that early buckets travel while backward goes on; the
    DDP hook gets DDP's own buckets, ``bucket_cap_mb``); ``verbose``: rank 0 prints each
    decision.
    """

    name = "auto"
    segmented = True
    margin = 0.01               #: a choice must beat the first candidate's step by this
                                #: fraction
    trial_margin = 0.05         #: a tried combination must beat the model's choice (and a
                                #: compressing one the first candidate) by this
    window = 0.5                #: combinations predicted within 1.5x of the best are tried
    reference = 2.0             #: the first candidate everywhere within 3x of it
    tries = 3                   #: and at most this many besides the model's choice
    WATCH = 10                  #: steps between comparisons of the measured step with the
                                #: expected one
    adaptive = True             #: the glue asks :meth:`choose` per bucket and step

    def __init__(self, candidates=None, calibrate=20, every=100, drift=0.5, bucket_mb=1.0,
                 trial=5, verbose=True):
        super().__init__(ef=False)
        members, names = parse(candidates)
        specs = [m.spec for m in members]
        for key, value, low in (("calibrate", calibrate, len(members)), ("every", every, 0),
                                ("trial", trial, 0)):
            if int(value) != value or int(value) < low:
                raise ValueError(f"auto: {key} must be an integer >= {low}, got {value!r}")
        if not drift > 0:
            raise ValueError(f"auto: drift must be > 0, got {drift!r}")
        self.members, self.names = members, names   # names: as the user wrote them
        self.specs = specs                           # canonical, computed once
        self.candidates = label(specs)
        self.calibrate, self.every, self.trial = int(calibrate), int(every), int(trial)
        self.drift, self.verbose = float(drift), bool(verbose)
        from ...buckets import bucket_mb as check_mb
        self.bucket_mb = check_mb(bucket_mb)
        self.reset()

    # -- schedule ---------------------------------------------------------------------
    def reset(self):
        """Forget every measurement and decision: calibrate from the next step."""
        self.steps = 0                 #: steps completed
        self.phase = "calibrate"       #: "calibrate", "run" or "check"
        self.phase_step = 0            #: steps done in the current phase
        self.choice = {}               #: bucket key -> candidate index (after a decision)
        self.scale = 1.0               #: link time scale since the last calibration
        self.samples = {}              #: calibration: key -> {"ready": [], "c<i>": [[C, T, D, bytes]]}
        self.compute = []              #: calibration: compute seconds per step
        self.costs = []                #: the BucketCosts of the last decision (all ranks')
        self.compute_s = 0.0           #: and its compute seconds
        self.link = (0.0, math.inf)    #: (alpha s, beta B/s) fitted to the dense collectives
        self.decisions = []            #: one summary per decision (what was printed)
        self.trials = []               #: combinations tried for real (key -> index each)
        self.trial_index = 0
        self.trial_times = []          #: measured step seconds per trial
        self.measured = []             #: their medians (slowest rank)
        self.expected = 0.0            #: the step the chosen combination should take
        self.recent = []               #: step seconds since then (watched, WATCH at a time)
        self.penalty = {}              #: combination -> its real step, where slower than tried
        self._why = ""
        self._step = None

    @property
    def blocking(self):
        """True in calibration and check steps: the glue must complete each bucket's
        exchange right after launching it (so each part is timed alone)."""
        return self.phase in ("calibrate", "check")

    def choose(self, key):
        """``(index, compressor)`` that sends bucket ``key`` this step."""
        if self.phase == "calibrate":      # consecutive steps per candidate (a block)
            i = min(self.phase_step // (self.calibrate // len(self.members)),
                    len(self.members) - 1)
        elif self.phase == "trial":
            i = self.trials[self.trial_index].get(key, 0)
        else:
            i = self.choice.get(key, 0)
        return i, self.members[i]

    def for_bucket(self, key):
        return self.choose(key)[1]

    # -- what the glue reports ----------------------------------------------------------
    def _timeline(self):
        if self._step is None:
            self._step = dict(ours=0.0, ready={}, parts={}, backward_end=None)
        return self._step

    def abort_step(self):
        """The current step will not finish (an Elastic reset, a failed step): its
        timeline is void."""
        self._step = None

    def launched(self, key):
        """The glue is about to compress bucket ``key`` (its last gradient is ready)."""
        tl = self._timeline()
        tl["ready"][key] = time.perf_counter() - tl["ours"]

    def record(self, key, index, compress_s, wait_s, decompress_s, nbytes):
        """Bucket ``key`` was sent with candidate ``index``: its seconds and bytes."""
        tl = self._timeline()
        tl["ours"] += compress_s + wait_s + decompress_s
        tl["parts"][key] = (index, compress_s, wait_s, decompress_s, nbytes)

    def backward_done(self):
        """``synchronize()`` was entered: backward is over."""
        tl = self._timeline()
        tl["backward_end"] = time.perf_counter() - tl["ours"]

    def end_step(self, comm):
        """Close the step; decides (collectives through ``comm``) at phase ends.

        ``comm.rank``; ``comm.broadcast(list of floats, name) -> list``: rank 0's values,
        and ``comm.allgather(list of floats, name) -> list of lists``, one per rank (each
        one named collective)."""
        tl, self._step = self._timeline(), None
        now = time.perf_counter()
        end = tl["backward_end"] if tl["backward_end"] is not None else now - tl["ours"]
        last = getattr(self, "_last_end", None)
        self._last_end = now
        if self.phase == "calibrate":
            if last is not None:
                self.compute.append(now - last - tl["ours"])
            for key, (i, c, t, d, nbytes) in tl["parts"].items():
                s = self.samples.setdefault(key, {"ready": []})
                if key in tl["ready"]:
                    s["ready"].append(tl["ready"][key] - end)
                s.setdefault(f"c{i}", []).append([c, t, d, nbytes])
        elif self.phase == "trial" and last is not None:
            self.trial_times[self.trial_index].append(now - last)
        elif self.phase == "run" and last is not None:
            self.recent.append(now - last)
        self.steps += 1
        self.phase_step += 1
        if self.phase == "calibrate" and self.phase_step >= self.calibrate:
            self._decide(comm, "calibration")
        elif self.phase == "trial" and self.phase_step >= self.trial:
            self.trial_index, self.phase_step = self.trial_index + 1, 0
            if self.trial_index == len(self.trials):
                self._finish_trials(comm)
        elif self.phase == "check":
            self._check(comm, tl["parts"])
        elif self.phase == "run" and self.every and self.phase_step >= self.every:
            self.phase, self.phase_step = "check", 0
        elif self.phase == "run" and self.phase_step % self.WATCH == 0 \
                and len(self.recent) >= self.WATCH:
            self._watch(comm)

    # -- decisions ----------------------------------------------------------------------
    def forget(self, key):
        """Drop bucket ``key`` (a bucket that no longer exists: DDP rebuilt its buckets)."""
        self.samples.pop(key, None)
        self.choice.pop(key, None)

    def _combine(self, comm, costs, compute):
        """Every rank's measurements (one named allgather): a collective's time is the
        minimum over ranks (timed alone, it also waits for the last rank to arrive; the
        last one waits only for the transfer), compress, decompress and compute the
        maximum (the slowest rank sets the pace), ready times the median."""
        costs = sorted(costs, key=lambda b: b.key)
        row = [compute]
        for b in costs:
            row += [b.ready, *b.compress, *b.comm, *b.decompress, *b.nbytes]
        rows = comm.allgather(row, "auto.costs")
        if any(len(r) != len(row) for r in rows):
            raise RuntimeError("hvd_compress auto: ranks measured different buckets "
                               f"({[len(r) for r in rows]} numbers)")
        dense = [i for i, m in enumerate(self.members) if m.name == "none"]
        out, compute, self.link = combine(rows, costs, len(self.members), dense)
        return out, compute

    def _decide(self, comm, why):
        compute = median(self.compute) if self.compute else 0.0
        self.costs, self.compute_s = self._combine(
            comm, bucket_costs(self.samples, len(self.members)), compute)
        costs, compute = self.costs, self.compute_s
        keys = sorted(b.key for b in costs)
        baseline = first_measured(costs, len(self.members))
        first = predict(costs, baseline, compute, self.scale)
        n = len(self.members)
        mine = decide(costs, n, compute, self.scale)
        if predict(costs, mine, compute, self.scale) > first * (1 - self.margin):
            mine = baseline                # compressing must gain more than the margin
        # what to try for real: the model's choice, then the current one (a re-decision),
        # the first candidate and each candidate alone, where predicted close enough
        current = [self.choice[b.key] for b in costs] if self.choice.keys() >= set(keys) else None
        # (the first candidate everywhere within a wider bound: it is the reference that a
        # compressing choice must be measured faster than, and one noisy collective in
        # calibration can put it past 1.5x on a fast link)
        options, ref = [], predict(costs, mine, compute, self.scale)
        for o in [mine, current, baseline] + [[c] * len(costs) for c in range(n)]:
            bound = 1 + (self.reference if o is baseline else self.window)
            if o is not None and list(o) not in options and (
                    not options or predict(costs, o, compute, self.scale) <= bound * ref):
                options.append(list(o))
        options = options[:1 + self.tries]
        width = len(keys) * (n + 2)
        if not keys:                   # nothing was sent (every tensor empty): same on all ranks
            self.trials, self.choice, self.phase, self.phase_step = [], {}, "run", 0
            return
        order = {b.key: i for i, b in enumerate(costs)}
        flat = [float(o[order[k]]) for o in options for k in keys]
        got = comm.broadcast(flat + [-1.0] * (width - len(flat)), "auto.decision")
        self.trials = [{k: int(round(got[t * len(keys) + j])) for j, k in enumerate(keys)}
                       for t in range(width // max(1, len(keys)))
                       if len(keys) and got[t * len(keys)] >= 0]
        self.trial_times = [[] for _ in self.trials]
        self.trial_index, self.phase_step, self._why = 0, 0, why
        if len(self.trials) > 1 and self.trial > 0:
            self.phase = "trial"       # measure them: the model does not see everything
        else:
            self._finish_trials(comm)

    def _finish_trials(self, comm):
        """Choose among the tried combinations by their measured steps (the slowest rank's
        median, first step of each left out): the model's choice (the first) stays unless
        another was measured ``trial_margin`` (5%) faster: trials catch the model's large
        errors, and must not follow a few steps' noise.  Where the first candidate
        everywhere (``none``) was tried, whatever is chosen must also be measured
        ``trial_margin`` faster than it, else it is kept: a tie does not pay for a codec."""
        measured = []
        if len(self.trials) > 1 and self.trial > 0:
            mine = [median(warm(t)) for t in self.trial_times]
            measured = [max(col) for col in zip(*comm.allgather(mine, "auto.trials"))]
        # a choice whose real steps were slower than its trial keeps the slower figure
        measured = [max(v, self.penalty.get(_label(o), 0.0)) for v, o in zip(measured, self.trials)]
        best = 0                       # the model's choice, unless measured clearly slower
        if measured:
            fastest = min(range(len(measured)), key=lambda t: (measured[t], t))
            if measured[fastest] < measured[0] * (1 - self.trial_margin):
                best = fastest
            # and a tie goes to the first candidate: compressing must be measured faster
            first = dict(zip((b.key for b in self.costs),
                             first_measured(self.costs, len(self.members))))
            base = next((t for t, o in enumerate(self.trials) if o == first), None)
            if base is not None and measured[best] >= measured[base] * (1 - self.trial_margin):
                best = base
        got = comm.broadcast([float(best)], "auto.choice")
        self.choice = dict(self.trials[int(round(got[0]))]) if self.trials else {}
        self.measured = measured
        self.expected = measured[int(round(got[0]))] if measured else \
            predict(self.costs, [self.choice.get(b.key, 0) for b in self.costs],
                    self.compute_s, self.scale)
        self.recent = []
        self.phase, self.phase_step = "run", 0
        summary = self.summary(self.compute_s, self._why)
        self.decisions.append({k: v for k, v in summary.items() if k != "table"})
        if self.verbose:
            info_rank0(comm.rank, summary["table"])

    def _recalibrate(self, comm, why):
        """Forget the measurements and decision (keeping the step count and the decisions'
        history): calibrate from the next step."""
        if self.verbose:
            info_rank0(comm.rank, f"hvd_compress auto: {why}: calibrating again")
        keep = self.steps, list(self.decisions)
        self.reset()
        self.steps, self.decisions = keep

    def _watch(self, comm):
        """Every WATCH steps: the measured step (median of the last WATCH, slowest rank;
        one allgather) against what the decision expected.  Slower by more than
        ``drift``: that measurement becomes the choice's (a short trial can be flattered,
        e.g. by a token bucket's burst) and the options are tried again; faster by more
        than ``drift`` (the link got faster): calibrate again."""
        mine = median(self.recent[-self.WATCH:])
        m = max(v for (v,) in comm.allgather([mine], "auto.watch"))
        self.recent = []
        if not self.expected > 0:
            return
        if m > (1 + self.drift) * self.expected and len(self.trials) > 1 and self.trial > 0:
            self.penalty[_label(self.choice)] = m
            self.trial_times = [[] for _ in self.trials]
            self.trial_index, self.phase, self.phase_step = 0, "trial", 0
            self._why = f"steps took {m / self.expected:.2f}x the expected time"
        elif not (1 / (1 + self.drift) <= m / self.expected <= 1 + self.drift):
            self._recalibrate(comm, f"steps took {m / self.expected:.2f}x the expected time")

    def _check(self, comm, parts):
        """A check step: scale the link by measured / predicted collective time."""
        by_key = {b.key: b for b in self.costs}
        keys = sorted(key for key in parts if key in by_key)
        every = comm.allgather([parts[k][2] for k in keys], "auto.check")
        measured = sum(min(col) for col in zip(*every))     # min over ranks, as _combine
        predicted = sum(self.scale * by_key[k].comm[parts[k][0]] for k in keys)
        m = measured / predicted if predicted > 0 else 1.0
        recalibrate = not (1 / (1 + self.drift) <= m <= 1 + self.drift)
        flag, m = comm.broadcast([float(recalibrate), float(m)], "auto.verdict")
        if flag:
            self._recalibrate(comm, f"collectives took {m:.2f}x the predicted time")
            return
        self.scale *= m
        self._decide(comm, f"check (link x{m:.2f})")

    def summary(self, compute=None, why=""):
        """The current decision: predicted step seconds of auto's choice and of each
        candidate alone, the link fit, and a printable ``table`` (:func:`.report.summary`)."""
        return report.summary(self, self.compute_s if compute is None else compute, why)

    def choices(self):
        """Bucket key -> spec of the candidate sending it now (``opt.stats``)."""
        return {key: self.specs[self.choose(key)[0]] for key in self.samples}

    # -- residuals across switches ------------------------------------------------------
    def _state(self, ops):
        store = super()._state(ops)
        for m in self.members:              # one store: a residual goes on with the next
            for c in (m, getattr(m, "inner", m)):      # hier: its inner compressor's
                c._store, c._ops = store, ops
        return store

    def carry(self, layout, flat, compressor, ops, hosts=None):
        """Before ``compressor`` sends ``flat`` (the tensors of ``layout`` end to end):
        the residuals it will not use itself travel with this gradient
        (:func:`.residuals.carry`; ``hosts``: ``(local rank, L, H)`` where there are
        ``hier:`` candidates).  The glue calls it before every compress (it also makes
        the candidates share one store)."""
        return residuals.carry(self._state(ops), layout, flat, compressor, ops, hosts)

    def holds(self):
        return self.members

    def residual(self, name):
        """Flat residual of ``name`` in the shared store, whichever candidate keeps it."""
        return None if self._store is None else stored_residual(self._store, self._ops, name)

    # -- not a codec itself -------------------------------------------------------------
    def compress(self, tensor, name=None):
        raise TypeError("auto chooses a compressor per bucket and step inside hvd_compress's "
                        "glue: use hvd_compress.torch.DistributedOptimizer, hvd_compress."
                        "tensorflow.DistributedGradientTape, hvd_compress.keras or "
                        "hvd_compress.ddp")

    compress_bucket = decompress = compress

    # -- checkpoints --------------------------------------------------------------------
    _FIELDS = ("steps", "phase", "phase_step", "choice", "scale", "samples", "compute",
               "decisions", "costs", "compute_s", "link", "trials", "trial_index",
               "trial_times", "measured", "_why", "expected", "recent", "penalty")

    def state_dict(self):
        import copy
        out = super().state_dict()
        fields = {k: getattr(self, k) for k in self._FIELDS}
        fields["costs"] = [tuple(b) for b in self.costs]     # plain types: torch.load's
        out["auto"] = copy.deepcopy(fields)                  # weights_only accepts them
        return out

    def load_state_dict(self, state_dict, framework="torch", strict=True):
        import copy
        super().load_state_dict(state_dict, framework, strict=False)  # none drops residuals
        self.reset()
        for k, v in copy.deepcopy(state_dict.get("auto", {})).items():
            setattr(self, k, v)
        self.costs = [BucketCost(*b) for b in self.costs]
        self._last_end = None
