"""PyTorch primitives, checks family: a payload's checks (its indices' range, the
range-float headers' flag), made at once or deferred.

At once, a check reads its device values back to the host (one synchronisation on CUDA),
or shares a readback the decode makes anyway (``IndexCheck.read``).  Inside
:func:`deferred_checks` (the exchange driver's decompresses) it joins a list instead,
and :func:`settle_checks` reads the whole list back in one synchronisation per device,
raising the first failure's ValueError: a step of many buckets then waits for the GPU
once in its decompresses, not once per bucket.

May import: torch.  Not the other families of this package (``codecs`` imports this one).
"""
import contextlib as _contextlib
import threading as _threading

import torch as _torch


class IndexCheck:
    """The range check of a payload's indices, ``[0, n)``: its ``(min, max)`` computed on
    the device at once (``minmax``, two 0-d tensors; None when there is no index), read
    back with another host readback where the decode makes one anyway (``read``), else on
    its own, one host synchronisation; ``finish`` raises the ValueError, after the
    decoder's own checks, and returns the indices to scatter.

    Inside :func:`deferred_checks` a check that no other readback read is not read on its
    own: ``finish`` appends it to the sink, whose :func:`settle_checks` reads every check
    of a step back in one synchronisation, and returns the indices clamped into
    ``[0, n)`` meanwhile (one launch: a malformed payload's scatter stays in bounds,
    and its sum is never used, as the settle raises before the step goes on)."""

    def __init__(self, idx, n, what):
        self.idx, self.n, self.what, self.bounds = idx, n, what, None
        flat = idx.reshape(-1)
        self.count = flat.numel()          #: the number of indices (a host int)
        self.minmax = tuple(_torch.aminmax(flat)) if self.count else None

    @property
    def pending(self):
        """The device values :func:`settle_checks` reads back for it."""
        return self.minmax

    def read(self, lo, hi):
        """The host's ``(min, max)``, read back with something else."""
        self.bounds = (lo, hi)

    def finish(self):
        """Raise the ValueError unless every index is in ``[0, n)``; the indices to
        scatter (clamped, when deferred)."""
        if self.minmax is None:
            return self.idx
        if self.bounds is None and _DEFERRED.sink is not None and self.n > 0:
            idx, self.idx = self.idx, None     # (the sink keeps no payload alive)
            _DEFERRED.sink.append(self)
            return idx.clamp(0, min(self.n - 1, _torch.iinfo(idx.dtype).max))
        self.raise_unless(*(self.bounds if self.bounds is not None
                            else _torch.stack(self.minmax).tolist()))
        return self.idx

    def raise_unless(self, lo, hi):
        if lo < 0 or hi >= self.n:
            raise ValueError(
                f"{self.what}: payload index out of range [0, {self.n}) (min {lo}, max {hi}); "
                "the payload is malformed or was produced for another tensor")


def index_check(idx, n, what):
    return IndexCheck(idx, n, what)


class _Deferred(_threading.local):
    sink = None                        #: the list checks go to (:func:`deferred_checks`)


_DEFERRED = _Deferred()


def deferral_sink():
    """The list checks go to now (inside :func:`deferred_checks`), or None."""
    return _DEFERRED.sink


@_contextlib.contextmanager
def deferred_checks(sink):
    """Index checks finished inside go to the list ``sink`` (None: checked at once), for
    :func:`settle_checks`: the exchange driver's decompresses run inside, so that a
    sparse decompress needs no host synchronisation of its own on CUDA."""
    before, _DEFERRED.sink = _DEFERRED.sink, sink
    try:
        yield
    finally:
        _DEFERRED.sink = before


class _FlagCheck:
    """A device flag (0-d integer tensor, nonzero: failed) and its ValueError's message."""

    def __init__(self, flag, message):
        self.pending, self.message = (flag,), message

    def raise_unless(self, flag):
        if flag:
            raise ValueError(self.message)


def _deferring():
    """Inside :func:`deferred_checks` with a sink?"""
    return _DEFERRED.sink is not None


def _defer_flag(flag, message):
    """Inside :func:`deferred_checks`: the flag joins the sink (True); else False, and the
    caller reads it itself."""
    if _DEFERRED.sink is None:
        return False
    _DEFERRED.sink.append(_FlagCheck(flag, message))
    return True


def settle_checks(sink):
    """Read every check of ``sink`` back in one host synchronisation per device (none
    for an empty sink), empty it, and raise the first failed check's ValueError."""
    if not sink:
        return
    pending = list(sink)
    sink.clear()
    devices = {}
    for c in pending:
        devices.setdefault(c.pending[0].device, []).append(c)
    got = {}
    for checks in devices.values():
        values = iter(_torch.stack([v.reshape(()) for c in checks for v in c.pending]).tolist())
        got.update({id(c): [next(values) for _ in c.pending] for c in checks})
    for c in pending:
        c.raise_unless(*got[id(c)])


def check_indices(idx, n, what):
    """The check at once (a caller that scatters no clamped indices: never deferred)."""
    c = IndexCheck(idx, n, what)
    if c.minmax is not None:
        c.raise_unless(*_torch.stack(c.minmax).tolist())
