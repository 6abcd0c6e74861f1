#!/usr/bin/env bash
# The wheel check: what `pip install hvd_compress` gets, not the editable install.
#
#   1. build the wheel from a copy of this checkout (tracked files and new, not ignored
#      ones: no stale build/ or *.egg-info can leak in)
#   2. check that every file under hvd_compress/ of that copy is in the wheel (so every
#      subpackage, found by pyproject.toml's discovery, and any data file)
#   3. create a fresh virtual environment (python -m venv, from .venv's interpreter) and
#      `pip install --no-deps` the wheel into it; torch, numpy (and Horovod, TensorFlow,
#      Triton) come from .venv's site-packages, appended AFTER the fresh one's by a plain
#      path line in a .pth file.  A plain path is not a site directory, so the .pth files
#      in it (.venv's editable-install finder of hvd_compress) are not executed.
#   4. in that environment: hvd_compress comes from the fresh site-packages, no editable
#      finder is active, every module of the package imports (pkgutil.walk_packages;
#      modules needing Horovod/TensorFlow/Keras are skipped only when those are not
#      importable), and topk:density=0.01 compresses and decompresses a torch tensor.
#
# Environment: PYTHON (default .venv/bin/python; needs torch and pip).
# Exit status: 0 passed, non-zero on any failure.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
START=$SECONDS
[ -x "$PY" ] || { echo "!! [wheel] no interpreter at $PY (run 'make setup')" >&2; exit 2; }

WORK=$(mktemp -d "${TMPDIR:-/tmp}/hvd_compress_wheel.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
SRC=$WORK/src DIST=$WORK/dist VENV=$WORK/venv
mkdir -p "$SRC" "$DIST"

echo "==> [wheel] copy the checkout to $SRC"
if git -C "$ROOT" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  # tracked files still present and untracked ones that git does not ignore
  (cd "$ROOT" && git ls-files -z -co --exclude-standard \
     | while IFS= read -r -d '' f; do [ -f "$f" ] && printf '%s\0' "$f"; done \
     | xargs -0 cp --parents -t "$SRC")
else
  tar -C "$ROOT" --exclude=.venv --exclude=.git --exclude=build --exclude=dist \
      --exclude='*.egg-info' --exclude=__pycache__ -cf - . | tar -C "$SRC" -xf -
fi

echo "==> [wheel] build the wheel"
(cd "$SRC" && "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$DIST" . ) \
  > "$WORK/build.log" 2>&1 || { tail -30 "$WORK/build.log" >&2; exit 1; }
WHEEL=$(ls "$DIST"/hvd_compress-*.whl)
echo "    $(basename "$WHEEL")"

echo "==> [wheel] every file under hvd_compress/ is in the wheel"
"$PY" - "$SRC" "$WHEEL" <<'EOF'
import os, sys, zipfile
src, wheel = sys.argv[1:]
names = set(zipfile.ZipFile(wheel).namelist())
want, no_init = set(), []
for d, dirs, files in os.walk(os.path.join(src, "hvd_compress")):
    dirs[:] = [x for x in dirs if x != "__pycache__"]
    rel = os.path.relpath(d, src).replace(os.sep, "/")
    if any(f.endswith(".py") for f in files) and "__init__.py" not in files:
        no_init.append(rel)
    want |= {f"{rel}/{f}" for f in files if not f.endswith((".pyc", ".pyo"))}
missing = sorted(want - names)
packages = sorted(n[:-len("/__init__.py")].replace("/", ".") for n in names if n.endswith("/__init__.py"))
print("    packages:", ", ".join(packages))
if no_init:
    sys.exit(f"!! [wheel] folders with modules but no __init__.py (not found by discovery): {no_init}")
if missing:
    sys.exit(f"!! [wheel] files of hvd_compress/ missing from the wheel: {missing}")
EOF

echo "==> [wheel] fresh virtual environment"
"$PY" -m venv "$VENV"
SITE_NEW=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
SITE_OLD=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# a plain path line: appended to sys.path after the fresh site-packages, not a site dir
echo "$SITE_OLD" > "$SITE_NEW/zz_hvd_compress_deps.pth"
"$VENV/bin/python" -m pip install -q --no-deps --no-index "$WHEEL"

echo "==> [wheel] import every module from the installed wheel, compress a tensor"
cd "$WORK"        # not the checkout: its hvd_compress/ must not be importable from '.'
env -u PYTHONPATH -u HVD_COMPRESS PYTHONNOUSERSITE=1 TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-2} \
  "$VENV/bin/python" - "$SITE_NEW" <<'EOF'
import importlib
import importlib.util
import os
import pkgutil
import sys

site_new = os.path.realpath(sys.argv[1])
import hvd_compress

where = os.path.realpath(hvd_compress.__file__)
print("    hvd_compress", hvd_compress.__version__, "from", where)
if not where.startswith(site_new + os.sep):
    sys.exit(f"!! [wheel] hvd_compress imported from {where}, not from the fresh environment")
editable = [repr(f) for f in sys.meta_path + sys.path_hooks
            if "editable" in (getattr(f, "__module__", "") + type(f).__module__).lower()]
if editable:
    sys.exit(f"!! [wheel] an editable finder is active: {editable}")

OPTIONAL = {"horovod", "tensorflow", "keras", "tf_keras", "lightning", "accelerate"}
absent = {m for m in OPTIONAL if importlib.util.find_spec(m) is None}
failed, skipped, imported = [], [], []


def optional_missing(e):
    return isinstance(e, ModuleNotFoundError) and (e.name or "").split(".")[0] in absent


def onerror(name):
    e = sys.exc_info()[1]
    (skipped if optional_missing(e) else failed).append((name, repr(e)))


for info in pkgutil.walk_packages(hvd_compress.__path__, "hvd_compress.", onerror=onerror):
    try:
        importlib.import_module(info.name)
        imported.append(info.name)
    except Exception as e:  # noqa: BLE001 - reported below
        (skipped if optional_missing(e) else failed).append((info.name, repr(e)))
    mod = sys.modules.get(info.name)
    if mod is not None and not os.path.realpath(mod.__file__).startswith(site_new + os.sep):
        failed.append((info.name, f"imported from {mod.__file__}"))

print(f"    imported {len(imported)} modules; skipped {len(skipped)}"
      + (f" (not installed: {', '.join(sorted(absent))})" if skipped else ""))
for name, why in skipped:
    print(f"      skipped {name}: {why}")
if failed:
    for name, why in failed:
        print(f"!! [wheel] {name}: {why}", file=sys.stderr)
    sys.exit(1)

import torch

torch.manual_seed(0)
t = torch.randn(64, 50)
c = hvd_compress.from_spec("topk:density=0.01")
payload, ctx = c.compress(t, "x")
out = c.decompress(payload, ctx)
assert out.shape == t.shape and out.dtype == t.dtype, (out.shape, out.dtype)
i = int(t.abs().argmax())
assert out.reshape(-1)[i].item() == t.reshape(-1)[i].item(), "the largest entry was not kept"
assert out.abs().max().item() == t.abs().max().item()
kept = out.reshape(-1) != 0
assert int(kept.sum()) == 32, int(kept.sum())
assert torch.equal(out.reshape(-1)[kept], t.reshape(-1)[kept])
print(f"    {c}: {tuple(t.shape)} -> {int(kept.sum())} values kept, largest {t.reshape(-1)[i].item():.4f}")
EOF
echo "==> [wheel] passed in $(( SECONDS - START ))s"
