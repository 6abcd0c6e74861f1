"""Runs under ``horovodrun -np 2 --gloo``: Keras 3 ``model.fit`` with
``hvd_compress.keras``, scenarios named on the command line.  Each rank writes
``$OUT_DIR/keras_<scenario>_rank<r>.npz``; tests/integration/test_keras.py computes the expected
values from what both ranks wrote.
"""
import os
import pickle
import sys

import horovod.tensorflow as hvd
import keras
import numpy as np
import tensorflow as tf

import hvd_compress  # noqa: F401  (first: what hvd_compress.keras adds is measured)
_BEFORE = {m for m in sys.modules if m.split(".")[0] == "torch"}
import hvd_compress.keras as hck  # noqa: E402
TORCH_ADDED = sorted(m for m in sys.modules if m.split(".")[0] == "torch" and m not in _BEFORE)

MODES = {"compiled": False, "eager": True}           # mode -> run_eagerly
AGG_SPECS = ["topk:density=0.05", "twobit", "none"]
BATCH = 16


def rng(*key):
    return np.random.default_rng([hvd.rank(), *key])


def data(steps, *key):
    """This rank's ``steps`` batches: x (steps*BATCH, 6) float32, y labels 0..2."""
    r = rng(*key)
    return (r.standard_normal((steps * BATCH, 6)).astype(np.float32),
            r.integers(0, 3, size=steps * BATCH))


def build(seed=0, dropout=False):
    """A small MLP; the same weights on every rank for the same ``seed``.  Named layers:
    variable paths (collective and residual names) are then the same for every model
    built here ("mlp/hidden/kernel"), not "dense_7/kernel" after six other models."""
    keras.utils.set_random_seed(seed)
    layers = [keras.Input((6,)), keras.layers.Dense(8, activation="tanh", name="hidden")]
    layers += [keras.layers.Dropout(0.25, name="drop")] if dropout else []
    return keras.Sequential(layers + [keras.layers.Dense(3, name="out")], name="mlp")


LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def compile_(model, spec, mode, lr=1.0, momentum=0.0, **kwargs):
    opt = hck.DistributedOptimizer(keras.optimizers.SGD(lr, momentum=momentum),
                                   compression=spec, **kwargs)
    model.compile(optimizer=opt, loss=LOSS, run_eagerly=MODES[mode])
    return opt


def aggregate(out):
    """One ``fit`` step with SGD(lr=1): new weights = old - aggregate.  Saved: weights
    before and after, and this rank's local gradient from a plain tf.GradientTape on
    the same batch (the test computes the aggregate from both ranks' gradients)."""
    for spec in AGG_SPECS:
        for mode in MODES:
            key = f"{spec}|{mode}"
            model = build()
            x, y = data(1, 1)
            with tf.GradientTape() as tape:
                loss = LOSS(y, model(x, training=True))
            local = tape.gradient(loss, model.trainable_variables)
            before = [v.numpy() for v in model.trainable_variables]
            opt = compile_(model, spec, mode)
            model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
            for i, (v, b, g) in enumerate(zip(model.trainable_variables, before, local)):
                out[f"{key}|{i}|before"], out[f"{key}|{i}|grad"] = b, g.numpy()
                out[f"{key}|{i}|after"] = v.numpy()
            st = opt.stats.as_dict()
            out[f"{key}|stats"] = np.array([st["steps"], st["last_sent"], st["last_dense"]])
            out[f"{key}|names"] = np.array([v.path for v in model.trainable_variables])


def nonfinite(out):
    """``opt.apply`` (eager) with a NaN and an Inf in rank 0's gradient on step 1: the
    weights start at zero each step, so ``-after`` is the aggregate (SGD, lr=1)."""
    model = build()
    opt = compile_(model, "topk:density=0.05", "eager")
    kernel = model.trainable_variables[0]
    for step in range(3):
        grads = [rng(7, step, i).standard_normal(v.shape).astype(np.float32)
                 for i, v in enumerate(model.trainable_variables)]
        if step == 1 and hvd.rank() == 0:
            grads[0][0, 3], grads[0][2, 5] = np.nan, np.inf
        for v in model.trainable_variables:
            v.assign(tf.zeros(v.shape))
        opt.apply([tf.constant(g) for g in grads], model.trainable_variables)
        out[f"{step}|out"] = -kernel.numpy()
        out[f"{step}|residual"] = opt.compression.residual(kernel.path).numpy().copy()


UPDATE_STEPS, UPDATE_SPEC = 4, "topk:density=0.3"


def flat(arrays):
    return np.concatenate([np.asarray(a, np.float64).ravel() for a in arrays])


def update(out):
    """``compressed_update=True`` with AdamW, compiled and eager, ``fit`` one batch a
    step, and a custom loop (``tf.function``: a plain ``tf.GradientTape``, then
    ``opt.apply_gradients``).  Recorded per step, as tests/workers/update_scenarios.py's trace: the start,
    this rank's update as a plain Keras AdamW on its own gradient makes it (a copy of
    the model set to the start each step: its slots follow the wrapped optimizer's),
    the weights and residuals after.  Then a step with NaN in rank 1's gradient (eager,
    ``opt.apply``): rank 1 skips its own step, the weights stay equal and finite; and a
    step with rank 1's payload corrupted: every rank raises, the weights stay."""
    adamw = dict(learning_rate=0.05, weight_decay=0.1)
    for mode in list(MODES) + ["loop"]:
        model, ref = build(), build()
        opt = hck.DistributedOptimizer(keras.optimizers.AdamW(**adamw),
                                       compression=UPDATE_SPEC, compressed_update=True)
        if mode == "loop":                    # a custom loop: a plain tape, apply_gradients
            opt.build(model.trainable_variables)

            @tf.function
            def train_step(x, y, model=model, opt=opt):
                with tf.GradientTape() as tape:
                    loss = LOSS(y, model(x, training=True))
                grads = tape.gradient(loss, model.trainable_variables)
                opt.apply_gradients(zip(grads, model.trainable_variables))
        else:
            model.compile(optimizer=opt, loss=LOSS, run_eagerly=MODES[mode])
        ref_opt = keras.optimizers.AdamW(**adamw)
        x, y = data(UPDATE_STEPS, 13)
        for t in range(1, UPDATE_STEPS + 1):
            sl = slice((t - 1) * BATCH, t * BATCH)
            start = [v.numpy() for v in model.trainable_variables]
            for r, s in zip(ref.trainable_variables, start):
                r.assign(s)
            with tf.GradientTape() as tape:
                loss = LOSS(y[sl], ref(x[sl], training=True))
            ref_opt.apply(tape.gradient(loss, ref.trainable_variables), ref.trainable_variables)
            key = f"{mode}|trace/{t}"
            out[f"{key}/start"] = flat(start)
            out[f"{key}/update"] = flat(v.numpy() for v in ref.trainable_variables) - \
                flat(start)
            if mode == "loop":
                train_step(tf.constant(x[sl]), tf.constant(y[sl]))
            else:
                model.fit(x[sl], y[sl], batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
            out[f"{key}/param"] = flat(v.numpy() for v in model.trainable_variables)
            state = opt.compression.state_dict()["state"]
            out[f"{key}/residual"] = flat(state["residual/" + v.path]
                                          for v in model.trainable_variables)
        out[f"{mode}|sent"] = np.array(opt.stats.as_dict()["total_sent"])
    model = build()
    opt = hck.DistributedOptimizer(keras.optimizers.AdamW(**adamw), compression=UPDATE_SPEC,
                                   compressed_update=True)
    grads = [rng(17, i).standard_normal(v.shape).astype(np.float32)
             for i, v in enumerate(model.trainable_variables)]
    if hvd.rank() == 1:
        grads[0][0, 0] = np.nan
    opt.apply([tf.constant(g) for g in grads], model.trainable_variables)
    out["nan|param"] = flat(v.numpy() for v in model.trainable_variables)
    out["nan|skipped"] = np.array(opt._hvd_update.skipped)
    out["nan|iterations"] = np.array(int(opt.iterations.numpy()))
    c = opt.compression                       # rank 1's indices past the tensors, as on a wire
    if hvd.rank() == 1:
        for name in ("compress", "compress_bucket"):
            def corrupted(*a, _inner=getattr(c, name), **k):
                payload, ctx = _inner(*a, **k)
                return tuple(payload)[:-1] + (tuple(payload)[-1] + 10 ** 6,), ctx
            setattr(c, name, corrupted)
    try:
        opt.apply([tf.constant(g) for g in grads], model.trainable_variables)
        out["malformed|error"] = np.array("")
    except Exception as e:                    # noqa: BLE001 (whatever the check raises)
        out["malformed|error"] = np.array(f"{type(e).__name__}: {e}")
    out["malformed|param"] = flat(v.numpy() for v in model.trainable_variables)
    model = build()                           # compiled: the skip is a tf.cond
    opt = hck.DistributedOptimizer(keras.optimizers.AdamW(**adamw), compression=UPDATE_SPEC,
                                   compressed_update=True)
    model.compile(optimizer=opt, loss=LOSS, run_eagerly=False)
    x, y = data(1, 19)
    if hvd.rank() == 1:
        x[0, 0] = np.nan
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    out["nan_compiled|param"] = flat(v.numpy() for v in model.trainable_variables)
    out["nan_compiled|iterations"] = np.array(int(opt.iterations.numpy()))
    for name, kwargs in {"sum": dict(op=hvd.Sum), "momentum": dict(compressed_momentum=3),
                         "passes": dict(backward_passes_per_step=2)}.items():
        try:
            hck.DistributedOptimizer(keras.optimizers.AdamW(), compression=UPDATE_SPEC,
                                     compressed_update=True, **kwargs)
            out[f"errors|{name}"] = np.array("")
        except ValueError as e:
            out[f"errors|{name}"] = np.array(str(e))


def checkpoint(out):
    """Momentum SGD, topk with error feedback, compiled: 6 steps in one go vs 3 steps,
    save (weights, optimizer variables, compression state), restore into a fresh model
    and optimizer, 3 more steps; and the same restore without the compression state."""
    x, y = data(6, 11)

    def fresh():
        model = build(seed=3)
        return model, compile_(model, "topk:density=0.05", "compiled", lr=0.1, momentum=0.9)

    def fit(model, steps):
        sl = slice(steps.start * BATCH, steps.stop * BATCH)
        model.fit(x[sl], y[sl], batch_size=BATCH, epochs=1, shuffle=False, verbose=0)

    model, _ = fresh()
    fit(model, range(0, 6))
    out["straight"] = np.concatenate([w.ravel() for w in model.get_weights()])

    model, opt = fresh()
    fit(model, range(0, 3))
    path = os.path.join(os.environ["OUT_DIR"], f"kerasckpt_rank{hvd.rank()}.pkl")
    with open(path, "wb") as f:
        pickle.dump({"weights": model.get_weights(),
                     "optimizer": [v.numpy() for v in opt.variables],
                     "compression": opt.compression.state_dict()}, f)
    out["residual_norm"] = np.array(sum(float(np.abs(v).sum()) for k, v in
                                        opt.compression.state_dict()["state"].items()
                                        if k.startswith("residual")))
    for restore_compression in (True, False):
        model, opt = fresh()
        with open(path, "rb") as f:
            saved = pickle.load(f)
        model.set_weights(saved["weights"])
        opt.build(model.trainable_variables)
        for v, value in zip(opt.variables, saved["optimizer"]):
            v.assign(value)
        if restore_compression:
            opt.compression.load_state_dict(saved["compression"], framework="tensorflow")
        fit(model, range(3, 6))
        out[f"resumed|{restore_compression}"] = np.concatenate(
            [w.ravel() for w in model.get_weights()])


def broadcast(out):
    """Different initial weights per rank: ``broadcast_variables`` makes them rank 0's;
    ``BroadcastGlobalVariablesCallback`` makes ``fit`` end with the same weights on both
    ranks (without it they differ)."""
    model = build(seed=100 + hvd.rank(), dropout=True)
    out["mine"] = np.concatenate([v.numpy().ravel() for v in model.variables])
    hck.broadcast_variables(model.variables, root_rank=0)
    out["after"] = np.concatenate([v.numpy().ravel() for v in model.variables])
    x, y = data(3, 13)
    for mode in MODES:
        for with_callback in (True, False):
            model = build(seed=200 + hvd.rank(), dropout=True)
            compile_(model, "topk:density=0.05", mode, lr=0.1, momentum=0.9)
            callbacks = [hck.BroadcastGlobalVariablesCallback(0)] if with_callback else []
            model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                      callbacks=callbacks)
            out[f"fit|{mode}|{with_callback}"] = np.concatenate(
                [w.ravel() for w in model.get_weights()])


def mismatch(out):
    """Rank 0 topk, rank 1 randomk: fit must raise ValueError on both ranks, compiled
    and eager, and the job must end."""
    spec = "topk:density=0.05" if hvd.rank() == 0 else "randomk:density=0.05"
    x, y = data(1, 1)
    failed = 0
    for mode in MODES:
        model = build()
        compile_(model, spec, mode)
        try:
            model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
        except ValueError as e:
            print(f"CONFIG_ERROR rank {hvd.rank()} {mode}: {e}", flush=True)
            failed += 1
    sys.exit(3 if failed else 0)


def xla(out):
    """``jit_compile=True``: a clear ValueError on both ranks at the first step (Horovod's
    ops have no XLA kernels), and training can go on without XLA."""
    x, y = data(1, 1)
    model = build()
    opt = hck.DistributedOptimizer(keras.optimizers.SGD(0.1), compression="topk:density=0.05")
    model.compile(optimizer=opt, loss=LOSS, jit_compile=True)
    try:
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
        out["error"] = np.array("")
    except ValueError as e:
        out["error"] = np.array(str(e))
    model.compile(optimizer=opt, loss=LOSS, jit_compile=False)
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    out["steps"] = np.array(opt.stats.as_dict()["steps"])


MNIST_SPECS = ["none", "topk:density=0.01"]
MNIST_EPOCHS = 6


def mnist(out):
    """examples/keras_mnist.py's training, none and topk:density=0.01, MNIST_EPOCHS
    epochs each; rank 0 saves test accuracy and bytes (sent, dense) per epoch."""
    import argparse
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                    "examples"))
    import keras_mnist
    for spec in MNIST_SPECS:
        args = argparse.Namespace(compression=spec, epochs=MNIST_EPOCHS, batch_size=32, lr=0.02,
                                  seed=42, json=None, no_progress=True)
        rows = keras_mnist.train(args).rows
        if hvd.rank() == 0:
            out[f"{spec}|accuracy"] = np.array([r["test_accuracy"] for r in rows])
            out[f"{spec}|bytes"] = np.array([[r["bytes_sent"], r["bytes_dense"]] for r in rows])


def imports(out):
    """PyTorch modules that ``import hvd_compress.keras`` imported (beyond ``import
    hvd_compress``): none expected."""
    out["torch_added"] = np.array(TORCH_ADDED, dtype=str)


SCENARIOS = {f.__name__: f for f in (imports, aggregate, nonfinite, checkpoint, broadcast, mismatch,
                                     xla, mnist, update)}

if __name__ == "__main__":
    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    for scenario in sys.argv[1:]:
        result = {}
        SCENARIOS[scenario](result)
        np.savez(os.path.join(os.environ["OUT_DIR"], f"keras_{scenario}_rank{hvd.rank()}.npz"),
                 **result)
    print("WORKER_DONE", hvd.rank(), flush=True)
