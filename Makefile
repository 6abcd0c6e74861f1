# make demo  - set up if needed, then run the main job (2-worker MNIST with top-k compression)
# make test  - set up if needed, then run the whole test suite (what CI runs)
# make test-fast - set up if needed, then only the in-process tests (tests/unit, a few minutes)
# make setup - create .venv with torch, TensorFlow, Triton and Horovod (built from source)
VENV   := .venv
PY     := $(VENV)/bin/python
HVDRUN := $(VENV)/bin/horovodrun -np 2 -H localhost:2 --gloo

.PHONY: setup test test-fast demo demo-tf demo-keras demo-ddp demo-lightning demo-cssgd bench clean gpu-test

setup:
	@bash ci/setup.sh

test: setup
	$(PY) -m pytest -ra tests

test-fast: setup
	$(PY) -m pytest -ra tests/unit

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

clean:
	rm -rf $(VENV) build *.egg-info

# make gpu-test - every kernel and compressor on CUDA, sync counts, GPU benchmarks (ci/gpu.sh);
#                no .venv, no Horovod/TensorFlow, no network: python3 (or $$PYTHON) with torch+triton
gpu-test:
	@bash ci/gpu.sh
