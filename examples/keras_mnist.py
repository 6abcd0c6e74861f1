"""Train a small CNN on 5,000 real MNIST digits with Horovod, Keras 3 model.fit and hvd_compress.

    horovodrun -np 2 -H localhost:2 --gloo python examples/keras_mnist.py \\
        --compression topk:density=0.01

The same model, data, optimizer (momentum SGD) and report as
``examples/tensorflow2_mnist.py``, but trained with ``model.compile`` / ``model.fit``:
``hvd_compress.keras.DistributedOptimizer`` compresses and aggregates the gradients
inside Keras' compiled train step, and ``BroadcastGlobalVariablesCallback`` starts every
rank from rank 0's weights.
"""
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import horovod.tensorflow as hvd  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import hvd_compress.keras as hck  # noqa: E402
from mnist_common import (Report, build_compression, load_mnist, parse_args,  # noqa: E402
                          show_progress)


def build_model():
    """The CNN of tensorflow2_mnist.py, with named layers: variable paths such as
    "cnn/fc1/kernel" name the collectives and the error-feedback residuals, and fixed
    names keep them the same whatever else the process built before."""
    return keras.Sequential([
        keras.Input((28, 28, 1)),
        keras.layers.Conv2D(16, 5, activation="relu", name="conv1"),
        keras.layers.MaxPooling2D(name="pool1"),
        keras.layers.Conv2D(32, 5, activation="relu", name="conv2"),
        keras.layers.MaxPooling2D(name="pool2"),
        keras.layers.Flatten(name="flatten"),
        keras.layers.Dense(128, activation="relu", name="fc1"),
        keras.layers.Dense(10, name="fc2"),
    ], name="cnn")


class EpochReport(keras.callbacks.Callback):
    """After each epoch: test accuracy on the 1,000 held-out digits and bytes sent, on
    rank 0 (the loss is Keras' running mean over this rank's batches)."""

    def __init__(self, report, x_test, y_test):
        super().__init__()
        self.report, self.x_test, self.y_test = report, x_test, y_test

    def on_epoch_end(self, epoch, logs=None):
        logits = self.model(self.x_test, training=False)
        accuracy = float(np.mean(np.argmax(logits, 1) == self.y_test))
        if hvd.rank() == 0:
            self.report.epoch(epoch + 1, logs["loss"], accuracy,
                              self.model.optimizer.stats.as_dict())


def train(args):
    """Train on this rank's shard as ``args`` say (see mnist_common.parse_args); rank 0
    prints a line per epoch.  Returns the :class:`mnist_common.Report` (``rows``: one
    dict per epoch).  ``hvd.init()`` must have run."""
    keras.utils.set_random_seed(args.seed)
    x_train, y_train, x_test, y_test = load_mnist(hvd.rank(), hvd.size())
    x_train, x_test = x_train.transpose(0, 2, 3, 1), x_test.transpose(0, 2, 3, 1)  # NHWC
    # every rank must run the same number of steps: whole batches only, as the other examples
    n = len(y_train) // args.batch_size * args.batch_size
    x_train, y_train = x_train[:n], y_train[:n]

    model = build_model()
    compression = build_compression(args.compression, model, verbose=hvd.rank() == 0)
    opt = hck.DistributedOptimizer(keras.optimizers.SGD(args.lr, momentum=0.9),
                                   compression=compression)
    model.compile(optimizer=opt,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=False,     # Horovod's ops have no XLA kernels
                  # auto chooses a compressor per bucket between steps, in Python
                  run_eagerly=getattr(opt.compression, "adaptive", False))
    report = Report(args, "keras", hvd.size())
    if hvd.rank() == 0:
        print(f"compression: {opt.compression.spec}", flush=True)
    # Keras' bar (on stdout) only on a terminal, rank 0; else EpochReport's line per epoch
    bar = show_progress(hvd.rank() == 0 and not args.no_progress, sys.stdout)
    model.fit(x_train, y_train, batch_size=args.batch_size, epochs=args.epochs,
              verbose=1 if bar else 0,
              callbacks=[hck.BroadcastGlobalVariablesCallback(root_rank=0),
                         EpochReport(report, x_test, y_test)])
    return report


def main():
    args = parse_args(__doc__.splitlines()[0])
    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    report = train(args)
    if hvd.rank() == 0:
        report.finish()


if __name__ == "__main__":
    main()
