"""Runs under ``horovodrun -np 2 --gloo``: real TensorFlow + Horovod, scenarios named on
the command line, eagerly and inside tf.function.  Each rank writes
``$OUT_DIR/tf_<scenario>_rank<r>.npz``; the tests compute the expected aggregates.
"""
import os
import pickle
import sys
import time

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

import hvd_compress
import hvd_compress.tensorflow as hctf

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import agg_scenario  # noqa: E402
import auto_scenario  # noqa: E402
from agg_scenario import agg_grads  # noqa: E402
from cases import (AGG_SHAPES, AUTO_MB, BUCKET_MBS, BUCKET_SHAPES, BUCKET_SPECS,  # noqa: E402
                   BUCKET_TOL_SPECS, POLICY, SHAPES, SPECS)
OPS = {"average": hvd.Average, "sum": hvd.Sum}


def rng(*key):
    return np.random.default_rng([hvd.rank(), *key])


def make_vars():
    return [tf.Variable(tf.zeros(s), name=n) for n, s in SHAPES.items()]


def grads_equal_to(variables, gs, compression, op):
    """A tape whose gradient for each variable is exactly ``gs[i]``."""
    with tf.GradientTape() as tape:
        loss = tf.add_n([tf.reduce_sum(v * g) for v, g in zip(variables, gs)])
    tape = hctf.DistributedGradientTape(tape, compression=compression, op=op)
    return tape.gradient(loss, variables), tape


def aggregate(out):
    for ci, spec in enumerate(SPECS):
        for op_name, op in OPS.items():
            for mode in ("eager", "function"):
                key = f"{spec}|{op_name}|{mode}"
                variables = make_vars()
                comp = hvd_compress.from_spec(spec)
                gs = [tf.constant(rng(ci).standard_normal(s).astype(np.float32))
                      for s in SHAPES.values()]
                fn = lambda *g: grads_equal_to(variables, g, comp, op)[0]  # noqa: E731
                result = (tf.function(fn) if mode == "function" else fn)(*gs)
                for n, g, r in zip(SHAPES, gs, result):
                    out[f"{key}|{n}|in0"] = g.numpy()
                    out[f"{key}|{n}|out"] = r.numpy()
                st = hctf.stats(comp).as_dict()
                out[f"{key}|stats"] = np.array([st["last_sent"], st["last_dense"]])


def functional(out):
    r = rng(99)
    base = r.standard_normal((9, 11)).astype(np.float32)
    cases = {"zero_d": tf.constant(np.float32(r.standard_normal())),
             "empty": tf.zeros((0, 3)),
             "int": tf.constant(r.integers(-50, 50, size=20).astype(np.int32)),
             "fp16": tf.constant(base.astype(np.float16)),
             "bf16": tf.cast(tf.constant(base), tf.bfloat16),
             "sparse": tf.IndexedSlices(tf.constant([1.5, -2.0, 3.0]), tf.constant([1, 4, 7]),
                                        tf.constant([10]))}
    comp = hvd_compress.from_spec("topk:density=0.2")
    for name, t in cases.items():
        res, _ = hctf.allreduce(t, f"func.{name}", comp, op=hvd.Sum)
        dense = tf.convert_to_tensor(t)
        out[f"{name}|in"] = (tf.cast(dense, tf.float32) if dense.dtype.is_floating else dense).numpy()
        out[f"{name}|out"] = (tf.cast(res, tf.float32) if res.dtype.is_floating else res).numpy()
        out[f"{name}|dtype"] = np.array(res.dtype.name)


def empty_rank(out):
    variables = make_vars()
    scale = 1.0 if hvd.rank() == 0 else 0.01
    gs = [tf.constant((scale * rng(5).standard_normal(s)).astype(np.float32))
          for s in SHAPES.values()]
    comp = hvd_compress.from_spec("threshold:threshold=1.0")
    result = tf.function(lambda *g: grads_equal_to(variables, g, comp, hvd.Sum)[0])(*gs)
    for n, g, r in zip(SHAPES, gs, result):
        out[f"{n}|in"], out[f"{n}|out"] = g.numpy(), r.numpy()
    out["stats"] = np.array([hctf.stats(comp).as_dict()["last_sent"]])


def nonfinite(out):
    variables = make_vars()
    comp = hvd_compress.from_spec("topk:density=0.05")
    step = tf.function(lambda *g: grads_equal_to(variables, g, comp, hvd.Sum)[0])
    for i in range(3):
        gs = [rng(7, i).standard_normal(s).astype(np.float32) for s in SHAPES.values()]
        if i == 1 and hvd.rank() == 0:
            gs[0][0, 3], gs[0][2, 5] = np.nan, np.inf
        result = step(*map(tf.constant, gs))
        out[f"{i}|out"] = result[0].numpy()
        out[f"{i}|residual"] = comp.residual("w").numpy().copy()


def checkpoint(out):
    def build():
        w = tf.Variable(np.random.default_rng(0).standard_normal((12, 10)).astype(np.float32),
                        name="w")
        b = tf.Variable(tf.zeros(7), name="b")
        return [w, b], hvd_compress.from_spec("randomk:density=0.1")

    def train(variables, comp, start, steps):
        @tf.function
        def one(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((x @ tf.transpose(variables[0]) + variables[1][:1] - y) ** 2)
            tape = hctf.DistributedGradientTape(tape, compression=comp)
            for v, g in zip(variables, tape.gradient(loss, variables)):
                v.assign_sub(0.1 * g)
        for s in range(start, start + steps):
            r = rng(11, s)
            one(tf.constant(r.standard_normal((16, 10)).astype(np.float32)),
                tf.constant(r.standard_normal((16, 12)).astype(np.float32)))

    variables, comp = build()
    train(variables, comp, 0, 6)
    out["straight"] = variables[0].numpy()

    variables, comp = build()
    train(variables, comp, 0, 3)
    path = os.path.join(os.environ["OUT_DIR"], f"tfckpt_rank{hvd.rank()}.pkl")
    with open(path, "wb") as f:
        pickle.dump({"vars": [v.numpy() for v in variables], "compression": comp.state_dict()}, f)
    variables, comp = build()
    with open(path, "rb") as f:
        saved = pickle.load(f)
    for v, value in zip(variables, saved["vars"]):
        v.assign(value)
    comp.load_state_dict(saved["compression"], framework="tensorflow")
    train(variables, comp, 3, 3)
    out["resumed"] = variables[0].numpy()
    # the checkpoint records the rank (the tape told the compressor); the other rank's
    # file, restored before any tape took the compressor, is refused when one does (a
    # barrier first: it is written)
    out["saved_rank"] = np.int64(saved["compression"]["rank"])
    hvd.allreduce(tf.zeros(1), name="tf_checkpoint_barrier")
    with open(os.path.join(os.environ["OUT_DIR"], f"tfckpt_rank{1 - hvd.rank()}.pkl"),
              "rb") as f:
        other = pickle.load(f)
    fresh = build()[1]
    fresh.load_state_dict(other["compression"], framework="tensorflow")
    try:
        hctf.DistributedGradientTape(tf.GradientTape(), compression=fresh)
        out["other_refused"] = np.array("")
    except ValueError as e:
        out["other_refused"] = np.array(str(e))


def policy(out):
    """A per-parameter policy through the tape inside tf.function."""
    variables = [tf.Variable(tf.zeros(kshape), name=n) for n, (_, kshape, _) in POLICY.items()]
    pol = hvd_compress.Policy({n: spec for n, (_, _, spec) in POLICY.items()})
    gs = [tf.constant(rng(21).standard_normal(k).astype(np.float32)) for _, k, _ in POLICY.values()]
    result = tf.function(lambda *g: grads_equal_to(variables, g, pol, hvd.Sum)[0])(*gs)
    for n, g, r in zip(POLICY, gs, result):
        out[f"{n}|in"], out[f"{n}|out"] = g.numpy(), r.numpy()
    st = hctf.stats(pol).as_dict()
    out["stats"] = np.array([st["last_sent"], st["last_dense"]])


def mismatch(out):
    spec = "topk:density=0.05" if hvd.rank() == 0 else "randomk:density=0.05"
    try:
        grads_equal_to(make_vars(), [tf.ones(s) for s in SHAPES.values()],
                       hvd_compress.from_spec(spec), hvd.Average)
    except ValueError as e:
        print(f"CONFIG_ERROR rank {hvd.rank()}: {e}", flush=True)
        FAILED.append(e)


#: their eager paths (numpy) and their graphs (TensorFlow ops) round the scales
#: differently in the last bit: tensor by tensor inside tf.function too
GRAPH_REFERENCE = ("twobit", "qsgd", "signsgd")


def _bucket_run(spec, mb, steps=3, eager=False):
    """``steps`` steps with ``bucket_mb=mb``, inside tf.function unless ``eager`` (the
    tensor-by-tensor reference: its per-tensor traces were 60% of this scenario's time);
    "late" has no gradient on step 1 (not in the loss: the tape returns None for it)."""
    variables = [tf.Variable(tf.zeros(s), name=n) for n, s in BUCKET_SHAPES.items()]
    comp = spec if isinstance(spec, hvd_compress.Policy) else hvd_compress.from_spec(spec)

    def one(gs, with_late):
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(v * g) for (n, v), g in
                             zip(zip(BUCKET_SHAPES, variables), gs) if with_late or n != "late"])
        tape = hctf.DistributedGradientTape(tape, compression=comp, op=hvd.Sum, bucket_mb=mb)
        return tape.gradient(loss, variables)

    # named functions, not two lambdas on one line: autograph cannot find a lambda's
    # source there, and its failed attempts (warnings) cost 12% of this scenario
    def with_late(*gs):
        return one(gs, True)

    def without_late(*gs):
        return one(gs, False)

    fns = {True: with_late, False: without_late} if eager else \
        {True: tf.function(with_late), False: tf.function(without_late)}
    results = []
    for step in range(steps):
        gs = [tf.constant(rng(31, step, 0).standard_normal(s).astype(np.float32))
              for s in BUCKET_SHAPES.values()]
        grads = fns[step != 1](*gs)
        results.append({n: g.numpy() for n, g in zip(BUCKET_SHAPES, grads) if g is not None})
    return results, comp


def buckets(out):
    for spec in BUCKET_SPECS + BUCKET_TOL_SPECS:
        for mb in BUCKET_MBS:
            eager = mb == 0 and spec.partition(":")[0] not in GRAPH_REFERENCE
            results, comp = _bucket_run(spec, mb, eager=eager)
            for step, g in enumerate(results):
                for n, v in g.items():
                    out[f"{spec}|{mb}|1|{step}|{n}"] = v
            for k, v in comp.state_dict()["state"].items():
                out[f"{spec}|{mb}|1|state|{k}"] = np.asarray(v).copy()


def bucket_mismatch(out):
    mb = 25 if hvd.rank() == 0 else 0.002
    try:
        _bucket_run("topk:density=0.05", mb, steps=1)
    except ValueError as e:
        print(f"CONFIG_ERROR rank {hvd.rank()}: {e}", flush=True)
        FAILED.append(e)


def _agg_run(comp, mb, steps, start=0, op=hvd.Sum, process_set=hvd.global_process_set):
    """``steps`` steps from ``start``, eagerly for bucket_mb=0 and in tf.function else:
    (outputs per step, stats per step)."""
    variables = [tf.Variable(tf.zeros(s), name=n) for n, s in AGG_SHAPES.items()]

    def one(*gs):
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(v * g) for v, g in zip(variables, gs)])
        tape = hctf.DistributedGradientTape(tape, compression=comp, op=op, bucket_mb=mb,
                                            process_set=process_set)
        return tape.gradient(loss, variables)

    fn = one if mb == 0 else tf.function(one)
    outs, stats = [], []
    for step in range(start, start + steps):
        grads = fn(*[tf.constant(g) for g in agg_grads(hvd, step).values()])
        outs.append({n: g.numpy() for n, g in zip(AGG_SHAPES, grads)})
        st = hctf.stats(comp).as_dict()
        stats.append([st[f"last_{k}"] for k in ("sent", "received", "received_local", "union", "k")])
    return outs, stats


def agg(out):
    agg_scenario.agg(out, hvd, _agg_run, "tensorflow")


def _auto_run(comp, steps, start=0):
    """``auto``, eagerly: (outputs per step, candidate index per bucket per step, bucket
    names in launch order)."""
    from hvd_compress import buckets as plan_buckets
    variables = [tf.Variable(tf.zeros(s), name=n) for n, s in BUCKET_SHAPES.items()]
    entries = [(n, s, comp.for_tensor(n, tf.zeros(s)), "float32", 4) for n, s in BUCKET_SHAPES.items()]
    plan = [[entries[i][0] for i in b] for b in plan_buckets.plan(entries, AUTO_MB)]
    keys = [plan_buckets.layout(b, [BUCKET_SHAPES[n] for n in b]).key for b in plan]
    outs, chosen = [], []
    for step in range(start, start + steps):
        chosen.append([comp.choose(k)[0] for k in keys])
        gs = [tf.constant(g) for g in auto_scenario.auto_grads(hvd, step).values()]
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(v * g) for v, g in zip(variables, gs)])
        tape = hctf.DistributedGradientTape(tape, compression=comp, op=hvd.Sum, bucket_mb=AUTO_MB)
        grads = tape.gradient(loss, variables)
        outs.append({n: g.numpy() for n, g in zip(BUCKET_SHAPES, grads)})
    return outs, chosen, plan


_auto_run.framework = "tensorflow"


def auto(out):
    auto_scenario.auto(out, hvd, _auto_run)
    # inside tf.function the choice would be fixed at trace time: a clear error instead
    v = tf.Variable(tf.zeros(3), name="v")
    comp = hvd_compress.from_spec("auto:candidates=none|fp16,calibrate=2,verbose=0")

    @tf.function
    def traced():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(v * 2.0)
        return hctf.DistributedGradientTape(tape, compression=comp).gradient(loss, [v])
    try:
        traced()
        out["graph_error"] = np.array("")
    except ValueError as e:
        out["graph_error"] = np.array(str(e))


def auto_mismatch(out):
    auto_scenario.mismatch(hvd, _auto_run, FAILED)


FAILED = []      #: configuration errors caught (the mismatch scenarios): exit 3 at the end

SCENARIOS = {f.__name__: f for f in (aggregate, functional, empty_rank, nonfinite,
                                     checkpoint, policy, mismatch, buckets, bucket_mismatch,
                                     agg, auto, auto_mismatch)}

if __name__ == "__main__":
    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    for scenario in sys.argv[1:]:
        result = {}
        start = time.perf_counter()
        SCENARIOS[scenario](result)
        print(f"SCENARIO {scenario} rank {hvd.rank()}: {time.perf_counter() - start:.1f} s",
              flush=True)
        np.savez(os.path.join(os.environ["OUT_DIR"], f"tf_{scenario}_rank{hvd.rank()}.npz"),
                 **result)
    print("WORKER_DONE", hvd.rank(), flush=True)
    if FAILED:
        sys.exit(3)
