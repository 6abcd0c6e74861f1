#!/usr/bin/env bash
# make gpu-test: everything that needs a CUDA GPU, in one command.
#
#   1. preflight  versions, device; hvd_compress and its kernels import with no Horovod/TF
#   2. tests      tests/gpu (every kernel and compressor on CUDA, sync counts) and
#                 tests/unit/test_kernels.py, test_buckets.py, test_histogram_select.py,
#                 test_bucket_launches.py, test_rangefloat_segments.py (on CUDA tensors
#                 when there is a GPU)
#   3. benchmarks select.py on CUDA (1M-100M, laplace_topk vs torch.topk), codecs and DCT,
#                 compress+decompress per step of examples/models.py; where each
#                 compressor's time and host synchronisations go (profile); one exchange
#                 of every compressor, peer baselines included (codec_time.py); a
#                 training step of GPT-2 small and ResNet-50 on one GPU, backward against
#                 compress + decompress of every bucket, and two processes through the DDP
#                 hook on Gloo with CUDA tensors (gpu_step.py); a bucket compress's
#                 device time kernel by kernel against its wall time (gpu_breakdown.py);
#                 the launches, framework ops and host work per tensor of a bucket
#                 exchange (bucket_ops.py)
#   4. summary    gpu_summary.json: device, versions, date, pass/fail/skip counts, figures
#
# Every step runs eagerly unless it asks for CUDA-graph replay (on by default for users:
# HVD_COMPRESS_CUDA_GRAPHS; gpu_step's +graphs rows and the replay tests set it to 1).
#
# Needs python with torch (and triton for the kernels); installs nothing and uses no
# network.  Horovod and TensorFlow are made unimportable for every step, as on the GPU
# machine; hvd_compress (its Triton kernels in hvd_compress/kernels/ included) is
# imported from this checkout, nothing is pip-installed.
#
# Environment:
#   PYTHON          interpreter (default: python3 if it has torch, else .venv/bin/python)
#   RESULTS_DIR     where the results go (default benchmarks/results/gpu_<date>)
#   GPU_TEST_BUDGET seconds for all steps (default 450: the issue's 8 minutes, with margin;
#                   1500 for a dry run)
#   REQUIRE_CUDA=1  exit 3 when there is no CUDA device (default: exit 0, status "no_cuda")
#   PEAK_GBPS       peak memory bandwidth of the device, if its name is not in the table
#   GPU_TEST_DEVICE=cpu
#                   a dry run without a GPU (make gpu-dry-run): every step on CPU tensors,
#                   the CUDA code path's Triton kernels in the interpreter
#                   (TRITON_INTERPRET=1, HVD_COMPRESS_BACKEND=triton), tiny sizes, the GPU
#                   tests with HVD_COMPRESS_GPU_TESTS_ON_CPU=1; results in a temporary folder
#                   unless RESULTS_DIR is set; status "dry_run": it shows that the steps
#                   run, its times are no GPU figures
#   GPU_TEST_TESTS  the test paths of step 2 (default tests/gpu, and more with CUDA)
#   GPU_TEST_COMPILE_FOR=90
#                   with GPU_TEST_DEVICE=cpu: every kernel launch of every step is also
#                   compiled for that GPU first (tests/triton_compile.py: Triton's compiler
#                   down to a cubin, no GPU), so a benchmark's own kernel variants that
#                   would not compile show here
#
# Exit status: 0 all passed (or no CUDA device, reported as such), 1 a test or step
# failed, 2 the environment is unusable (no torch, hvd_compress does not import).
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
START=$SECONDS
STAMP=$(date -u +%Y-%m-%d)

if [ -n "${PYTHON:-}" ]; then
  PY=$PYTHON
elif python3 -c 'import torch' >/dev/null 2>&1; then
  PY=python3
elif [ -x "$ROOT/.venv/bin/python" ]; then
  PY=$ROOT/.venv/bin/python
else
  PY=python3
fi

# What the device decides: results folder, time limits, benchmark sizes and repeats
DEVICE=${GPU_TEST_DEVICE:-cuda}
case $DEVICE in
  cuda)
    RESULTS=${RESULTS_DIR:-$ROOT/benchmarks/results/gpu_$STAMP}
    BUDGET=${GPU_TEST_BUDGET:-450} TESTS_LIMIT=300 DRY= SLOWER=1
    BIG=25M SMALL=1M,4M HUGE=100M PROF=1M,25M REPEAT=5 STEP=(--repeat 2 --warmup 1)
    MODELS=(--repeat 10) ;;
  cpu)                                # tests/gpu on CPU tensors, kernels interpreted
    RESULTS=${RESULTS_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/hvd_compress_gpu_dry_run.XXXXXX")}
    BUDGET=${GPU_TEST_BUDGET:-1500} TESTS_LIMIT=900 DRY=1 SLOWER=2   # the interpreter
    BIG=4K SMALL=1K,2K HUGE=8K PROF=1K,4K REPEAT=1
    # gpu step without fused=1 (padded=1 runs its kernels) and dct (tests/unit's dct
    # bucket tests run its kernels): 80 s less in the interpreter, the same script
    STEP_SPECS="none;fp16;topk:density=0.01;laplace_topk:density=0.01"
    STEP_SPECS+=";laplace_topk:density=0.01,padded=1;laplace_topk:density=0.01,values=rangefloat8"
    STEP=(--tiny --repeat 1 --warmup 0 --specs "$STEP_SPECS;twobit;powersgd:rank=4")
    MODELS=(--repeat 1 --models resnet_small    # vgg_small's fused search: 37 s more here
            --schemes "none;topk:density=0.01;laplace_topk:density=0.01,fused=1") ;;
  *) echo "GPU_TEST_DEVICE must be cuda or cpu, not '$DEVICE'" >&2; exit 2 ;;
esac
mkdir -p "$RESULTS"
RESULTS=$(cd "$RESULTS" && pwd)
rm -f "$RESULTS"/.steps.tsv "$RESULTS"/.records.json "$RESULTS"/.preflight.json "$RESULTS"/.select_*
LOG=$RESULTS/gpu.log
exec > >(tee "$LOG") 2>&1
TEE_PID=$!

# A python start-up hook for every step: Horovod and TensorFlow (and Keras) cannot be
# imported (None in sys.modules: `import` raises ModuleNotFoundError and
# importlib.util.find_spec returns None, exactly as when they are not installed).
SHIM=$(mktemp -d)
trap 'rm -rf "$SHIM"; exec 1>&- 2>&-; wait "$TEE_PID" 2>/dev/null' EXIT
cat > "$SHIM/sitecustomize.py" <<'EOF'
import os
import sys

for _name in filter(None, os.environ.get("HVD_COMPRESS_BLOCK_IMPORTS", "").split(",")):
    sys.modules.setdefault(_name, None)

if os.environ.get("HVD_COMPRESS_COMPILE_FOR"):   # a dry run that compiles every kernel
    sys.path.insert(0, os.path.join(os.environ["HVD_COMPRESS_ROOT"], "tests"))
    import triton_compile
    triton_compile.enable(int(os.environ["HVD_COMPRESS_COMPILE_FOR"]), counts=False)  # no report
    del sys.path[0]


# run the sitecustomize this one shadows, if any
_here = os.path.dirname(os.path.abspath(__file__))
for _entry in sys.path:
    _file = os.path.join(os.path.abspath(_entry or "."), "sitecustomize.py")
    if os.path.dirname(_file) != _here and os.path.isfile(_file):
        try:
            with open(_file) as _f:
                exec(compile(_f.read(), _file, "exec"), {"__name__": "sitecustomize", "__file__": _file})
        except Exception:
            pass
        break
EOF
export HVD_COMPRESS_BLOCK_IMPORTS=${HVD_COMPRESS_BLOCK_IMPORTS:-horovod,tensorflow,keras,tf_keras}
export PYTHONPATH="$SHIM:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export HVD_COMPRESS_CUDA_GRAPHS=${HVD_COMPRESS_CUDA_GRAPHS:-0}   # eager; +graphs asks replay
unset HVD_COMPRESS_BACKEND TRITON_INTERPRET
unset HVD_COMPRESS_COMPILE_FOR
if [ "$DEVICE" = cpu ]; then         # the CUDA path's kernels, in Triton's interpreter
  export HVD_COMPRESS_BACKEND=triton HVD_COMPRESS_GPU_TESTS_ON_CPU=1
  export OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-Nehalem}
  if [ -n "${GPU_TEST_COMPILE_FOR:-}" ]; then   # ... each launch compiled for that GPU first
    export HVD_COMPRESS_COMPILE_FOR=$GPU_TEST_COMPILE_FOR HVD_COMPRESS_ROOT=$ROOT
  else
    export TRITON_INTERPRET=1
  fi
fi

echo "==> [gpu] $(date -u '+%Y-%m-%d %H:%M:%S') UTC, python: $PY, device: $DEVICE, results: $RESULTS, budget ${BUDGET}s"

# run_step NAME SECONDS CMD...: run CMD with a timeout of SECONDS (times SLOWER) clipped
# to what is left of the budget; record "NAME rc seconds status" for the summary.
run_step() {
  local name=$1 want=$(( $2 * SLOWER )); shift 2
  local left=$(( BUDGET - (SECONDS - START) - 15 ))
  local limit=$(( want < left ? want : left ))
  if [ "$limit" -lt 10 ]; then
    echo "==> [gpu] $name: skipped, the ${BUDGET}s budget is spent"
    printf '%s\t%s\t%s\t%s\n' "$name" "" 0 "skipped: budget spent" >> "$RESULTS/.steps.tsv"
    return 0
  fi
  echo "==> [gpu] $name (at most ${limit}s)"
  local t0=$SECONDS rc status
  timeout --kill-after=15 "$limit" "$@"
  rc=$?
  case $rc in
    0) status=ok ;;
    124|137) status="timed out after ${limit}s" ;;
    *) status="failed (exit $rc)" ;;
  esac
  echo "==> [gpu] $name: $status in $(( SECONDS - t0 ))s"
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(( SECONDS - t0 ))" "$status" >> "$RESULTS/.steps.tsv"
  return $rc
}

skip_step() {
  echo "==> [gpu] $1: skipped ($2)"
  printf '%s\t%s\t%s\t%s\n' "$1" "" 0 "skipped: $2" >> "$RESULTS/.steps.tsv"
}

BENCH=("$PY" benchmarks/gpu_bench.py)

# 1. preflight
if ! run_step preflight 120 "${BENCH[@]}" preflight --out "$RESULTS/.preflight.json" \
      ${PEAK_GBPS:+--peak-gbps "$PEAK_GBPS"}; then
  "${BENCH[@]}" summary --results "$RESULTS" >/dev/null 2>&1 || true
  echo "!! [gpu] the environment is unusable (see above): nothing was tested"
  exit 2
fi
HAVE_CUDA=$("$PY" -c 'import torch; print(int(torch.cuda.is_available()))' 2>/dev/null || echo 0)

# 2. tests (no CUDA: the GPU tests are collected and skipped, and counted as skipped)
export HVD_COMPRESS_GPU_RECORD=$RESULTS/.records.json
TESTS=()
[ -n "${GPU_TEST_TESTS:-}" ] && read -r -a TESTS <<< "$GPU_TEST_TESTS"
if [ "${#TESTS[@]}" = 0 ]; then      # (blank: the default, never pytest's whole suite)
  TESTS=(tests/gpu)
  [ "$HAVE_CUDA" = 1 ] && TESTS+=(tests/unit/test_kernels.py tests/unit/test_buckets.py \
    tests/unit/test_histogram_select.py tests/unit/test_bucket_launches.py \
    tests/unit/test_rangefloat_segments.py tests/unit/test_padded_select.py \
    tests/unit/test_warm_start.py)
fi
run_step tests "$TESTS_LIMIT" "$PY" -m pytest -p no:cacheprovider -ra -q -o junit_family=xunit2 \
  --junitxml="$RESULTS/tests.xml" "${TESTS[@]}"

# 3. benchmarks (CUDA only, or the dry run's tiny sizes); the key case (25M) first, each
#    part its own JSON
if [ "$HAVE_CUDA" = 1 ] || [ "$DEVICE" = cpu ]; then
  SELECT=("$PY" benchmarks/select.py --device "$DEVICE" --no-progress --repeat "$REPEAT")
  run_step "select $BIG" 90 "${SELECT[@]}" --sizes "$BIG" --inputs laplace,gaussian,student_t2 \
    --out "$RESULTS/.select_2_25M.json"
  run_step codecs 90 "${BENCH[@]}" codecs --device "$DEVICE" --sizes "$BIG,$HUGE" --repeat $(( REPEAT * 2 )) \
    --out "$RESULTS/codecs.json" ${PEAK_GBPS:+--peak-gbps "$PEAK_GBPS"}
  run_step models 75 "${BENCH[@]}" models --device "$DEVICE" "${MODELS[@]}" \
    --out "$RESULTS/models.json"
  run_step "gpu step" 150 "$PY" benchmarks/gpu_step.py --device "$DEVICE" --models gpt2,resnet50 \
    "${STEP[@]}" --ddp-check --out "$RESULTS"   # issue 26; each model's JSON when done
  run_step breakdown 75 "$PY" benchmarks/gpu_breakdown.py --device "$DEVICE" \
    ${DRY:+--tiny --repeat 1} --out "$RESULTS"  # device time by kernel; host overhead
  run_step "bucket ops" 60 "$PY" benchmarks/bucket_ops.py --device "$DEVICE" \
    ${DRY:+--specs "twobit;qsgd" --host-tensors 2,6 --host-reps 1} \
    --out "$RESULTS"      # launches, ops and host work per tensor of a bucket exchange
  run_step "select $SMALL + real" 60 "${SELECT[@]}" --sizes "$SMALL" --inputs laplace,gaussian,student_t2,real \
    ${DRY:+--densities 0.01} --out "$RESULTS/.select_1_small.json"  # (dry: 30 s less)
  run_step profile 60 "${BENCH[@]}" profile --device "$DEVICE" --sizes "$PROF" --repeat "$REPEAT" \
    --out "$RESULTS/profile.json"
  run_step "codec time" 60 "$PY" benchmarks/codec_time.py --device "$DEVICE" --sizes "$PROF" \
    --repeat $(( REPEAT * 2 )) --out "$RESULTS"                # the peer baselines beside ours
  run_step "select $HUGE" 90 "${SELECT[@]}" --sizes "$HUGE" --inputs laplace,gaussian \
    --methods topk,laplace_topk,laplace_topk_exact,laplace_topk_fused,laplace_topk_padded,laplace_topk_padded_cached,laplace_topk_padded_warm,dgc,gaussian_k,sidco_exp \
    --out "$RESULTS/.select_3_100M.json"
else
  for s in "select 25M" codecs models "gpu step" breakdown "bucket ops" "select 1M,4M + real" \
      profile "codec time" "select 100M"; do
    skip_step "$s" "no CUDA device"
  done
fi

# 4. summary
"${BENCH[@]}" summary --results "$RESULTS" ${DRY:+--dry-run}
rc=$?
echo "==> [gpu] done in $(( SECONDS - START ))s; results in $RESULTS"
if [ "$HAVE_CUDA" != 1 ] && [ "${REQUIRE_CUDA:-0}" = 1 ]; then
  echo "!! [gpu] REQUIRE_CUDA=1 and there is no CUDA device"
  exit 3
fi
exit $rc
