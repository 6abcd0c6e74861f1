"""A launch cache for the package's Triton kernels: ``kernel[grid](...)`` without
Triton's per-call dispatch, where that is safe.

Why.  On the lent H200 (2026-11-29, ``benchmarks/gpu_breakdown.py``'s launch row) the host
took 43.2 us to issue one histogram launch through our launcher, 32.8 us through
Triton's JIT dispatch alone (``kernel[grid](...)``: binding the arguments, the
specialisation key, the cache lookup, the check of global values) and 15.7 us through
the compiled kernel's own launcher (``compiled[grid](...)``).  A bucket compress on the
kernel path makes 3-20 launches and its device time is a fraction of its wall time (the
fused search of a GPT-2 block: 0.22 ms on the device, 1.74 ms wall), so the host's
dispatch is where the time goes.

How.  :func:`cached` wraps a ``triton.jit`` function in a :class:`CachedKernel`, used as
the function is (``k[grid](*args, **constexprs)``).  Its key holds what Triton 3.6
specialises a compiled kernel on, computed in Python from the call's arguments:

- a tensor: its dtype and whether its address is a multiple of 16;
- an int: whether it is 1, whether it is a multiple of 16, and its width (int32, int64,
  uint64);
- a float, a bool, None: the type;
- the constexprs and launch options (``num_warps``, ``num_stages``) by value;
- the device.

A miss goes through Triton's own dispatch (which compiles where needed and launches)
and keeps the compiled kernel it returns; a hit calls that kernel's launcher with every
argument, constexprs included, in the kernel's order.  The key is at least as fine as
Triton's, so a hit runs the kernel Triton would have chosen.

When.  Only where the arguments are CUDA tensors (the interpreter and the CPU compile
check pass through), only under a Triton whose specialisation rules these are (3.6,
the lent GPU's; ``SUPPORTED``), and only when ``HVD_COMPRESS_LAUNCH_CACHE=1``: off by
default until a GPU run has compared it with the plain dispatch (``make gpu-test``:
``tests/gpu/test_gpu_launch_cache.py`` bit for bit, ``gpu_breakdown``'s launch row for
the time).

Imports: the standard library; Triton lazily (its version, on first launch).
"""
import functools
import logging
import os

logger = logging.getLogger("hvd_compress")

#: Triton versions whose specialisation rules the key reproduces ("major.minor")
SUPPORTED = ("3.6",)

#: hits and misses of every cache since the process started (tests and benchmarks read it)
STATS = {"hits": 0, "misses": 0}

_INT32 = (-(2 ** 31), 2 ** 31 - 1)
_INT64_MAX = 2 ** 63 - 1


@functools.lru_cache(maxsize=None)
def _supported_triton():
    import triton
    ok = ".".join(triton.__version__.split(".")[:2]) in SUPPORTED
    if not ok and enabled():
        logger.warning("hvd_compress: HVD_COMPRESS_LAUNCH_CACHE=1 is ignored under Triton %s "
                       "(its key follows the specialisation rules of Triton %s)",
                       triton.__version__, ", ".join(SUPPORTED))
    return ok


def enabled():
    """Whether ``HVD_COMPRESS_LAUNCH_CACHE`` asks for the cache (``1``; default ``0``)."""
    value = os.environ.get("HVD_COMPRESS_LAUNCH_CACHE", "0")
    if value not in ("0", "1"):
        raise ValueError(f"HVD_COMPRESS_LAUNCH_CACHE must be 0 or 1, got {value!r}")
    return value == "1"


def _tensor_key(v):
    return (v.dtype, v.data_ptr() % 16 == 0)


def _int_key(v):
    width = 32 if _INT32[0] <= v <= _INT32[1] else 64 if v <= _INT64_MAX else 65
    return (int, v == 1, v % 16 == 0, width)


#: the key of an argument by its exact type: one dict lookup, no isinstance chain (a
#: tensor's type is added on first use, so this module imports no torch)
_BY_TYPE = {bool: lambda v: bool, int: _int_key, float: lambda v: float,
            type(None): lambda v: None}


def _arg_key(v):
    """What Triton 3.6 specialises a compiled kernel on, for one runtime argument."""
    by_type = _BY_TYPE.get(type(v))
    if by_type is not None:
        return by_type(v)
    if hasattr(v, "data_ptr"):                                   # a tensor
        if type(v).__name__ == "Tensor":
            _BY_TYPE[type(v)] = _tensor_key
        return _tensor_key(v)
    if isinstance(v, bool):
        return bool
    if isinstance(v, int):
        return _int_key(v)
    if isinstance(v, float):
        return float
    raise TypeError(f"the launch cache has no key for an argument of type {type(v).__name__}")


class CachedKernel:
    """A ``triton.jit`` function launched through a cache of its compiled kernels (see the
    module docstring).  ``jit``: the function itself (for anything but launching).

    A hit costs the host the key (:meth:`key`), the launcher's arguments
    (:meth:`arguments`) and the compiled kernel's launcher, whose runner for a grid is
    kept too (``compiled[grid]`` makes a new closure each call; the runner picks the
    current stream when it launches)."""

    def __init__(self, jit):
        self.jit = jit
        self.compiled = {}
        self._params = None

    def __getattr__(self, name):                     # the jit function's other attributes
        return getattr(self.jit, name)

    def __getitem__(self, grid):
        return functools.partial(self.launch, grid)

    def params(self):
        """``(names, constexpr names, defaults)`` of the kernel's parameters, in order."""
        if self._params is None:
            import inspect
            sig = inspect.signature(self.jit.fn)
            names = list(sig.parameters)
            at = getattr(self.jit, "constexprs", None)
            if at is None:            # Triton's interpreter: from the annotations
                at = [i for i, p in enumerate(sig.parameters.values())
                      if "constexpr" in str(p.annotation)]
            constexprs = {names[i] for i in at}
            defaults = {n: p.default for n, p in sig.parameters.items()
                        if p.default is not inspect.Parameter.empty}
            self._params = names, constexprs, defaults
            # what the hot path reads: the first constexpr's position, and the names a
            # keyword argument is keyed by value under (constexprs, and launch options:
            # names that are no parameter)
            self._first_constexpr = min(at, default=len(names))
            self._runtime = frozenset(names) - constexprs
        return self._params

    def key(self, args, kwargs):
        """The cache key of a call (module docstring): constexprs and launch options by
        value, runtime arguments by what Triton specialises on."""
        names, constexprs, _ = self.params()
        if len(args) <= self._first_constexpr:                 # none given by position
            positional = tuple(map(_arg_key, args))
        else:
            positional = tuple(("c", a) if names[i] in constexprs else _arg_key(a)
                               for i, a in enumerate(args))
        if self._runtime.isdisjoint(kwargs):     # constexprs and options: by value, as given
            return positional, tuple(kwargs.items())
        named = tuple(sorted((k, v if k in constexprs or k not in names else _arg_key(v))
                             for k, v in kwargs.items()))
        return positional, ("sorted",) + named

    def arguments(self, args, kwargs):
        """Every parameter's value in the kernel's order (constexprs and defaults
        included): what the compiled kernel's launcher takes."""
        names, _, defaults = self.params()
        if len(args) == len(names):
            return args
        given = {**defaults, **kwargs}
        return (*args, *[given[n] for n in names[len(args):]])

    def launch(self, grid, *args, **kwargs):
        if not enabled():                   # the default: no scan of the arguments either
            return self.jit[grid](*args, **kwargs)
        first = args[0] if args and hasattr(args[0], "is_cuda") else next(
            (a for a in args if hasattr(a, "is_cuda")), None)
        if first is None or not first.is_cuda or not _supported_triton():
            return self.jit[grid](*args, **kwargs)
        key = (first.device.index, self.key(args, kwargs))
        entry = self.compiled.get(key)
        if entry is None:
            STATS["misses"] += 1
            compiled = self.jit[grid](*args, **kwargs)         # compiles where needed, launches
            compiled = compiled.result() if hasattr(compiled, "result") else compiled
            if len(self.compiled) > 256:
                self.compiled.clear()
            self.compiled[key] = (compiled, {})
            return compiled
        STATS["hits"] += 1
        compiled, runners = entry
        grid3 = tuple(grid) + (1,) * (3 - len(grid))
        runner = runners.get(grid3)
        if runner is None:
            if len(runners) > 64:
                runners.clear()
            runner = runners[grid3] = compiled[grid3]
        runner(*self.arguments(args, kwargs))
        return compiled


def cached(jit):
    """:class:`CachedKernel` of the ``triton.jit`` function ``jit`` (the interpreter's
    functions too: they pass through)."""
    return CachedKernel(jit)
