"""Host synchronisations per call on CUDA, counted with
``torch.cuda.set_sync_debug_mode("warn")`` (one warning per synchronising operation: a
``.item()``, a ``bool()`` of a tensor, a ``nonzero``, a blocking copy).

Asserted where a docstring promises a number:

- ``kernels.rangefloat.max_exponent``: "no host sync" -> 0;
- ``kernels.compact_above`` (threshold already on the device): "the only host
  synchronisation: the size of an allocation" -> 1;
- a bucket's compress, decompress and settle: the table ``counting.BUCKET_SYNCS``, which
  tests/unit/test_bucket_syncs.py checks on the CPU by counting the calls that wait for a
  GPU (here the GPU says whether that count is the real one).

Everything else promises no number, so the measured counts are recorded (``record``) and
end up in the summary JSON of ``make gpu-test``: each kernel launcher, and ``compress`` and
``decompress`` of every compressor (after a warm-up call, so compiling kernels and creating
error-feedback state are not counted).
"""
import math
import warnings

import pytest
import torch

import hvd_compress
from hvd_compress import kernels as K
from hvd_compress.kernels import dct as D
from hvd_compress.kernels import rangefloat as RF
from hvd_compress.kernels import twobit as TB
import counting  # tests/counting.py
from gpu_helpers import CUDA_ONLY, GPU, laplace
from test_gpu_compressors import APPROX, EXACT, aggregate, shape_for

pytestmark = GPU + [CUDA_ONLY]

N = 1_000_003


def count_syncs(fn):
    """(number of synchronising CUDA operations in ``fn()``, its result)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        start = len(caught)       # set_sync_debug_mode itself can warn once (torch 2.11, H100)
        try:
            result = fn()
            count = sum("synchroniz" in str(w.message) for w in caught[start:])
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return count, result


def warm_count(fn):
    fn()                                    # compile the kernels, fill caches
    return count_syncs(fn)[0]


@pytest.fixture(scope="module")
def x():
    return laplace(N, seed=3).cuda()


def test_counter_counts_what_it_should(x, record):
    assert warm_count(lambda: (x * 2).sum()) == 0
    assert warm_count(lambda: x.sum().item()) == 1
    assert warm_count(lambda: bool(x.sum() > 0)) == 1
    record("sync_counts", "calibration: torch.nonzero", count_syncs(lambda: torch.nonzero(x > 1))[0])
    record("sync_counts", "calibration: torch.tensor(0.5, device=cuda)",
           count_syncs(lambda: torch.tensor(0.5, device="cuda"))[0])


def test_max_exponent_does_not_synchronise(x, record):
    n = warm_count(lambda: RF.max_exponent(x))
    record("sync_counts", "kernels.rangefloat.max_exponent", n)
    assert n == 0, "max_exponent promises no host sync"


def test_compact_above_synchronises_once(x, record):
    t = torch.tensor(2.0, device="cuda")
    n = warm_count(lambda: K.compact_above(x, t))
    record("sync_counts", "kernels.compact_above (threshold on the device)", n)
    assert n == 1, "compact_above promises one host synchronisation (the output size)"
    record("sync_counts", "kernels.compact_above (threshold a python float)",
           warm_count(lambda: K.compact_above(x, 2.0)))


def test_record_kernel_launchers(x, record):
    t = torch.tensor(0.7, device="cuda")
    thr = torch.linspace(0.5, 5.0, 16, device="cuda")
    emax = RF.max_exponent(x)
    data = RF.encode(x, emax, 4, 3)
    per_group = emax.to(torch.int32).expand(data.numel()).contiguous()
    words = TB.pack(x, t)
    coefs = D.dct(x, 256)
    calls = {
        "kernels.abs_sum_max": lambda: K.abs_sum_max(x),
        "kernels.count_above (16 thresholds on the device)": lambda: K.count_above(x, thr),
        "kernels.count_above (python list of 4)": lambda: K.count_above(x, [0.5, 1.0, 2.0, 4.0]),
        "kernels.twobit.pack (threshold on the device)": lambda: TB.pack(x, t),
        "kernels.twobit.unpack": lambda: TB.unpack(words),
        "kernels.rangefloat.encode (8 bits)": lambda: RF.encode(x, emax, 4, 3),
        "kernels.rangefloat.decode (8 bits)": lambda: RF.decode(data, per_group, 4, 3),
        "kernels.dct.dct (256)": lambda: D.dct(x, 256),
        "kernels.dct.idct (256)": lambda: D.idct(coefs, 256),
    }
    for label, fn in calls.items():
        record("sync_counts", label, warm_count(fn))


SELECT_EF0 = ["topk:density=0.001,ef=0", "laplace_topk:density=0.001,ef=0",
              "laplace_topk:density=0.001,exact=1,ef=0", "laplace_topk:density=0.001,fused=1,ef=0",
              "laplace_topk:density=0.001,fused=1,exact=1,ef=0", "dgc:density=0.001,ef=0",
              "gaussian_k:density=0.001,ef=0", "sidco_exp:density=0.001,ef=0"]


@pytest.mark.parametrize("spec", EXACT + APPROX + SELECT_EF0)
def test_record_compress_and_decompress(spec, record):
    shape = shape_for(spec) if spec.startswith("kernel_select") else (N,)
    n = math.prod(shape)
    grads = [laplace(n, seed=r).reshape(shape).cuda() for r in range(2)]
    comps = [hvd_compress.from_spec(spec) for _ in grads]
    for c, g in zip(comps, grads):                       # warm-up: kernels, residuals
        c.compress(g, "layer")
    counts = []
    payloads = []
    for c, g in zip(comps, grads):
        k, (payload, ctx) = count_syncs(lambda c=c, g=g: c.compress(g, "layer"))
        counts.append(k)
        payloads.append(payload)
    agg = aggregate(comps[0], payloads)
    comps[0].decompress(agg, ctx)
    dec, _ = count_syncs(lambda: comps[0].decompress(agg, ctx))
    record("sync_counts", f"compress {spec} (n={n})", counts[0])
    record("sync_counts", f"decompress {spec} (2 ranks)", dec)
    assert counts[0] >= 0 and dec >= 0


# -- buckets: host synchronisations per bucket must not grow with its number of tensors --

BUCKET_FLAT = ["none", "fp16", "topk:density=0.01", "laplace_topk:density=0.01",
               "laplace_topk:density=0.01,exact=1", "laplace_topk:density=0.01,fused=1",
               "threshold:threshold=2.5", "twobit", "rangefloat:bits=8",
               "topk:density=0.01,values=rangefloat8",
               "laplace_topk:density=0.01,fused=1,values=rangefloat8"]


def _bucket_syncs(spec, tensors, size=4096):
    """Host synchronisations of one warm compress_bucket of ``tensors`` tensors."""
    from hvd_compress import buckets
    lay = buckets.layout([f"t{i}" for i in range(tensors)], [(size,)] * tensors)
    c = hvd_compress.from_spec(spec)
    flat = laplace(lay.total, seed=tensors).cuda()
    c.compress_bucket(flat.clone(), lay)                 # warm-up: kernels, residuals
    return count_syncs(lambda: c.compress_bucket(flat.clone(), lay))[0]


@pytest.mark.parametrize("spec", BUCKET_FLAT)
def test_bucket_synchronisations_do_not_grow_with_tensors(spec, record):
    """The bucket issue's promise for these compressors: what a bucket synchronises
    (non-finite check, payload size) is per bucket, not per tensor."""
    few, many = _bucket_syncs(spec, 4), _bucket_syncs(spec, 40)
    record("sync_counts", f"compress_bucket {spec} (4 tensors)", few)
    record("sync_counts", f"compress_bucket {spec} (40 tensors)", many)
    assert many == few, f"{spec}: {few} syncs for 4 tensors, {many} for 40"


@pytest.mark.parametrize("spec", list(counting.BUCKET_SYNCS))
def test_bucket_exchange_synchronisations_are_the_cpu_count(spec, record):
    """compress_bucket, decompress_bucket (two ranks' payloads, index checks deferred as
    the driver defers them) and the settle of the deferred checks, of 4 and of 40
    tensors: the real host synchronisations are those counted on the CPU."""
    for tensors in (4, 40):
        counts = counting.exchange_syncs(tensors, spec, lambda n, step: laplace(n, seed=step)
                                         .cuda(), counter=count_syncs)
        record("sync_counts", f"bucket exchange {spec} ({tensors} tensors: compress, "
               "decompress, settle)", list(counts))
        assert tuple(counts) == counting.BUCKET_SYNCS[spec], (tensors, counts)


@pytest.mark.parametrize("spec", ["laplace_topk:density=0.01,fused=1",
                                  "laplace_topk:density=0.01,fused=1,exact=1",
                                  "laplace_topk:density=0.01,fused=1,values=rangefloat8"])
def test_fused_search_synchronises_once_per_bucket(spec, record):
    """laplace_topk:fused=1 promises one host synchronisation per bucket compress, with
    error feedback on (the payload's length, read back with the NaN/Inf flag); with
    values=rangefloat8 too (its codes need no byte count; the own payload's decode for
    error feedback is not checked)."""
    for tensors in (4, 40):
        n = _bucket_syncs(spec, tensors)
        record("sync_counts", f"compress_bucket {spec} ({tensors} tensors, promised 1)", n)
        assert n == 1, f"{spec}: {n} host synchronisations for a bucket of {tensors} tensors"
