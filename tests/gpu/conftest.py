"""GPU tests (``make gpu-test``, ci/gpu.sh): every Triton kernel and every compressor on
CUDA tensors, and host-synchronisation counts.  Each module is marked ``gpu`` and skipped,
with a reason, when ``torch.cuda.is_available()`` is false.

Nothing here imports Horovod or TensorFlow: the GPU machine has neither.

Measured figures (synchronisation counts, counts of selected entries, ...) are collected
with the ``record`` fixture and written as JSON to ``$HVD_COMPRESS_GPU_RECORD`` at the end
of the session; ci/gpu.sh folds them into its summary.
"""
import json
import os

import pytest

RECORDS = {}


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (run with `make gpu-test`)")
    config.addinivalue_line("markers", "gpu_big: a GPU test with tensors of >= 2^28 elements")


@pytest.fixture(scope="session")
def record():
    """``record(section, key, value)``: keep a measured figure for the summary JSON."""
    def put(section, key, value):
        RECORDS.setdefault(section, {})[key] = value

    yield put
    path = os.environ.get("HVD_COMPRESS_GPU_RECORD")
    if path and RECORDS:
        old = {}
        if os.path.exists(path):
            with open(path) as f:
                old = json.load(f)
        for section, values in RECORDS.items():
            old.setdefault(section, {}).update(values)
        with open(path, "w") as f:
            json.dump(old, f, indent=1, sort_keys=True)


@pytest.fixture
def free_cuda_cache():
    """Release cached CUDA memory after a test with large tensors."""
    yield
    import gc

    import torch
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
