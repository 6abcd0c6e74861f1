"""The launch cache's own logic (``hvd_compress/kernels/_launch.py``): when it passes a
call to Triton's dispatch, when it reuses a compiled kernel, and what that kernel's
launcher is given.  Triton's dispatch and compiled kernels cannot run here (no GPU), so
these tests give the cache a recording stand-in for a ``triton.jit`` function and for the
kernel it compiles; ``tests/gpu/test_gpu_launch_cache.py`` runs the real ones on CUDA,
bit for bit against the plain dispatch, and the interpreter test below runs real kernels
through the cache's pass-through."""
import pytest
import torch

from hvd_compress.kernels import _launch


class FakeTensor:
    """What the cache reads of a CUDA tensor: ``is_cuda``, ``device``, ``dtype``,
    ``data_ptr()``."""

    is_cuda = True
    device = torch.device("cuda", 0)

    def __init__(self, ptr, dtype=torch.float32):
        self.ptr, self.dtype = ptr, dtype

    def data_ptr(self):
        return self.ptr


class Compiled:
    def __init__(self, log):
        self.log = log

    def __getitem__(self, grid):
        self.log.append(("runner", grid))
        return lambda *args: self.log.append(("direct", grid, args))


class FakeJit:
    """A stand-in for ``triton.jit`` of ``kernel(x_ptr, n, BLOCK: constexpr, FLAG:
    constexpr = False)``: records each dispatch and returns one compiled kernel per call."""

    constexprs = [2, 3]

    def __init__(self):
        self.log = []

        def kernel(x_ptr, n, BLOCK, FLAG=False):
            pass
        self.fn = kernel

    def __getitem__(self, grid):
        def dispatch(*args, **kwargs):
            self.log.append(("jit", grid, args, kwargs))
            return Compiled(self.log)
        return dispatch


@pytest.fixture
def cache(monkeypatch):
    monkeypatch.setenv("HVD_COMPRESS_LAUNCH_CACHE", "1")
    monkeypatch.setattr(_launch, "_supported_triton", lambda: True)
    jit = FakeJit()
    return jit, _launch.cached(jit)


def kinds(jit):
    return [entry[0] for entry in jit.log if entry[0] != "runner"]


def test_a_second_launch_of_the_same_specialisation_calls_the_compiled_kernel(cache):
    jit, k = cache
    x = FakeTensor(1024)
    k[(4,)](x, 1000, BLOCK=256)
    k[(7, 2)](FakeTensor(2048), 999, BLOCK=256)       # another aligned address, another n
    assert kinds(jit) == ["jit", "direct"]
    # every parameter in the kernel's order, the constexpr's default included; 3-D grid
    direct = [e for e in jit.log if e[0] == "direct"][0]
    assert direct[1:] == ((7, 2, 1), (direct[2][0], 999, 256, False))


def test_a_hit_keeps_the_compiled_kernels_runner_for_its_grid(cache):
    """``compiled[grid]`` makes a runner (a closure; it picks the stream when it runs):
    made once a grid, then reused."""
    jit, k = cache
    for grid in [(4,), (4,), (4,), (5,), (4,)]:
        k[grid](FakeTensor(1024), 1000, BLOCK=256)
    assert kinds(jit) == ["jit"] + ["direct"] * 4
    assert [e[1] for e in jit.log if e[0] == "runner"] == [(4, 1, 1), (5, 1, 1)]


def test_keywords_given_in_another_order_are_the_same_kernel_or_a_miss(cache):
    """Constexprs by keyword are keyed as given (no sort): another order may miss once,
    never hit a kernel compiled for other values."""
    jit, k = cache
    k[(1,)](FakeTensor(1024), 1000, BLOCK=256, FLAG=True)
    k[(1,)](FakeTensor(1024), 1000, FLAG=True, BLOCK=256)
    k[(1,)](FakeTensor(1024), 1000, FLAG=False, BLOCK=256)
    k[(1,)](FakeTensor(1024), 1000, FLAG=True, BLOCK=256)
    assert kinds(jit) == ["jit", "jit", "jit", "direct"]
    assert jit.log[-1][2][2:] == (256, True)


def test_the_key_of_an_interpreted_kernel_takes_its_constexprs_from_the_annotations():
    """Under Triton's interpreter a kernel has no ``constexprs`` list: the cache reads
    them from its annotations (benchmarks time the key on the CPU)."""
    from hvd_compress.kernels import histogram_select as H
    k = H._kernels().histogram
    names, constexprs, _ = k.params()
    assert {"BINS", "BLOCK", "LOCAL", "ALIGN", "PICK", "CHUNK"} <= constexprs
    assert "x_ptr" in names and "x_ptr" not in constexprs
    x = torch.zeros(8)
    kw = {"BINS": 14, "BLOCK": 8}
    assert k.key((x, 3), kw) == k.key((torch.ones(8), 3), kw) != k.key((x, 1), kw)


@pytest.mark.parametrize("change", ["alignment", "dtype", "one", "multiple of 16", "int64",
                                    "constexpr", "num_warps", "device"])
def test_what_triton_specialises_on_is_a_new_kernel(cache, change):
    jit, k = cache
    k[(1,)](FakeTensor(1024), 1000, BLOCK=256)
    x, n, kw = FakeTensor(1024), 1000, {"BLOCK": 256}
    if change == "alignment":
        x = FakeTensor(1024 + 4)
    elif change == "dtype":
        x = FakeTensor(1024, torch.int32)
    elif change == "one":
        n = 1
    elif change == "multiple of 16":
        n = 1024
    elif change == "int64":
        n = 2 ** 40 + 8
    elif change == "constexpr":
        kw = {"BLOCK": 512}
    elif change == "num_warps":
        kw = {"BLOCK": 256, "num_warps": 8}
    else:
        x.device = torch.device("cuda", 1)
    k[(1,)](x, n, **kw)
    assert kinds(jit) == ["jit", "jit"]


def test_a_constexpr_given_by_position_is_keyed_by_its_value(cache):
    jit, k = cache
    k[(1,)](FakeTensor(1024), 1000, 256)
    k[(1,)](FakeTensor(1024), 1000, 512)
    k[(1,)](FakeTensor(1024), 1000, 512)
    assert kinds(jit) == ["jit", "jit", "direct"]


def test_off_by_default_and_for_cpu_tensors(monkeypatch):
    monkeypatch.setattr(_launch, "_supported_triton", lambda: True)
    jit = FakeJit()
    k = _launch.cached(jit)
    monkeypatch.delenv("HVD_COMPRESS_LAUNCH_CACHE", raising=False)
    for _ in range(2):
        k[(1,)](FakeTensor(1024), 1000, BLOCK=256)
    monkeypatch.setenv("HVD_COMPRESS_LAUNCH_CACHE", "1")
    for _ in range(2):
        k[(1,)](torch.zeros(4), 1000, BLOCK=256)
    assert kinds(jit) == ["jit"] * 4
    monkeypatch.setenv("HVD_COMPRESS_LAUNCH_CACHE", "yes")
    with pytest.raises(ValueError, match="HVD_COMPRESS_LAUNCH_CACHE must be 0 or 1"):
        k[(1,)](FakeTensor(1024), 1000, BLOCK=256)


def test_another_triton_passes_through(monkeypatch):
    monkeypatch.setenv("HVD_COMPRESS_LAUNCH_CACHE", "1")
    monkeypatch.setattr(_launch, "_supported_triton", lambda: False)
    jit = FakeJit()
    k = _launch.cached(jit)
    for _ in range(2):
        k[(1,)](FakeTensor(1024), 1000, BLOCK=256)
    assert kinds(jit) == ["jit", "jit"]


def test_real_kernels_pass_through_in_the_interpreter(monkeypatch):
    """With the cache asked for, a real kernel on CPU tensors (Triton's interpreter) gives
    what it gives without, and the cache neither hits nor misses."""
    from hvd_compress.kernels import segmented as S
    x = torch.randn(10_000)
    want = S.segment_abs_sum_max(x, [3000, 7000], backend="triton")
    monkeypatch.setenv("HVD_COMPRESS_LAUNCH_CACHE", "1")
    before = dict(_launch.STATS)
    got = S.segment_abs_sum_max(x, [3000, 7000], backend="triton")
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert _launch.STATS == before
