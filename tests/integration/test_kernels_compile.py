"""Every Triton kernel of the package compiles for the lent GPU (sm_90: H100, H200), on a
machine without one.

Triton's interpreter, which runs the kernel tests here, does not compile: a kernel that
fails to compile would be found only on a lent GPU, whose 15 minutes it would cost.  So
the kernel tests run once more with ``HVD_COMPRESS_COMPILE_FOR=90``
(tests/triton_compile.py): every launch is compiled by Triton's compiler, down to a cubin
with the ptxas that Triton ships, then interpreted as usual.  This asserts that they
pass so, that every ``@triton.jit`` function in ``hvd_compress/kernels`` was compiled at
least once, within the shared memory of one program and without spilling registers,
and, on a broken kernel that the interpreter runs happily, that the check
fails with the kernel named.  ``make compile-check`` does the same with Triton 3.6, the
GPU machine's version, over every kernel test.  What it cannot promise: that the
compiled code computes what the interpreter computes."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# together these launch every kernel (test_bucket_syncs most of them; test_hylo the
# one-tensor twobit kernels; test_dct the one-tensor DCT; the review file the segment
# counts; test_kernels the top-k kernels)
TESTS = ["test_kernels.py", "test_bucket_syncs.py", "test_hylo.py", "test_dct.py",
         "test_histogram_select_review.py", "test_onebit_segments.py",
         "test_uniform_draws.py"]


def defined_kernels():
    """``module.function`` of every ``@triton.jit`` kernel in hvd_compress/kernels (named
    ``*_kernel``; a helper that kernels call, such as ``histogram_select._pick``, is
    compiled inside them)."""
    names = set()
    for path in (ROOT / "hvd_compress" / "kernels").glob("*.py"):
        for fn in re.findall(r"@triton\.jit[^\n]*\n\s*def (\w+_kernel)\b", path.read_text()):
            names.add(f"{path.stem}.{fn}")
    return names


#: kernels allowed an atomic that orders memory, and how many: the histogram's per-block
#: counter when it also makes the search's step (``FOLD_PICK``: the block's counts must
#: be visible to the tensor's last block), one per block, not per entry
ORDERED_ATOMICS = {"histogram_select._histogram_kernel": 1}


def compile_env(**extra):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["HVD_COMPRESS_COMPILE_FOR"] = "90"
    env.update(extra)
    return env


def test_every_kernel_compiles_for_sm90_and_still_passes_its_tests(tmp_path):
    from triton_compile import SHARED_LIMIT          # what one program may use on sm_90
    report = tmp_path / "compiled.json"
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        *[f"tests/unit/{t}" for t in TESTS]],
                       cwd=ROOT, env=compile_env(HVD_COMPRESS_COMPILE_REPORT=str(report)),
                       capture_output=True, text=True, timeout=900)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    assert "Triton kernels compiled for sm_90" in out
    compiled = json.loads(report.read_text())
    assert compiled["arch"] == 90
    kernels = compiled["kernels"]
    want = defined_kernels()
    assert len(want) >= 29, want                       # the scan found the kernels
    missing = sorted(k for k in want if kernels.get(k, {}).get("specialisations", 0) == 0)
    assert not missing, f"never compiled: {missing}"
    assert all(kernels[k]["max_shared"] <= SHARED_LIMIT[90] for k in want)
    # no kernel spills registers to local memory (it would be slower than it looks);
    # registers were read from every cubin (cuobjdump, shipped with Triton)
    assert all(0 < kernels[k]["max_registers"] <= 255 for k in want), kernels
    assert not [k for k in want if kernels[k]["max_local_bytes"]], kernels
    # no 64-bit integer division (an 85-instruction subroutine on sm_90, which has no
    # divider: the histogram kernel had one per entry) and no atomic that orders memory
    # (Triton's default acq_rel puts a MEMBAR.ALL.GPU before each: every kernel's atomics
    # are counters or maxima, read after the launch)
    assert not [k for k in want if kernels[k]["max_div64"]], kernels
    assert not [k for k in want
                if kernels[k]["max_ordered_atomics"] > ORDERED_ATOMICS.get(k, 0)], kernels


BROKEN = r'''
import os
import sys
COMPILE = sys.argv[1] == "compile"
if COMPILE:
    sys.path.insert(0, "tests")
    import triton_compile
    triton_compile.enable(90)
else:
    os.environ["TRITON_INTERPRET"] = "1"
import torch
import triton
import triton.language as tl


@triton.jit
def _loop_changes_type(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    acc = 0                                     # int32 before the loop ...
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc += tl.sum(tl.load(x_ptr + offs, mask=offs < n, other=0.0), axis=0)   # ... fp32
    tl.store(out_ptr, acc)


@triton.jit
def _block_sum(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr, tl.sum(tl.load(x_ptr + offs, mask=offs < n, other=0.0), axis=0))


x, out = torch.arange(10, dtype=torch.float32), torch.zeros(1)
_block_sum[(1,)](x, out, 10, BLOCK=16)           # compiles, and the interpreter computes
assert out.item() == 45.0, out
try:
    _loop_changes_type[(1,)](x, out, 10, BLOCK=4)
    print("RAN", out.item())
except RuntimeError as e:
    print("ERROR", e)
if not COMPILE:
    sys.exit(0)
triton_compile.SHARED_LIMIT[90] = 1               # a device with no shared memory
try:
    _block_sum[(1,)](x, out, 10, BLOCK=1024)      # a new specialisation: 4 warps share a sum
except RuntimeError as e:
    print("ERROR", e)
'''


def test_the_check_fails_on_a_kernel_the_interpreter_runs(tmp_path):
    script = tmp_path / "broken.py"
    script.write_text(BROKEN)
    r = subprocess.run([sys.executable, str(script), "interpret"], cwd=ROOT,
                       env=compile_env(HVD_COMPRESS_COMPILE_FOR=""),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert "RAN 45.0" in r.stdout, r.stdout                 # the interpreter takes it
    r = subprocess.run([sys.executable, str(script), "compile"], cwd=ROOT, env=compile_env(),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    errors = [line for line in r.stdout.splitlines() if line.startswith("ERROR")]
    assert len(errors) == 2, r.stdout
    assert "_loop_changes_type does not compile for sm_90" in errors[0]
    assert "_block_sum needs" in errors[1] and "sm_90 allows 1" in errors[1]
