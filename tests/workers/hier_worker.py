"""The hierarchical exchange (``hier:``) through real Horovod on H hosts x L workers:
``horovodrun -np 4 -H localhost:2,127.0.0.1:2 --gloo python hier_worker.py torch|tf``
(two "hosts" that are both this machine: Horovod sets local and cross ranks as for two
machines).  tests/integration/test_hier_horovod.py checks what each rank writes.

Gradients are fixed: the loss is ``sum_p (p * G_p(rank, step)).sum()``, so each rank's
gradient is exactly G, generated here from (rank, step), and the test compares the
aggregate with the numpy reference of the scheme (tests/reference.py).  Cases:

- ``bucket``: one bucket of three tensors, op=Sum, 3 steps; aggregates, residuals of
  every piece, stats; then a checkpoint after step 2 restored into a new optimizer,
  step 3 again (must be bit for bit the first run's).
- ``tensor``: tensor by tensor (bucket_mb=0), op=Average, 2 steps.
- ``auto``: ``auto`` with candidates topk, hier:topk and none, calibrating one step
  each (so it switches flat -> hier -> dense): aggregates and the slow/fast link bytes.
- ``mismatch``: rank 3 asks for another density: ValueError on every rank.

With MODE=uneven (launched on hosts of 2 and 1 workers) each rank only records the
ValueError of building the optimizer.
"""
import os
import sys
import traceback

import numpy as np

FRAMEWORK = sys.argv[1]
OUT = os.environ["OUT_DIR"]
SHAPES = {"a.weight": (40, 30), "b.weight": (30, 20), "c.bias": (7,)}
SPEC = "hier:topk:density=0.05"
AUTO = ("auto:candidates=topk:density=0.05|hier:topk:density=0.05|none,calibrate=3,"
        "trial=0,every=0,verbose=0")


def grad(rank, step, name):
    seed = 1000 * step + 10 * rank + list(SHAPES).index(name)
    return np.random.RandomState(seed).standard_normal(SHAPES[name]).astype(np.float32)


# -- PyTorch ----------------------------------------------------------------------------
def torch_main(record):
    import horovod.torch as hvd
    import torch

    import hvd_compress.torch as hc
    hvd.init()
    rank = hvd.rank()
    record["places"] = np.array([hvd.rank(), hvd.local_rank(), hvd.local_size(),
                                 hvd.cross_rank(), hvd.cross_size()])

    def make(spec=SPEC, op=hvd.Sum, bucket_mb=64):
        params = {n: torch.nn.Parameter(torch.zeros(s)) for n, s in SHAPES.items()}
        opt = hc.DistributedOptimizer(torch.optim.SGD(params.values(), lr=0.0),
                                      named_parameters=list(params.items()),
                                      compression=spec, op=op, bucket_mb=bucket_mb)
        return params, opt

    def step(params, opt, s):
        loss = sum((p * torch.from_numpy(grad(rank, s, n))).sum() for n, p in params.items())
        loss.backward()
        opt.synchronize()
        got = {n: p.grad.detach().numpy().copy() for n, p in params.items()}
        with opt.skip_synchronize():
            opt.step()
        opt.zero_grad()
        return got

    if os.environ.get("MODE") == "uneven":
        try:
            make()
        except ValueError as e:
            record["uneven_error"] = np.array(str(e))
        return

    params, opt = make()
    record["host_transport"] = np.array(type(opt._driver.hierarchy.local).__name__)
    record["bucket_order"] = np.array([list(lay.names) for lay in opt._layouts][0])
    for s in range(3):
        if s == 2:
            state = opt.compression.state_dict()
        for n, g in step(params, opt, s).items():
            record[f"bucket|{s}|{n}"] = g
        record[f"bucket|{s}|stats"] = np.array(
            [opt.stats.as_dict()[k] for k in ("last_sent", "last_dense", "last_host_sent")])
    for name in _piece_names():
        res = opt.compression.residual(name)
        if res is not None:
            record[f"bucket|residual|{name}"] = res.numpy().copy()
    params2, opt2 = make()
    opt2.compression.load_state_dict(state)
    for n, g in step(params2, opt2, 2).items():
        record[f"restored|2|{n}"] = g

    params, opt = make(op=hvd.Average, bucket_mb=0)
    for s in range(2):
        for n, g in step(params, opt, s).items():
            record[f"tensor|{s}|{n}"] = g

    params, opt = make(spec=AUTO)
    for s in range(3):
        for n, g in step(params, opt, s).items():
            record[f"auto|{s}|{n}"] = g
        record[f"auto|{s}|stats"] = np.array(
            [opt.stats.as_dict()[k] for k in ("last_sent", "last_dense", "last_host_sent")])

    try:
        params, opt = make(spec="hier:topk:density=0.1" if rank == 3 else SPEC)
        step(params, opt, 0)
    except ValueError as e:
        record["mismatch_error"] = np.array(str(e))


# -- TensorFlow -------------------------------------------------------------------------
def tf_main(record):
    import horovod.tensorflow as hvd
    import tensorflow as tf

    import hvd_compress
    import hvd_compress.tensorflow as htf
    from hvd_compress.hosts import process_sets
    hvd.init(process_sets=process_sets())          # the hosts' sets up front (static)
    rank = hvd.rank()
    record["places"] = np.array([hvd.rank(), hvd.local_rank(), hvd.local_size(),
                                 hvd.cross_rank(), hvd.cross_size()])
    # Keras/TF name variables without dots' meaning; the tape names them by name
    variables = [tf.Variable(tf.zeros(s), name=n) for n, s in SHAPES.items()]

    def step(compression, s, op=hvd.Sum, bucket_mb=64, graph=False):
        gs = [tf.constant(grad(rank, s, n)) for n in SHAPES]

        def run():
            with tf.GradientTape() as t:
                loss = tf.add_n([tf.reduce_sum(v * g) for v, g in zip(variables, gs)])
            tape = htf.DistributedGradientTape(t, compression=compression, op=op,
                                               bucket_mb=bucket_mb)
            return tape.gradient(loss, variables)
        out = tf.function(run)() if graph else run()
        return {n: g.numpy() for n, g in zip(SHAPES, out)}

    comp = hvd_compress.from_spec(SPEC)
    for s in range(3):
        if s == 2:
            state = comp.state_dict()
        for n, g in step(comp, s).items():
            record[f"bucket|{s}|{n}"] = g
    record["bucket_order"] = np.array(list(reversed(SHAPES)))
    from hvd_compress.tensorflow import collectives   # eager steps: shared memory inside
    record["host_transport"] = np.array(type(collectives._HIERARCHY[0].local).__name__)
    for name in _piece_names():
        res = comp.residual(name)
        if res is not None:
            record[f"bucket|residual|{name}"] = np.asarray(res)
    comp2 = hvd_compress.from_spec(SPEC)
    comp2.load_state_dict(state, framework="tensorflow")
    for n, g in step(comp2, 2).items():
        record[f"restored|2|{n}"] = g
    comp = hvd_compress.from_spec(SPEC)
    for s in range(2):
        for n, g in step(comp, s, op=hvd.Average, bucket_mb=0, graph=True).items():
            record[f"tensor|{s}|{n}"] = g
    comp = hvd_compress.from_spec(AUTO)
    for s in range(3):
        for n, g in step(comp, s).items():
            record[f"auto|{s}|{n}"] = g
    try:
        step(hvd_compress.from_spec("hier:topk:density=0.1" if rank == 3 else SPEC), 0)
    except ValueError as e:
        record["mismatch_error"] = np.array(str(e))


def _piece_names():
    """Every name a residual may be kept under: tensors and their shard pieces."""
    return [n for n in SHAPES] + [f"{n}/shard{l}" for n in SHAPES for l in range(4)]


def main():
    record = {}
    try:
        torch_main(record) if FRAMEWORK == "torch" else tf_main(record)
    except Exception:
        traceback.print_exc()
        raise
    rank = int(os.environ["HOROVOD_RANK"])
    prefix = f"hier_{FRAMEWORK}_{os.environ.get('MODE', 'main')}"
    np.savez(os.path.join(OUT, f"{prefix}_rank{rank}.npz"), **record)


if __name__ == "__main__":
    main()
