"""The torch and TensorFlow primitives are one contract: ``hvd_compress.ops.torch_ops``
and ``hvd_compress.ops.tf_ops`` expose the same public names, split into the same
families, and every name documented in :mod:`hvd_compress.ops` is defined by both."""
import importlib
import importlib.util
import re
import subprocess
import sys

import pytest

import hvd_compress.ops as ops
from hvd_compress.ops import torch_ops

FAMILIES = ("core", "checks", "selection", "segments", "codecs")


def public(module):
    return {n for n in vars(module) if not n.startswith("_")}


def documented():
    """Names in the table of hvd_compress/ops/__init__.py (first column) and in the
    paragraph of further groups below it."""
    doc = ops.__doc__
    rule = re.compile(r"^=+ +=+$", re.M)
    start, end = [m.end() for m in rule.finditer(doc)][:2]
    names = set()
    for line in doc[start:end].splitlines():
        if line.startswith("``"):
            first_column = re.split(r"``\s{2,}", line, maxsplit=1)[0]
            names |= set(re.findall(r"``([A-Za-z_]\w*)", first_column))
    further = doc[end:]
    names |= set(re.findall(r"``([A-Za-z_]\w*)``", further))
    names -= set(FAMILIES) | {"None"}
    return names


def tf_ops_or_skip():
    if importlib.util.find_spec("tensorflow") is None:
        pytest.skip("tensorflow is not importable here (CI has it)")
    from hvd_compress.ops import tf_ops
    return tf_ops


def test_documented_table_parses():
    names = documented()
    assert {"flatten", "random_indices", "scatter_sum", "float32", "int32", "new_store",
            "abs_sum_max", "segment_compact_above", "unique_sorted",
            "twobit_decode_sum", "rangefloat_decode_ranks"} <= names


def test_torch_ops_defines_every_documented_name():
    assert sorted(documented() - public(torch_ops)) == []


def test_tf_ops_defines_every_documented_name():
    tf_ops = tf_ops_or_skip()
    assert sorted(documented() - public(tf_ops)) == []


def test_torch_and_tf_expose_the_same_names():
    tf_ops = tf_ops_or_skip()
    t, f = public(torch_ops), public(tf_ops)
    assert sorted(t - f) == [], "in torch_ops only"
    assert sorted(f - t) == [], "in tf_ops only"


def test_same_families_with_the_same_names():
    tf_ops = tf_ops_or_skip()
    for family in FAMILIES:
        t = importlib.import_module(f"hvd_compress.ops.torch_ops.{family}")
        f = importlib.import_module(f"hvd_compress.ops.tf_ops.{family}")
        # the functions each family defines itself (what it imports from core is core's)
        own_t = {n for n in public(t) if getattr(getattr(t, n), "__module__", None) == t.__name__}
        own_f = {n for n in public(f) if getattr(getattr(f, n), "__module__", None) == f.__name__}
        assert sorted(own_t ^ own_f) == [], family
        assert (t.__doc__ or "").strip() and (f.__doc__ or "").strip(), family


def test_ops_for_imports_frameworks_lazily():
    code = ("import sys, torch\n"
            "from hvd_compress.ops import ops_for\n"
            "assert 'tensorflow' not in sys.modules\n"
            "assert ops_for(torch.zeros(1)).__name__ == 'hvd_compress.ops.torch_ops'\n"
            "assert 'tensorflow' not in sys.modules, 'ops_for(torch tensor) imported TF'\n"
            "try:\n"
            "    ops_for([1.0])\n"
            "except TypeError:\n"
            "    pass\n"
            "else:\n"
            "    raise AssertionError('ops_for(list) did not raise TypeError')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_import_hvd_compress_and_the_ddp_glue_import_no_framework_they_do_not_need():
    """``import hvd_compress`` imports neither torch, TensorFlow nor Horovod (each is
    imported when a tensor of its framework is first seen); the DDP hook needs no Horovod."""
    import subprocess
    import sys
    code = ("import sys, hvd_compress\n"
            "print(sorted(m for m in ('torch', 'tensorflow', 'horovod', 'keras') if m in sys.modules))\n"
            "import hvd_compress.ddp\n"
            "print('horovod' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[:2] == ["[]", "False"], out.stdout
