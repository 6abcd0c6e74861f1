#!/usr/bin/env bash
# Set up everything hvd_compress needs, from nothing, on a fresh machine:
#   .venv/ with pinned torch (CPU), tensorflow-cpu, triton, numpy, mlxtend, pytest,
#   mkdocs + Material + mkdocstrings (ci/requirements-docs.txt: the docs site),
#   Horovod 0.28.1 built from its source distribution (Gloo + PyTorch + TensorFlow)
#   with the two build edits recorded in DESIGN.md, and hvd_compress in editable mode.
#
# The built Horovod wheel is cached outside the repo ($HVD_COMPRESS_CACHE, default
# ~/.cache/hvd_compress), so a second set-up takes seconds.  Re-running is cheap:
# a stamp file records a completed set-up for this exact script and requirements.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
PY=${PYTHON:-python3}
VENV="$ROOT/.venv"
CACHE=${HVD_COMPRESS_CACHE:-$HOME/.cache/hvd_compress}
HOROVOD_VERSION=0.28.1
TORCH_VERSION=2.13.0
TF_VERSION=2.21.0
STAMP="$VENV/.hvd_compress_setup"
WANT=$(cat ci/setup.sh ci/requirements.txt ci/requirements-docs.txt pyproject.toml | sha256sum | cut -c1-16)

step() { CURRENT_STEP="$*"; echo "==> [setup] $*"; }
fail() { echo "!! [setup] step failed: ${CURRENT_STEP:-?} (line $1, exit $2)." >&2
         echo "!! [setup] fix the cause above and re-run 'make setup'." >&2; }
trap 'fail $LINENO $?' ERR

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  echo "==> [setup] up to date ($VENV)"
  exit 0
fi

step "create virtual environment .venv with $($PY --version 2>&1)"
[ -x "$VENV/bin/python" ] || $PY -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade "pip>=23" "setuptools>=68,<81" wheel

step "install torch==$TORCH_VERSION (CPU), tensorflow-cpu==$TF_VERSION and the pinned requirements"
$PIP install -q "torch==$TORCH_VERSION" "tensorflow-cpu==$TF_VERSION" -r ci/requirements.txt \
    -r ci/requirements-docs.txt      # the docs site: mkdocs, Material, mkdocstrings

HVD_TAG="horovod-$HOROVOD_VERSION-torch$TORCH_VERSION-tf$TF_VERSION-$($VENV/bin/python -c 'import sys;print("cp%d%d"%sys.version_info[:2])')"
WHEEL_DIR="$CACHE/$HVD_TAG"
if ! ls "$WHEEL_DIR"/horovod-*.whl >/dev/null 2>&1; then
  step "build Horovod $HOROVOD_VERSION from source (Gloo, PyTorch, TensorFlow; 5-10 minutes)"
  command -v cmake >/dev/null || { echo "cmake is required to build Horovod (apt-get install cmake)" >&2; false; }
  BUILD=$(mktemp -d)
  $PIP download -q --no-deps --no-binary :all: -d "$BUILD" "horovod==$HOROVOD_VERSION"
  tar -xzf "$BUILD/horovod-$HOROVOD_VERSION.tar.gz" -C "$BUILD"
  SRC="$BUILD/horovod-$HOROVOD_VERSION"
  # Edit 1: torch >= 2.1 and TF 2.21 headers need C++17.
  sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' \
      "$SRC/CMakeLists.txt" "$SRC/horovod/torch/CMakeLists.txt"
  grep -q 'CMAKE_CXX_STANDARD 17' "$SRC/CMakeLists.txt"
  grep -q 'CMAKE_CXX_STANDARD 17' "$SRC/horovod/torch/CMakeLists.txt"
  # Edit 2: the XLA ops need headers TF no longer ships (a GPU-only feature).
  sed -i '/xla_mpi_ops.cc/d' "$SRC/horovod/tensorflow/CMakeLists.txt"
  ! grep -q 'xla_mpi_ops.cc' "$SRC/horovod/tensorflow/CMakeLists.txt"
  mkdir -p "$WHEEL_DIR"
  ( cd "$SRC" && \
    HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
    HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 HOROVOD_CPU_OPERATIONS=gloo \
    MAKEFLAGS="-j$(nproc)" \
    "$VENV/bin/python" -m pip wheel --no-build-isolation --no-deps -w "$WHEEL_DIR.tmp" . \
      > "$BUILD/build.log" 2>&1 ) || { tail -40 "$BUILD/build.log" >&2; false; }
  mv "$WHEEL_DIR.tmp"/horovod-*.whl "$WHEEL_DIR"/ && rmdir "$WHEEL_DIR.tmp"
  rm -rf "$BUILD"
else
  step "use cached Horovod wheel from $WHEEL_DIR"
fi
step "install Horovod wheel"
$PIP install -q --force-reinstall --no-deps "$WHEEL_DIR"/horovod-*.whl
$PIP install -q cloudpickle psutil pyyaml packaging cffi

step "install hvd_compress in editable mode"
$PIP install -q --no-build-isolation --no-deps -e .

step "check that Horovod was built with TensorFlow, PyTorch and Gloo"
CHECK=$("$VENV/bin/horovodrun" --check-build)
echo "$CHECK"
for fw in TensorFlow PyTorch Gloo; do
  echo "$CHECK" | grep -qE "\[X\] $fw" || { echo "Horovod lacks $fw support" >&2; false; }
done

echo "$WANT" > "$STAMP"
echo "==> [setup] done"
