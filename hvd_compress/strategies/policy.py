"""Per-parameter compression: a policy maps parameter names to compressors, and Hylo's
layer-aware policy (seed 004) builds one from a model.

Both glue layers ask ``compression.for_tensor(name, tensor)`` which compressor to use, so
a :class:`Policy` is accepted wherever a single compressor is::

    policy = hvd_compress.Policy({"features.*.weight": "kernel_select",
                                  "classifier.*.weight": "twobit"}, default="none")
    opt = hvd_compress.torch.DistributedOptimizer(opt, model.named_parameters(),
                                                  compression=policy)

Hylo (Peng, "Communication optimization of distributed deep learning systems based on
model structure characteristics", 2021): parameters below ``min_size`` values go
uncompressed; convolution weights send their most important kernels
(:class:`~hvd_compress.compressors.kernel_select.KernelSelect`, a fraction adapted to the
layer's size); fully-connected (and embedding) weights are quantized to 2 bits
(:class:`~hvd_compress.compressors.quantize.TwoBit`); biases and normalisation
parameters go uncompressed.
"""
import fnmatch
import sys

from ..compressors.base import Compressor, leaves, same_spec
from ..memory import check_rank_of, check_residuals_of
from ..spec import from_spec


class Policy(Compressor):
    """Compressor per parameter: exact names first, then ``fnmatch`` patterns in order,
    else ``default``.  Values are compressors or spec strings."""

    name = "policy"

    def __init__(self, mapping, default="none"):
        super().__init__(ef=False)
        if not isinstance(mapping, dict):
            raise TypeError(f"a policy maps parameter names or patterns to compressors, "
                            f"got {type(mapping).__name__}")
        self.rules = [(str(k), from_spec(v)) for k, v in mapping.items()]
        self.exact = {k: c for k, c in self.rules}
        self.default = from_spec(default)
        self.notes = {}                      # name -> why (from_model fills it)

    def compressor_for(self, name):
        if name in self.exact:
            return self.exact[name]
        for pattern, compressor in self.rules:
            if fnmatch.fnmatchcase(name, pattern):
                return compressor
        return self.default

    def for_tensor(self, name, tensor):
        return self.compressor_for(name).for_tensor(name, tensor)

    def compress(self, tensor, name=None):
        raise TypeError("a Policy chooses a compressor per tensor: "
                        "use policy.for_tensor(name, tensor).compress(tensor, name)")

    decompress = compress

    def compressors(self):
        """The distinct compressors of the policy, in a fixed order."""
        seen, out = set(), []
        for c in [c for _, c in self.rules] + [self.default]:
            if id(c) not in seen:
                seen.add(id(c))
                out.append(c)
        return out

    def decay_residuals(self, beta):
        """``ef_decay=beta`` for each member with error feedback (the others send all they
        are given); ValueError when none has any, or one is ``auto`` (give ``ef_decay=``
        to its candidates' specs).  Returns ``self``."""
        members = leaves(self, into_auto=False)
        if any(getattr(c, "adaptive", False) for c in members):
            raise ValueError(f"{self.spec}: ef_decay applies to one compressor's error "
                             "feedback; auto chooses per bucket (give ef_decay= to the "
                             "specs of its candidates and of the policy's other members)")
        members = [c for c in members if c.ef]
        if not members:
            raise ValueError(f"{self.spec}: ef_decay={beta!r} needs error feedback, which none "
                             "of the policy's compressors has")
        for c in members:                      # a bad beta: the first refuses, none changed
            c.decay_residuals(beta)
        return self

    def holds(self):
        return self.compressors()

    def attach_journal(self, journal):
        super().attach_journal(journal)
        for c in self.compressors():
            c.attach_journal(journal)

    @property
    def spec(self):
        rules = ";".join(f"{p}={c.spec}" for p, c in self.rules)
        return f"policy({rules};*={self.default.spec})"

    def state_dict(self):
        return dict(self._state_header(), state=[c.state_dict() for c in self.compressors()])

    def load_state_dict(self, state_dict, framework="torch", strict=True):
        if not same_spec(state_dict.get("spec"), self.spec):
            raise ValueError("state_dict is for another policy:\n"
                             f"  {state_dict.get('spec')}\nnot\n  {self.spec}")
        check_residuals_of(self, state_dict)
        check_rank_of(self, state_dict)
        for c, sd in zip(self.compressors(), state_dict["state"]):
            sd = {k: v for k, v in sd.items() if k != "residuals_of"}    # checked above
            # (an empty one clears; auto also holds its schedule and choices)
            if sd["state"] or c._store is not None or getattr(c, "adaptive", False):
                c.load_state_dict(sd, framework, strict)

    def residual(self, name):
        return self.compressor_for(name).residual(name)

    def table(self, names=None):
        """A text table of what the policy chose for each parameter (and why)."""
        names = list(names) if names is not None else list(self.exact)
        rows = [("parameter", "compressor", "why")]
        rows += [(n, self.compressor_for(n).spec, self.notes.get(n, "")) for n in names]
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)

    def __repr__(self):
        return f"<hvd_compress {self.spec}>"


class Hylo(Policy):
    """Hylo's layer-aware policy; build it with :meth:`from_model`."""

    name = "hylo"

    @classmethod
    def from_model(cls, model, min_size=4096, conv="kernel_select", fc="twobit"):
        """Policy for a ``torch.nn.Module`` or a Keras model.

        ``min_size``: parameters with fewer values go uncompressed.  ``conv`` and ``fc``:
        the compressors (or specs) for convolution and fully-connected/embedding weights;
        one instance of each is shared (error-feedback state is kept per name).
        """
        conv_c, fc_c, none_c = from_spec(conv), from_spec(fc), from_spec("none")
        torch = sys.modules.get("torch")
        is_torch = torch is not None and isinstance(model, torch.nn.Module)
        params = _torch_params(model) if is_torch else _keras_params(model)
        mapping, notes = {}, {}
        for name, numel, kind in params:
            if numel < min_size:
                mapping[name], notes[name] = none_c, f"{kind}, {numel} < {min_size} values"
            elif kind.endswith("conv weight"):
                mapping[name], notes[name] = conv_c, f"{kind}, {numel} values"
            elif kind.endswith(("linear weight", "embedding weight")):
                mapping[name], notes[name] = fc_c, f"{kind}, {numel} values"
            else:
                mapping[name], notes[name] = none_c, f"{kind}, {numel} values"
        policy = cls(mapping, default="none")
        policy.notes = notes
        policy.min_size = min_size
        return policy


def _torch_params(model):
    """``(name, numel, kind)`` for every parameter of a torch module."""
    import torch.nn as nn
    out = []
    for mod_name, mod in model.named_modules():
        for p_name, p in mod.named_parameters(recurse=False):
            name = f"{mod_name}.{p_name}" if mod_name else p_name
            layer = type(mod).__name__
            if isinstance(mod, nn.modules.conv._ConvNd) and p_name == "weight":
                kind = f"{layer} conv weight"
            elif isinstance(mod, nn.Linear) and p_name == "weight":
                kind = f"{layer} linear weight"
            elif isinstance(mod, nn.Embedding) and p_name == "weight":
                kind = f"{layer} embedding weight"
            elif isinstance(mod, nn.modules.batchnorm._NormBase) or "norm" in layer.lower():
                kind = f"{layer} normalisation {p_name}"
            else:
                kind = f"{layer} {p_name}"
            out.append((name, p.numel(), kind))
    return out


def _keras_params(model):
    """``(name, numel, kind)`` for every trainable variable of a Keras model; names are
    the variables' paths, as ``hvd_compress.tensorflow`` names them."""
    import numpy as np
    out = []
    for layer in model._flatten_layers(include_self=False, recursive=True):
        cls = type(layer).__name__
        for v in layer._trainable_variables:
            name = getattr(v, "path", None) or v.name
            name = name[:-2] if name.endswith(":0") else name
            short = name.rsplit("/", 1)[-1]
            if "Conv" in cls and short in ("kernel", "depthwise_kernel"):
                kind = f"{cls} conv weight"
            elif cls == "Dense" and short == "kernel":
                kind = f"{cls} linear weight"
            elif cls == "Embedding" and short in ("embeddings", "kernel"):
                kind = f"{cls} embedding weight"
            elif "Normalization" in cls:
                kind = f"{cls} normalisation {short}"
            else:
                kind = f"{cls} {short}"
            out.append((name, int(np.prod(v.shape)), kind))
    return out

