"""``hier:<spec>``: the marker that sends a compressor through the hierarchical exchange.

:class:`Hierarchical` wraps any compressor (``hier:laplace_topk:density=0.01``, or the
key ``hier=1`` in the inner spec) and delegates to it; it only says *how* the payload
travels: :class:`hvd_compress.exchange.driver.Driver` starts a
:class:`hvd_compress.exchange.hierarchical.HierarchicalExchange` for it (a dense
reduce-scatter inside the host, the inner compressor across hosts on the shard each
local rank owns, a dense allgather inside the host).  It holds no state of its own: the
inner compressor's residuals (keyed by shard piece, see the exchange) are its state, and
``state_dict`` carries the ``hier:`` spec so a checkpoint is not restored into a flat
compressor.

Imports: modules of its own package.
"""
from .base import Compressor

PREFIX = "hier:"


class Hierarchical(Compressor):
    """``inner`` sent hierarchically (module docstring).  ``collective``, ``segmented``,
    ``biased`` are the inner compressor's, so buckets are planned as for it."""

    name = "hier"
    hierarchical = True        #: the Driver starts a HierarchicalExchange for it
    #: The glue's bucket size for it unless ``bucket_mb=`` or ``$HVD_COMPRESS_BUCKET_MB``
    #: says otherwise: smaller buckets let one bucket's dense steps inside the host
    #: overlap another's exchange across hosts.  2 hosts x 2 workers, CNNMLPLarge, hier
    #: step medians (ms) at 4 MB / 25 MB buckets: 792-1077 / 1258-2606 at 100 Mbit/s,
    #: 761-1494 / 956-2862 at 10 Mbit/s (docs/hierarchical.md).
    bucket_mb = 4.0

    def __init__(self, inner):
        if not isinstance(inner, Compressor):
            raise TypeError(f"inner must be a compressor, got {inner!r}")
        if getattr(inner, "hierarchical", False):
            raise ValueError(f"inner={inner.spec!r} is already hierarchical ('hier:' once)")
        if getattr(inner, "adaptive", False) or len(inner.compressors()) != 1 or \
                inner.compressors()[0] is not inner:
            raise ValueError(f"inner={inner.spec!r}: 'hier:' wraps one compressor (not auto or "
                             "a Policy; give a Policy hier: members instead)")
        super().__init__(ef=False)
        self.inner = inner
        self.collective, self.rounds = inner.collective, inner.rounds
        self.segmented, self.biased = inner.segmented, inner.biased
        self.ef, self.uses_step = inner.ef, inner.uses_step
        self._for = {}

    @property
    def spec(self):
        return PREFIX + self.inner.spec

    @property
    def ef_decay(self):
        return self.inner.ef_decay

    @property
    def ef_decay_given(self):
        return self.inner.ef_decay_given

    def holds(self):
        return [self.inner]

    def decay_residuals(self, beta):
        self.inner.decay_residuals(beta)
        return self

    def send_whole_below(self, min_size):
        self.inner.send_whole_below(min_size)      # (for_tensor and spec are the inner's)
        return self

    def for_tensor(self, name, tensor):
        """The inner compressor's choice, still hierarchical (integer tensors: ``none``,
        summed densely through the same hierarchy)."""
        chosen = self.inner.for_tensor(name, tensor)
        if chosen is self.inner:
            return self
        key = id(chosen)
        if key not in self._for:
            self._for[key] = Hierarchical(chosen)
        return self._for[key]

    # -- never sent flat: the Driver routes it (protocol.Exchange refuses it) ------------
    def _flat(self, *_, **__):
        raise ValueError(f"compression {self.spec!r}: 'hier:' compressors are exchanged by "
                         "hvd_compress.exchange.Driver with the hosts' local and cross "
                         "transports, not compressed flat")

    compress = compress_bucket = propose = propose_bucket = _flat

    # -- state: the inner compressor's --------------------------------------------------
    def residual(self, name):
        return self.inner.residual(name)

    def residual_names(self, lay):
        return self.inner.residual_names(lay)

    def state_dict(self):
        return dict(self._state_header(), state=self.inner.state_dict()["state"])

    def load_state_dict(self, state_dict, framework="torch", strict=True):
        self._check_state_header(state_dict)
        self.inner.load_state_dict({"spec": self.inner.spec, "state": state_dict["state"]},
                                   framework=framework, strict=strict)

    @classmethod
    def params(cls):
        return {}
