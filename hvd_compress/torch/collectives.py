"""Horovod's PyTorch collectives as an exchange transport, and compressed allreduce of one
tensor (the public ``hvd_compress.torch.allreduce``/``allreduce_async``/``synchronize``).

What crosses the network and in which order is :mod:`hvd_compress.exchange`; this
module only says how to start and wait for one Horovod collective.  Every collective is
named (``hvd_compress.<name>[.suffix]``): Horovod pairs unnamed operations by issue
order, which differs between ranks.  May import Horovod, torch and the framework-free
parts of hvd_compress.
"""
import hashlib

import horovod.torch as hvd
import torch

from ..exchange import PREFIX, Exchange, ProcessSetTransport, Wait, standard_traffic
from ..ops import torch_ops
from ..spec import resolve


def check_op(op):
    """``op`` (``hvd.Average`` or ``hvd.Sum``), else ValueError naming it."""
    from .horovod_surface import check_op as check
    return check(op, hvd)


def _to_wire(t):
    # Gloo rejects bfloat16: move its bits as int16 (allgather only; never summed).
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def _from_wire(t, dtype):
    return t.view(torch.bfloat16) if dtype == torch.bfloat16 else t


class HorovodTorch(ProcessSetTransport):
    """Horovod's asynchronous torch collectives on ``process_set``."""

    ops = torch_ops

    def __init__(self, process_set=hvd.global_process_set):
        super().__init__(process_set)

    def allreduce(self, tensor, name, inplace_of=None):
        in_place = inplace_of is not None and tensor.is_contiguous() and \
            tensor.data_ptr() == inplace_of.data_ptr() and tensor.dtype == inplace_of.dtype
        reduce = hvd.allreduce_async_ if in_place else hvd.allreduce_async
        handle = reduce(tensor, name=name, op=hvd.Sum, process_set=self.process_set)
        out = yield Wait(hvd.synchronize, handle)
        return (out,) + standard_traffic(torch_ops, "allreduce", tensor, out, self.size)

    def allgather(self, tensors, name):
        dtypes = [t.dtype for t in tensors]
        if len(tensors) == 1:
            handle = hvd.allgather_async(_to_wire(tensors[0]), name=name,
                                         process_set=self.process_set)
            gathered = [(yield Wait(hvd.synchronize, handle))]
        else:                                       # one grouped op for every tensor
            handle = hvd.grouped_allgather_async([_to_wire(t) for t in tensors], name=name,
                                                 process_set=self.process_set)
            gathered = yield Wait(hvd.synchronize, handle)
        out = tuple(_from_wire(g, d) for g, d in zip(gathered, dtypes))
        return (out,) + standard_traffic(torch_ops, "allgather", tensors, out, self.size)

    def divide(self, out, size):
        # ``out`` is a new tensor (or, in place, the gradient): divide without a copy
        return out.div_(size) if out.is_floating_point() else \
            torch.div(out, size, rounding_mode="trunc").to(out.dtype)

    def broadcast_floats(self, values, name):
        t = torch.tensor(values, dtype=torch.float64)
        return hvd.broadcast(t, root_rank=0, name=PREFIX + name,
                             process_set=self.process_set).tolist()

    def allgather_floats(self, values, name):
        t = torch.tensor([values], dtype=torch.float64)
        return hvd.allgather(t, name=PREFIX + name, process_set=self.process_set).tolist()


def host_array(tensor):
    """A numpy array sharing a CPU tensor's memory, for the shared-memory collectives
    inside a host (:mod:`hvd_compress.exchange.shared_host`); None for a tensor on a
    device, or of a dtype numpy lacks (bfloat16): those go through Horovod."""
    if tensor.device.type != "cpu" or tensor.dtype == torch.bfloat16 or tensor.is_sparse:
        return None
    return tensor.detach().numpy()


#: ``(to_numpy, from_numpy)`` for :func:`hvd_compress.hosts.hierarchy`
HOST_ARRAYS = (host_array, torch.from_numpy)


class _Done:
    """What :func:`allreduce_async` returns for an empty tensor: nothing to exchange."""

    done = True
    sent = received = received_local = union = k = dense = 0
    compress_s = wait_s = decompress_s = compress_late_s = 0.0

    def __init__(self, result):
        self.result = result

    def run(self):
        return self.result


def allreduce_async(tensor, name, compression=None, op=hvd.Average,
                    process_set=hvd.global_process_set, inplace=False):
    """Compress ``tensor`` and start its collective; returns a handle for
    :func:`synchronize` (an :class:`hvd_compress.exchange.Exchange`).

    ``compression``: a compressor, a spec string, or None for ``$HVD_COMPRESS``.
    Empty tensors need no collective; integer tensors go uncompressed; sparse
    tensors are made dense first.  ``inplace=True`` lets an uncompressed payload be
    reduced in ``tensor``'s own memory, as Horovod does with gradients (no copy).
    """
    check_op(op)
    if not name:
        raise ValueError("name is required: Horovod matches collectives across ranks by name")
    compressor = resolve(compression)
    if tensor.is_sparse:
        tensor = tensor.to_dense()
    if tensor.numel() == 0:
        return _Done(tensor.clone())
    return Exchange(compressor.for_tensor(name, tensor), HorovodTorch(process_set), name,
                    tensor=tensor.detach(), inplace=inplace, average=op == hvd.Average)


def synchronize(handle):
    """Wait for ``handle``; return the decoded sum (or average) over the ranks."""
    return handle.run()


def allreduce(tensor, name, compression=None, op=hvd.Average,
              process_set=hvd.global_process_set):
    """Blocking :func:`allreduce_async` + :func:`synchronize`."""
    return synchronize(allreduce_async(tensor, name, compression, op, process_set))


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
