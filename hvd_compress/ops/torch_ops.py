"""PyTorch implementation of the primitives listed in :mod:`hvd_compress.ops`.

On CUDA tensors the hot primitives may dispatch to Triton kernels from
:mod:`hvd_compress.kernels`; everywhere else they are plain torch.
"""
import torch as _torch

float32 = _torch.float32
float16 = _torch.float16
bfloat16 = _torch.bfloat16
int16 = _torch.int16
int8 = _torch.int8
uint8 = _torch.uint8
int32 = _torch.int32
int64 = _torch.int64


def flatten(t):
    return t.reshape(-1)


def numel(t):
    return int(t.numel())


def shape(t):
    return tuple(t.shape)


def is_floating(t):
    return t.is_floating_point()


def all_finite(t):
    # min and max propagate NaN and are +-Inf when any entry is: 30x faster on the CPU
    # than isfinite(t).all(), which materialises a mask.
    if t.numel() == 0:
        return True
    lo, hi = _torch.aminmax(t.reshape(-1))
    return bool(_torch.isfinite(lo) & _torch.isfinite(hi))


def abs(t):  # noqa: A001 - mirrors the framework name
    return t.abs()


def topk_indices(scores, k):
    return _torch.topk(scores, k, sorted=False).indices.to(_torch.int32)


def where_indices(mask):
    return _torch.nonzero(mask, as_tuple=False).reshape(-1).to(_torch.int32)


def arange(n, like=None):
    device = like.device if like is not None else None
    return _torch.arange(n, dtype=_torch.int32, device=device)


def _mix(seed, step):
    # SplitMix64-style mix of (seed, step) into a 63-bit generator seed.
    x = (int(seed) * 0x9E3779B97F4A7C15 + int(step) + 0x632BE59BD9B4E019) & (2**64 - 1)
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return (x ^ (x >> 31)) & (2**63 - 1)


def random_indices(n, k, seed, step, like=None):
    gen = _torch.Generator(device="cpu")
    gen.manual_seed(_mix(seed, int(step)))
    idx = _torch.randperm(n, generator=gen)[:k].to(_torch.int32)
    return idx.to(like.device) if like is not None else idx


def gather(t, idx):
    return t[idx.long()]


def scatter_sum(n, idx, values, dtype=float32):
    out = _torch.zeros(n, dtype=dtype, device=values.device)
    if idx.numel():
        out.index_add_(0, idx.long(), values.to(dtype))
    return out


def check_indices(idx, n, what):
    if idx.numel() == 0:
        return
    lo, hi = int(idx.min()), int(idx.max())
    if lo < 0 or hi >= n:
        raise ValueError(
            f"{what}: payload index out of range [0, {n}) (min {lo}, max {hi}); "
            "the payload is malformed or was produced for another tensor")


def cast(t, dtype):
    return t.to(dtype)


def bitcast(t, dtype):
    return t.view(dtype)


def cond(pred, f, g):
    return f() if bool(pred) else g()


def select(pred, a, b):
    return a if bool(pred) else b


def size_bytes(t):
    return int(t.numel()) * t.element_size()


def count64(t):
    """Number of elements (a python int; an int64 tensor in TensorFlow)."""
    return int(t.numel())


def dtype_size(dtype):
    """Bytes per element of ``dtype``."""
    return _torch.empty((), dtype=dtype).element_size()


def zeros(n, dtype, like=None):
    return _torch.zeros(n, dtype=dtype, device=like.device if like is not None else None)


def supports_inplace():
    """Error feedback may update its buffers in place (see memory.ResidualMemory)."""
    return True


def add_into(a, b, out):
    """``a + b`` written into ``out``."""
    return _torch.add(a, b, out=out)


def subtract(a, b, inplace=False):
    """``a - b``, in place on ``a`` when ``inplace``."""
    return a.sub_(b) if inplace else a - b


def subtract_at(a, idx, values, inplace=False):
    """``a - cast(scatter_sum(len(a), idx, values))`` for *distinct* ``idx``, touching only
    those entries (the same bits: ``0.0 + v`` is what the scatter into zeros holds)."""
    out = a if inplace else a.clone()
    if idx.numel():
        i = idx.long()
        out.index_put_((i,), a[i] - (0.0 + values.float()).to(a.dtype))
    return out


def new_store():
    from ..memory import TorchStore
    return TorchStore()


def sum_rows(t, n):
    """Sum of the rows of ``t`` viewed as (len(t) // n, n)."""
    return t.reshape(-1, n).sum(0)


def length(t):
    return int(t.shape[0])


def reshape(t, shape):
    return t.reshape(shape)


# -- threshold selection (Triton kernels on CUDA, torch references elsewhere) ------------

def abs_sum_max(t):
    """``(sum|t|, max|t|)`` as float32 0-d tensors (one pass)."""
    from ..kernels import abs_sum_max as launch
    return launch(t)


def count_above(t, thresholds):
    """int64 counts of ``|t| > thr`` for each of ``thresholds`` (one pass)."""
    from ..kernels import count_above as launch
    return launch(t, thresholds)


def compact_above(t, threshold):
    """``(t[sel], int32 indices of sel)``, ``sel = |t| > threshold``, index order."""
    from ..kernels import compact_above as launch
    return launch(t, threshold)


def shrink_candidates(t):
    """Re-compact candidates after each search pass?  On the CPU it makes later passes
    nearly free; on CUDA counting a few hundred thousand candidates again is cheaper
    than the host synchronisation a compaction needs (its output size)."""
    return not t.is_cuda


def to_float32(t):
    return t.float()


def scalar(value, like):
    return _torch.as_tensor(value, device=like.device)


def float_bits(t):
    """Bit pattern of non-negative float32 ``t`` as int64: orders like the floats."""
    return t.float().reshape(-1).view(_torch.int32).to(_torch.int64).reshape(t.shape)


def bits_float(b):
    return b.to(_torch.int32).view(_torch.float32)


def grid_fractions(g, like):
    return _torch.arange(1, g + 1, dtype=_torch.int64, device=like.device)


def where(cond, a, b):
    return _torch.where(cond, a, b)


def reduce_max(t):
    return t.max()


def reduce_min(t):
    return t.min()


def cumsum(t):
    return _torch.cumsum(t, 0)


def mask_indices(mask):
    return _torch.nonzero(mask, as_tuple=False).reshape(-1)



def random_sample(t, m, seed, step):
    return gather(t, random_indices(numel(t), m, seed, step, t))


def moments(t):
    """``(mean, std)`` of float32 ``t``."""
    tf = t.float()
    return tf.mean(), tf.std(unbiased=False)


def reduce_sum_int(mask):
    return mask.sum(dtype=_torch.int64)


def small_topk_below(t):
    """Tensors smaller than this take torch.topk in laplace_topk.

    CPU (2026-11-22, benchmarks/select.py): torch.topk of 80k-235k values took 0.2-1.7 ms
    against the search's ~1.1-1.6 ms, and the search wins from about 1M values: 2^18.

    CUDA (H100, torch 2.11, the first GPU run, 2026-11-22, benchmarks/results/gpu_*):
    torch.topk took 0.3-0.5 ms at 1M-4M values, 0.8 ms at 25M and 2.6 ms at 100M; the
    search took 2-3.5 ms at every size (about 140 small kernel launches and 4 host
    synchronisations a call, so its cost is mostly fixed), 3.1-3.8 ms at 100M.  torch.topk
    won up to 25M and broke even at 100M (2.5 ms against 2.2-3.1 ms), so on CUDA the
    search runs only from 2^27 values (134M; or with
    ``small=0`` / ``exact=1``)."""
    return (1 << 27) if t.is_cuda else (1 << 18)


def search_grid(t):
    """Thresholds per counting pass: one kernel pass counts 16 on CUDA; on the CPU
    each threshold costs a compare over the candidates, so 8."""
    return 16 if t.is_cuda else 8


def host_bool(t):
    """Python bool of a 0-d tensor (a host synchronisation on CUDA)."""
    return bool(t)


# -- 2-bit packing and convolution kernels ---------------------------------------------

def twobit_pack(flat, t):
    """int32 words, 16 two-bit codes each (+t: 1, -t: 2, else 0)."""
    from ..kernels import twobit
    return twobit.pack(flat, t)


def twobit_unpack(words):
    """float32 signs (+1, -1, 0) of every code, 16 per word."""
    from ..kernels import twobit
    return twobit.unpack(words)


def twobit_decode_sum(words, thresholds, n):
    """Optional fast path of the 2-bit decoder, ``sum_r thresholds[r] * signs_r[:n]``:
    one table lookup per byte, scaled per rank, bit-identical (CPU).  None on CUDA,
    where the decoder's generic unpack-multiply-sum runs the kernel."""
    if words.is_cuda:
        return None
    from ..kernels import twobit
    return twobit.unpack_cpu(words, scale=thresholds, n=n)


def kernel_matrix(flat, shape):
    """Convolution weight (out, in, *kernel) as rows of kernels: (out * in, prod(kernel))."""
    return flat.reshape(-1, _prod(shape[2:]))


def from_kernel_matrix(rows, shape):
    return rows.reshape(-1)


def row_norms(rows):
    return _torch.linalg.vector_norm(rows.float(), dim=1)


def _prod(dims):
    out = 1
    for d in dims:
        out *= int(d)
    return out


# -- range-based float and block DCT ----------------------------------------------------

def max_exponent(flat):
    from ..kernels import rangefloat
    return rangefloat.max_exponent(flat)


def rangefloat_encode(flat, emax, e, m):
    from ..kernels import rangefloat
    return rangefloat.encode(flat, emax, e, m)


def rangefloat_decode(data, emax_per_group, e, m):
    from ..kernels import rangefloat
    return rangefloat.decode(data, emax_per_group, e, m)


def rangefloat_decode_ranks(data, emax, counts, e, m):
    """Fast path of the codec's decode: every rank's values, unpadded, decoded rank by
    rank with one exponent each (CPU: a table per exponent; CUDA: one kernel per rank)."""
    from ..kernels import rangefloat
    return rangefloat.decode_ranks(data, emax, counts, e, m)


def repeat_interleave(values, repeats):
    return _torch.repeat_interleave(values, repeats.to(_torch.int64))


def block_dct(flat, block):
    from ..kernels import dct
    return dct.dct(flat, block)


def block_idct(coefs, block):
    from ..kernels import dct
    return dct.idct(coefs, block)


def head(t, n):
    return t[:n]


def stack_int32(values, like):
    return _torch.stack([v.to(_torch.int32) if hasattr(v, "to")
                         else _torch.tensor(v, dtype=_torch.int32, device=like.device)
                         for v in values]).to(like.device)


# -- buckets: tensors end to end, one result per tensor (segment) ----------------------

def concat(ts):
    return _torch.cat([t.reshape(-1) for t in ts])


def split(flat, lengths):
    """Views of ``flat``, one per length."""
    return list(_torch.split(flat, list(lengths)))


_PER_LAYOUT = {}


def _per_layout(what, layout, device, make):
    """``make()``, computed once per (what, bucket layout, device) and kept (a bounded
    cache: the constants of a model's buckets)."""
    key = (what, layout.key, layout.numels, str(device))
    value = _PER_LAYOUT.get(key)
    if value is None:
        if len(_PER_LAYOUT) > 512:
            _PER_LAYOUT.clear()
        value = _PER_LAYOUT[key] = make()
    return value


def segment_ids(layout, like):
    """int32 tensor index of every entry of a bucket (cached per layout and device)."""
    from ..kernels import segmented
    return _per_layout("ids", layout, like.device,
                       lambda: segmented.segment_ids(layout.numels, like.device))


def segment_constant(values, dtype, like):
    """A small per-segment constant (k, n) on ``like``'s device."""
    return _torch.tensor(values, dtype=dtype).to(like.device, non_blocking=True)


def segment_abs_sum_max(flat, layout):
    """float32 ``(sum|x|, max|x|)`` per tensor of a bucket (one pass; Triton on CUDA)."""
    from ..kernels import segmented
    if flat.is_cuda:
        return segmented.segment_abs_sum_max(flat, layout.numels)
    return segmented.segment_abs_sum_max_reference(flat, layout.numels, segment_ids(layout, flat))


def segment_count_above(a, seg, thresholds):
    """int64 ``[T, G]`` counts of ``a > thresholds[seg, g]`` (one pass; Triton on CUDA)."""
    from ..kernels import segmented
    return segmented.segment_count_above(a, seg, thresholds)


def segment_compact_above(flat, thresholds, seg, layout):
    """``(flat[sel], int32 indices)``, ``sel = |flat| > thresholds[seg]``, index order."""
    from ..kernels import compact_above as launch
    from ..kernels.compact import compact_above_reference
    if flat.is_cuda:
        return launch(flat, thresholds, segment_ids=seg)
    # CPU: the thresholds repeated per tensor (one write) instead of a gather per entry
    lengths = _per_layout("lengths", layout, "cpu",
                          lambda: _torch.tensor(layout.numels, dtype=_torch.int64))
    return compact_above_reference(flat, _torch.repeat_interleave(thresholds.float(), lengths))


def segment_sum_int(values, seg, segments):
    """int64 per-segment sums of the integers (or booleans) ``values``."""
    out = _torch.zeros(segments, dtype=_torch.int64, device=values.device)
    return out.index_add_(0, seg.long(), values.to(_torch.int64))


def rows_max(t):
    return t.max(dim=1).values


def rows_min(t):
    return t.min(dim=1).values


def host_all(t):
    """Python bool: are all entries true (a host synchronisation on CUDA)."""
    return bool(t.all())


def segment_counts(seg, segments):
    """int64 number of entries of each segment."""
    return _torch.bincount(seg.long(), minlength=segments)


def stack_cols(ts):
    return _torch.stack(ts, 1)


def split_sizes(t, sizes, n):
    """``t`` cut into ``n`` pieces of the (tensor) ``sizes`` (a host synchronisation)."""
    return list(_torch.split(t, sizes.tolist()))


def segmented_search(t, exact):
    """laplace_topk on a bucket: one search for all its tensors (True) or each tensor's
    own selection in turn (False)?  Measured 2026-11-22 on the VGG-like (28 tensors,
    815k values) and ResNet-like (47, 697k) models' gradients:

    - CPU, one thread: tolerance mode 18 / 17 ms segmented against 6 / 6 ms tensor by
      tensor (small tensors take torch.topk); ``exact=1`` 22-25 ms against 56 / 89 ms.
    - H100: tolerance mode 5.6 / 6.4 ms segmented against 1.9 / 4.7 ms for per-tensor
      torch.topk in a bucket; ``exact=1`` 5.1 / 6.6 ms against 80 / 168 ms tensor by
      tensor (each tensor's own search: launches and host syncs per tensor).

    So: the segmented search for ``exact=1``, each tensor's own selection otherwise."""
    return bool(exact)


# -- aggregation-aware exchange (compressors/aggregation.py) ------------------------------

def unique_sorted(idx):
    """The distinct values of 1-D int32 ``idx``, ascending."""
    return _torch.unique(idx, sorted=True)


def ones_like(t, dtype):
    return _torch.ones(t.shape, dtype=dtype, device=t.device)


# -- fixed point and modular int32 (coded SGD, hvd_compress.coded) -------------------
FIXED_MAX = 2 ** 31 - 1


def fixed_encode(t, value_range):
    """int32 ``q = round(t·(2³¹−1)/R)`` of 1-D ``t`` (so 0x7FFFFFFF is R, 0x80000001 is −R)
    and int64 ``[clipped, nonfinite]`` counts: |t| > R saturates, NaN becomes 0, ±Inf
    saturates.  Computed in float64, so every float32 rounds the same on every rank."""
    x = t.reshape(-1).to(_torch.float64)
    finite = _torch.isfinite(x)
    counts = _torch.stack([(finite & (x.abs() > value_range)).sum(), (~finite).sum()])
    x = _torch.nan_to_num(x, nan=0.0, posinf=value_range, neginf=-value_range)
    q = _torch.round(x.clamp(-value_range, value_range) * (FIXED_MAX / value_range))
    return q.clamp(-FIXED_MAX, FIXED_MAX).to(_torch.int32), counts


def fixed_decode(q, value_range):
    """float32 ``q·R/(2³¹−1)`` of integer ``q`` (any width), through float64."""
    return (q.to(_torch.float64) * (value_range / FIXED_MAX)).to(_torch.float32)


def wrap_int32(x):
    """int64 ``x`` modulo 2³² into int32 (two's complement): the wire form of a sum whose
    terms are subtracted again by the receiver, so the wrap-around cancels exactly."""
    return (((x + 2 ** 31) & (2 ** 32 - 1)) - 2 ** 31).to(_torch.int32)


def saturate_int32(x):
    """int64 ``x`` clamped to ±(2³¹−1) as int32, and the int64 count of clamped entries."""
    return x.clamp(-FIXED_MAX, FIXED_MAX).to(_torch.int32), (x.abs() > FIXED_MAX).sum()


def pad_to(t, n):
    """1-D ``t`` followed by zeros up to length ``n``."""
    return t if t.numel() == n else _torch.cat([t, t.new_zeros(n - t.numel())])


# -- peer baselines: random draws, 1-bit codes, low-rank products -----------------------

def uniform(n, seed, step, like):
    """``n`` float32 draws from U[0, 1), a pure function of ``(seed, step)`` (on
    ``like``'s device, whose generator makes them: CPU and CUDA draws differ)."""
    gen = _torch.Generator(device=like.device)
    gen.manual_seed(_mix(seed, int(step)))
    return _torch.rand(n, generator=gen, device=like.device, dtype=_torch.float32)


_MAGIC_PACK = 0x8040201008040201 - 2**64   # gathers 8 bytes' low bits into the top byte
_BIT_TABLES = {}


def onebit_pack(bits):
    """uint8 words, 8 booleans each (the first in the high bit); padded with 0.  One
    multiply per 8 values: the 8 bytes (0 or 1) read as one int64, times a constant that
    moves byte i's bit to bit 63 - i without carries."""
    n = bits.numel()
    padded = _torch.zeros(-(-n // 8) * 8, dtype=_torch.uint8, device=bits.device)
    padded[:n] = bits.reshape(-1).to(_torch.uint8)
    return ((padded.view(_torch.int64) * _MAGIC_PACK) >> 56).to(_torch.uint8)


def _bit_table(device):
    """(256, 8) bool: the 8 bits of every byte value, high bit first."""
    if device not in _BIT_TABLES:
        byte = _torch.arange(256, device=device)[:, None]
        shifts = _torch.arange(7, -1, -1, device=device)
        _BIT_TABLES[device] = ((byte >> shifts) & 1).bool()
    return _BIT_TABLES[device]


def onebit_decode_sum(words, scales, n):
    """``sum_r (scales[r, 0] where bit else scales[r, 1])`` over the first ``n`` bits of
    each rank's row of ``words`` (ranks, w) uint8: a table of 256 x 8 values per rank,
    gathered by byte (no per-bit shifts)."""
    words = words.reshape(words.shape[0], -1) if words.dim() > 1 else words.reshape(1, -1)
    ranks = words.shape[0]
    tables = _torch.where(_bit_table(words.device)[None], scales[:, 0, None, None],
                          scales[:, 1, None, None])                      # (ranks, 256, 8)
    rows = _torch.arange(ranks, device=words.device)[:, None]
    values = tables[rows, words.long()].reshape(ranks, -1)[:, :n]         # (ranks, n)
    return values.sum(0)


def matmul(a, b, transpose_a=False, transpose_b=False):
    """``a @ b`` with either operand transposed (float32 matrices)."""
    return (a.t() if transpose_a else a) @ (b.t() if transpose_b else b)


def orthonormal_columns(m):
    """An orthonormal basis of ``m``'s columns (reduced QR's Q; float32, same shape)."""
    return _torch.linalg.qr(m.float(), mode="reduced").Q


def constant(array, like):
    """A float32 tensor on ``like``'s device from a numpy array."""
    return _torch.as_tensor(array, dtype=_torch.float32).to(like.device)
