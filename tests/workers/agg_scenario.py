"""The aggregation-aware scenario of both workers (torch_worker.py, tf_worker.py): what
it runs and the keys it writes are the same; each worker passes its framework's run."""
import numpy as np

import hvd_compress
from cases import AGG_MBS, AGG_SHAPES, AGG_SPECS, AGG_STEPS, AGG_ZERO_STEP


def agg_grads(hvd, step):
    """This rank's gradients at ``step`` ({name: array}); the step's leader has zeros on
    AGG_ZERO_STEP."""
    zero = step == AGG_ZERO_STEP and hvd.rank() == step % hvd.size()
    rng = np.random.default_rng
    return {n: np.zeros(s, np.float32) if zero else
            rng([hvd.rank(), 41, step, i]).standard_normal(s).astype(np.float32)
            for i, (n, s) in enumerate(AGG_SHAPES.items())}


def agg(out, hvd, run, framework):
    """Every AGG_SPECS compressor, tensor by tensor and bucketed; a checkpoint after 2
    steps restored into new objects; Average; a process set of ranks 0 and 2 (-np 3).
    ``run(comp, mb, steps, start=0, op=Sum, process_set=global)`` -> (outputs per step,
    stats per step)."""
    for step in range(AGG_STEPS):
        for n, g in agg_grads(hvd, step).items():
            out[f"in|{step}|{n}"] = g
    for spec in AGG_SPECS:
        for mb in AGG_MBS:
            comp = hvd_compress.from_spec(spec)
            outs, stats = run(comp, mb, AGG_STEPS)
            for step, o in enumerate(outs):
                for n, v in o.items():
                    out[f"{spec}|{mb}|{step}|{n}"] = v
            out[f"{spec}|{mb}|stats"] = np.array(stats, dtype=np.float64)
            for k, v in comp.state_dict()["state"].items():
                out[f"{spec}|{mb}|state|{k}"] = np.array(v, copy=True)
        if "hint" in spec or "leader" in spec:        # checkpoint: 2 steps, save, 2 more
            first = hvd_compress.from_spec(spec)
            run(first, 25, 2)
            second = hvd_compress.from_spec(spec)
            second.load_state_dict(first.state_dict(), framework=framework)
            outs, _ = run(second, 25, AGG_STEPS - 2, start=2)
            for n, v in outs[-1].items():
                out[f"{spec}|resumed|{n}"] = v
    outs, _ = run(hvd_compress.from_spec(AGG_SPECS[0]), 25, 1, op=hvd.Average)
    for n, v in outs[0].items():
        out[f"average|{n}"] = v
    if hvd.size() == 3:
        ps = hvd.add_process_set([0, 2])
        if ps.included():
            outs, _ = run(hvd_compress.from_spec(AGG_SPECS[1]), 25, 2, process_set=ps)
            for step, o in enumerate(outs):
                for n, v in o.items():
                    out[f"pset|{step}|{n}"] = v
        hvd.remove_process_set(ps)
