"""PyTorch primitives, selection family: top-k and index sets, threshold selection
(one-pass sums, counts and compaction above thresholds, the bit-space search helpers and
laplace_topk's size cut-offs), random samples and moments (dgc, gaussian_k, sidco_exp),
convolution kernels as rows (kernel_select) and the distinct indices of the
aggregation-aware exchange.

On CUDA tensors ``abs_sum_max``, ``count_above`` and ``compact_above`` dispatch to the
Triton kernels (their torch references run elsewhere).

May import: torch, :mod:`.core`, :mod:`hvd_compress.ops._cpu_topk` (numpy); lazily,
:mod:`hvd_compress.kernels`.
"""
import torch as _torch

from .. import _cpu_topk
from .core import _mix, numel


# -- top-k and index sets ----------------------------------------------------------------

def topk_indices(scores, k):
    """int32 indices of the ``k`` largest of 1-D ``scores`` (in no particular order).

    On the CPU: numpy's introselect in a reused buffer, then one compare pass
    (:func:`hvd_compress.ops._cpu_topk.indices`; ties by lowest index): 16-20 ms for
    k = 63K of 6.3M float32 values on one core here (2026-11-25), against 102-120 ms for
    ``torch.topk``; 0.33 against 1.63 ms at 262K values.  NaN ranks highest, as in
    ``torch.topk``."""
    n = scores.numel()
    if scores.device.type == "cpu" and 0 < k < n and scores.is_floating_point():
        s = scores.detach().reshape(-1).float().numpy()
        return _torch.from_numpy(_cpu_topk.indices(s, k))
    return _torch.topk(scores, k, sorted=False).indices.to(_torch.int32)


def where_indices(mask):
    return _torch.nonzero(mask, as_tuple=False).reshape(-1).to(_torch.int32)


def mask_indices(mask):
    return _torch.nonzero(mask, as_tuple=False).reshape(-1)


# -- threshold selection and the bit-space search ----------------------------------------

def abs_sum_max(t):
    """``(sum|t|, max|t|)`` as float32 0-d tensors (one pass)."""
    from ...kernels import abs_sum_max as launch
    return launch(t)


def count_above(t, thresholds):
    """int64 counts of ``|t| > thr`` for each of ``thresholds`` (one pass)."""
    from ...kernels import count_above as launch
    return launch(t, thresholds)


def compact_above(t, threshold):
    """``(t[sel], int32 indices of sel)``, ``sel = |t| > threshold``, index order."""
    from ...kernels import compact_above as launch
    return launch(t, threshold)


def shrink_candidates(t):
    """Re-compact candidates after each search pass?  On the CPU it makes later passes
    nearly free; on CUDA counting a few hundred thousand candidates again is cheaper
    than the host synchronisation a compaction needs (its output size)."""
    return not t.is_cuda


def float_bits(t):
    """Bit pattern of non-negative float32 ``t`` as int64: orders like the floats."""
    return t.float().reshape(-1).view(_torch.int32).to(_torch.int64).reshape(t.shape)


def bits_float(b):
    return b.to(_torch.int32).view(_torch.float32)


def grid_fractions(g, like):
    return _torch.arange(1, g + 1, dtype=_torch.int64, device=like.device)


# -- random samples and moments (dgc, gaussian_k, sidco_exp) -----------------------------

def random_sample(t, m, seed, step):
    """``m`` entries of 1-D ``t`` drawn uniformly *with replacement* (all of ``t`` when
    ``m >= numel(t)``), a pure function of ``(seed, step)``: the same on every rank.

    O(m) on ``t``'s own device, drawn by a generator of that device (CPU and CUDA draws
    differ): no permutation of ``t``'s ``n`` positions and no host-to-device copy (this
    was ``randperm(n)`` on the CPU, 0.8 s at 25M values).  A sample with replacement is
    what a quantile estimate needs (dgc); ``random_indices`` gives distinct indices."""
    n = numel(t)
    if m >= n:
        return t
    gen = _torch.Generator(device=t.device)
    gen.manual_seed(_mix(seed, int(step)))
    idx = _torch.randint(n, (int(m),), generator=gen, device=t.device)
    return t[idx]


def moments(t):
    """``(mean, std)`` of float32 ``t``."""
    tf = t.float()
    return tf.mean(), tf.std(unbiased=False)


# -- laplace_topk's cut-offs -------------------------------------------------------------

def small_topk_below(t):
    """Tensors smaller than this take the framework's top-k in laplace_topk (on the CPU
    ``segment_abs_topk``: a sampled threshold, then numpy's partition of the candidates,
    finiteness included; :mod:`hvd_compress.ops._cpu_topk`).

    CPU: 2^27, with one torch thread or two.  2026-11-28 (Laplace, Gaussian and
    Student-t(2) data, densities 0.001 and 0.01, ``benchmarks/select.py``: its ``topk``
    against ``laplace_topk`` with ``small=0``; ``select_cpu_sampled*_2026-11-28.json``):
    the top-k was faster than the search in all 30 cases from 2M to 128M values on one
    thread (1.55-4.2x; 25M: 22-33 against 35-84 ms; 128M: 112-232 against 245-568 ms) and
    in all 24 from 2M to 64M on two (the search's torch ops use both; 1.3-4.3x).  Above
    2^27 it was not measured: the search.  (Before the sampled threshold, 2026-11-25, the
    whole partition lost to the search from 2^25 values on one thread and from 2^22 on
    two, which were the crossovers then.)

    CUDA (H100, torch 2.11, the first GPU run, 2026-11-22, benchmarks/results/gpu_*):
    torch.topk took 0.3-0.5 ms at 1M-4M values, 0.8 ms at 25M and 2.6 ms at 100M; the
    search took 2-3.5 ms at every size (about 140 small kernel launches and 4 host
    synchronisations a call, so its cost is mostly fixed), 3.1-3.8 ms at 100M.  torch.topk
    won up to 25M and broke even at 100M (2.5 ms against 2.2-3.1 ms), so on CUDA the
    search runs only from 2^27 values (134M; or with
    ``small=0`` / ``exact=1``).  An H200 (2026-11-26) measured the same at 25M: the
    search 0.29-0.41x the speed of torch.topk."""
    return 1 << 27


def search_grid(t):
    """Thresholds per counting pass: one kernel pass counts 16 on CUDA; on the CPU
    each threshold costs a compare over the candidates, so 8."""
    return 16 if t.is_cuda else 8


# -- aggregation-aware exchange (compressors/aggregation.py) -----------------------------

def unique_sorted(idx):
    """The distinct values of 1-D int32 ``idx``, ascending."""
    return _torch.unique(idx, sorted=True)


# -- convolution kernels as rows (kernel_select) -----------------------------------------

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
