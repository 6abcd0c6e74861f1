"""``auto``'s candidates: what a user may list, parsed and checked.

Imports: the standard library and :mod:`hvd_compress.spec` (lazily: the spec registry
imports this package).
"""
DEFAULT_CANDIDATES = ("none", "fp16", "laplace_topk:density=0.01",
                      "laplace_topk:density=0.01,values=rangefloat8")


#: auto's default candidates for an Adam-family optimizer that compresses gradients (not
#: its momentum): compressed gradients slow Adam's convergence (compressed_momentum is
#: the way to send fewer bytes with Adam), so only the lossless-enough ones
ADAM_CANDIDATES = ("none", "fp16")


def split(text):
    """``"none|laplace_topk:density=0.01+values=rangefloat8"`` -> specs."""
    return [c.strip().replace("+", ",") for c in text.split("|") if c.strip()]


def parse(candidates):
    """``(compressors, names as the user wrote them)`` for ``candidates`` (None: the
    defaults; a ``|``-separated string; or a list of specs or compressors).  ValueError,
    naming the candidate, for one that cannot be chosen per bucket."""
    from ...spec import from_spec
    if candidates is None:
        candidates = DEFAULT_CANDIDATES
    if isinstance(candidates, str):
        candidates = split(candidates)
    members, names = [], []
    for c in candidates:
        try:
            m = from_spec(c)
        except ValueError as e:
            raise ValueError(f"auto: bad candidate {c!r}: {e}") from None
        if getattr(m, "adaptive", False) or m.name in ("policy", "hylo"):
            raise ValueError(f"auto: candidate {m.spec!r} is not a single compressor")
        if not m.segmented or m.collective not in ("allreduce", "allgather"):
            raise ValueError(f"auto: candidate {m.spec!r} cannot be chosen per bucket: "
                             "candidates must take buckets of several tensors "
                             "(segmented) and need one collective (no agg=union/"
                             "leader/hint, no powersgd)")
        members.append(m)
        names.append(c if isinstance(c, str) else m.spec)
    specs = [m.spec for m in members]
    if not members or len(set(specs)) != len(specs):
        raise ValueError(f"auto: candidates must be a non-empty list of distinct "
                         f"compressors, got {specs}")
    return members, names


def label(specs):
    """The ``candidates`` parameter of the spec (None for the defaults)."""
    from ...spec import from_spec
    default = [from_spec(c).spec for c in DEFAULT_CANDIDATES]
    return None if specs == default else "|".join(s.replace(",", "+") for s in specs)


def for_adam(compression):
    """The wrapped optimizer is of the Adam family and sends its *gradients* (no
    compressed momentum): an auto among ``compression`` (alone or in a Policy) that has
    the default candidates keeps only :data:`ADAM_CANDIDATES` (a list the user gave is
    kept: auto chooses among what the user accepted).  Before the first step only.
    Returns the autos changed."""
    changed = []
    for auto in compression.compressors():
        if not getattr(auto, "adaptive", False) or auto.candidates is not None or auto.steps:
            continue
        auto.members, auto.names = parse(ADAM_CANDIDATES)
        auto.specs = [m.spec for m in auto.members]
        auto.candidates = label(auto.specs)
        auto.calibrate = max(auto.calibrate, len(auto.members))
        auto.reset()
        changed.append(auto)
    return changed
