"""Spec strings <-> compressor objects.

Syntax: ``name[:param=value[,param=value...]]``, e.g. ``"topk:density=0.01,ef=0"``.
Values are converted to the type of the parameter's default (bool accepts
0/1/true/false).  ``hier:<spec>`` (or the key ``hier=1``) wraps the compressor for the
hierarchical exchange (:mod:`hvd_compress.compressors.hierarchical`).  ``HVD_COMPRESS``
holds a spec in the same syntax; the glue layers use it when no ``compression`` argument
is given.

Imports: the standard library, ``hvd_compress.compressors``.
"""
import os

from .compressors import REGISTRY
from .compressors.base import Compressor
from .compressors.hierarchical import PREFIX as HIER, Hierarchical

ENV_VAR = "HVD_COMPRESS"
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


def _convert(name, param, text, default):
    if isinstance(default, bool) or param == "ef":
        low = text.lower()
        if low in _TRUE | _FALSE:
            return low in _TRUE
        raise ValueError(f"{name}: parameter {param} must be 0/1/true/false, got {text!r}")
    kind = type(default) if default is not None else str
    try:
        return kind(text)
    except ValueError:
        raise ValueError(f"{name}: parameter {param} must be {kind.__name__}, "
                         f"got {text!r}") from None


def _unparse(name, params):
    """The spec string of ``name`` with ``params`` (unconverted): :func:`parse` undone."""
    return name + "".join(f"{',' if i else ':'}{k}={v}" for i, (k, v) in enumerate(params.items()))


def parse(spec):
    """``"topk:density=0.01"`` -> ``("topk", {"density": "0.01"})`` (values unconverted)."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"a compressor spec is a non-empty string like 'topk:density=0.01', "
                         f"got {spec!r}")
    name, _, rest = spec.strip().partition(":")
    params = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"bad parameter {item!r} in spec {spec!r}: expected key=value")
        params[key.strip()] = value.strip()
    return name.strip(), params


def from_spec(spec):
    """Build a compressor from a spec string (a Compressor is returned as is).

    Raises ValueError naming the valid compressors or parameters when one is unknown.
    """
    if isinstance(spec, Compressor):
        return spec
    if isinstance(spec, str) and spec.strip().startswith(HIER):
        inner = spec.strip()[len(HIER):]
        if not inner.strip():
            raise ValueError(f"spec {spec!r}: 'hier:' wraps a compressor spec, e.g. "
                             "'hier:laplace_topk:density=0.01'")
        return Hierarchical(from_spec(inner))
    name, raw = parse(spec)
    if "min_size" in raw:                  # any compressor: smaller tensors sent whole
        size = _convert(name, "min_size", raw.pop("min_size"), 0)
        return from_spec(_unparse(name, raw)).send_whole_below(size)
    if "ef_decay" in raw:                  # any compressor with error feedback
        beta = _convert(name, "ef_decay", raw.pop("ef_decay"), 1.0)
        return from_spec(_unparse(name, raw)).decay_residuals(beta)
    if "hier" in raw:                      # "topk:density=0.01,hier=1" == "hier:topk:..."
        hier = _convert(name, "hier", raw.pop("hier"), False)
        inner = from_spec(_unparse(name, raw))
        return Hierarchical(inner) if hier else inner
    if name not in REGISTRY:
        raise ValueError(f"unknown compressor {name!r}; valid: {', '.join(sorted(REGISTRY))}")
    cls = REGISTRY[name]
    valid = cls.params()
    unknown = sorted(set(raw) - set(valid))
    if unknown:
        raise ValueError(f"unknown parameter(s) {', '.join(unknown)} for compressor {name!r}; "
                         f"valid: {', '.join(valid) or '(none)'}")
    return cls(**{k: _convert(name, k, v, valid[k]) for k, v in raw.items()})


def from_env(default="none"):
    """The compressor named by ``$HVD_COMPRESS``, else ``default``."""
    return from_spec(os.environ.get(ENV_VAR) or default)


#: Horovod's own compression objects (``hvd.Compression.none`` / ``.fp16``, PyTorch's and
#: TensorFlow's: classes used without instantiating) -> the spec of ours that does the same
HOROVOD_COMPRESSION = {"NoneCompressor": "none", "FP16Compressor": "fp16"}


def from_horovod(compression):
    """The spec of ours for Horovod's ``hvd.Compression.none`` / ``hvd.Compression.fp16``
    (the class or an instance of it); None when ``compression`` is not Horovod's.  Any
    other Horovod compressor (a subclass of Horovod's ``Compressor``) is a ValueError
    naming ``compression``: ours need the tensor's name and, for most, an allgather."""
    cls = compression if isinstance(compression, type) else type(compression)
    horovod = [k for k in getattr(cls, "__mro__", ())
               if (getattr(k, "__module__", "") or "").startswith("horovod.")]
    if not horovod:
        return None
    name = getattr(cls, "__name__", "")
    if horovod[0] is cls and name in HOROVOD_COMPRESSION:
        return HOROVOD_COMPRESSION[name]
    raise ValueError(f"compression={cls.__module__}.{name} is a Horovod compressor "
                     "hvd_compress has no counterpart for; pass hvd.Compression.none or "
                     "hvd.Compression.fp16, a spec string like 'topk:density=0.01' or an "
                     "hvd_compress compressor")


def resolve(compression):
    """What the glue layers accept: a Compressor, a spec string, Horovod's
    ``hvd.Compression.none``/``fp16`` (our ``none``/``fp16``), or None (= from_env)."""
    if compression is None:
        return from_env()
    horovod = from_horovod(compression)
    return from_spec(horovod if horovod is not None else compression)
