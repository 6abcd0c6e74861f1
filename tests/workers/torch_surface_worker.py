"""Runs under ``horovodrun -np 2 --gloo``: Horovod's optimizer surface (the arguments and
methods of ``horovod.torch.DistributedOptimizer`` 0.28.1) and mixed precision
(``torch.autocast`` + ``torch.amp.GradScaler`` on the CPU) through
``hvd_compress.torch.DistributedOptimizer``; scenarios named on the command line.  Each
rank writes what it saw to ``$OUT_DIR/surface_<scenario>_rank<r>.npz``; the tests
(tests/integration/test_torch_surface.py) compute the expected values from both ranks'
inputs.
"""
import logging
import os
import sys

import horovod.torch as hvd
import numpy as np
import torch

import hvd_compress
import hvd_compress.torch as hct

SHAPES = {"w": (6, 10), "b": (10,), "v": (5,)}


def rng(*key):
    return np.random.default_rng([hvd.rank(), *key])


def grads(*key):
    return {n: torch.from_numpy(rng(*key, i).standard_normal(s).astype(np.float32))
            for i, (n, s) in enumerate(SHAPES.items())}


class Params(torch.nn.Module):
    def __init__(self, shapes=SHAPES):
        super().__init__()
        for n, s in shapes.items():
            self.register_parameter(n, torch.nn.Parameter(torch.zeros(s)))


def backward_with(model, g):
    sum((p * g[n]).sum() for n, p in model.named_parameters() if n in g).backward()


def error(fn):
    """The text of what ``fn()`` raised, as ``Type: message`` (``none`` if nothing)."""
    try:
        fn()
    except Exception as e:          # noqa: BLE001 (the tests check type and text)
        return np.array(f"{type(e).__name__}: {e}")
    return np.array("none")


def ours(model, opt=None, **kw):
    opt = opt or torch.optim.SGD(model.parameters(), lr=0.0)
    return hct.DistributedOptimizer(opt, model.named_parameters(), **kw)


# -- Horovod's surface ---------------------------------------------------------------
def broadcast_state(out):
    """hvd.broadcast_parameters + hvd.broadcast_optimizer_state with ours, for SGD, Adam,
    AdamW, RMSprop: rank 1 starts from other weights and another lr (eps for AdamW, whose
    state-initialising step on zero gradients decays the weights by each rank's own lr,
    with Horovod's optimizer too); after the broadcasts and 3 steps both ranks hold the
    same weights and state, and ours with ``none`` equals Horovod's own optimizer."""
    makers = {"sgd": lambda ps, r: torch.optim.SGD(ps, lr=0.01 * (1 + r), momentum=0.9),
              "adam": lambda ps, r: torch.optim.Adam(ps, lr=0.01 * (1 + r)),
              "adamw": lambda ps, r: torch.optim.AdamW(ps, lr=0.01, eps=1e-8 * (1 + r),
                                                       weight_decay=0.01),
              "rmsprop": lambda ps, r: torch.optim.RMSprop(ps, lr=0.01 * (1 + r))}
    for (name, make), which in ((m, w) for m in makers.items()
                                for w in ("topk", "none", "horovod")):
        torch.manual_seed(hvd.rank())
        model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
        base = make(model.parameters(), hvd.rank())
        comp = hvd_compress.from_spec("topk:density=0.3" if which == "topk" else "none")
        opt = hvd.DistributedOptimizer(base, model.named_parameters()) if which == "horovod" \
            else ours(model, base, compression=comp)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        name = f"{name}|{which}"
        out[f"{name}|lr"] = np.array(opt.param_groups[0]["lr"])
        out[f"{name}|eps"] = np.array(opt.param_groups[0]["eps"] if "eps" in base.defaults else 0)
        out[f"{name}|ef_after_broadcast"] = np.array(len(comp.state_dict()["state"]))
        for step in range(3):
            r = rng(1, step)
            x = torch.from_numpy(r.standard_normal((4, 8)).astype(np.float32))
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
        for k, v in model.state_dict().items():
            out[f"{name}|param|{k}"] = v.numpy().copy()
        for i, st in enumerate(opt.state_dict()["state"].values()):
            for k, v in st.items():
                if torch.is_tensor(v):
                    out[f"{name}|state|{i}|{k}"] = v.numpy().copy()


def passes(out):
    """backward_passes_per_step=2, then set_backward_passes_per_step(3); one backward too
    many and zero_grad() at the wrong time raise Horovod's AssertionErrors."""
    model = Params()
    opt = ours(model, backward_passes_per_step=2, op=hvd.Sum, compression="none")
    for step, n in ((0, 2), (1, 3)):
        if step == 1:
            opt.set_backward_passes_per_step(3)
        opt.zero_grad()
        for pas in range(n):
            g = grads(2, step, pas)
            for k, v in g.items():
                out[f"{step}|in{pas}|{k}"] = v.numpy()
            backward_with(model, g)
        opt.step()
        for k, p in model.named_parameters():
            out[f"{step}|out|{k}"] = p.grad.numpy().copy()
    opt.zero_grad()
    for _ in range(3):
        backward_with(model, grads(2, 9, 0))
    out["zero_grad_error"] = error(opt.zero_grad)
    out["set_passes_error"] = error(lambda: opt.set_backward_passes_per_step(2))
    out["fourth_backward_error"] = error(lambda: backward_with(model, grads(2, 9, 1)))
    opt.synchronize()                          # the 3 passes were all sent: fine
    with opt.skip_synchronize():
        opt.step()
    out["bad_passes_error"] = error(lambda: opt.set_backward_passes_per_step(0))


def clip(out):
    """synchronize(); clip_grad_norm_; with skip_synchronize(): step(); SGD lr=1."""
    for spec in ("none", "topk:density=0.5"):
        model = Params()
        opt = ours(model, torch.optim.SGD(model.parameters(), lr=1.0), compression=spec)
        g = grads(3)
        for k, v in g.items():
            out[f"{spec}|in|{k}"] = v.numpy()
        backward_with(model, g)
        opt.synchronize()
        for k, p in model.named_parameters():
            out[f"{spec}|avg|{k}"] = p.grad.numpy().copy()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        with opt.skip_synchronize():
            opt.step()
        for k, p in model.named_parameters():
            out[f"{spec}|param|{k}"] = p.detach().numpy().copy()
        out[f"{spec}|in_flight"] = np.array(len(opt._handles))


def no_grads(out):
    """A parameter without a gradient (unused by the loss), one frozen after the
    optimizer was built, one unfrozen after: zeros exchanged for the first two, the last
    one kept local with a warning."""
    shapes = dict(SHAPES, frozen=(4,))
    model = Params(shapes)
    model.frozen.requires_grad_(False)
    logs = []
    handler = logging.Handler()
    handler.emit = lambda record: logs.append(record.getMessage())
    logging.getLogger("hvd_compress").addHandler(handler)
    opt = ours(model, op=hvd.Sum, compression="none")
    for step in range(3):
        g = grads(4, step)
        g["frozen"] = torch.ones(4) * (1 + hvd.rank())
        if step == 0:
            g.pop("v")                      # unused this step
        if step == 1:
            model.b.requires_grad_(False)   # frozen after building
            g.pop("b")
        if step == 2:
            model.b.requires_grad_(True)
            model.frozen.requires_grad_(True)   # unfrozen after building
        opt.zero_grad(set_to_none=True)
        backward_with(model, g)
        opt.step()
        for k, v in g.items():
            out[f"{step}|in|{k}"] = v.numpy()
        for k, p in model.named_parameters():
            out[f"{step}|out|{k}"] = p.grad.numpy().copy() if p.grad is not None else np.array([])
    logging.getLogger("hvd_compress").removeHandler(handler)
    out["warnings"] = np.array("\n".join(logs))


class _CustomHorovodCompressor(hvd.compression.Compressor):
    pass


def errors(out):
    """Wrong arguments: ValueError (AssertionError where Horovod raises one) naming them."""
    model = Params()
    named = list(model.named_parameters())
    sgd = lambda: torch.optim.SGD(model.parameters(), lr=0.1)   # noqa: E731
    cases = {
        "duplicate": lambda: hct.DistributedOptimizer(sgd(), [("w", model.w), ("w", model.b),
                                                              ("v", model.v)]),
        "missing": lambda: hct.DistributedOptimizer(sgd(), named[:2]),
        "not_tuples": lambda: hct.DistributedOptimizer(sgd(), [model.w]),
        "adasum": lambda: hct.DistributedOptimizer(sgd(), named, op=hvd.Adasum),
        "adasum_topk": lambda: hct.DistributedOptimizer(sgd(), named, op=hvd.Adasum,
                                                        compression="topk:density=0.1"),
        "predivide_sum": lambda: hct.DistributedOptimizer(sgd(), named, op=hvd.Sum,
                                                          gradient_predivide_factor=2.0),
        "predivide_zero": lambda: hct.DistributedOptimizer(sgd(), named,
                                                           gradient_predivide_factor=0),
        "groups_bad": lambda: hct.DistributedOptimizer(sgd(), named, groups="two"),
        "groups_twice": lambda: hct.DistributedOptimizer(sgd(), named, groups=[[model.w, model.b],
                                                                              [model.w]]),
        "groups_and_bucket_mb": lambda: hct.DistributedOptimizer(sgd(), named, groups=2,
                                                                 bucket_mb=1),
        "num_groups_bad": lambda: hct.DistributedOptimizer(sgd(), named, num_groups=-1),
        "passes_zero": lambda: hct.DistributedOptimizer(sgd(), named, backward_passes_per_step=0),
        "grad_scaler_bad": lambda: hct.DistributedOptimizer(sgd(), named, grad_scaler=2.0),
        "loss_scale_bad": lambda: ours(model).set_loss_scale(-1.0),
        "horovod_custom": lambda: hct.DistributedOptimizer(sgd(), named,
                                                           compression=_CustomHorovodCompressor),
    }
    for k, fn in cases.items():
        out[k] = error(fn)


def sparse(out):
    """An nn.Embedding(sparse=True): sparse_as_dense=True gives a sparse aggregate back
    (as Horovod), False a dense one (as before); both equal the sum over ranks."""
    for spec in ("none", "topk:density=0.5"):
        for as_dense in (False, True):
            key = f"{spec}|{int(as_dense)}"
            torch.manual_seed(0)
            emb = torch.nn.Embedding(12, 3, sparse=True)
            opt = hct.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.0),
                                           emb.named_parameters(), compression=spec,
                                           op=hvd.Sum, sparse_as_dense=as_dense)
            idx = torch.tensor([[0, 3, 5], [5, 7, 11]]) + hvd.rank()
            idx = idx.clamp(max=11)
            # this rank's gradient, from a copy without hooks: emb.weight.grad itself is
            # being reduced in place once backward() returns (read it only after step())
            plain = torch.nn.Embedding(12, 3, sparse=True)
            plain.load_state_dict(emb.state_dict())
            plain(idx).sum().backward()
            out[f"{key}|in"] = plain.weight.grad.to_dense().numpy().copy()
            emb(idx).sum().backward()
            opt.step()
            out[f"{key}|is_sparse"] = np.array(emb.weight.grad.is_sparse)
            out[f"{key}|out"] = emb.weight.grad.to_dense().numpy().copy()


def horovod_compression(out):
    """compression=hvd.Compression.none / .fp16: our none / fp16."""
    for name, comp in (("none", hvd.Compression.none), ("fp16", hvd.Compression.fp16)):
        model = Params()
        opt = ours(model, compression=comp, op=hvd.Sum)
        out[f"{name}|spec"] = np.array(opt.compression.spec)
        g = grads(5)
        backward_with(model, g)
        opt.step()
        for k, p in model.named_parameters():
            out[f"{name}|in|{k}"] = g[k].numpy()
            out[f"{name}|out|{k}"] = p.grad.numpy().copy()


def predivide(out):
    """gradient_predivide_factor=4 vs 1 (op=Average), 3 steps: the same gradients."""
    for spec in ("none", "topk:density=0.3", "twobit"):
        for factor in (1.0, 4.0):
            model = Params()
            opt = ours(model, compression=spec, gradient_predivide_factor=factor)
            for step in range(3):
                opt.zero_grad()
                backward_with(model, grads(6, step))
                opt.step()
                for k, p in model.named_parameters():
                    out[f"{spec}|{factor:g}|{step}|{k}"] = p.grad.numpy().copy()


def groups(out):
    """num_groups=2 and groups=[[w, v]] as buckets, vs tensor by tensor (bucket_mb=0)."""
    spec = "topk:density=0.3"
    for key in ("tensorwise", "num_groups", "groups", "groups_int"):
        model = Params()
        kw = {"tensorwise": {"bucket_mb": 0}, "num_groups": {"num_groups": 2},
              "groups": {"groups": [[model.w, model.v]]}, "groups_int": {"groups": 3}}[key]
        opt = ours(model, compression=spec, op=hvd.Sum, **kw)
        names = {p: n for n, p in model.named_parameters()}
        out[f"{key}|buckets"] = np.array(["+".join(sorted(names[p] for p in b))
                                          for b in opt._buckets])
        for step in range(3):
            opt.zero_grad()
            backward_with(model, grads(7, step))
            opt.step()
            for k, p in model.named_parameters():
                out[f"{key}|{step}|{k}"] = p.grad.numpy().copy()


# -- mixed precision -----------------------------------------------------------------
AMP_SPECS = ("topk:density=0.1", "laplace_topk:density=0.1", "twobit", "powersgd:rank=2")
AMP_STEPS, AMP_OVERFLOW = 10, 5


def _amp_run(spec, init_scale, dtype, scaler_on=True, mb=None, growth=2):
    """10 steps of a small MLP under autocast(cpu, dtype) with a GradScaler starting at
    ``init_scale`` (``growth``: its growth_interval); rank 0's input holds an Inf at
    step 5.  Returns the final weights, the scale per step, the error-feedback state
    before step 5, after it and after step 6, and the count of overflow steps."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    comp = hvd_compress.from_spec(spec)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth)
    opt = hct.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   model.named_parameters(), compression=comp,
                                   grad_scaler=scaler if scaler_on else None, bucket_mb=mb)
    scales, before, after, later = [], None, None, None
    for step in range(AMP_STEPS):
        r = rng(8, step)
        x = torch.from_numpy(r.standard_normal((8, 16)).astype(np.float32))
        y = torch.from_numpy(r.standard_normal((8, 8)).astype(np.float32))
        if step == AMP_OVERFLOW and hvd.rank() == 0:
            x[0, 0] = float("inf")
        if step == AMP_OVERFLOW:
            before = {k: v.numpy().copy() for k, v in comp.state_dict()["state"].items()}
        opt.zero_grad()
        with torch.autocast("cpu", dtype=dtype):
            loss = ((model(x).float() - y) ** 2).mean()
        scales.append(scaler.get_scale())
        scaler.scale(loss).backward()
        opt.synchronize()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()
        state = {k: v.numpy().copy() for k, v in comp.state_dict()["state"].items()}
        after = state if step == AMP_OVERFLOW else after
        later = state if step == AMP_OVERFLOW + 1 else later
    params = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    return params, scales, (before, after, later), opt.overflow_steps


#: (spec, autocast dtype, grad_scaler given, bucket_mb): each run three times, starting at
#: 2^8 and 2^16 growing every 2 steps, and at 2^12 not growing ("const"); the overflow
#: at step 5 halves every scale once
AMP_RUNS = [(spec, "bfloat16", 1, None) for spec in AMP_SPECS] + [
    ("threshold:threshold=0.002", "bfloat16", 1, None),   # an absolute threshold
    ("topk:density=0.1", "float16", 1, None),
    ("topk:density=0.1", "bfloat16", 1, 0),               # tensor by tensor
    ("topk:density=0.1", "bfloat16", 0, None),            # no grad_scaler: as before
]
AMP_STARTS = {"256": (2.0 ** 8, 2), "65536": (2.0 ** 16, 2), "const": (2.0 ** 12, 1000)}


def amp(out):
    for spec, dtype, on, mb in AMP_RUNS:
        for start, (init, growth) in AMP_STARTS.items():
            key = f"{spec}|{dtype}|{on}|{mb}|{start}"
            params, scales, states, overflows = _amp_run(spec, init, getattr(torch, dtype),
                                                         bool(on), mb, growth)
            for k, v in params.items():
                out[f"{key}|param|{k}"] = v
            out[f"{key}|scales"] = np.array(scales)
            out[f"{key}|overflows"] = np.array(overflows)
            out[f"{key}|residual_keys"] = np.array(sorted(states[0]))
            for when, state in zip(("before", "after", "later"), states):
                for k, v in state.items():
                    out[f"{key}|{when}|{k}"] = v


SCENARIOS = {f.__name__: f for f in (broadcast_state, passes, clip, no_grads, errors, sparse,
                                     horovod_compression, predivide, groups, amp)}

if __name__ == "__main__":
    hvd.init()
    torch.set_num_threads(1)
    for scenario in sys.argv[1:] or list(SCENARIOS):
        result = {}
        SCENARIOS[scenario](result)
        np.savez(os.path.join(os.environ["OUT_DIR"], f"surface_{scenario}_rank{hvd.rank()}.npz"),
                 **result)
    print("WORKER_DONE", hvd.rank(), flush=True)
