"""Compressed reduction of one PyTorch tensor over Horovod (the building block of the
optimizer).  Every collective is named after the tensor (``hvd_compress.<name>[.i]``):
Horovod pairs unnamed operations by issue order, which differs between ranks.
"""
import hashlib
import time

import horovod.torch as hvd
import torch

from ..compressors import payload_bytes
from ..ops import torch_ops
from ..spec import resolve
from ..stats import ring_received

PREFIX = "hvd_compress."


def check_op(op):
    if op not in (hvd.Average, hvd.Sum):
        raise ValueError(f"op must be hvd.Average or hvd.Sum, got {op!r}")
    return op


def _to_wire(t):
    # Gloo rejects bfloat16: move its bits as int16 (allgather only; never summed).
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def _from_wire(t, dtype):
    return t.view(torch.bfloat16) if dtype == torch.bfloat16 else t


class Handle:
    """An in-flight compressed reduction; pass it to :func:`synchronize`."""

    def __init__(self, compressor, ctx, handles, dtypes, op, process_set, sent, dense,
                 result=None, compress_s=0.0):
        self.compressor, self.ctx, self.handles, self.dtypes = compressor, ctx, handles, dtypes
        self.op, self.process_set = op, process_set
        self.sent_bytes, self.dense_bytes = sent, dense
        self.result = result
        #: seconds spent compressing, waiting for the collective (after its launch, in
        #: :func:`synchronize`) and decompressing; filled in by :func:`synchronize`
        self.compress_s, self.wait_s, self.decompress_s = compress_s, 0.0, 0.0
        self.bucket = None     #: the Layout of a bucket (bucket_allreduce_async), else None
        #: two-round exchanges (agg=union/leader/hint, PowerSGD): the compressor's state
        #: between the rounds, and round 1's message until round 2 starts (:func:`advance`)
        self.round = self.proposal = None
        #: bytes this rank received, what agg=local would have received (every rank
        #: sending k pairs), and the union size and k of the selection (0 where none)
        self.received_bytes = self.received_local_bytes = 0
        self.union = self.k = 0
        #: ``auto``: (the Auto, candidate index) that chose this exchange's compressor
        self.auto = None


def allreduce_async(tensor, name, compression=None, op=hvd.Average,
                    process_set=hvd.global_process_set, inplace=False):
    """Compress ``tensor`` and start its collective; returns a :class:`Handle`.

    ``compression``: a compressor, a spec string, or None for ``$HVD_COMPRESS``.
    Empty tensors need no collective; integer tensors go uncompressed; sparse
    tensors are made dense first.  ``inplace=True`` lets an uncompressed payload be
    reduced in ``tensor``'s own memory, as Horovod does with gradients (no copy); the
    optimizer passes it for ``p.grad``.
    """
    check_op(op)
    if not name:
        raise ValueError("name is required: Horovod matches collectives across ranks by name")
    compressor = resolve(compression)
    if tensor.is_sparse:
        tensor = tensor.to_dense()
    if tensor.numel() == 0:
        return Handle(compressor, None, [], [], op, process_set, 0, 0, result=tensor.clone())
    compressor = compressor.for_tensor(name, tensor)
    if compressor.collective == "two_round":
        start = time.perf_counter()
        proposal, rnd = compressor.propose(tensor.detach(), name, process_set.rank(),
                                           process_set.size())
        return _start_rounds(compressor, rnd, proposal, PREFIX + name, op, process_set,
                             tensor.numel() * 4, time.perf_counter() - start)
    start = time.perf_counter()
    payload, ctx = compressor.compress(tensor.detach(), name)
    compress_s = time.perf_counter() - start
    if compressor.collective == "allreduce":
        in_place = inplace and payload.is_contiguous() and payload.data_ptr() == \
            tensor.data_ptr() and payload.dtype == tensor.dtype
        reduce = hvd.allreduce_async_ if in_place else hvd.allreduce_async
        handles = [reduce(payload, name=PREFIX + name, op=hvd.Sum, process_set=process_set)]
        dtypes = [payload.dtype]
    else:
        handles = [hvd.allgather_async(_to_wire(t), name=f"{PREFIX}{name}.{i}",
                                       process_set=process_set)
                   for i, t in enumerate(payload)]
        dtypes = [t.dtype for t in payload]
    return Handle(compressor, ctx, handles, dtypes, op, process_set,
                  payload_bytes(payload, torch_ops), tensor.numel() * 4, compress_s=compress_s)


def bucket_allreduce_async(flat, layout, compressor, op=hvd.Average,
                           process_set=hvd.global_process_set):
    """Compress a bucket (``flat``: the tensors of ``layout`` end to end, one dtype, a
    buffer the caller gives away) with one compress call and start *one* collective for
    it, named after the bucket: an allreduce, or one grouped allgather of every payload
    tensor.  :func:`synchronize` returns the flat sum (or average) over the ranks."""
    check_op(op)
    start = time.perf_counter()
    if compressor.collective == "two_round":
        proposal, rnd = compressor.propose_bucket(flat, layout, process_set.rank(),
                                                  process_set.size())
        handle = _start_rounds(compressor, rnd, proposal, PREFIX + layout.key, op, process_set,
                               layout.total * 4, time.perf_counter() - start)
        handle.bucket = layout
        return handle
    payload, ctx = compressor.compress_bucket(flat, layout)
    compress_s = time.perf_counter() - start
    name = PREFIX + layout.key
    if compressor.collective == "allreduce":
        handles = [hvd.allreduce_async(payload, name=name, op=hvd.Sum, process_set=process_set)]
        dtypes = [payload.dtype]
    else:
        handles = [hvd.grouped_allgather_async([_to_wire(t) for t in payload], name=name,
                                               process_set=process_set)]
        dtypes = [t.dtype for t in payload]
    handle = Handle(compressor, ctx, handles, dtypes, op, process_set,
                    payload_bytes(payload, torch_ops), layout.total * 4, compress_s=compress_s)
    handle.bucket = layout
    return handle


def _start_rounds(compressor, rnd, proposal, name, op, process_set, dense, compress_s):
    """Round 1 of a two-round exchange (agg=union/leader/hint, PowerSGD): start the
    first collective of ``compressor.rounds`` (``<name>.<suffix>``); :func:`advance`
    starts round 2."""
    (kind, suffix), _ = compressor.rounds
    if kind == "allgather":
        first = hvd.allgather_async(proposal, name=f"{name}.{suffix}", process_set=process_set)
    else:
        first = hvd.allreduce_async(proposal, name=f"{name}.{suffix}", op=hvd.Sum,
                                    process_set=process_set)
    handle = Handle(compressor, None, [first], [proposal.dtype], op, process_set,
                    proposal.numel() * proposal.element_size(), dense, compress_s=compress_s)
    handle.round, handle.name, handle.proposal = rnd, name, proposal
    return handle


def advance(handle):
    """Two-round exchange: wait for round 1, let the compressor ``agree`` and start round
    2, one allreduce (Sum) of what it returns (``<name>.<suffix>``).  Does nothing for
    other handles, or when round 2 runs already.  The optimizer advances every handle
    before waiting for any, so round-2 allreduces overlap."""
    if handle.round is None or handle.proposal is None:
        return
    start = time.perf_counter()
    gathered = hvd.synchronize(handle.handles[0])
    waited = time.perf_counter()
    values, handle.round = handle.compressor.agree(gathered, handle.round)
    handle.handles = [hvd.allreduce_async(values, name=f"{handle.name}.{handle.compressor.rounds[1][1]}",
                                          op=hvd.Sum, process_set=handle.process_set)]
    (handle.sent_bytes, handle.received_bytes, handle.received_local_bytes, handle.union,
     handle.k) = handle.compressor.traffic(handle.proposal, gathered, values, handle.round,
                                           handle.process_set.size())
    handle.proposal = None
    handle.wait_s += waited - start
    handle.compress_s += time.perf_counter() - waited


def synchronize(handle):
    """Wait for ``handle``; return the decoded sum (or average) over the ranks."""
    if handle.result is not None:
        return handle.result
    advance(handle)
    start = time.perf_counter()
    outputs = [hvd.synchronize(h) for h in handle.handles]
    waited = time.perf_counter()
    bucket = getattr(handle, "bucket", None)
    if handle.round is not None:
        out = handle.compressor.finish(outputs[0], handle.round)
    else:
        if bucket is not None and handle.compressor.collective == "allgather":
            outputs = outputs[0]                       # one grouped allgather: a list
        if handle.compressor.collective == "allreduce":
            payload = outputs[0]
            handle.received_bytes = ring_received(payload.numel() * payload.element_size(),
                                                  handle.process_set.size())
        else:
            payload = tuple(_from_wire(t, d) for t, d in zip(outputs, handle.dtypes))
            handle.received_bytes = sum(t.numel() * t.element_size() for t in outputs) \
                - handle.sent_bytes
        handle.received_local_bytes = handle.received_bytes
        if bucket is not None:
            out = handle.compressor.decompress_bucket(payload, handle.ctx)
        else:
            out = handle.compressor.decompress(payload, handle.ctx)
    if handle.op == hvd.Average:
        size = handle.process_set.size()
        # ``out`` is a new tensor (or, in place, the gradient): divide without a copy
        out = out.div_(size) if out.is_floating_point() else \
            torch.div(out, size, rounding_mode="trunc").to(out.dtype)
    handle.wait_s += waited - start
    handle.decompress_s = time.perf_counter() - waited
    return out


def allreduce(tensor, name, compression=None, op=hvd.Average,
              process_set=hvd.global_process_set):
    """Blocking :func:`allreduce_async` + :func:`synchronize`."""
    return synchronize(allreduce_async(tensor, name, compression, op, process_set))


class AutoComm:
    """What :meth:`hvd_compress.auto.Auto.end_step` needs: the rank, and a named
    broadcast of a few floats from rank 0 of ``process_set``."""

    def __init__(self, process_set=hvd.global_process_set):
        self.process_set, self.rank = process_set, process_set.rank()

    def broadcast(self, values, name):
        t = torch.tensor(values, dtype=torch.float64)
        return hvd.broadcast(t, root_rank=0, name=PREFIX + name,
                             process_set=self.process_set).tolist()

    def allgather(self, values, name):
        t = torch.tensor([values], dtype=torch.float64)
        return hvd.allgather(t, name=PREFIX + name, process_set=self.process_set).tolist()


def _allgather_strings(text, name, process_set):
    # horovod.torch.allgather_object takes no process_set in 0.28.1: two named allgathers.
    data = torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8)
    sizes = hvd.allgather(torch.tensor([data.numel()], dtype=torch.int32), name=name + ".sizes",
                          process_set=process_set)
    gathered = hvd.allgather(data, name=name + ".data", process_set=process_set)
    out, start = [], 0
    for size in sizes.tolist():
        out.append(bytes(gathered[start:start + size].tolist()).decode())
        start += size
    return out


def check_same_config(description, process_set=hvd.global_process_set):
    """Raise ValueError on every rank unless all ranks pass the same ``description``.

    One named, fixed-shape collective, so ranks that disagree get an error, not a hang.
    """
    everyone = [(hashlib.sha256(d.encode()).hexdigest(), d)
                for d in _allgather_strings(description, PREFIX + "config_check", process_set)]
    if len({d for d, _ in everyone}) > 1:
        lines = "\n".join(f"  rank {r}: {desc[:300]}" for r, (_, desc) in enumerate(everyone))
        raise ValueError("hvd_compress: ranks are configured differently (compressor, "
                         f"parameter names or shapes must match on every rank):\n{lines}")
