"""Compressed-momentum Adam in Keras 3 (hvd_compress.keras.DistributedOptimizer, eager)
under ``horovodrun -np 2 --gloo``; each rank saves ``momentum_keras_rank<r>.npz`` in
$OUT_DIR for tests/integration/test_momentum_keras.py, which computes the expected values.

Scenarios: ``trace`` (local gradients, weights and Adam slots per step, and a plain
Keras AdamW stepped on the dense average for the warm-up), ``resume`` (a checkpoint after
a compressed step restored into fresh objects), ``nan`` (one rank's NaN at a compressed
step), ``fit`` (model.fit with run_eagerly=True), ``warm``
(``warmup_compression``: PowerSGD's gradients in the warm-up, a checkpoint inside it),
``mismatch`` (different warm-ups).
"""
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
import numpy as np  # noqa: E402
import horovod.tensorflow as hvd  # noqa: E402
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import hvd_compress.keras as hk  # noqa: E402
from hvd_compress.tensorflow.tape import stats, variable_names  # noqa: E402

hvd.init()
RANK = hvd.rank()
STEPS, WARMUP, SPEC = 7, 3, "topk:density=0.3"
OUT = {}


def model():
    keras.utils.set_random_seed(0)
    m = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="tanh", name="fc1"),
                          keras.layers.Dense(3, name="fc2")], name="net")
    return m


def adamw():
    return keras.optimizers.AdamW(learning_rate=0.05, beta_2=0.99, weight_decay=0.1)


def batch(step, rank):
    rng = np.random.default_rng(1000 * step + rank)
    return rng.standard_normal((8, 6)).astype(np.float32), rng.integers(0, 3, 8)


def grads_of(m, step):
    x, y = batch(step, RANK)
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
            y, m(x), from_logits=True))
    return tape.gradient(loss, m.trainable_variables), float(loss)


def flat(tensors):
    return np.concatenate([np.asarray(t, np.float64).reshape(-1) for t in tensors])


def build(warmup=WARMUP):
    m = model()
    opt = hk.DistributedOptimizer(adamw(), compression=SPEC, compressed_momentum=warmup)
    return m, opt


def slots(opt, m):
    idx = [opt._get_variable_index(v) for v in m.trainable_variables]
    return (flat([opt._momentums[i] for i in idx]), flat([opt._velocities[i] for i in idx]))


def residuals(opt, m):
    state = opt.compression.state_dict()["state"]
    return flat([state["residual/" + n] for n in variable_names(m.trainable_variables)])


def step(m, opt, t, poison=False):
    g, loss = grads_of(m, t)
    if poison:
        g = [x * float("nan") for x in g]
    opt.apply(g, m.trainable_variables)
    return g, loss


def trace():
    m, opt = build()
    ref = model()
    ref_opt = adamw()
    for t in range(1, STEPS + 1):
        g, _ = step(m, opt, t)
        OUT[f"trace/{t}/grad"] = flat(g)
        if t <= WARMUP:
            gr, _ = grads_of(ref, t)
            avg = [hvd.allreduce(x, name=f"ref.{t}.{i}") for i, x in enumerate(gr)]
            ref_opt.apply(avg, ref.trainable_variables)
            OUT[f"trace/{t}/dense_ref"] = flat(ref.trainable_variables)
        OUT[f"trace/{t}/param"] = flat(m.trainable_variables)
        OUT[f"trace/{t}/m"], OUT[f"trace/{t}/v"] = slots(opt, m)
        if t > WARMUP:
            OUT[f"trace/{t}/residual"] = residuals(opt, m)


def restore(m, opt, saved):
    """Load a checkpoint (weights, optimizer variables, compressor and momentum state)
    into a fresh model and optimizer."""
    opt.build(m.trainable_variables)
    for w, value in zip(m.weights, saved["weights"]):
        w.assign(value)
    for v, value in zip(opt.variables, saved["opt"]):
        v.assign(value)
    opt.compression.load_state_dict(saved["compression"], framework="tensorflow")
    opt.compressed_momentum.load_state_dict(saved["momentum"])


def resume(k=5):
    m, opt = build()
    for t in range(1, k + 1):
        step(m, opt, t)
    saved = dict(weights=[w.numpy() for w in m.weights],
                 opt=[v.numpy() for v in opt.variables],
                 compression=opt.compression.state_dict(), momentum=opt.compressed_momentum.state_dict())
    m, opt = build()
    restore(m, opt, saved)
    for t in range(k + 1, STEPS + 1):
        step(m, opt, t)
    OUT["resume/param"] = flat(m.trainable_variables)


def nan():
    m, opt = build(warmup=2)
    for t in (1, 2, 3):
        step(m, opt, t)
    before = [flat(m.trainable_variables), *slots(opt, m), residuals(opt, m)]
    step(m, opt, 4, poison=RANK == 1)
    after = [flat(m.trainable_variables), *slots(opt, m), residuals(opt, m)]
    for name, b, a in zip(("param", "m", "v", "residual"), before, after):
        OUT[f"nan/{name}/before"], OUT[f"nan/{name}/after"] = b, a
    step(m, opt, 5)
    OUT["nan/next_param"] = flat(m.trainable_variables)
    OUT["nan/skipped"] = np.array(opt.compressed_momentum.skipped)


def fit():
    m = model()
    opt = hk.DistributedOptimizer(keras.optimizers.Adam(1e-2), compression="onebit",
                                  compressed_momentum=2)
    m.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              run_eagerly=True)
    rng = np.random.default_rng(RANK)
    x, y = rng.standard_normal((64, 6)).astype(np.float32), rng.integers(0, 3, 64)
    hist = m.fit(x, y, batch_size=16, epochs=2, verbose=0)
    OUT["fit/loss"] = np.array(hist.history["loss"])
    OUT["fit/param"] = flat(m.trainable_variables)
    OUT["fit/frozen_at"] = np.array(opt.compressed_momentum.schedule.frozen_at)


def warm():
    schedule = {"warmup": 3, "warmup_compression": "powersgd:rank=2"}

    def run(start, stop, saved=None):
        m = model()
        opt = hk.DistributedOptimizer(adamw(), compression=SPEC, compressed_momentum=schedule)
        if saved is not None:
            restore(m, opt, saved)
        sent = []
        for t in range(start, stop + 1):
            step(m, opt, t)
            sent.append(stats(opt.compression).as_dict()["last_sent"])
        return m, opt, sent

    m, opt, sent = run(1, STEPS)
    OUT["warm/param"], OUT["warm/sent"] = flat(m.trainable_variables), np.array(sent)
    m, opt, _ = run(1, 2)
    saved = dict(weights=[w.numpy() for w in m.weights], opt=[v.numpy() for v in opt.variables],
                 compression=opt.compression.state_dict(),
                 momentum=opt.compressed_momentum.state_dict())
    OUT["warm/saved_keys"] = np.array(sorted(saved["momentum"]))
    m, opt, _ = run(3, STEPS, saved)
    OUT["warm/resumed"] = flat(m.trainable_variables)


def mismatch():
    try:
        m, opt = build(warmup=3 + RANK)
        step(m, opt, 1)
        OUT["mismatch/error"] = np.array("")
    except ValueError as e:
        OUT["mismatch/error"] = np.array(str(e))


if __name__ == "__main__":
    trace()
    resume()
    nan()
    fit()
    warm()
    mismatch()
    np.savez(os.path.join(os.environ["OUT_DIR"], f"momentum_keras_rank{RANK}.npz"), **OUT)
    print(f"rank {RANK} done", flush=True)
    sys.exit(0)
