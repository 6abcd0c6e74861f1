"""Host synchronisations of a bucket exchange on the CUDA code path, counted on the CPU
(HVD_COMPRESS_BACKEND=triton: the kernels in Triton's interpreter; the calls that wait
for a GPU counted by tests/counting.py's CountSyncs).  Compress, decompress (two
ranks' payloads, index checks deferred as the exchange driver defers them) and the
settle of the deferred checks, of a bucket of 4 and of 40 tensors, make the same
numbers, those stated in counting.BUCKET_SYNCS; tests/gpu/test_gpu_sync.py counts the real ones on a
GPU against the same table."""
import numpy as np
import pytest
import torch

from hvd_compress.buckets import layout
from hvd_compress.spec import from_spec

import counting  # tests/counting.py


def laplace(n, step):
    return torch.from_numpy(np.random.default_rng(step).laplace(size=n).astype(np.float32))


@pytest.mark.parametrize("spec", list(counting.BUCKET_SYNCS))
def test_bucket_syncs_do_not_grow_with_its_tensors(spec, monkeypatch):
    monkeypatch.setenv("HVD_COMPRESS_BACKEND", "triton")
    got = {T: counting.exchange_syncs(T, spec, laplace) for T in (4, 40)}
    for T, counts in got.items():
        want = counting.BUCKET_SYNCS[spec]
        assert tuple(sum(c.values()) for c in counts) == want, (T, counts)
    assert got[4] == got[40]


#: a GPT-2 block's tensor sizes, scaled down: every tensor a multiple of 16 values, as
#: in the real models, where the kernels' tables hold aligned offsets (under
#: HVD_COMPRESS_COMPILE_FOR the kernels are compiled at these specialisations too)
ALIGNED = [768, 4 * 768, 768, 3 * 768, 64 * 48]


@pytest.mark.parametrize("spec", list(counting.BUCKET_SYNCS))
def test_bucket_syncs_of_aligned_tensors(spec, monkeypatch):
    monkeypatch.setenv("HVD_COMPRESS_BACKEND", "triton")
    counts = counting.exchange_syncs(0, spec, laplace, sizes=ALIGNED)
    assert tuple(sum(c.values()) for c in counts) == counting.BUCKET_SYNCS[spec], counts


def test_a_float16_twobit_bucket_subtracts_in_a_pass_of_its_own(monkeypatch):
    """twobit's pack writes a float32 bucket's residual in its own launch; a float16
    bucket's is one in-place pass of its own (``subtract_segments``), with no host
    synchronisation either."""
    from hvd_compress.kernels import counting_launches
    monkeypatch.setenv("HVD_COMPRESS_BACKEND", "triton")
    half = lambda n, step: laplace(n, step).half()                  # noqa: E731
    counts = counting.exchange_syncs(4, "twobit", half, sizes=ALIGNED)
    assert tuple(sum(c.values()) for c in counts) == (0, 0, 0), counts
    lay = layout(list("abcde"), [(n,) for n in ALIGNED])
    for dtype, subtracts in ((torch.float16, 1), (torch.float32, 0)):
        c = from_spec("twobit")
        with counting_launches() as launched:
            c.compress_bucket(laplace(lay.total, 1).to(dtype), lay)
        assert launched["twobit_subtract_segments"] == subtracts, launched
        assert launched["twobit_pack_segments"] == 1


@pytest.mark.parametrize("spec, want, kernel", [
    ("twobit", (0, 0, 0), "twobit_pack_segments"),
    ("twobit:threshold=0.5", (0, 0, 0), "twobit_pack_segments"),
    ("rangefloat:bits=8", (0, 0, 1), "rangefloat_encode_segments")])
def test_a_lone_tensor_of_the_dense_codecs_takes_the_bucket_paths(spec, want, kernel,
                                                                  monkeypatch):
    """A one-tensor bucket (and ``compress``) of twobit and rangefloat: the bucket kernels,
    so no synchronisation in compress either (rangefloat's single-tensor encode copied
    its header's count from the host, which the CPU run cannot count: hence the kernel)."""
    from hvd_compress.kernels import counting_launches
    monkeypatch.setenv("HVD_COMPRESS_BACKEND", "triton")
    counts = counting.exchange_syncs(1, spec, laplace, size=5000)
    assert tuple(sum(c.values()) for c in counts) == want, counts
    with counting.CountSyncs() as syncs, counting_launches() as launched:
        from_spec(spec).compress(laplace(5000, 0), "w")
    assert not syncs.syncs and launched[kernel] == 1, launched


def test_rangefloat_values_check_indices_in_the_header_readback(monkeypatch):
    """values=rangefloat8 on the kernel path: an index out of range is the clear error,
    found in the one readback that also checks the values' headers."""
    monkeypatch.setenv("HVD_COMPRESS_BACKEND", "triton")
    lay = layout(["a", "b"], [(300,), (5000,)])
    c = from_spec("topk:density=0.01,values=rangefloat8")
    payload, ctx = c.compress_bucket(laplace(lay.total, 0), lay)
    data, headers, idx = (torch.cat([p, p]) for p in payload)
    for bad in (lay.total, -1):
        wrong = idx.clone()
        wrong[3] = bad
        with counting.CountSyncs() as seen, pytest.raises(ValueError) as error:
            c.decompress_bucket((data, headers, wrong), ctx)
        assert sum(seen.syncs.values()) == 1, seen.syncs
        assert str(error.value).startswith("topk (") and "values" not in str(error.value)
        assert f"index out of range [0, {lay.total})" in str(error.value)
    wrong = torch.cat([idx, idx[:1] * 0 - 1])          # one index more, and out of range
    with pytest.raises(ValueError, match="values but .* indices"):   # the count comes first
        c.decompress_bucket((data, headers, wrong), ctx)
    broken = headers.clone()
    broken[0] = 500                                  # an exponent out of range wins
    with pytest.raises(ValueError, match="malformed"):
        c.decompress_bucket((data, broken, idx), ctx)


def _malformed(spec, two, n):
    """(payload, the error's pattern) for each way in which ``spec``'s payload ``two`` (a
    bucket of ``n`` values, two ranks) is made malformed: an index out of range on
    either side; range-float headers with an exponent out of range, a count too large,
    negative or zero; the bytes cut in half."""
    out = []

    def mutated(i, how, match):
        p = [t.clone() for t in two]
        p[i] = how(p[i])
        out.append((tuple(p), match))

    def at(j, v):
        def how(t):
            t[j] = v
            return t
        return how

    if spec.startswith("rangefloat"):
        mutated(1, at(0, 500), "rangefloat \\(.*malformed")            # an exponent
        mutated(1, at(1, 7), "rangefloat \\(.*malformed")              # a count
        return out
    where = "index out of range \\[0, \\d+\\)"           # (dct: of the padded blocks)
    mutated(-1, at(3, n + 10 ** 6), where)
    mutated(-1, at(0, -1), where)
    if len(two) == 3:                                    # range-float values' headers
        for j, v in ((0, 500), (1, 10 ** 6), (1, -5), (3, 0)):
            mutated(1, at(j, v), "headers do not describe")
        mutated(0, lambda t: t[:t.numel() // 2], "headers do not describe")   # bytes cut
    return out


@pytest.mark.parametrize("spec, backend", [("topk:density=0.01", "triton"),
                                           ("topk:density=0.01", "torch"),
                                           ("topk:density=0.01,values=rangefloat8", "triton"),
                                           ("dct:density=0.01", "triton"),
                                           ("rangefloat:bits=8", "triton")])
def test_deferred_checks_raise_the_clear_error_at_settle(spec, backend, monkeypatch):
    """Inside ``deferred_checks`` (as the exchange driver decompresses) a malformed peer
    payload (an index out of range; a range-float header or byte count that does not
    describe the payload) decodes without a readback and without reading or writing out
    of bounds, and ``settle_checks`` raises the ValueError; a good payload's sum is the
    one checked at once."""
    from hvd_compress.ops import torch_ops
    monkeypatch.setenv("HVD_COMPRESS_BACKEND", backend)
    lay = layout(["a", "b"], [(300,), (5000,)])
    c = from_spec(spec)
    payload, ctx = c.compress_bucket(laplace(lay.total, 0), lay)
    two = tuple(torch.cat([p, p]) for p in payload)
    sink = []
    with torch_ops.deferred_checks(sink):
        got = c.decompress_bucket(two, ctx)
    torch_ops.settle_checks(sink)
    assert not sink
    torch.testing.assert_close(got, c.decompress_bucket(two, ctx), rtol=0, atol=0)
    for wrong, match in _malformed(spec, two, lay.total):
        with counting.CountSyncs() as seen, torch_ops.deferred_checks(sink):
            assert c.decompress_bucket(wrong, ctx).shape == (lay.total,)
        assert not seen.syncs and sink, (seen.syncs, sink)
        with pytest.raises(ValueError, match=match):
            torch_ops.settle_checks(sink)
        assert not sink
    if len(two) == 3:                   # no header at all (but indices): raised at once
        with torch_ops.deferred_checks(sink), pytest.raises(ValueError, match="malformed"):
            c.decompress_bucket((two[0], two[1][:0], two[2]), ctx)
        assert not sink


def test_randomk_draws_do_not_depend_on_the_prefix_read(monkeypatch):
    """randomk reads a prefix of its draws sized to hold k distinct indices and doubles
    it when it does not: a prefix of 64 draws (several doublings) gives the same indices."""
    from hvd_compress.ops.torch_ops import _draws as draws
    numels, ks = (1000, 5000, 37, 0, 300), (200, 50, 3, 1, 150)
    want = draws.draw_segments(numels, ks, 7, [3, 4, 5, 6, 7])

    class Log:                                        # every prefix: 64 draws
        @staticmethod
        def log(_):
            return 0.0
    monkeypatch.setattr(draws, "_math", Log)
    got = draws.draw_segments(numels, ks, 7, [3, 4, 5, 6, 7])
    assert torch.equal(got, want)
    assert got.numel() == 200 + 50 + 3 + 150


def test_kernel_select_defers_its_kernel_ids_check(monkeypatch):
    """Hylo's kernel selection: inside ``deferred_checks`` its kernel ids' range check
    joins the sink (no readback; the ids clamped meanwhile) and the settle raises the
    clear error; a good payload decodes to what the check at once gives."""
    from hvd_compress.ops import torch_ops
    c = from_spec("kernel_select")
    payload, ctx = c.compress(laplace(8 * 4 * 9, 0).reshape(8, 4, 3, 3), "conv")
    values, ids = payload
    for bad, error in ((ids, None), (ids + 10 ** 6, "kernel_select \\(conv\\).*out of range")):
        sink = []
        with counting.CountSyncs() as syncs, torch_ops.deferred_checks(sink):
            got = c.decompress((values, bad), ctx)
        assert not syncs.syncs and len(sink) == 1, syncs.syncs
        if error is None:
            torch_ops.settle_checks(sink)
            assert torch.equal(got, c.decompress((values, bad), ctx))
        else:
            with pytest.raises(ValueError, match=error):
                torch_ops.settle_checks(sink)
            with pytest.raises(ValueError, match=error):
                c.decompress((values, bad), ctx)                 # at once, outside
