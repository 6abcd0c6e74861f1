"""Allreduce 2.5 MB a few times and write how long it took (rank 0): run inside a
shaped namespace by tests/integration/test_shaped_link.py."""
import json
import os
import sys
import time

import horovod.torch as hvd
import torch

hvd.init()
x = torch.ones(625_000)                                   # 2.5 MB of float32
hvd.allreduce(x, name="warmup", op=hvd.Sum)
start = time.perf_counter()
for i in range(3):
    out = hvd.allreduce(x, name=f"shaped.{i}", op=hvd.Sum)
elapsed = time.perf_counter() - start
assert torch.equal(out, 2 * x)
if hvd.rank() == 0:
    with open(os.path.join(sys.argv[1], "shaped.json"), "w") as f:
        json.dump({"seconds": elapsed, "bytes": 3 * x.numel() * 4, "size": hvd.size()}, f)
