"""Coded SGD through real Horovod: ``horovodrun -np N python coded_worker.py torch|tf``.

For each (redundancy, exchange) case every rank takes one step on the same global
mini-batch and writes: the exchanged gradient, every part's plain float32 gradient
(computed here with the framework's autograd, not by hvd_compress), the full-batch
gradient and the byte counters.  Then the failure cases: ranks that disagree on the
redundancy or the batch size, a NaN on one rank, clipping.  tests/unit/test_coded.py and tests/integration/test_coded_horovod.py checks.
With STATIC_SETS=1 the process sets are passed to hvd.init instead of added later.
"""
import os
import sys
import warnings

import numpy as np

FRAMEWORK = sys.argv[1]
if FRAMEWORK == "torch":
    import horovod.torch as hvd
    import torch
else:
    import horovod.tensorflow as hvd
    import tensorflow as tf

import hvd_compress.coded as coded

B, IN, HID, OUT_ = 25, 12, 10, 3


def data():
    rng = np.random.default_rng(7)
    return rng.standard_normal((B, IN)).astype(np.float32), rng.integers(0, OUT_, B)


def init_weights():
    rng = np.random.default_rng(11)
    return [rng.standard_normal(s).astype(np.float32) * 0.5
            for s in ((HID, IN), (HID,), (OUT_, HID), (OUT_,))]


class TorchModel:
    def __init__(self, scale=1.0):
        self.params = [torch.nn.Parameter(torch.from_numpy(w)) for w in init_weights()]
        self.scale = scale

    def loss(self, x, y):
        w1, b1, w2, b2 = self.params
        h = torch.tanh(x @ w1.T + b1)
        return torch.nn.functional.cross_entropy(h @ w2.T + b2, y) * self.scale

    def grad(self, x, y, weight):
        for p in self.params:
            p.grad = None
        (self.loss(x, y) * weight).backward()
        return np.concatenate([p.grad.reshape(-1).numpy() for p in self.params])

    def step(self, r, exchange, batch_size=B, value_range=10.0, poison=False, noise=False,
             dropout=False):
        opt = coded.DistributedOptimizer(torch.optim.SGD(self.params, lr=0.0),
                                         [(str(i), p) for i, p in enumerate(self.params)],
                                         batch_size=batch_size, redundancy=r,
                                         value_range=value_range, exchange=exchange)
        x, y = data()
        x, y = torch.from_numpy(x), torch.from_numpy(y)
        fn = self.loss
        if poison:
            fn = lambda a, b: self.loss(a, b) * float("nan")    # noqa: E731
        if noise:        # randomness the optimizer does not seed: replicas differ
            fn = lambda a, b: self.loss(a, b) * (1 + np.random.default_rng().random())  # noqa: E731
        if dropout:      # torch's RNG: seeded per part, so the replicas agree
            fn = lambda a, b: self.loss(torch.nn.functional.dropout(a, 0.5), b)  # noqa: E731
        opt.zero_grad()
        opt.backward(fn, x, y)
        opt.step()
        return np.concatenate([p.grad.reshape(-1).numpy() for p in self.params]), opt.stats

    def reference(self, place):
        x, y = data()
        x, y = torch.from_numpy(x), torch.from_numpy(y)
        parts = [self.grad(x[a:b], y[a:b], (b - a) / B) for a, b in place.part_slices(B)]
        return np.stack(parts), self.grad(x, y, 1.0)


class TFModel:
    def __init__(self, scale=1.0):
        self.params = [tf.Variable(w) for w in init_weights()]
        self.scale = scale

    def loss(self, x, y):
        w1, b1, w2, b2 = self.params
        h = tf.tanh(tf.matmul(x, w1, transpose_b=True) + b1)
        logits = tf.matmul(h, w2, transpose_b=True) + b2
        return tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(
            y, logits, from_logits=True)) * self.scale

    def grad(self, x, y, weight):
        with tf.GradientTape() as tape:
            loss = self.loss(x, y) * weight
        return np.concatenate([g.numpy().reshape(-1) for g in tape.gradient(loss, self.params)])

    def step(self, r, exchange, batch_size=B, value_range=10.0, poison=False, noise=False):
        cg = coded.CodedGradients(self.params, batch_size=batch_size, redundancy=r,
                                  value_range=value_range, exchange=exchange)
        x, y = data()
        fn = self.loss
        if poison:
            fn = lambda a, b: self.loss(a, b) * float("nan")    # noqa: E731
        if noise:
            fn = lambda a, b: self.loss(a, b) * (1 + np.random.default_rng().random())  # noqa: E731
        _, grads = cg.gradient(fn, tf.constant(x), tf.constant(y))
        return np.concatenate([g.numpy().reshape(-1) for g in grads]), cg.stats

    def reference(self, place):
        x, y = data()
        parts = [self.grad(x[a:b], y[a:b], (b - a) / B) for a, b in place.part_slices(B)]
        return np.stack(parts), self.grad(x, y, 1.0)


def die():
    """One coded step, then rank 1 is killed (SIGKILL) before the second; the others
    must fail, not wait forever."""
    import signal
    hvd.init()
    Model = TorchModel if FRAMEWORK == "torch" else TFModel
    model = Model()
    model.step(2, "multicast")
    if hvd.rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    model.step(2, "multicast")
    print("survived a lost worker: unexpected", flush=True)


def main():
    if sys.argv[2:] == ["die"]:
        return die()
    if os.environ.get("STATIC_SETS"):
        n = int(os.environ["HOROVOD_SIZE"])
        sets = [s for r in range(1, n) for s in coded.process_sets(n, r)]
        hvd.init(process_sets=sets)
    else:
        hvd.init()
    if FRAMEWORK == "torch":
        torch.set_num_threads(1)
    n, rank = hvd.size(), hvd.rank()
    Model = TorchModel if FRAMEWORK == "torch" else TFModel
    out = {}
    cases = [(r, ex) for r in range(1, n)
             for ex in ("multicast", "multicast_alltoall", "reduce_scatter")]
    cases += [(1, "allreduce"), (n, "multicast")]
    for r, ex in cases:
        model = Model()
        got, stats = model.step(r, ex)
        parts, full = model.reference(coded.placement(n, r))
        key = f"{r}|{ex}"
        out[f"{key}|got"], out[f"{key}|parts"], out[f"{key}|full"] = got, parts, full
        out[f"{key}|bytes"] = np.array([stats["last_sent"], stats["last_received"],
                                        stats["total_handed_to_horovod"], stats["last_clipped"]])
    # clipping: a loss scaled up so that entries leave [-R, R]
    for ex in ("multicast", "reduce_scatter"):
        model = Model(scale=50.0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got, stats = model.step(2, ex, value_range=0.5)
        parts, _ = model.reference(coded.placement(n, 2))
        out[f"clip|{ex}|got"], out[f"clip|{ex}|parts"] = got, parts
        out[f"clip|{ex}|counts"] = np.array([stats["last_clipped"], stats["last_saturated"],
                                             sum("clipped" in str(w.message) for w in caught)])
    # failures: every rank must raise, none may hang
    failures = {"redundancy": dict(r=1 if rank == 0 else 2, ex="multicast"),
                "batch": dict(r=2, ex="reduce_scatter", batch_size=B if rank else B + 1),
                "exchange": dict(r=1, ex="allreduce" if rank == 0 else "multicast")}
    for what, kw in failures.items():
        try:
            Model().step(kw.pop("r"), kw.pop("ex"), **kw)
            out[f"fail|{what}"] = np.array("no error")
        except ValueError as e:
            out[f"fail|{what}"] = np.array(str(e))
    for ex in ("multicast", "reduce_scatter", "allreduce"):
        try:
            Model().step(1 if ex == "allreduce" else 2, ex, poison=(rank == n - 1))
            out[f"nan|{ex}"] = np.array("no error")
        except FloatingPointError as e:
            out[f"nan|{ex}"] = np.array(str(e))
    # replicas that compute differently: every rank must refuse the step
    for r, ex in ((2, "multicast"), (2, "multicast_alltoall"), (n, "multicast")):
        try:
            Model().step(r, ex, noise=True)
            out[f"differ|{r}|{ex}"] = np.array("no error")
        except RuntimeError as e:
            out[f"differ|{r}|{ex}"] = np.array(str(e))
    if FRAMEWORK == "torch":
        got, _ = Model().step(2, "multicast", dropout=True)
        out["dropout|got"] = got
    np.savez(os.path.join(os.environ["OUT_DIR"], f"coded_{FRAMEWORK}_{n}_rank{rank}.npz"), **out)


if __name__ == "__main__":
    main()
