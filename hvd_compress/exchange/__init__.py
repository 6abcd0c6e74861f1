"""The exchange protocol and the step driver, written once for every glue.

:mod:`.protocol`: how one compressor's payload crosses the network (one tensor or a
bucket; allreduce, allgather or two rounds), through a :class:`~.protocol.Transport`
that each glue implements.  :mod:`.driver`: a step's exchanges (launch, advance in the
same order on every rank, stats, ``auto``).  :mod:`.hierarchical`: the hierarchical
exchange (``hier:``: dense inside a host, compressed across hosts).  Imports no
framework and no Horovod.
"""
from .hierarchical import HierarchicalExchange, Hierarchy, check_hosts  # noqa: F401
from .driver import Driver, find_auto, single_layout  # noqa: F401
from .protocol import (PREFIX, AutoComm, Exchange, Gathered, ProcessSetTransport,  # noqa: F401
                       Transport, Wait, finish_all, standard_traffic)
