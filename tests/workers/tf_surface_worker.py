"""Runs under ``horovodrun -np 2 --gloo``: Horovod's surface of
``horovod.tensorflow.DistributedGradientTape`` and ``horovod.keras.DistributedOptimizer``
(0.28.1) through ``hvd_compress.tensorflow.DistributedGradientTape`` and
``hvd_compress.keras.DistributedOptimizer``, next to Horovod's own on the same model and
data; scenarios named on the command line.  Each rank writes what it saw to
``$OUT_DIR/tfsurface_<scenario>_rank<r>.npz``; tests/integration/test_tf_surface.py
compares.

Horovod's Keras optimizer overrides methods Keras 3 no longer calls (scenario
``horovod_keras``: it constructs, but never allreduces), so the Keras reference is what
it does under Keras 2: Horovod's ``DistributedGradientTape`` (same arguments) and the
plain Keras optimizer's ``apply_gradients``, in a loop over the same batches; for
``backward_passes_per_step``, its ``LocalGradientAggregationHelper``'s rule written out
(sum locally, ``hvd.allreduce`` every N-th call, divide by N if
``average_aggregated_gradients``, count ``iterations`` on the others).
"""
import os
import sys
import time

import horovod.tensorflow as hvd
import keras
import numpy as np
import tensorflow as tf

import hvd_compress
import hvd_compress.keras as hck
import hvd_compress.tensorflow as hctf

SHAPES = {"a": (6, 10), "b": (10,), "c": (5,), "emb": (20, 4)}
TAPES = (("hvd", hvd.DistributedGradientTape), ("ours", hctf.DistributedGradientTape))
STEPS, BATCH = 6, 8


def rng(*key):
    return np.random.default_rng([hvd.rank(), *key])


# -- the tape ----------------------------------------------------------------------------
def make_vars():
    return {n: tf.Variable(np.random.default_rng([7, i]).standard_normal(s).astype(np.float32),
                           name=n) for i, (n, s) in enumerate(SHAPES.items())}


def tape_inputs(step):
    r = rng(1, step)
    return (tf.constant(r.standard_normal((4, 6)).astype(np.float32)),
            tf.constant(np.append(r.integers(0, 20, 5), 3).astype(np.int32)),   # 3 twice
            tf.constant(r.standard_normal(5).astype(np.float32)))


def gradients(wrap, variables, step=0):
    """``wrap(tape).gradient`` of a loss with an embedding lookup (IndexedSlices)."""
    x, idx, w = tape_inputs(step)
    v = variables
    with tf.GradientTape() as tape:
        loss = (tf.reduce_sum(tf.tanh(x @ v["a"] + v["b"])) + tf.reduce_sum(v["c"] * w) +
                tf.reduce_sum(tf.gather(v["emb"], idx) ** 2))
    return wrap(tape).gradient(loss, list(v.values()))


def save(out, key, grads):
    for n, g in zip(SHAPES, grads):
        out[f"{key}|{n}"] = tf.convert_to_tensor(g).numpy()
        out[f"{key}|{n}|type"] = np.array(type(g).__name__.replace("EagerTensor", "Tensor"))


def both(out, key, mode="eager", spec="none", **kw):
    """Horovod's tape and ours with the same Horovod arguments, on the same gradients."""
    variables = make_vars()
    for who, make in (("hvd", lambda t: hvd.DistributedGradientTape(t, **kw)),
                      ("ours", lambda t: hctf.DistributedGradientTape(t, compression=spec, **kw))):
        fn = lambda: gradients(make, variables)  # noqa: E731
        save(out, f"{key}|{mode}|{who}", tf.function(fn)() if mode == "function" else fn())


def tape_predivide(out):
    """gradient_predivide_factor 1 and 4, eager and in tf.function, Horovod's and ours;
    topk with factor 1 vs 4 over 3 steps (error feedback in g/4 units)."""
    for mode in ("eager", "function"):
        for f in (1.0, 4.0):
            both(out, f"predivide{f:g}", mode, gradient_predivide_factor=f, sparse_as_dense=True)
    for f in (1.0, 4.0):
        variables = make_vars()
        tape = None
        for step in range(3):
            def wrap(t):
                nonlocal tape
                tape = hctf.DistributedGradientTape(
                    t, compression=hvd_compress.from_spec("topk:density=0.3") if tape is None
                    else tape.compression, gradient_predivide_factor=f)
                return tape
            save(out, f"topk{f:g}|{step}", gradients(wrap, variables, step))


def tape_groups(out):
    """groups=2, num_groups=2 and groups=[[a, emb]]: Horovod's grouped allreduces vs our
    buckets (their names saved)."""
    variables = make_vars()
    cases = {"groups2": dict(groups=2), "num_groups2": dict(num_groups=2),
             "lists": dict(groups=[[variables["a"], variables["emb"]]])}
    for key, kw in cases.items():
        for who, make in TAPES:
            extra = {"compression": "none"} if who == "ours" else {}
            made = []
            save(out, f"{key}|{who}", gradients(
                lambda t: made.append(make(t, sparse_as_dense=True, **kw, **extra)) or made[-1],
                variables))
            if who == "ours":
                out[f"{key}|buckets"] = np.array(["+".join(sorted(b))
                                                  for b in made[-1].stats.buckets])


def tape_sparse(out):
    """sparse_as_dense False/True: IndexedSlices or dense, Horovod's and ours, eager and
    in tf.function; topk: ranks equal."""
    for as_dense in (False, True):
        for mode in ("eager", "function"):
            both(out, f"sparse{int(as_dense)}", mode, sparse_as_dense=as_dense)
        both(out, f"sparse{int(as_dense)}topk", spec="topk:density=0.5", sparse_as_dense=as_dense)


def tape_compression(out):
    """Horovod's hvd.Compression.none / .fp16 objects given to both tapes."""
    for name in ("none", "fp16"):
        comp = getattr(hvd.Compression, name)
        variables = make_vars()
        made = []
        save(out, f"{name}|hvd", gradients(
            lambda t: hvd.DistributedGradientTape(t, compression=comp), variables))
        save(out, f"{name}|ours", gradients(
            lambda t: made.append(hctf.DistributedGradientTape(t, compression=comp)) or made[-1],
            variables))
        out[f"{name}|spec"] = np.array(made[-1].compression.spec)


def tape_local(out):
    """register_local_source(c) with scale_local_gradients True/False."""
    for scale in (True, False):
        variables = make_vars()
        for who, make in TAPES:
            def wrap(t, make=make):
                tape = make(t, scale_local_gradients=scale)
                tape.register_local_source(variables["c"])
                return tape
            save(out, f"local{int(scale)}|{who}", gradients(wrap, variables))
        x, idx, w = tape_inputs(0)
        out[f"local{int(scale)}|c_local"] = w.numpy()


# -- Keras -------------------------------------------------------------------------------
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def build():
    keras.utils.set_random_seed(3)
    inp = keras.Input((3,), dtype="int32")
    h = keras.layers.Flatten()(keras.layers.Embedding(20, 4, name="emb")(inp))
    h = keras.layers.Dense(5, activation="tanh", name="hidden")(h)
    return keras.Model(inp, keras.layers.Dense(3, name="out")(h), name="net")


def data():
    r = rng(2)
    return r.integers(0, 20, (STEPS * BATCH, 3)).astype(np.int32), r.integers(0, 3, STEPS * BATCH)


def sgd():
    return keras.optimizers.SGD(0.1, momentum=0.9)


def fit_ours(out, key, eager=False, spec="none", local=None, **kw):
    model = build()
    opt = hck.DistributedOptimizer(sgd(), compression=spec, **kw)
    if local:
        opt.register_local_var(model.get_layer(local).bias)
    model.compile(optimizer=opt, loss=LOSS, run_eagerly=eager)
    x, y = data()
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    for v in model.trainable_variables:
        out[f"{key}|ours|{v.path}"] = v.numpy()
    out[f"{key}|ours|iterations"] = np.array(int(opt.iterations.numpy()))
    out[f"{key}|ours|exchanges"] = np.array(opt.stats.as_dict()["steps"])
    return opt


def loop_horovod(out, key, passes=1, average=False, local=None, **kw):
    """What horovod.keras.DistributedOptimizer does under Keras 2, written out."""
    model = build()
    opt = sgd()
    x, y = data()
    sums = None
    if passes > 1:
        opt.build(model.trainable_variables)
    for step in range(STEPS):
        xb, yb = x[step * BATCH:(step + 1) * BATCH], y[step * BATCH:(step + 1) * BATCH]
        with tf.GradientTape() as tape:
            loss = LOSS(yb, model(xb, training=True))
        if passes == 1:
            tape = hvd.DistributedGradientTape(tape, **kw)
            if local:       # Horovod's tape takes tf.Variables (``ref()``), not Keras 3's
                tape.register_local_source(model.get_layer(local).bias.value)
            grads = tape.gradient(loss, [v.value for v in model.trainable_variables])
            opt.apply_gradients(zip(grads, model.trainable_variables))
            continue
        grads = [tf.convert_to_tensor(g) for g in tape.gradient(loss, model.trainable_variables)]
        sums = grads if sums is None else [s + g for s, g in zip(sums, grads)]
        if (step + 1) % passes:
            opt.iterations.assign_add(1)
            continue
        reduced = [hvd.allreduce(s, op=hvd.Average, name=f"ref.{i}") for i, s in enumerate(sums)]
        if average:
            reduced = [r / passes for r in reduced]
        opt.apply_gradients(zip(reduced, model.trainable_variables))
        sums = None
    for v in model.trainable_variables:
        out[f"{key}|hvd|{v.path}"] = v.numpy()
    out[f"{key}|hvd|iterations"] = np.array(int(opt.iterations.numpy()))


def keras_args(out):
    """model.fit with ours vs Horovod's rule (its tape + the plain optimizer), momentum
    SGD, an embedding, 6 steps: each Horovod argument alone."""
    cases = {"plain": {}, "sparse0": dict(sparse_as_dense=False),
             "sparse1": dict(sparse_as_dense=True),
             "predivide4": dict(gradient_predivide_factor=4.0, sparse_as_dense=True),
             "groups2": dict(groups=2, sparse_as_dense=True),
             "fp16": dict(compression=hvd.Compression.fp16),
             "sum": dict(op=hvd.Sum), "local": dict(local="out")}
    for key, kw in cases.items():
        ours = dict(kw)
        if "compression" in ours:
            ours["spec"] = ours.pop("compression")
        fit_ours(out, key, **ours)
        loop_horovod(out, key, **kw)


def keras_passes(out):
    """backward_passes_per_step 2 (average_aggregated_gradients) and 3 (sum), compiled
    and eager, vs Horovod's rule; topk: exchanges counted, ranks equal; and passes=2
    with average next to Keras' own gradient_accumulation_steps=2, which exchanges at
    every step."""
    for passes, average in ((2, True), (3, False)):
        key = f"passes{passes}{int(average)}"
        for eager in (False, True):
            fit_ours(out, f"{key}|{'eager' if eager else 'compiled'}", eager=eager,
                     backward_passes_per_step=passes, average_aggregated_gradients=average)
        loop_horovod(out, key, passes=passes, average=average)
    fit_ours(out, "passes_topk", spec="topk:density=0.3", backward_passes_per_step=2)
    model = build()
    opt = hck.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9,
                                                        gradient_accumulation_steps=2),
                                   compression="none")
    model.compile(optimizer=opt, loss=LOSS)
    x, y = data()
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    for v in model.trainable_variables:
        out[f"keras_accumulation|{v.path}"] = v.numpy()
    out["keras_accumulation|exchanges"] = np.array(opt.stats.as_dict()["steps"])


def horovod_keras(out):
    """Horovod's own Keras DistributedOptimizer under Keras 3: one fit step."""
    import horovod.tensorflow.keras as hvd_keras
    model = build()
    model.compile(optimizer=hvd_keras.DistributedOptimizer(sgd()), loss=LOSS)
    x, y = data()
    model.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    for v in model.trainable_variables:
        out[f"horovod_keras|{v.path}"] = v.numpy()


SCENARIOS = {f.__name__: f for f in (tape_predivide, tape_groups, tape_sparse, tape_compression,
                                     tape_local, keras_args, keras_passes, horovod_keras)}

if __name__ == "__main__":
    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    for scenario in sys.argv[1:] or SCENARIOS:
        result = {}
        start = time.time()
        SCENARIOS[scenario](result)
        print("SCENARIO", scenario, hvd.rank(), f"{time.time() - start:.1f} s", flush=True)
        np.savez(os.path.join(os.environ["OUT_DIR"], f"tfsurface_{scenario}_rank{hvd.rank()}.npz"),
                 **result)
    print("WORKER_DONE", hvd.rank(), flush=True)
