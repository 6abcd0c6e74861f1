"""hvd_compress in PyTorch Lightning: the DDP communication hook through Lightning's
``DDPStrategy``, and a callback that logs the bytes saved each step.

    from lightning.pytorch import Trainer
    from hvd_compress.ddp import CompressionState, compression_hook
    from hvd_compress.lightning import CompressionStats, DDPStrategy

    state = CompressionState(compression="topk:density=0.01")    # no model yet
    trainer = Trainer(accelerator="cpu", devices=2,
                      strategy=DDPStrategy(ddp_comm_state=state, ddp_comm_hook=compression_hook),
                      callbacks=[CompressionStats()])           # compression/* each step

Lightning wraps the model in DistributedDataParallel after the state is built: the
state takes the parameter names (``model.named_parameters()`` of the LightningModule)
when it is bound, at the hook's first bucket at the latest
(:meth:`~hvd_compress.torch.ddp.CompressionState.bind`).

:class:`DDPStrategy` is Lightning's own, with one difference: Lightning registers
``ddp_comm_hook`` only on CUDA devices, so on CPU (Gloo) its ``DDPStrategy`` trains
with DDP's plain allreduce and the hook is never called.  Ours registers it on every
device (and binds the state at once).  On GPUs Lightning's ``DDPStrategy`` works as
well, except for compressed updates: with
``CompressionState(compression=..., compressed_update=True)`` (each rank's AdamW update
sent instead of its gradient: :mod:`hvd_compress.torch.compressed_update`) ours gives
the state the optimizer that ``configure_optimizers()`` returns (one) once Lightning has
set it up (:meth:`~hvd_compress.torch.ddp.CompressionState.take_optimizer`).
:class:`CompressionStats` warns when a step ended with no bucket through the hook.

Imports: torch, :mod:`hvd_compress.torch.ddp`; ``lightning.pytorch`` only when
:class:`DDPStrategy` or :class:`CompressionStats` is first used (the classes are made
then, as subclasses of Lightning's).  Importing Lightning imports ``torch._dynamo`` and
with it Triton, which aborts a process that has loaded TensorFlow before (both register
LLVM's options): importing this module alone stays safe, as every other module is.
"""
import importlib.util
import sys

from ..log import logger
from ..strategies.momentum import learning_rate_hint
from .ddp import CompressionState


def _compression_state(state):
    """``state`` itself, or the CompressionState inside a wrapper state (amp's), or None."""
    if isinstance(state, CompressionState):
        return state
    inner = getattr(state, "state", None)
    return inner if isinstance(inner, CompressionState) else None


def _build():
    """Make :class:`DDPStrategy` and :class:`CompressionStats` (Lightning imported now)."""
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.strategies import DDPStrategy as _LightningDDPStrategy

    class DDPStrategy(_LightningDDPStrategy):
        """``lightning.pytorch.strategies.DDPStrategy`` (same arguments) that registers
        ``ddp_comm_hook`` with ``ddp_comm_state`` on every device, CPU included, and binds a
        :class:`~hvd_compress.torch.ddp.CompressionState` to the wrapped model there."""

        def __init__(self, *args, ddp_comm_state=None, ddp_comm_hook=None, ddp_comm_wrapper=None,
                     **kwargs):
            super().__init__(*args, ddp_comm_state=ddp_comm_state, ddp_comm_hook=ddp_comm_hook,
                             ddp_comm_wrapper=ddp_comm_wrapper, **kwargs)
            self.hvd_comm = (ddp_comm_state, ddp_comm_hook, ddp_comm_wrapper)

        def _register_ddp_hooks(self):
            state, hook, wrapper = self.hvd_comm
            if self.root_device.type == "cuda" or hook is None:
                super()._register_ddp_hooks()          # Lightning registers it on CUDA
            else:
                self.model.register_comm_hook(state, wrapper(hook) if wrapper is not None else hook)
            compression = _compression_state(state)
            if compression is not None and hook is not None:
                compression.bind(self.model)

        def setup_optimizers(self, trainer):
            super().setup_optimizers(trainer)
            state = _compression_state(self.hvd_comm[0])
            if state is None or not state.compressed_update:
                return
            if len(self.optimizers) != 1:
                raise ValueError("compressed_update=True needs configure_optimizers() to "
                                 "return one optimizer (its step() exchanges the update), "
                                 f"got {len(self.optimizers)}")
            if getattr(self.precision_plugin, "scaler", None) is not None:
                raise ValueError("compressed_update=True does not take a precision with a "
                                 "GradScaler (precision='16-mixed'): the scaler skips the "
                                 "step, and with it the exchange, on an overflowing rank "
                                 "only; use precision='bf16-mixed' or 32")
            if state.optimizer is not self.optimizers[0]:   # each fit makes its optimizer
                state.drop_optimizer()
                state.take_optimizer(self.optimizers[0])
                if state.ranks is None:       # made before the process group: hint now
                    learning_rate_hint(state.compression, trainer.world_size)


    class CompressionStats(Callback):
        """Logs the hook's bytes each training step through ``pl_module.log_dict``, so they
        reach whatever logger the Trainer has (TensorBoard, CSV, W&B...):
        ``<prefix>sent_bytes``, ``dense_bytes`` (the same gradients as a float32 allreduce),
        ``ratio`` (dense / sent), ``received_bytes``, ``total_sent_bytes``,
        ``total_dense_bytes``, ``total_ratio`` and the step's seconds compressing, waiting and
        decompressing (:meth:`hvd_compress.stats.Stats.scalars`).  Each rank logs its own
        (the logger writes rank 0's).

        ``state``: the :class:`~hvd_compress.torch.ddp.CompressionState`; default the
        strategy's ``ddp_comm_state``.  ``prog_bar``: show the ratio in the progress bar.
        At ``on_fit_start`` an unbound state is bound to the strategy's DDP model."""

        def __init__(self, state=None, prefix="compression/", prog_bar=False):
            if state is not None and _compression_state(state) is None:
                raise ValueError("CompressionStats: state must be an hvd_compress.ddp."
                                 f"CompressionState, got {type(state).__name__}")
            self.state = _compression_state(state) if state is not None else None
            self.prefix, self.prog_bar = prefix, prog_bar
            self._warned, self._logged = False, 0

        def _find(self, trainer):
            if self.state is None:
                found = _compression_state(getattr(trainer.strategy, "_ddp_comm_state", None))
                if found is None:
                    found = _compression_state(getattr(trainer.strategy, "hvd_comm", (None,))[0])
                if found is None:
                    raise ValueError("CompressionStats: no state= given and the trainer's strategy "
                                     "has no hvd_compress CompressionState as ddp_comm_state")
                self.state = found
            return self.state

        def on_fit_start(self, trainer, pl_module):
            state = self._find(trainer)
            model = getattr(trainer.strategy, "model", None)
            if not state.bound and model is not None and hasattr(model, "register_comm_hook"):
                state.bind(model)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            stats = self._find(trainer).stats
            if stats.steps == 0 and trainer.global_step > 0 and not self._warned:
                self._warned = True
                logger.warning(
                    "hvd_compress.lightning.CompressionStats: an optimizer step went by and the "
                    "comm hook has seen no bucket (Lightning's DDPStrategy registers "
                    "ddp_comm_hook only on CUDA: use hvd_compress.lightning.DDPStrategy)")
            if stats.steps <= self._logged:          # no new exchange (accumulating batches)
                return
            self._logged = stats.steps
            values = stats.scalars(self.prefix)
            ratio = values.pop(self.prefix + "ratio", None)
            pl_module.log_dict(values, on_step=True, on_epoch=False, batch_size=1)
            if ratio is not None:
                pl_module.log(self.prefix + "ratio", ratio, on_step=True, on_epoch=False,
                              prog_bar=self.prog_bar, batch_size=1)

    return DDPStrategy, CompressionStats


def __getattr__(name):
    if name in ("DDPStrategy", "CompressionStats"):
        if ("tensorflow" in sys.modules and "triton" not in sys.modules
                and importlib.util.find_spec("triton") is not None):
            raise ImportError(
                f"hvd_compress.lightning.{name}: TensorFlow is loaded and Triton is not; "
                "Lightning imports torch._dynamo, which loads Triton, and the process would "
                "abort (both register LLVM's options): import lightning before tensorflow")
        module = sys.modules[__name__]
        for cls in _build():
            cls.__module__, cls.__qualname__ = __name__, cls.__name__
            setattr(module, cls.__name__, cls)
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["CompressionStats", "DDPStrategy"]
