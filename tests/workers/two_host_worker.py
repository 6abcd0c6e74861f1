"""One worker of a job across the two hosts of hvd_compress.tools.shaped_link.two_hosts
(tests/integration/test_shaped_link.py): allreduces, a broadcast, an allgather and a job on a
process set; each rank writes what it saw to ``<out dir>/two_host_rank<r>.json``."""
import json
import os
import socket
import sys

import horovod.torch as hvd
import torch

pair = hvd.ProcessSet([0, 1])          # with 3+ workers: a process set of ranks 0 and 1
hvd.init(process_sets=[pair] if int(os.environ["HOROVOD_SIZE"]) > 2 else None)
rank, size = hvd.rank(), hvd.size()
x = torch.full((300_000,), float(rank + 1))                   # 1.2 MB: several packets
summed = hvd.allreduce(x, op=hvd.Sum, name="two_host.sum")
averaged = hvd.allreduce(x, op=hvd.Average)                  # unnamed
got = hvd.broadcast(torch.arange(5.0) * (rank + 1), root_rank=1, name="two_host.bcast")
gathered = hvd.allgather(torch.tensor([[rank, 10 * rank]]))
objects = hvd.allgather_object({"rank": rank, "host": socket.gethostbyname(socket.gethostname())})
pair_sum = None
if size > 2 and rank in (0, 1):          # a collective on the process set's own Gloo context
    pair_sum = float(hvd.allreduce(torch.tensor([rank + 1.0]), op=hvd.Sum, name="two_host.pair",
                                   process_set=pair))
# every rank waits here: a rank outside the pair that finished first shut Horovod down
# under the pair's collective ("Horovod has been shut down ... after one of the ranks
# finished execution")
hvd.allreduce(torch.zeros(1), name="two_host.done")
out = dict(rank=rank, size=size, local_rank=hvd.local_rank(), local_size=hvd.local_size(),
           cross_rank=hvd.cross_rank(), cross_size=hvd.cross_size(),
           summed=[float(summed.min()), float(summed.max())],
           averaged=[float(averaged.min()), float(averaged.max())],
           broadcast=got.tolist(), gathered=gathered.tolist(), objects=objects, pair_sum=pair_sum,
           hostname_resolves_to=socket.gethostbyname(socket.gethostname()),
           gloo_iface=os.environ.get("HOROVOD_GLOO_IFACE"))
with open(os.path.join(sys.argv[1], f"two_host_rank{rank}.json"), "w") as f:
    json.dump(out, f)
print(f"rank {rank} done: sum {out['summed']}", flush=True)
