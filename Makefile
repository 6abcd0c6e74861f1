# make demo  - set up if needed, then run the main job (2-worker MNIST with top-k compression)
# make test  - set up if needed, then run the whole test suite (what CI runs)
# make test-fast - set up if needed, then only the in-process tests (tests/unit, a few minutes)
# make test-triton36 - the kernel tests in Triton 3.6's interpreter (the GPU machine's version)
# make compile-check - those tests with every kernel also compiled for sm_90 (H100/H200) by Triton 3.6
# make setup - create .venv with torch, TensorFlow, Triton and Horovod (built from source)
VENV   := .venv
PY     := $(VENV)/bin/python
HVDRUN := $(VENV)/bin/horovodrun -np 2 -H localhost:2 --gloo

.PHONY: setup test test-fast triton36 test-triton36 compile-check demo demo-tf demo-keras demo-ddp demo-lightning demo-cssgd bench clean gpu-test gpu-dry-run

setup:
	@bash ci/setup.sh

# make test runs in three parts: first, on 2 workers (pytest-xdist), the tests that each
# run in one process (tests/unit, the GPU tests, and the two long one-process
# integration tests: the GPU dry run and the sm_90 compile check); then, on 2 workers a
# file each (--dist loadfile: a module's horovodrun job is launched once), the
# integration tests that launch horovodrun or torchrun jobs (2-3 processes each: two jobs
# at once kept both cores busy, 196% CPU against about 150% one at a time, and took
# 23 minutes where one at a time took 25-29, 2026-11-30); last, one at a time, those that
# shape a link or time it (network namespaces).  Every part runs; any failing fails it.
PARALLEL_TESTS := tests/integration/test_gpu_dry_run.py tests/integration/test_kernels_compile.py \
	tests/unit tests/gpu
ALONE_TESTS := tests/integration/test_auto_link.py tests/integration/test_hier_horovod.py \
	tests/integration/test_shaped_link.py
PYTEST := $(PY) -m pytest -ra --durations=25

test: setup
	@rc=0; \
	$(PYTEST) -n 2 --dist worksteal $(PARALLEL_TESTS) || rc=$$?; \
	$(PYTEST) -n 2 --dist loadfile tests/integration \
		$(patsubst %,--ignore=%,$(filter tests/integration/%,$(PARALLEL_TESTS)) $(ALONE_TESTS)) \
		|| rc=$$?; \
	$(PYTEST) $(ALONE_TESTS) || rc=$$?; \
	exit $$rc

test-fast: setup
	$(PY) -m pytest -ra -n 2 --dist worksteal tests/unit

demo: setup
	$(HVDRUN) $(PY) examples/pytorch_mnist.py --compression topk:density=0.01

# coded SGD (seed 003): 3 workers, every part computed on 2 of them
demo-cssgd: setup
	HOROVOD_DYNAMIC_PROCESS_SETS=1 $(VENV)/bin/horovodrun -np 3 -H localhost:3 --gloo \
		$(PY) examples/cssgd_mnist.py --redundancy 2

demo-tf: setup
	$(HVDRUN) $(PY) examples/tensorflow2_mnist.py --compression topk:density=0.01

demo-keras: setup
	$(HVDRUN) $(PY) examples/keras_mnist.py --compression topk:density=0.01

# PyTorch DDP without Horovod: hvd_compress as a DDP communication hook (torchrun, Gloo, CPU)
demo-ddp: setup
	$(VENV)/bin/torchrun --nproc_per_node 2 --standalone examples/ddp_mnist.py --compression topk:density=0.01

# PyTorch Lightning: Trainer(devices=2) on the CPU starts its second process itself (DDP, Gloo)
demo-lightning: setup
	OMP_NUM_THREADS=1 $(PY) examples/lightning_mnist.py --compression topk:density=0.01 --epochs 5 \
		--no-progress --log-dir $${TMPDIR:-/tmp}/hvd_compress_lightning_logs

# make test-triton36 - the kernel tests (and tests/gpu on CPU tensors) in the interpreter of
#                     Triton 3.6, the lent GPU machine's version: .venv-triton36 reuses .venv's
#                     packages with triton 3.6.0 in front (downloaded once)
TRITON36 := .venv-triton36
KERNEL_TESTS := tests/unit/test_kernels.py tests/unit/test_bucket_launches.py \
	tests/unit/test_bucket_syncs.py tests/unit/test_dct.py tests/unit/test_dct_bucket.py \
	tests/unit/test_histogram_select.py tests/unit/test_histogram_select_review.py \
	tests/unit/test_buckets.py tests/unit/test_hylo.py tests/unit/test_onebit_segments.py \
	tests/unit/test_uniform_draws.py tests/unit/test_rangefloat_segments.py \
	tests/unit/test_padded_select.py
triton36: setup
	@test -x $(TRITON36)/bin/python || { $(PY) -m venv $(TRITON36) && \
		$(PY) -c "import site; print(site.getsitepackages()[0])" > \
		"$$($(TRITON36)/bin/python -c 'import site; print(site.getsitepackages()[0])')/zz_main_venv.pth" && \
		$(TRITON36)/bin/pip install -q --no-deps triton==3.6.0; }
	$(TRITON36)/bin/python -c "import triton; assert triton.__version__.startswith('3.6'), triton.__version__"

test-triton36: triton36
	$(TRITON36)/bin/python -m pytest -q -p no:cacheprovider $(KERNEL_TESTS)
	HVD_COMPRESS_GPU_TESTS_ON_CPU=1 $(TRITON36)/bin/python -m pytest -q -p no:cacheprovider tests/gpu

# make compile-check - the same tests, every kernel launch also compiled for the lent GPU (sm_90:
#                     H100/H200) by Triton 3.6's compiler, down to a cubin, no GPU needed
#                     (tests/triton_compile.py); the table of what compiled goes to $(COMPILE_REPORT)
COMPILE_REPORT ?= $${TMPDIR:-/tmp}/hvd_compress_compiled_sm90.json
compile-check: triton36
	HVD_COMPRESS_COMPILE_FOR=90 HVD_COMPRESS_COMPILE_REPORT=$(COMPILE_REPORT) \
		$(TRITON36)/bin/python -m pytest -q -p no:cacheprovider $(KERNEL_TESTS)
	HVD_COMPRESS_COMPILE_FOR=90 HVD_COMPRESS_GPU_TESTS_ON_CPU=1 \
		$(TRITON36)/bin/python -m pytest -q -p no:cacheprovider tests/gpu

clean:
	rm -rf $(VENV) $(TRITON36) build *.egg-info

# make gpu-test - every kernel and compressor on CUDA, sync counts, GPU benchmarks (ci/gpu.sh);
#                no .venv, no Horovod/TensorFlow, no network: python3 (or $$PYTHON) with torch+triton
gpu-test:
	@bash ci/gpu.sh

# make gpu-dry-run - make gpu-test's steps without a GPU: CPU tensors, the CUDA path's kernels in
#                   Triton's interpreter, tiny sizes, results in a temporary folder (no GPU figures;
#                   PYTHON=.venv-triton36/bin/python for the GPU machine's Triton)
gpu-dry-run: setup
	@GPU_TEST_DEVICE=cpu PYTHON=$${PYTHON:-$(PY)} bash ci/gpu.sh
