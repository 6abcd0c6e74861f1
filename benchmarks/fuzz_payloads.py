"""Malformed aggregated payloads, many of them: every compressor x every mutation
(tensors dropped or added, truncated, extended, emptied, another dtype, indices out of
range) x random positions and sizes, in PyTorch and TensorFlow.  Prints, per framework
and compressor, how many cases raised a clear error (ValueError/TypeError naming the
compressor), stayed well formed, or did not apply; any raw framework error stops it.

    python benchmarks/fuzz_payloads.py                 # 2,000 cases per framework
    python benchmarks/fuzz_payloads.py --cases 20000 --frameworks torch
"""
import sys
from pathlib import Path

sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
import torch  # noqa: E402,F401  (Triton before TensorFlow, see tests/conftest.py)
from malformed import SPECS, TF, Torch, fuzz  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", type=int, default=2000, help="per framework")
    p.add_argument("--frameworks", default="torch,tensorflow")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    for name in args.frameworks.split(","):
        fw = Torch() if name == "torch" else TF()
        counts = fuzz(fw, args.cases, args.seed)
        print(f"\n### {name}: {args.cases} malformed aggregates, no raw error\n")
        print("| compressor | clear error | still well formed | not applicable |")
        print("|---|---|---|---|")
        for spec in SPECS:
            c = counts[spec]
            print(f"| {spec} | {c['error']} | {c['ok']} | {c['skip']} |")


if __name__ == "__main__":
    main()
