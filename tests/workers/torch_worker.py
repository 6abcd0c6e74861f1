"""Runs under ``horovodrun -np 2 --gloo``: real PyTorch + Horovod, scenarios named on
the command line.  Each rank writes what it saw to ``$OUT_DIR/torch_<scenario>_rank<r>.npz``
(inputs and outputs); the tests compute the expected aggregates from both ranks' files.
"""
import os
import sys

import horovod.torch as hvd
import numpy as np
import torch

import hvd_compress
import hvd_compress.torch as hct

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import agg_scenario  # noqa: E402
import auto_scenario  # noqa: E402
from agg_scenario import agg_grads  # noqa: E402
from cases import (AGG_SHAPES, AUTO_MB, BUCKET_MBS, BUCKET_SHAPES, BUCKET_SPECS,  # noqa: E402
                   BUCKET_TOL_SPECS, POLICY, REPLAY_SPECS, SHAPES, SPECS, TORCH_BUCKET_SPECS,
                   TORCH_BUCKET_TOL_SPECS)
OPS = {"average": hvd.Average, "sum": hvd.Sum}


def rng(*key):
    return np.random.default_rng([hvd.rank(), *key])


class Params(torch.nn.Module):
    def __init__(self):
        super().__init__()
        for n, s in SHAPES.items():
            self.register_parameter(n, torch.nn.Parameter(torch.zeros(s)))


def backward_with(model, grads):
    """One backward pass whose gradient for each parameter is exactly ``grads[name]``."""
    loss = sum((p * grads[n]).sum() for n, p in model.named_parameters())
    loss.backward()


def aggregate(out):
    for ci, spec in enumerate(SPECS):
        for op_name, op in OPS.items():
            for bpps in (1, 2):
                key = f"{spec}|{op_name}|{bpps}"
                model = Params()
                opt = hct.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                               model.named_parameters(),
                                               compression=hvd_compress.from_spec(spec),
                                               backward_passes_per_step=bpps, op=op)
                for pas in range(bpps):
                    g = {n: torch.from_numpy(rng(ci, bpps, pas).standard_normal(s)
                                             .astype(np.float32)) for n, s in SHAPES.items()}
                    for n in SHAPES:
                        out[f"{key}|{n}|in{pas}"] = g[n].numpy()
                    backward_with(model, g)
                opt.step()
                for n, p in model.named_parameters():
                    out[f"{key}|{n}|out"] = p.grad.numpy().copy()
                out[f"{key}|stats"] = np.array([opt.stats.last_sent, opt.stats.last_dense])


def functional(out):
    """The functional API on awkward tensors: 0-d, empty, int, fp16, bf16,
    non-contiguous, sparse; compressor topk."""
    r = rng(99)
    base = torch.from_numpy(r.standard_normal((9, 11)).astype(np.float32))
    cases = {
        "zero_d": torch.tensor(float(r.standard_normal())),
        "empty": torch.zeros(0, 3),
        "int": torch.from_numpy(r.integers(-50, 50, size=20).astype(np.int32)),
        "fp16": base.half(),
        "bf16": base.bfloat16(),
        "noncontig": base.t(),
        "sparse": torch.sparse_coo_tensor([[1, 4, 7]], torch.tensor([1.5, -2.0, 3.0]), (10,)),
    }
    assert not cases["noncontig"].is_contiguous()
    c = hvd_compress.from_spec("topk:density=0.2")
    for name, t in cases.items():
        res = hct.allreduce(t, name=f"func.{name}", compression=c, op=hvd.Sum)
        dense = t.to_dense() if t.is_sparse else t
        out[f"{name}|in"] = dense.float().numpy() if dense.is_floating_point() else dense.numpy()
        out[f"{name}|out"] = res.float().numpy() if res.is_floating_point() else res.numpy()
        out[f"{name}|dtype"] = np.array(str(res.dtype))
        out[f"{name}|shape"] = np.array(tuple(res.shape))


def empty_rank(out):
    """Rank 1's gradients are all below the threshold: it sends nothing."""
    model = Params()
    opt = hct.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                   model.named_parameters(), compression="threshold:threshold=1.0",
                                   op=hvd.Sum)
    scale = 1.0 if hvd.rank() == 0 else 0.01
    g = {n: torch.from_numpy((scale * rng(5).standard_normal(s)).astype(np.float32))
         for n, s in SHAPES.items()}
    backward_with(model, g)
    opt.step()
    for n, p in model.named_parameters():
        out[f"{n}|in"] = g[n].numpy()
        out[f"{n}|out"] = p.grad.numpy().copy()
    out["stats"] = np.array([opt.stats.last_sent])


def nonfinite(out):
    """Step 1 finite, step 2 rank 0 has NaN and Inf, step 3 finite again."""
    model = Params()
    comp = hvd_compress.from_spec("topk:density=0.05")
    opt = hct.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                   model.named_parameters(), compression=comp, op=hvd.Sum)
    for step in range(3):
        g = {n: torch.from_numpy(rng(7, step).standard_normal(s).astype(np.float32))
             for n, s in SHAPES.items()}
        if step == 1 and hvd.rank() == 0:
            g["w"][0, 3] = float("nan")
            g["w"][2, 5] = float("inf")
        opt.zero_grad()
        backward_with(model, g)
        opt.step()
        out[f"{step}|out"] = model.w.grad.numpy().copy()
        out[f"{step}|residual"] = comp.residual("w").numpy().copy()


def _train(model, opt, steps, start):
    for step in range(start, start + steps):
        r = rng(11, step)
        x = torch.from_numpy(r.standard_normal((16, 10)).astype(np.float32))
        y = torch.from_numpy(r.standard_normal((16, 12)).astype(np.float32))
        opt.zero_grad()
        loss = ((x @ model.w.t() + model.b[:1] - y) ** 2).mean()
        loss.backward()
        opt.step()


def checkpoint(out):
    """6 steps straight vs 3 steps, save, restore into new objects, 3 more steps."""
    def build():
        torch.manual_seed(0)
        model = Params()
        with torch.no_grad():
            model.w.normal_()
        comp = hvd_compress.from_spec("randomk:density=0.1")
        opt = hct.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                       model.named_parameters(), compression=comp)
        return model, opt, comp

    model, opt, _ = build()
    _train(model, opt, 6, 0)
    out["straight"] = model.w.detach().numpy().copy()

    model, opt, comp = build()
    _train(model, opt, 3, 0)
    path = os.path.join(os.environ["OUT_DIR"], f"ckpt_rank{hvd.rank()}.pt")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                "compression": comp.state_dict()}, path)
    del model, opt, comp
    model, opt, comp = build()
    saved = torch.load(path)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    comp.load_state_dict(saved["compression"])
    _train(model, opt, 3, 3)
    out["resumed"] = model.w.detach().numpy().copy()
    # the checkpoint records the rank (the optimizer told the compressor), and the other
    # rank's file is refused (a barrier first: it is written)
    out["saved_rank"] = np.int64(saved["compression"]["rank"])
    hvd.allreduce(torch.zeros(1), name="checkpoint_barrier")
    other = torch.load(os.path.join(os.environ["OUT_DIR"], f"ckpt_rank{1 - hvd.rank()}.pt"))
    try:
        build()[2].load_state_dict(other["compression"])
        out["other_refused"] = np.array("")
    except ValueError as e:
        out["other_refused"] = np.array(str(e))


def stock(out):
    """Our allreduce-able compressor inside Horovod's own DistributedOptimizer."""
    model = Params()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                   named_parameters=model.named_parameters(),
                                   compression=hvd_compress.from_spec("fp16"), op=hvd.Sum)
    g = {n: torch.from_numpy(rng(13).standard_normal(s).astype(np.float32))
         for n, s in SHAPES.items()}
    backward_with(model, g)
    opt.step()
    out["in"], out["out"] = g["w"].numpy(), model.w.grad.numpy().copy()
    model = Params()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                   named_parameters=model.named_parameters(),
                                   compression=hvd_compress.from_spec("topk:density=0.1"))
    try:
        backward_with(model, g)
        out["topk_error"] = np.array("no error")
    except TypeError as e:
        out["topk_error"] = np.array(str(e))


def policy(out):
    """A per-parameter policy through the optimizer, plus Hylo.from_model on a model."""
    model = torch.nn.Module()
    for n, (shape, _, _) in POLICY.items():
        model.register_parameter(n, torch.nn.Parameter(torch.zeros(shape)))
    pol = hvd_compress.Policy({n: spec for n, (_, _, spec) in POLICY.items()})
    opt = hct.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                   model.named_parameters(), compression=pol, op=hvd.Sum)
    g = {n: torch.from_numpy(rng(21).standard_normal(s).astype(np.float32))
         for n, (s, _, _) in POLICY.items()}
    backward_with(model, g)
    opt.step()
    for n, p in model.named_parameters():
        out[f"{n}|in"], out[f"{n}|out"] = g[n].numpy(), p.grad.numpy().copy()
    out["stats"] = np.array([opt.stats.last_sent, opt.stats.last_dense])


def mismatch(out):
    spec = "topk:density=0.05" if hvd.rank() == 0 else "randomk:density=0.05"
    model = Params()
    opt = hct.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                   model.named_parameters(), compression=spec)
    g = {n: torch.ones(s) for n, s in SHAPES.items()}
    try:
        backward_with(model, g)
        opt.step()
    except ValueError as e:
        print(f"CONFIG_ERROR rank {hvd.rank()}: {e}", flush=True)
        FAILED.append(e)


class BucketParams(torch.nn.Module):
    def __init__(self):
        super().__init__()
        for n, s in BUCKET_SHAPES.items():
            self.register_parameter(n, torch.nn.Parameter(torch.zeros(s)))


def _bucket_run(spec, mb, steps=3, bpps=1, state=None, save=None):
    """``steps`` steps of BucketParams with ``bucket_mb=mb``; gradient of "late" missing on
    step 1 (its hook never fires: handled at synchronize()).  Returns the gradients of
    every step, the compressor and the optimizer."""
    model = BucketParams()
    comp = spec if isinstance(spec, hvd_compress.Policy) else hvd_compress.from_spec(spec)
    if state is not None:
        comp.load_state_dict(state)
    opt = hct.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                   model.named_parameters(), compression=comp, op=hvd.Sum,
                                   backward_passes_per_step=bpps, bucket_mb=mb)
    grads = []
    for step in range(steps):
        opt.zero_grad()
        for pas in range(bpps):
            g = {n: torch.from_numpy(rng(31, step, pas).standard_normal(s).astype(np.float32))
                 for n, s in BUCKET_SHAPES.items()}
            if step == 1:
                g.pop("late")
            loss = sum((p * g[n]).sum() for n, p in model.named_parameters() if n in g)
            loss.backward()
        opt.step()
        grads.append({n: p.grad.numpy().copy() for n, p in model.named_parameters()})
    return grads, comp, opt


def buckets(out):
    """The same steps tensor by tensor (bucket_mb=0) and in buckets; the tests compare."""
    for spec in BUCKET_SPECS + BUCKET_TOL_SPECS + TORCH_BUCKET_SPECS + TORCH_BUCKET_TOL_SPECS:
        for mb in BUCKET_MBS:
            for bpps in (1, 2) if spec == "topk:density=0.05" else (1,):
                grads, comp, opt = _bucket_run(spec, mb, bpps=bpps)
                for step, g in enumerate(grads):
                    for n, v in g.items():
                        out[f"{spec}|{mb}|{bpps}|{step}|{n}"] = v
                out[f"{spec}|{mb}|{bpps}|buckets"] = np.array([len(b) for b in opt._buckets])
                state = comp.state_dict()["state"]
                for k, v in state.items():
                    out[f"{spec}|{mb}|{bpps}|state|{k}"] = v.numpy().copy()
    for mb in BUCKET_MBS:                  # a new policy each time: it holds the residuals
        pol = hvd_compress.Policy({"conv": "kernel_select", "big": "topk:density=0.05",
                                   "w": "topk:density=0.05",
                                   "b": "laplace_topk:density=0.05,exact=1"}, default="none")
        grads, _, opt = _bucket_run(pol, mb)
        for n, v in grads[-1].items():
            out[f"policy|{mb}|{n}"] = v
        out[f"policy|{mb}|buckets"] = np.array([len(b) for b in opt._buckets])
    # a checkpoint moves between the paths: 2 steps in buckets, restore tensor by tensor
    spec = "laplace_topk:density=0.05,exact=1"
    straight, _, _ = _bucket_run(spec, 0.002, steps=4)
    first, comp, _ = _bucket_run(spec, 0.002, steps=2)
    second, comp2, _ = _bucket_run(spec, 0, steps=2, state=comp.state_dict())
    # (the second run repeats steps 0-1's gradients: compare with a straight run that does)
    again, _, _ = _bucket_run(spec, 0.002, steps=2, state=comp.state_dict())
    for n in BUCKET_SHAPES:
        out[f"ckpt|bucket_then_tensor|{n}"] = second[-1][n]
        out[f"ckpt|bucket_then_bucket|{n}"] = again[-1][n]
    del straight, first, comp2


def replay(out):
    """CUDA-graph replay through the optimizer (``HVD_COMPRESS_CUDA_GRAPHS``), eager,
    replayed, and replayed on rank 0 only, every bucket size (tensor by tensor: each tensor a bucket of one, sent as
    such where replayed), for the test to compare bit for bit.  No GPU here: replay is
    taken for CPU tensors, on the CUDA code path (kernels in Triton's interpreter),
    through tests/replay_standin.py's stand-in for the graphs (Horovod, PyTorch and the
    collectives are the real ones)."""
    from hvd_compress.compressors import replay as rp
    from replay_standin import StandIn
    saved = rp.wanted, rp.cuda_capture, rp._on_device
    env = {k: os.environ.get(k) for k in ("HVD_COMPRESS_BACKEND", rp.ENV_VAR)}
    rp.wanted = lambda c, t: c.replayable and rp.enabled()
    rp.cuda_capture, rp._on_device = StandIn(), (lambda capture, device: capture)
    os.environ["HVD_COMPRESS_BACKEND"] = "triton"
    try:
        for spec in REPLAY_SPECS:
            for mb in BUCKET_MBS:
                for graphs in ("0", "1", "mixed"):          # mixed: rank 0 replays
                    on = graphs == "1" or (graphs == "mixed" and hvd.rank() == 0)
                    os.environ[rp.ENV_VAR] = "1" if on else "0"
                    before = dict(rp.STATS)
                    grads, comp, _ = _bucket_run(spec, mb, steps=5)
                    for step, g in enumerate(grads):
                        for n, v in g.items():
                            out[f"{spec}|{mb}|{graphs}|{step}|{n}"] = v
                    for k in ("replayed", "off"):
                        out[f"{spec}|{mb}|{graphs}|{k}"] = np.array(rp.STATS[k] - before[k])
                    for k, v in comp.state_dict()["state"].items():
                        out[f"{spec}|{mb}|{graphs}|state|{k}"] = v.numpy().copy()
    finally:
        rp.wanted, rp.cuda_capture, rp._on_device = saved
        for k, v in env.items():                    # the settings as they were
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def bucket_mismatch(out):
    mb = 25 if hvd.rank() == 0 else 0.002
    try:
        _bucket_run("topk:density=0.05", mb, steps=1)
    except ValueError as e:
        print(f"CONFIG_ERROR rank {hvd.rank()}: {e}", flush=True)
        FAILED.append(e)


class AggParams(torch.nn.Module):
    def __init__(self):
        super().__init__()
        for n, s in AGG_SHAPES.items():
            self.register_parameter(n, torch.nn.Parameter(torch.zeros(s)))


def _agg_run(comp, mb, steps, start=0, op=hvd.Sum, process_set=hvd.global_process_set):
    """``steps`` steps from ``start``: (outputs per step, stats per step)."""
    model = AggParams()
    opt = hct.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                   model.named_parameters(), compression=comp, op=op,
                                   bucket_mb=mb, process_set=process_set)
    outs, stats = [], []
    for step in range(start, start + steps):
        opt.zero_grad()
        backward_with(model, {n: torch.from_numpy(g) for n, g in agg_grads(hvd, step).items()})
        opt.step()
        outs.append({n: p.grad.numpy().copy() for n, p in model.named_parameters()})
        st = opt.stats.as_dict()
        stats.append([st[f"last_{k}"] for k in ("sent", "received", "received_local", "union", "k")])
    return outs, stats


def agg(out):
    agg_scenario.agg(out, hvd, _agg_run, "torch")


def _auto_run(comp, steps, start=0):
    """``auto``: (outputs per step, candidate index per bucket per step, bucket names)."""
    model = BucketParams()
    opt = hct.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                   model.named_parameters(), compression=comp, op=hvd.Sum,
                                   bucket_mb=AUTO_MB)
    keys = [lay.key for lay in opt._layouts]
    outs, chosen = [], []
    for step in range(start, start + steps):
        chosen.append([comp.choose(k)[0] for k in keys])
        opt.zero_grad()
        g = auto_scenario.auto_grads(hvd, step)
        backward_with(model, {n: torch.from_numpy(v) for n, v in g.items()})
        opt.step()
        outs.append({n: p.grad.numpy().copy() for n, p in model.named_parameters()})
    return outs, chosen, [list(lay.names) for lay in opt._layouts]


_auto_run.framework = "torch"


def auto(out):
    auto_scenario.auto(out, hvd, _auto_run)


def auto_mismatch(out):
    auto_scenario.mismatch(hvd, _auto_run, FAILED)


FAILED = []      #: configuration errors caught (the mismatch scenarios): exit 3 at the end

SCENARIOS = {f.__name__: f for f in (aggregate, functional, empty_rank, nonfinite,
                                     checkpoint, stock, policy, mismatch, buckets,
                                     bucket_mismatch, agg, auto, auto_mismatch, replay)}

if __name__ == "__main__":
    hvd.init()
    torch.set_num_threads(1)
    for scenario in sys.argv[1:]:
        result = {}
        SCENARIOS[scenario](result)
        np.savez(os.path.join(os.environ["OUT_DIR"], f"torch_{scenario}_rank{hvd.rank()}.npz"),
                 **result)
    print("WORKER_DONE", hvd.rank(), flush=True)
    if FAILED:
        sys.exit(3)
