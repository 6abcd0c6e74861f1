"""Train a small CNN on 5,000 real MNIST digits with Horovod, TensorFlow 2 and hvd_compress.

    horovodrun -np 2 -H localhost:2 --gloo python examples/tensorflow2_mnist.py \\
        --compression topk:density=0.01

The training step is a ``tf.function`` around ``hvd_compress.tensorflow.
DistributedGradientTape`` (eager with ``--compression auto``, which chooses between steps); the optimizer is plain momentum SGD written out (for Keras 3
``model.fit`` see examples/keras_mnist.py and hvd_compress.keras).
"""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import horovod.tensorflow as hvd  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import hvd_compress.tensorflow as hctf  # noqa: E402
from mnist_common import (Report, batches, build_compression, load_mnist, parse_args,  # noqa: E402
                          progress)


def build_model():
    return tf.keras.Sequential([
        tf.keras.Input((28, 28, 1)),
        tf.keras.layers.Conv2D(16, 5, activation="relu"),
        tf.keras.layers.MaxPooling2D(),
        tf.keras.layers.Conv2D(32, 5, activation="relu"),
        tf.keras.layers.MaxPooling2D(),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(128, activation="relu"),
        tf.keras.layers.Dense(10),
    ])


def main():
    args = parse_args(__doc__.splitlines()[0])
    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.keras.utils.set_random_seed(args.seed)
    x_train, y_train, x_test, y_test = load_mnist(hvd.rank(), hvd.size())
    x_train, x_test = x_train.transpose(0, 2, 3, 1), x_test.transpose(0, 2, 3, 1)  # NHWC

    model = build_model()
    variables = model.trainable_variables
    velocity = [tf.Variable(tf.zeros_like(v), trainable=False) for v in variables]
    compression = build_compression(args.compression, model, verbose=hvd.rank() == 0)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = hctf.DistributedGradientTape(tape, compression=compression)
        for v, m, g in zip(variables, velocity, tape.gradient(loss, variables)):
            m.assign(0.9 * m + g)
            v.assign_sub(args.lr * m)
        return loss

    # auto chooses a compressor per bucket between steps, in Python: it runs eagerly
    if not getattr(compression, "adaptive", False):
        train_step = tf.function(train_step)

    # hvd.broadcast_variables() fails on Keras 3 variables in Horovod 0.28.1: broadcast values.
    for i, v in enumerate(variables):
        v.assign(hvd.broadcast(tf.convert_to_tensor(v), root_rank=0, name=f"init.{i}"))
    report = Report(args, "tensorflow", hvd.size())
    if hvd.rank() == 0:
        print(f"compression: {compression.spec}", flush=True)
    for epoch in range(1, args.epochs + 1):
        losses = []
        steps = batches(len(y_train), args.batch_size, args.seed, epoch)
        for idx in progress(steps, hvd.rank() == 0 and not args.no_progress, f"epoch {epoch}"):
            losses.append(float(train_step(x_train[idx], y_train[idx])))
        accuracy = float(np.mean(np.argmax(model(x_test, training=False), 1) == y_test))
        if hvd.rank() == 0:
            report.epoch(epoch, np.mean(losses), accuracy, hctf.stats(compression).as_dict())
    if hvd.rank() == 0:
        report.finish()


if __name__ == "__main__":
    main()
