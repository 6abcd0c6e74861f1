"""Buckets: gradients compressed together, one compress call and one grouped collective
per bucket, with per-tensor semantics kept (k, thresholds and residuals per tensor).

Why: compressing tensor by tensor costs a fixed Python and launch overhead per tensor
and two or three collectives per tensor, which on models of many small tensors costs
more than the bytes saved (README, "Does it make training faster?").  PyTorch DDP,
Horovod's tensor fusion and CGX group gradients into buckets for the same reason.

A :class:`Layout` says which tensors a bucket holds, end to end, in a fixed order;
:func:`plan` cuts a model's parameters into buckets:

- parameters are taken in *reverse* registration order (the order backward produces
  their gradients, as DDP does), so the first bucket is ready first;
- a bucket holds tensors of one compressor and one dtype (a Policy's parameters are
  split by compressor: a bucket never mixes methods) and at most ``bucket_mb`` MB;
- a tensor of at least half of ``bucket_mb`` is a bucket of its own, and the smaller
  tensors around it go on filling the open bucket: a bucket is sent once its last
  gradient is ready, so a large gradient put with smaller ones after it would wait for
  the rest of backward instead of overlapping it (CNNMLPLarge's 25.2 MB fc1 weight in a
  25 MB bucket with the convolutions: ``none`` 1.3x slower a step than Horovod's own
  optimizer on plain loopback, benchmarks/step_time.py, 2026-11-25);
- compressors that cannot take several tensors in one call (``segmented = False``:
  kernel_select, gaussian_k, sidco_exp, dgc, dct with ``agg`` other than local) get one
  bucket per tensor, which is
  exactly the tensor-by-tensor path; empty tensors get none (nothing to send).

``bucket_mb=0`` (or ``$HVD_COMPRESS_BUCKET_MB=0``) turns buckets off.

Imports: the standard library.
"""
import hashlib
import os
from typing import NamedTuple, Tuple

ENV_VAR = "HVD_COMPRESS_BUCKET_MB"
DEFAULT_MB = 25.0


class Layout(NamedTuple):
    """Tensors of a bucket, end to end: tensor ``i`` is ``flat[offsets[i]:][:numels[i]]``."""
    names: Tuple[str, ...]
    shapes: Tuple[Tuple[int, ...], ...]
    numels: Tuple[int, ...]
    offsets: Tuple[int, ...]
    total: int
    key: str          #: stable name of the bucket (collective names, caches)

    def split(self, flat, ops):
        """The bucket's tensors, flat views of ``flat`` reshaped to their shapes."""
        return [ops.reshape(t, s) for t, s in zip(ops.split(flat, self.numels), self.shapes)]


def layout(names, shapes):
    """The :class:`Layout` of tensors ``names`` with ``shapes``, in that order."""
    names, shapes = tuple(names), tuple(tuple(int(d) for d in s) for s in shapes)
    numels = tuple(_prod(s) for s in shapes)
    offsets, at = [], 0
    for n in numels:
        offsets.append(at)
        at += n
    digest = hashlib.sha1("\n".join(names).encode()).hexdigest()[:10]
    key = f"bucket.{names[0]}+{len(names) - 1}.{digest}" if len(names) > 1 else names[0]
    return Layout(names, shapes, numels, tuple(offsets), at, key)


def bucket_mb(value=None, compression=None):
    """The bucket size in MB: ``value``, else ``$HVD_COMPRESS_BUCKET_MB``, else the
    compression's own preference (``auto`` cuts smaller buckets, so that it can choose
    per bucket and overlap more), else 25."""
    if value is None:
        value = os.environ.get(ENV_VAR) or getattr(compression, "bucket_mb", None) or DEFAULT_MB
    try:
        mb = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"bucket_mb must be a number of MB >= 0, got {value!r}") from None
    if not mb >= 0 or mb == float("inf"):
        raise ValueError(f"bucket_mb must be a finite number of MB >= 0, got {value!r}")
    return mb


def describe(mb, buckets):
    """What ranks must agree on about buckets: ``bucket_mb=25 buckets=[3;1;1]``."""
    return f"bucket_mb={mb:g} buckets=[{';'.join(str(len(b)) for b in buckets)}]"


def plan(entries, mb):
    """Buckets for ``entries`` = [(name, shape, compressor, dtype_key, element_size)] in
    *registration* order: a list of lists of indices into ``entries``, in launch order.

    ``mb == 0``: one bucket per tensor.  See the module docstring for the rules."""
    cap = mb * 2**20
    buckets, open_ = [], {}          # (id(compressor), dtype) -> [indices, bytes]
    for i in reversed(range(len(entries))):
        name, shape, compressor, dtype_key, size = entries[i]
        n = _prod(shape)
        if n == 0:
            continue
        if mb <= 0 or not compressor.segmented:
            buckets.append([i])
            continue
        if 2 * n * size >= cap:                  # at least half a bucket: its own
            buckets.append([i])
            continue
        key = (id(compressor), dtype_key)
        cur = open_.get(key)
        if cur is not None and cur[1] + n * size > cap:
            buckets.append(cur[0])
            cur = None
        if cur is None:
            cur = open_[key] = [[], 0]
        cur[0].append(i)
        cur[1] += n * size
    buckets += [cur[0] for cur in open_.values() if cur[0]]
    # launch order: the bucket whose last gradient comes first (highest min index) first
    return sorted(buckets, key=lambda b: -min(b))


def _prod(shape):
    out = 1
    for d in shape:
        out *= int(d)
    return out
