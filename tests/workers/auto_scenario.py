"""The ``auto`` scenario of both workers (torch_worker.py, tf_worker.py): what it runs and
the keys it writes are the same; each worker passes its framework's run.

``run(comp, steps, start=0, grads=...)`` trains BUCKET_SHAPES parameters with op Sum and
``bucket_mb=AUTO_MB`` (several buckets) and returns, per step, the outputs and the
candidate index each bucket was sent with, plus the bucket names (in launch order).
"""
import json

import numpy as np

import hvd_compress
from cases import AUTO_CKPT_SPEC, AUTO_SPEC, AUTO_STEPS, BUCKET_SHAPES


def auto_grads(hvd, step):
    rng = np.random.default_rng
    return {n: rng([hvd.rank(), 51, step, i]).standard_normal(s).astype(np.float32)
            for i, (n, s) in enumerate(BUCKET_SHAPES.items())}


def auto(out, hvd, run):
    """AUTO_SPEC for AUTO_STEPS (calibration, decision, check steps); then a checkpoint
    of AUTO_CKPT_SPEC (decide once) restored into new objects mid-run."""
    for step in range(AUTO_STEPS):
        for n, g in auto_grads(hvd, step).items():
            out[f"in|{step}|{n}"] = g
    comp = hvd_compress.from_spec(AUTO_SPEC)
    outs, chosen, buckets = run(comp, AUTO_STEPS)
    out["buckets"] = np.array(json.dumps(buckets))
    for step, (o, c) in enumerate(zip(outs, chosen)):
        out[f"choice|{step}"] = np.array(c, np.int32)
        for n, v in o.items():
            out[f"out|{step}|{n}"] = v
    for n in BUCKET_SHAPES:
        r = comp.residual(n)
        out[f"residual|{n}"] = np.zeros(0, np.float32) if r is None else np.array(r).copy()
    out["decisions"] = np.array(len(comp.decisions))

    # checkpoint: saved after step 3; the same object goes on (steps 3-5), and new objects
    # restored from the checkpoint do the same steps (the decision came from step 2's
    # timings, so it is the saved run's continuation that the resumed one must equal)
    first = hvd_compress.from_spec(AUTO_CKPT_SPEC)
    run(first, 3)
    saved = first.state_dict()
    s_outs, s_chosen, _ = run(first, 3, start=3)
    s_outs, s_chosen = [None] * 3 + s_outs, [None] * 3 + s_chosen
    resumed = hvd_compress.from_spec(AUTO_CKPT_SPEC)
    resumed.load_state_dict(saved, framework=run.framework)
    r_outs, r_chosen, _ = run(resumed, 3, start=3)
    for step in range(3, 6):
        out[f"ckpt|choice|straight|{step}"] = np.array(s_chosen[step], np.int32)
        out[f"ckpt|choice|resumed|{step}"] = np.array(r_chosen[step - 3], np.int32)
        for n in BUCKET_SHAPES:
            out[f"ckpt|straight|{step}|{n}"] = s_outs[step][n]
            out[f"ckpt|resumed|{step}|{n}"] = r_outs[step - 3][n]


def mismatch(hvd, run, failed):
    """Rank 0 with other candidates than rank 1: a ValueError on every rank at the first
    step (printed as CONFIG_ERROR, kept in ``failed``)."""
    spec = "auto:candidates=none|topk:density=0.1" if hvd.rank() == 0 else "auto"
    try:
        run(hvd_compress.from_spec(spec), 1)
    except ValueError as e:
        print(f"CONFIG_ERROR rank {hvd.rank()}: {e}", flush=True)
        failed.append(e)
