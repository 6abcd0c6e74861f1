"""Train the MNIST examples' CNN on 5,000 real digits with PyTorch Lightning and hvd_compress.

    python examples/lightning_mnist.py --compression topk:density=0.01 --epochs 5

Lightning starts the second process itself (``devices=2``, DDP over Gloo on the CPU);
hvd_compress runs as the DDP communication hook, passed the way Lightning documents
it: ``DDPStrategy(ddp_comm_state=..., ddp_comm_hook=...)``, with a state built before
Lightning wraps the model.  ``hvd_compress.lightning.DDPStrategy`` is Lightning's own
with the hook registered on the CPU too (Lightning's registers it on CUDA only).  The
``CompressionStats`` callback logs the bytes sent, the dense bytes and their ratio each
step (``compression/*``) to the Trainer's logger (CSV under --log-dir; TensorBoard if
``--tensorboard``).  Prints the test accuracy and the bytes saved per epoch.
"""
import argparse
import sys

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import lightning as L
from lightning.pytorch.loggers import CSVLogger

from hvd_compress.ddp import CompressionState, compression_hook
from hvd_compress.lightning import CompressionStats, DDPStrategy
from hvd_compress.stats import human_bytes
from mnist_common import exit_skipping_teardown, load_mnist, parse_args
from models import MnistNet


def own_args():
    """--devices, --log-dir and --tensorboard; the rest is mnist_common's command line."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--devices", type=int, default=2, help="CPU processes")
    p.add_argument("--log-dir", default="lightning_logs")
    p.add_argument("--tensorboard", action="store_true",
                   help="log to TensorBoard (needs tensorboard) instead of CSV")
    ours, rest = p.parse_known_args()
    sys.argv[1:] = rest
    return ours


class LitMnist(L.LightningModule):
    def __init__(self, lr):
        super().__init__()
        self.net, self.lr = MnistNet(), lr

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        correct = (self.net(x).argmax(1) == y).float().sum()
        self.log("test_accuracy", correct / len(y), sync_dist=True, batch_size=len(y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


class Report(L.Callback):
    """One line per epoch on rank 0: test accuracy and the bytes this rank sent."""

    def __init__(self, state):
        self.state = state

    def on_validation_epoch_end(self, trainer, pl_module):
        if trainer.sanity_checking or trainer.global_rank != 0:
            return
        s = self.state.stats
        acc = float(trainer.callback_metrics["test_accuracy"])
        ratio = s.total_dense / s.total_sent if s.total_sent else float("inf")
        print(f"epoch {trainer.current_epoch + 1}: test accuracy {100 * acc:.2f}%  "
              f"sent {human_bytes(s.total_sent)} vs dense {human_bytes(s.total_dense)}  "
              f"({ratio:.1f}x less)", flush=True)


def main():
    ours = own_args()
    args = parse_args(__doc__.splitlines()[0])
    torch.set_num_threads(1)
    L.seed_everything(args.seed, verbose=False)
    x_train, y_train, x_test, y_test = load_mnist(0, 1)   # Lightning's sampler splits it
    train = DataLoader(TensorDataset(torch.from_numpy(x_train), torch.from_numpy(y_train)),
                       batch_size=args.batch_size, shuffle=True)
    test = DataLoader(TensorDataset(torch.from_numpy(x_test), torch.from_numpy(y_test)),
                      batch_size=500)

    state = CompressionState(compression=args.compression)      # no model yet
    if ours.tensorboard:
        from lightning.pytorch.loggers import TensorBoardLogger
        log = TensorBoardLogger(ours.log_dir)
    else:
        log = CSVLogger(ours.log_dir)
    trainer = L.Trainer(
        accelerator="cpu", devices=ours.devices, max_epochs=args.epochs,
        strategy=DDPStrategy(ddp_comm_state=state, ddp_comm_hook=compression_hook,
                             process_group_backend="gloo"),
        callbacks=[CompressionStats(state), Report(state)], logger=log,
        log_every_n_steps=10, enable_checkpointing=False, enable_model_summary=False,
        enable_progress_bar=not args.no_progress and sys.stderr.isatty())
    trainer.fit(LitMnist(args.lr), train, test)
    if trainer.global_rank == 0:
        s = state.stats
        acc = float(trainer.callback_metrics["test_accuracy"])
        print(f"done: {state.compression.spec} on {trainer.world_size} processes, final test "
              f"accuracy {100 * acc:.2f}%, {s.total_dense / max(s.total_sent, 1):.1f}x fewer "
              f"bytes than dense float32 ({human_bytes(s.total_dense - s.total_sent)} saved "
              f"over {s.steps} steps)", flush=True)


if __name__ == "__main__":
    main()
    exit_skipping_teardown()          # torch's Gloo may abort a rank at exit otherwise
