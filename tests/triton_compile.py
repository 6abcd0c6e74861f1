"""Compile every Triton kernel for a GPU that is not here, then run it in the interpreter.

Triton's interpreter (``TRITON_INTERPRET=1``) runs a kernel's Python on numpy: it checks
what a kernel computes, not that the kernel compiles.  A lent GPU is rare (15 minutes of
device time), so a kernel that fails to compile there costs the session its one run.
This module makes the CPU test run compile, too: with :func:`enable`, every kernel
launch is first compiled by Triton's real compiler for a CUDA target (sm_90 by default,
the lent H100/H200: TTIR, TTGIR, LLVM IR, PTX, then ``ptxas`` into a cubin -- Triton
ships ``ptxas``, no GPU or driver is needed), with the arguments, specialisations and
meta-parameters of that launch, then run in the interpreter as before, so the test
still checks the results.

What the compiler catches that the interpreter does not: a loop-carried value whose
type changes, a constexpr a kernel needs but is not given, type errors in ``tl.where``
or in a store, an op the backend lacks, and shared memory past what one program may
use on the device (checked here against ``SHARED_LIMIT``).  What it cannot catch: that
the compiled code computes what the interpreter computes (only a GPU says that).

Enabled by ``HVD_COMPRESS_COMPILE_FOR=<arch>`` (``90``) in ``tests/conftest.py``, which
then leaves ``TRITON_INTERPRET`` unset (``triton.jit`` must build compilable
functions); ``make compile-check`` runs the kernel tests so.  ``report()`` lists every
specialisation compiled, with its shared memory, warps, registers per thread, local
memory per thread (spills: a kernel that needs it is slower than it should be, which
the table shows; it is not an error), the width of most global loads and stores, and
compile time.

Imports: the standard library and triton (private parts: the driver seam, the JIT
function and the interpreter, as of Triton 3.6-3.9).
"""
import collections
import concurrent.futures
import os
import re
import subprocess
import tempfile
import time

import triton
import triton.backends.nvidia as nvidia_backend
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.interpreter import InterpretedFunction, _patch_lang
from triton.runtime.jit import JITFunction

#: the most shared memory one program may use, by compute capability (bytes; CUDA's
#: ``sharedMemPerBlockOptin``: 227 KiB on sm_90, 163 KiB on sm_80)
SHARED_LIMIT = {90: 232448, 80: 166912, 89: 101376, 86: 101376}

#: one row per specialisation compiled: kernel, arch, shared bytes, warps, seconds,
#: registers, local (spilled) bytes, load and store widths
COMPILED = []

#: every jitted function defined since :func:`enable` (kernels and their helpers)
DEFINED = set()

_INTERPRETED = {}
_SEEN = {}

#: where each variant's machine instructions are counted (``cuobjdump -sass`` takes some
#: 0.3 s a cubin): one thread beside the interpreter, read by :func:`report`; None when
#: :func:`enable` was told that nothing reads them
_COUNTING = None


def _name(fn):
    """``module.function``: kernels of different modules may share a name."""
    return f"{fn.__module__.rsplit('.', 1)[-1]}.{fn.__name__}"


class _TargetOnly:
    """A driver that names a CUDA target and nothing else (no device, no launch)."""

    def __init__(self, arch):
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target

    def is_active(self):
        return True


class CompiledThenInterpreted(JITFunction):
    """``triton.jit``'s function, whose launch compiles for the target, then interprets."""

    arch = 90

    def __init__(self, fn, **kwargs):
        super().__init__(fn, **kwargs)
        DEFINED.add(_name(fn))

    def run(self, *args, grid, warmup, **kwargs):
        start = time.perf_counter()
        try:
            compiled = super().run(*args, grid=grid, warmup=True, **kwargs)
        except Exception as e:   # the compiler's own error, with the kernel named
            raise RuntimeError(f"Triton kernel {self.fn.__name__} does not compile for "
                               f"sm_{self.arch}: {e}") from e
        if id(compiled) in _SEEN:      # compiled before: Triton's cache
            return self._interpret(compiled, args, grid, warmup, kwargs)
        _SEEN[id(compiled)] = compiled
        shared = compiled.metadata.shared
        row = {"kernel": _name(self.fn), "arch": self.arch, "shared": shared,
               "num_warps": compiled.metadata.num_warps, "block": kwargs.get("BLOCK"),
               "seconds": round(time.perf_counter() - start, 3),
               **resource_usage(compiled.asm.get("cubin")),
               **access_widths(compiled.asm.get("ptx", ""))}
        if _COUNTING is not None:
            row["counts"] = _COUNTING.submit(instruction_counts, compiled.asm.get("cubin"),
                                             compiled.asm.get("ptx", ""))
        COMPILED.append(row)
        limit = SHARED_LIMIT.get(self.arch)
        if limit is not None and shared > limit:
            raise RuntimeError(f"Triton kernel {self.fn.__name__} needs {shared} bytes of shared "
                               f"memory; sm_{self.arch} allows {limit}")
        return self._interpret(compiled, args, grid, warmup, kwargs)

    def _interpret(self, compiled, args, grid, warmup, kwargs):
        if warmup:
            return compiled
        knobs.runtime.interpret = True
        if "CHUNK" in kwargs and "BLOCK" in kwargs:
            # compiled as a GPU runs it, a program's block read in chunks; interpreted a
            # block at once, as on CPU tensors (kernels._backend.program_chunk), which
            # computes the same (the kernel tests check it) without the loop's numpy calls
            kwargs = dict(kwargs, CHUNK=kwargs["BLOCK"])
        try:
            return _interpreted(self.fn).run(*args, grid=grid, warmup=False, **kwargs)
        finally:
            knobs.runtime.interpret = False


def cuobjdump(cubin, option):
    """What ``cuobjdump <option>`` (shipped with Triton) prints of a cubin, or None where
    the tool or the cubin is missing."""
    tool = os.path.join(os.path.dirname(nvidia_backend.__file__), "bin", "cuobjdump")
    if not cubin or not os.path.exists(tool):
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        for attempt in range(3):
            try:
                return subprocess.run([tool, option, f.name], capture_output=True,
                                      text=True).stdout
            except OSError:   # the spawn itself failed: EFAULT once in CI (2026-11-29),
                if attempt == 2:                   # from the report's worker threads
                    raise
                time.sleep(0.5)


def resource_usage(cubin):
    """``{"registers", "local_bytes"}`` of a cubin's function, as ``cuobjdump -res-usage``
    (shipped with Triton) reads it: registers per thread, and local memory per thread
    (register spills and stack; 0 in a kernel that keeps everything in registers).
    ``{}`` where the tool or the cubin is missing."""
    out = cuobjdump(cubin, "-res-usage")
    if out is None:
        return {}
    usage = dict(re.findall(r"\b(REG|STACK|LOCAL):(\d+)", out))
    if "REG" not in usage:
        return {}
    return {"registers": int(usage["REG"]),
            "local_bytes": int(usage.get("STACK", 0)) + int(usage.get("LOCAL", 0))}


#: a PTX atomic with acquire or release order (``atom.global.gpu.acq_rel.add.u64``)
ORDERED_ATOMIC = re.compile(r"\b(?:atom|red)\.[\w.]*\.(?:acq_rel|acquire|release)\b")


def instruction_counts(cubin, ptx):
    """``{"sass", "div64", "ordered_atomics"}``: the machine instructions in a cubin's
    code (``cuobjdump -sass``: straight-line kernels run each about once per thread, so
    with the entries each thread holds it is a static cost per entry); the 64-bit
    integer divisions and remainders in its PTX (sm_90 has no integer divider: each is a
    subroutine of some 85 instructions, run per entry when the division is per entry);
    and its atomics with acquire or release order (Triton's default ``sem="acq_rel"``:
    ptxas puts a ``MEMBAR.ALL.GPU`` before each, which waits for the thread's memory
    traffic; a counter needs ``sem="relaxed"``, a fire-and-forget ``RED``).  ``{}``
    where the tool or the cubin is missing."""
    out = cuobjdump(cubin, "-sass")
    if out is None:
        return {}
    sass = re.findall(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?!NOP\b)\S", out, flags=re.M)
    return {"sass": len(sass), "div64": len(re.findall(r"\b(?:div|rem)\.[su]64\b", ptx)),
            "ordered_atomics": len(re.findall(ORDERED_ATOMIC, ptx))}


def access_widths(ptx):
    """``{"load_bits", "store_bits"}``: the width, in bits per thread and instruction, of
    most of a kernel's global loads and stores in its PTX (128: ``ld.global.v4.b32``, four
    floats at once, the vectorised access that streams memory fastest; 32: one float at
    a time; 0: none).  Triton vectorises where it can prove addresses contiguous and
    16-byte aligned, so a kernel whose offsets are loaded from a table gets 32."""
    def typical(op):
        found = re.findall(op + r"\.global(?:\.[a-z]+)*?\.(?:v(\d)\.)?[bsuf](\d+)", ptx)
        widths = collections.Counter(int(v or 1) * int(b) for v, b in found)
        return max(widths, key=lambda w: (widths[w], w)) if widths else 0
    return {"load_bits": typical("ld"), "store_bits": typical("st")}


def resident_warps(registers, shared, num_warps, arch=90):
    """Warps of one kernel that fit on an SM at once (of 64 on sm_80/sm_90), limited by
    registers (65,536 per SM, given out per warp in units of 256), shared memory (228 KiB
    per SM on sm_90, 164 on sm_80, with 1 KiB reserved per program) and 32 programs per
    SM: CUDA's occupancy calculation.  A static figure, not a measured one."""
    per_warp = -(-registers * 32 // 256) * 256
    programs = (65536 // per_warp) // num_warps if per_warp else 32
    sm_shared = {90: 233472, 80: 167936}.get(arch, 102400)
    programs = min(programs, sm_shared // (shared + 1024), 32)
    return min(programs * num_warps, 64)


def _interpreted(fn):
    f = _INTERPRETED.get(fn)
    if f is None:
        f = _INTERPRETED[fn] = InterpretedFunction(fn)
    return f


_jit_call = JITFunction.__call__


def _call(self, *args, **kwargs):
    """A jitted function called inside an interpreted kernel (``tl.max``, a helper) runs
    interpreted; anywhere else Triton's own rule holds (it may not be called)."""
    if not knobs.runtime.interpret:
        return _jit_call(self, *args, **kwargs)
    # as InterpretedFunction.__call__, but the language patches are undone afterwards
    # (the compiler, next, must see triton.language as it is)
    scope = _patch_lang(self.fn)
    try:
        return _interpreted(self.fn).rewrite()(*args, **kwargs)
    finally:
        scope.restore()


def _jit(fn=None, **kwargs):
    if fn is None:
        return lambda f: CompiledThenInterpreted(f, **kwargs)
    return CompiledThenInterpreted(fn, **kwargs)


def enable(arch=90, counts=True):
    """From now on, ``triton.jit`` kernels compile for ``sm_<arch>`` at every launch, then
    run in the interpreter.  Call before any kernel is defined (the package defines its
    kernels on first launch), with ``TRITON_INTERPRET`` unset.  ``counts=False``: no
    :func:`instruction_counts` (for a run that never calls :func:`report`)."""
    global _COUNTING
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("triton_compile.enable needs TRITON_INTERPRET unset: the "
                           "interpreter's triton.jit builds functions that cannot compile")
    CompiledThenInterpreted.arch = int(arch)
    # the kernels compiled as a GPU gets them: read in chunks where a launcher would on
    # CUDA (kernels._backend.program_chunk; CPU tensors are otherwise read a block at once)
    os.environ["HVD_COMPRESS_CHUNKS_ON_CPU"] = "1"
    if counts and _COUNTING is None:
        _COUNTING = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="cuobjdump")
    knobs.runtime.interpret = False     # whatever TRITON_INTERPRET says later (a benchmark
    driver.set_active(_TargetOnly(int(arch)))   # sets it on the CPU)
    JITFunction.__call__ = _call
    triton.jit = _jit


def report():
    """``{kernel: {"specialisations", "max_shared", "num_warps", "seconds",
    "max_registers", "max_local_bytes", "min_resident_warps", "load_bits", "store_bits"}}``
    over the variants compiled so far (the most of each, the fewest resident warps, the
    widest typical access), for every jitted function of this package defined so far (a
    kernel never launched, or a helper that is compiled inside its callers, has 0
    specialisations and zeros)."""
    rows = collections.defaultdict(list)
    for row in COMPILED:
        pending = row.pop("counts", None)
        if pending is not None:
            row.update(pending.result())
        rows[row["kernel"]].append(row)
    names = {n for n in DEFINED if not n.startswith(("standard.", "core.", "math."))} | set(rows)
    out = {}
    for name in names:
        rs = rows[name]

        def most(key, rs=rs):
            return max((r.get(key, 0) for r in rs), default=0)

        out[name] = {"specialisations": len(rs), "max_shared": most("shared"),
                     "num_warps": sorted({r["num_warps"] for r in rs}),
                     "seconds": round(sum(r["seconds"] for r in rs), 2),
                     "max_registers": most("registers"), "max_local_bytes": most("local_bytes"),
                     "min_resident_warps": min((resident_warps(r["registers"], r["shared"],
                                                               r["num_warps"], r["arch"])
                                                for r in rs if "registers" in r), default=0),
                     "load_bits": most("load_bits"), "store_bits": most("store_bits"),
                     "max_sass": most("sass"), "max_div64": most("div64"),
                     "max_ordered_atomics": most("ordered_atomics"),
                     "sass_per_entry": sass_per_entry(rs)}
    return out


def sass_per_entry(rows):
    """Machine instructions per entry, in the variants of a kernel compiled with its
    widest ``BLOCK`` (the launchers' own; tests also launch narrow ones): ``BLOCK`` entries
    a program, ``BLOCK / (32 * num_warps)`` a thread, the most of those variants' code
    (0.0 for a kernel that takes no ``BLOCK``).  A static figure: a loop or a subroutine
    counts once, an instruction on a path not taken counts too."""
    rows = [r for r in rows if entry_sass(r) is not None]
    if not rows:
        return 0.0
    widest = max(r["block"] for r in rows)
    return max(entry_sass(r) for r in rows if r["block"] == widest)


def entry_sass(row):
    """One compiled variant's machine instructions per entry, ``sass * 32 * num_warps /
    BLOCK`` (one decimal), or None for a variant without a ``BLOCK`` or a count."""
    if not row.get("block") or not row.get("sass"):
        return None
    return round(row["sass"] * 32 * row["num_warps"] / row["block"], 1)