"""Elastic Horovod with hvd_compress in a TensorFlow custom loop (tests/integration/test_elastic.py).

``elastic SPEC``: rank 1 removes its host and dies at step DIE; rank 0 restores the
commit (``hvd_compress.tensorflow.ElasticState``) and finishes.  ``reference SPEC FILE``:
one process from a commit.  ``join SPEC``: one worker, a second joins (AdamW).
``update SPEC``: 3 workers, one dies, Keras AdamW with ``compressed_update=True``.  Files
as in elastic_worker.py (pickled numpy arrays).
"""
import os
import pickle
import sys

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

import hvd_compress
import hvd_compress.tensorflow as hctf
from lost_host import LostWorker, join_step, leave_and_die

STEPS, DIE, COMMIT_EVERY = 24, 11, 4
OUT = os.environ.get("OUT_DIR", ".")


def build(spec):
    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential([tf.keras.Input((20,)), tf.keras.layers.Dense(16, activation="relu"),
                                 tf.keras.layers.Dense(10)])
    return model, tf.keras.optimizers.SGD(0.05, momentum=0.9), hvd_compress.from_spec(spec)


def one_step(model, opt, comp, step, tape_exchanges=True):
    """One step on this rank's batch; the gradients exchanged by DistributedGradientTape,
    or (``tape_exchanges=False``) by ``opt`` (hvd_compress.keras.DistributedOptimizer)."""
    gen = np.random.default_rng([step, hvd.rank()])
    x = tf.constant(gen.standard_normal((16, 20)).astype(np.float32))
    y = tf.constant(gen.integers(0, 10, 16))
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(
            y, model(x), from_logits=True))
    if tape_exchanges:
        tape = hctf.DistributedGradientTape(tape, compression=comp)
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))


def snapshot(model, opt, comp, step):
    return {"step": step, "vars": [v.numpy() for v in model.variables + list(opt.variables)],
            "compression": comp.state_dict(), "host": os.environ.get("HOROVOD_HOSTNAME")}


def elastic(spec):
    model, opt, comp = build(spec)
    opt.build(model.trainable_variables)
    state = hctf.ElasticState(model.variables, compression=comp, optimizer=opt, step=0)

    def on_reset():
        with open(f"{OUT}/reset_rank{hvd.rank()}.pkl", "wb") as f:
            pickle.dump(snapshot(model, opt, comp, state.step), f)
        print(f"RESET size {hvd.size()} at step {state.step}", flush=True)
    state.register_reset_callbacks([on_reset])

    @hctf.elastic.run
    def train(state):
        while state.step < STEPS:
            if state.step == DIE and hvd.rank() == 1 and hvd.size() == 2:
                leave_and_die()
            one_step(model, opt, comp, state.step)
            state.step += 1
            if state.step % COMMIT_EVERY == 0:
                with open(f"{OUT}/commit{state.step}_rank{hvd.rank()}.pkl", "wb") as f:
                    pickle.dump(snapshot(model, opt, comp, state.step), f)
                state.commit()

    train(state)
    if hvd.rank() == 0:
        with open(f"{OUT}/final_rank0.pkl", "wb") as f:
            pickle.dump({"vars": [v.numpy() for v in model.variables], "size": hvd.size(),
                         "lost": state.lost_residual_norm}, f)
    print("ELASTIC_DONE", hvd.rank(), hvd.size(), flush=True)


def join(spec):
    """As elastic_worker.py's ``join``, with AdamW and the optimizer *not* built first (as
    the recipe in docs/fault-tolerance.md reads): starts alone, a second host appears at
    step 5; every rank writes its variables at its first step in the world of 2 and at
    the end."""
    model, _, comp = build(spec)
    opt = tf.keras.optimizers.AdamW(1e-2)
    state = hctf.ElasticState(model.variables, compression=comp, optimizer=opt, step=0)

    @hctf.elastic.run
    def train(state):
        written = False
        while state.step < STEPS:
            with join_step(state, hvd.size, COMMIT_EVERY):
                if hvd.size() == 2 and not written:
                    with open(f"{OUT}/joined_rank{hvd.rank()}.pkl", "wb") as f:
                        pickle.dump(snapshot(model, opt, comp, state.step), f)
                    written = True
                one_step(model, opt, comp, state.step)
                state.step += 1

    train(state)
    with open(f"{OUT}/joined_final_rank{hvd.rank()}.pkl", "wb") as f:
        pickle.dump(snapshot(model, opt, comp, state.step), f)
    print("JOIN_DONE", hvd.rank(), hvd.size(), flush=True)


def update(spec):
    """``hvd_compress.keras.DistributedOptimizer(AdamW, compressed_update=True)`` in a custom
    loop (a plain tape, ``apply_gradients``) under ``ElasticState``; 3 workers, rank 1
    dies at DIE.  Every rank writes each commit and its state after the reset's sync,
    with its host name."""
    import hvd_compress.keras as hck
    model, _, comp = build(spec)
    opt = hck.DistributedOptimizer(tf.keras.optimizers.AdamW(1e-2), compression=comp,
                                   compressed_update=True)
    state = hctf.ElasticState(model.variables, compression=comp, optimizer=opt, step=0)
    def write(name):
        with open(f"{OUT}/{name}.pkl", "wb") as f:
            pickle.dump(snapshot(model, opt, comp, state.step), f)
    lost = LostWorker(DIE, hvd.rank, hvd.size, lambda: write(f"synced_rank{hvd.rank()}"))
    state.register_reset_callbacks([lost.on_reset])

    @hctf.elastic.run
    def train(state):
        while state.step < STEPS:
            lost.before_step(state.step)
            one_step(model, opt, comp, state.step, tape_exchanges=False)
            state.step += 1
            if state.step % COMMIT_EVERY == 0:
                write(f"commit{state.step}_rank{hvd.rank()}")
                state.commit()

    train(state)
    print("UPDATE_DONE", hvd.rank(), hvd.size(), flush=True)


def reference(spec, commit_file):
    model, opt, comp = build(spec)
    opt.build(model.trainable_variables)
    with open(commit_file, "rb") as f:
        commit = pickle.load(f)
    for v, value in zip(model.variables + list(opt.variables), commit["vars"]):
        v.assign(value)
    comp.load_state_dict(commit["compression"], "tensorflow")
    for step in range(commit["step"], STEPS):
        one_step(model, opt, comp, step)
    with open(f"{OUT}/reference.pkl", "wb") as f:
        pickle.dump({"vars": [v.numpy() for v in model.variables]}, f)


if __name__ == "__main__":
    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    if sys.argv[1] == "elastic":
        elastic(sys.argv[2])
    elif sys.argv[1] == "join":
        join(sys.argv[2])
    elif sys.argv[1] == "update":
        update(sys.argv[2])
    else:
        reference(sys.argv[2], sys.argv[3])
