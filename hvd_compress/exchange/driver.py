"""One training step's exchanges, for any glue: launch, advance, count, and drive ``auto``.

A glue (``hvd_compress.torch`` optimizer, ``hvd_compress.torch.ddp`` hook,
``hvd_compress.tensorflow`` tape and Keras optimizer) owns a :class:`Driver` and calls
only these hooks::

    driver.launch(compressor, layout, tensor=... | flat=...)   # a bucket's gradients are ready
    driver.backward_done()                                      # backward is over
    driver.finish(exchanges)       # wait for them (round-robin, protocol.finish_all)
    driver.end_step()              # close the step: stats, auto's decisions
    driver.abort()                 # a step that will not finish (Elastic reset, error)

What the driver does besides the protocol (:mod:`.protocol`):

- **Payload checks**: a sparse payload's index range (and range-float headers) are
  checked on the device as it is decompressed (the indices clamped into range
  meanwhile), and ``finish`` and ``end_step`` read every check of the step back in one
  host synchronisation (:meth:`Driver.settle`), raising the first failure's ValueError
  before the sums are used: on CUDA, no such decompress waits for the GPU on its own
  (``hier:`` exchanges still check at once: a shard's garbage sum would reach the other
  workers of its host before the settle; so does ``agg=``, whose union of indices waits
  for the GPU anyway).
- **Stats**: each exchange, once done, is counted in ``stats`` (``add``: bytes sent,
  dense, received, ...; ``add_time``: seconds), and ``end_step`` closes the step.
- **auto** (:class:`hvd_compress.strategies.auto.Auto`, alone or inside a Policy):
  when the compressor of a bucket is an auto, the driver tells it the bucket is ready
  (``launched``), asks which candidate sends it this step (``choose``), lets it carry the
  residuals other candidates left (``carry``), and when the exchange is done reports its
  seconds and bytes (``record``).  In auto's calibration and check steps
  (``auto.blocking``) the exchanges still in flight are finished first and the new one
  is completed at once, so each is timed alone.  ``end_step`` closes auto's step (its
  decisions use the transport's float broadcasts: :class:`.protocol.AutoComm`).  No glue
  calls into auto.

- **hier:** (:mod:`.hierarchical`): a compressor marked ``hierarchical`` is sent by a
  :class:`~.hierarchical.HierarchicalExchange` over the ``hierarchy`` the glue gave
  (local and cross transports); before the first one, :func:`~.hierarchical.check_hosts`
  checks the hosts once (ValueError on every rank for uneven hosts or differing specs).
  Without a hierarchy, a ValueError naming ``hier:``.  ``auto`` may have ``hier:``
  candidates: the hosts are checked at its first launch, and its ``carry`` gets the
  worker's place so residuals move between flat and hierarchical candidates.

This module imports no framework and no Horovod.
"""
from ..buckets import layout as make_layout
from .hierarchical import HierarchicalExchange, check_hosts
from .protocol import AutoComm, Exchange, finish_all


def find_auto(compressors):
    """The one adaptive (``auto``) compressor among the compressors the glue planned
    (None if none)."""
    autos = {id(c): c for c in compressors if getattr(c, "adaptive", False)}
    if len(autos) > 1:
        raise ValueError("compression holds several auto compressors; use one Auto "
                         "instance for every tensor that it should choose for")
    return next(iter(autos.values()), None)


class Driver:
    """The exchanges of one glue instance (module docstring).

    ``transport``: the glue's :class:`~.protocol.Transport`; ``stats``: a
    :class:`hvd_compress.stats.Stats` (or the TensorFlow one: ``add``, ``add_time``,
    ``end_step``, ``choices``); ``average``: divide sums by the number of ranks;
    ``auto``: the Auto among the compressors the glue planned (:func:`find_auto`);
    ``hierarchy``: a :class:`~.hierarchical.Hierarchy` (the worker's local and cross
    transports) for ``hier:`` compressors, or None."""

    def __init__(self, transport, stats, average, auto=None, hierarchy=None):
        self.transport, self.stats, self.average, self.auto = transport, stats, average, auto
        self.hierarchy = hierarchy
        self.hosts = None              #: (H, L) once check_hosts has run
        self.in_flight = []            #: exchanges launched this step, not yet finished
        #: the payload checks their decompresses deferred (``ops.deferred_checks``): read
        #: back once per ``finish`` and ``end_step``, not once per bucket
        self.checks = []

    def check_hosts(self, compressor):
        """Check the hosts once (:func:`~.hierarchical.check_hosts`, a blocking global
        collective: every rank calls it at its first ``hier:`` launch, or the glue calls
        it at set-up); returns ``(H, L)``."""
        if self.hierarchy is None:
            raise ValueError(f"compression {compressor.spec!r}: 'hier:' needs the hosts' "
                             "local and cross transports (Driver(hierarchy=...)), which this "
                             "glue did not give (no hosts information); drop 'hier:' for the "
                             "flat exchange")
        if self.hosts is None:       # once per hierarchy and spec (a glue may make a
            # Driver per step: TensorFlow's tape); ranks that differ fail the glue's own
            # configuration check first, so every rank checks, or none does
            checked = self.hierarchy.local.__dict__.setdefault("hvd_compress_hosts", {})
            if compressor.spec not in checked:
                checked[compressor.spec] = check_hosts(self.transport, self.hierarchy,
                                                       compressor.spec)
            self.hosts = checked[compressor.spec]
        return self.hosts

    @property
    def blocking(self):
        """True in auto's calibration and check steps (exchanges are timed alone)."""
        return self.auto is not None and self.auto.blocking

    def launch(self, compressor, layout, tensor=None, flat=None, inplace=False, key=None):
        """Start the exchange of one bucket; returns its :class:`~.protocol.Exchange`.

        ``layout``: the bucket's :class:`~hvd_compress.buckets.Layout`.  ``tensor``: a
        bucket of one tensor, sent on the tensor's own path (``compress``; ``inplace``:
        an uncompressed payload may be reduced in its memory); else ``flat``: the
        bucket's tensors end to end, a buffer the driver may keep (``compress_bucket``).
        ``key``: auto's name for the bucket (default ``layout.key``)."""
        ops = self.transport.ops
        index = None
        if getattr(compressor, "adaptive", False):
            auto, key = compressor, key or layout.key
            hosts = None
            if any(getattr(m, "hierarchical", False) for m in auto.members):
                self.check_hosts(auto)     # at the first launch, whatever auto chooses
                local, cross = self.hierarchy
                hosts = (local.rank, local.size, cross.size)
            auto.launched(key)
            index, compressor = auto.choose(key)
            if self.blocking:          # time this exchange alone
                self.finish(list(self.in_flight))
            if tensor is not None:
                tensor = ops.reshape(auto.carry(layout, ops.flatten(tensor), compressor, ops,
                                                hosts), layout.shapes[0])
            else:
                flat = auto.carry(layout, flat, compressor, ops, hosts)
        if getattr(compressor, "hierarchical", False):
            if index is None:          # auto's candidates were checked with auto's spec
                self.check_hosts(compressor)
            name = layout.names[0] if tensor is not None else layout.key
            c = compressor.for_tensor(name, tensor) if tensor is not None else compressor
            ex = HierarchicalExchange(c, self.hierarchy, name, tensor=tensor, flat=flat,
                                      layout=layout, inplace=inplace, average=self.average)
        elif tensor is not None:
            name = layout.names[0]
            ex = Exchange(compressor.for_tensor(name, tensor), self.transport, name,
                          tensor=tensor, inplace=inplace, average=self.average,
                          checks=self.checks)
        else:
            ex = Exchange(compressor, self.transport, layout.key, flat=flat, layout=layout,
                          average=self.average, checks=self.checks)
        if index is not None:
            ex.auto = (auto, index, key)
        ex.counted = False
        self.in_flight.append(ex)
        if index is not None and auto.blocking:
            ex.run()
        self._count_if_done(ex)
        return ex

    def advance(self, ex):
        """Move ``ex`` one collective further (counted when it is done)."""
        ex.advance()
        self._count_if_done(ex)

    def finish(self, exchanges):
        """Finish ``exchanges`` (round-robin in the given order, the same on every rank:
        :func:`~.protocol.finish_all`); returns their results."""
        try:
            finish_all(exchanges)
        except BaseException:
            self.checks.clear()        # a failed step's checks are not the next step's
            raise
        for e in exchanges:
            self._count_if_done(e)
        done = {id(e) for e in exchanges}
        self.in_flight = [e for e in self.in_flight if id(e) not in done]
        self.settle()
        return [e.result for e in exchanges]

    def settle(self):
        """Read back the payload checks that the finished exchanges' decompresses deferred
        (one host synchronisation on CUDA, none when there is none) and raise the first
        failure's ValueError, before their sums are used."""
        self.transport.ops.settle_checks(self.checks)

    def _count_if_done(self, ex):
        if not ex.done or ex.counted:
            return
        ex.counted = True
        self.stats.add(ex.sent, ex.dense, ex.received, ex.received_local, ex.union, ex.k)
        self.stats.add_time(ex.compress_s, ex.wait_s, ex.decompress_s, ex.compress_late_s)
        add_local = getattr(self.stats, "add_local", None)
        if ex.hierarchical and add_local is not None:     # the fast link's dense bytes
            add_local(ex.local_sent, ex.local_received)
        if ex.auto is not None:
            auto, index, key = ex.auto
            auto.record(key, index, ex.compress_s, ex.wait_s, ex.decompress_s,
                        int(ex.sent) + int(ex.received))

    def backward_done(self):
        """Backward is over (``synchronize()`` entered; the last DDP bucket; the tape's
        gradients computed)."""
        if self.auto is not None:
            self.auto.backward_done()

    def end_step(self):
        """Close the step: every exchange must be finished; stats' step ends; auto
        decides where its schedule says so (collectives through the transport)."""
        if self.in_flight:
            self.finish(list(self.in_flight))
        self.settle()                  # exchanges finished elsewhere (the DDP hook's)
        if self.auto is not None:
            self.auto.end_step(AutoComm(self.transport))
            self.stats.choices = self.auto.choices()
        self.stats.end_step()

    def forget(self, key):
        """Bucket ``key`` will not come back (DDP rebuilt its buckets): auto drops it."""
        if self.auto is not None:
            self.auto.forget(key)

    def describe(self):
        """What ranks must agree on about auto's state (schedule and choices, as restored
        from a checkpoint), for the glue's configuration check; "" without auto."""
        a = self.auto
        if a is None:
            return ""
        return (f"auto step={a.steps} phase={a.phase}:{a.phase_step} "
                f"choice={sorted(a.choice.items())}")

    def abort(self):
        """Forget the step's exchanges (they will not finish: Elastic Horovod shut down
        under them, or the step failed); auto's timeline of the step is void."""
        self.in_flight = []
        self.checks.clear()
        if self.auto is not None:
            self.auto.abort_step()


def single_layout(name, shape):
    """The layout of a bucket of one tensor."""
    return make_layout([name], [shape])
