"""Shared fixtures: the session-wide horovodrun jobs whose results many integration tests
read, and the GPU tests' records.  Launch helpers are in ``launch.py``, independent
references in ``reference.py`` (import those, not this module)."""
import os
import platform

# Triton's interpreter computes tl.dot with numpy's matmul, and OpenBLAS's Haswell/Zen
# sgemm kernels round a row differently by its position in the matrix (a row of a 32 x 32
# product changes in the last bit when the rows are rolled; SkylakeX's and the SSE
# kernels do not).  Then a kernel launched on a bucket differs in the last bit from the
# same kernel launched tensor by tensor, though it computes each row alike (seen
# 2026-11-25 on a machine whose environment sets OPENBLAS_CORETYPE=Haswell:
# tests/unit/test_dct.py, test_dct_bucket.py).  The tests pin a kernel that every x86-64 CPU has and that rounds
# a row the same wherever it is, before numpy loads OpenBLAS (torch imports numpy).
if platform.machine() in ("x86_64", "AMD64"):
    os.environ["OPENBLAS_CORETYPE"] = "Nehalem"

# CUDA-graph replay is on by default for CUDA tensors (hvd_compress/compressors/replay.py);
# the tests run eagerly unless they ask for it (the replay tests set it themselves), so
# that a GPU test of a kernel's launches or syncs sees them, and so do its subprocesses.
os.environ.setdefault("HVD_COMPRESS_CUDA_GRAPHS", "0")

import torch  # noqa: E402

# Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors.  It must be on
# before any kernel module is imported (triton.jit reads it at decoration time).  With
# HVD_COMPRESS_COMPILE_FOR=90 (make compile-check) every launch is also compiled for that
# GPU first (tests/triton_compile.py), which needs the interpreter off at decoration time.
COMPILE_FOR = os.environ.get("HVD_COMPRESS_COMPILE_FOR")
if COMPILE_FOR:
    import triton_compile  # noqa: E402
    triton_compile.enable(int(COMPILE_FOR))
elif not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Triton must be loaded before TensorFlow in one process: loaded after it, both register
# the same LLVM command-line options and the process aborts.  Tests use both.
try:
    import triton  # noqa: F401,E402
except ImportError:
    pass
import pytest

from launch import HOROVODRUN, ROOT, horovodrun, load_ranks  # noqa: E402,F401


@pytest.fixture(scope="session")
def torch_job(tmp_path_factory):
    """One horovodrun job running every PyTorch scenario but the failing one."""
    out = tmp_path_factory.mktemp("torch_job")
    rc, log = horovodrun([ROOT / "tests/workers/torch_worker.py", "aggregate", "functional",
                          "empty_rank", "nonfinite", "checkpoint", "stock", "policy", "buckets", "agg",
                          "auto", "replay"], out)
    assert rc == 0, log[-6000:]
    return out


@pytest.fixture(scope="session")
def tf_job(tmp_path_factory):
    """One horovodrun job running every TensorFlow scenario but the failing one."""
    out = tmp_path_factory.mktemp("tf_job")
    rc, log = horovodrun([ROOT / "tests/workers/tf_worker.py", "aggregate", "functional",
                          "empty_rank", "nonfinite", "checkpoint", "policy", "buckets", "agg",
                          "auto"], out)
    assert rc == 0, log[-6000:]
    return out


def _agg3_job(tmp_path_factory, worker):
    """The aggregation-aware scenario on three ranks (-np 3) of ``worker``; a process set
    of ranks 0 and 2 needs Horovod's dynamic process sets."""
    out = tmp_path_factory.mktemp("agg3_job")
    rc, log = horovodrun([ROOT / "tests/workers" / worker, "agg"], out, np_=3,
                         env={"HOROVOD_DYNAMIC_PROCESS_SETS": "1"})
    assert rc == 0, log[-6000:]
    return out


# one fixture a framework: `make test` runs test files on two pytest-xdist workers
# (--dist loadfile), where a session fixture that both frameworks' files asked for
# would launch both jobs on each worker
@pytest.fixture(scope="session")
def agg3_torch_job(tmp_path_factory):
    return _agg3_job(tmp_path_factory, "torch_worker.py")


@pytest.fixture(scope="session")
def agg3_tf_job(tmp_path_factory):
    return _agg3_job(tmp_path_factory, "tf_worker.py")


# --- GPU tests (tests/gpu/, `make gpu-test`, ci/gpu.sh) --------------------------------
# Every Triton kernel and compressor on CUDA tensors, and host-synchronisation counts;
# each module is marked ``gpu`` and skipped, with a reason, without a CUDA device.
# Measured figures are collected with the ``record`` fixture and written as JSON to
# ``$HVD_COMPRESS_GPU_RECORD`` at the end of the session; ci/gpu.sh folds them into its
# summary.  (This lives here, not in tests/gpu/conftest.py: two conftest modules both
# named ``conftest`` shadow each other, and ``from conftest import ...`` breaks.)
import json  # noqa: E402

RECORDS = {}


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (run with `make gpu-test`)")
    config.addinivalue_line("markers", "gpu_big: a GPU test with tensors of >= 2^28 elements")


@pytest.fixture(scope="session")
def record():
    """``record(section, key, value)``: keep a measured figure for the summary JSON."""
    def put(section, key, value):
        RECORDS.setdefault(section, {})[key] = value

    yield put
    path = os.environ.get("HVD_COMPRESS_GPU_RECORD")
    if path and RECORDS:
        old = {}
        if os.path.exists(path):
            with open(path) as f:
                old = json.load(f)
        for section, values in RECORDS.items():
            old.setdefault(section, {}).update(values)
        with open(path, "w") as f:
            json.dump(old, f, indent=1, sort_keys=True)


@pytest.fixture
def free_cuda_cache():
    """Release cached CUDA memory after a test with large tensors."""
    yield
    import gc

    import torch
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def pytest_terminal_summary(terminalreporter):
    """Under ``HVD_COMPRESS_COMPILE_FOR``: every kernel compiled, and how (the most shared
    memory, registers and spilled bytes of its variants, the fewest of its warps that fit
    on an SM at once, of 64, the width in bits of most of its global loads and stores, in
    its best variant; its machine instructions, and per entry at its widest block; its
    64-bit integer divisions, and atomics with acquire/release order: see
    ``triton_compile.instruction_counts``); the table also goes to
    ``$HVD_COMPRESS_COMPILE_REPORT`` (JSON) when that is set."""
    if not COMPILE_FOR:
        return
    import triton

    rows = triton_compile.report()
    tr = terminalreporter
    tr.section(f"Triton kernels compiled for sm_{COMPILE_FOR} (triton {triton.__version__})")
    tr.write_line(f"{'kernel':40s} {'variants':>8s} {'shared B':>9s} {'warps':>6s} {'regs':>5s} "
                  f"{'spill B':>7s} {'warps/SM':>8s} {'ld/st bits':>10s} {'sass':>6s} "
                  f"{'/entry':>6s} {'div64':>5s} {'acq':>4s} {'s':>6s}")
    for name, r in sorted(rows.items()):
        tr.write_line(f"{name:40s} {r['specialisations']:8d} {r['max_shared']:9d} "
                      f"{','.join(map(str, r['num_warps'])):>6s} {r['max_registers']:5d} "
                      f"{r['max_local_bytes']:7d} {r['min_resident_warps']:8d} "
                      f"{r['load_bits']:>5d}/{r['store_bits']:<4d} {r['max_sass']:6d} "
                      f"{r['sass_per_entry']:6.1f} {r['max_div64']:5d} "
                      f"{r['max_ordered_atomics']:4d} {r['seconds']:6.1f}")
    path = os.environ.get("HVD_COMPRESS_COMPILE_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump({"arch": int(COMPILE_FOR), "triton": triton.__version__,
                       "torch": torch.__version__, "kernels": rows}, f, indent=1, sort_keys=True)
