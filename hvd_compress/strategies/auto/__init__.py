"""``auto``: the compressor of each bucket chosen from measured compute, codec and link
speed, so that turning compression on never makes a step slower than not compressing.

Whether compression pays depends on the link, the model and the device: on a fast link
the codec costs more than the bytes it saves, on a slow one it saves seconds.  ``auto``
measures instead of guessing, and only ever chooses among the ``candidates`` the user
accepts (the accuracy trade-off stays theirs)::

    opt = hvd_compress.torch.DistributedOptimizer(opt, model.named_parameters(),
                                                  compression="auto")
    # or HVD_COMPRESS=auto with no code change; or
    hvd_compress.Auto(candidates=["none", "topk:density=0.01"], calibrate=20, every=100)

The model that predicts a step from measured parts (:mod:`.model`), the controller that
measures, decides and switches (:mod:`.controller`), and the decision table it logs
(:mod:`.report`).

Imports: its own modules only.
"""
from .controller import DEFAULT_CANDIDATES, Auto  # noqa: F401
from .model import BucketCost, decide, fit_link, predict  # noqa: F401

__all__ = ["Auto", "BucketCost", "DEFAULT_CANDIDATES", "decide", "fit_link", "predict"]
