"""``auto`` until its first decision (20 steps of calibration, then trials) on a model
with one large tensor (1M values) and small ones; rank 0 writes what auto chose per
bucket, the combinations it tried (bucket key -> candidate index) and their measured
steps to ``$1/auto_link.json``.  Run on plain loopback and inside a namespace shaped to
100 Mbit/s by tests/integration/test_auto_link.py."""
import json
import os
import sys

import horovod.torch as hvd
import torch

import hvd_compress.torch as hct

hvd.init()
torch.set_num_threads(1)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.ReLU(),
                            torch.nn.Linear(16, 65536), torch.nn.ReLU(),
                            torch.nn.Linear(65536, 10))
opt = hct.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                               model.named_parameters(),
                               compression="auto:every=0")
x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))
auto = opt.compression
for step in range(60):          # calibration (20 steps), then trials where close
    if auto.decisions and auto.phase == "run":
        break
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
if hvd.rank() == 0:
    sizes = {lay.key: lay.total for lay in opt._layouts}
    with open(os.path.join(sys.argv[1], "auto_link.json"), "w") as f:
        json.dump({"choices": opt.stats.as_dict()["choices"], "sizes": sizes,
                   "decision": auto.decisions[-1], "trials": auto.trials,
                   "measured": auto.measured, "choice": auto.choice}, f)
