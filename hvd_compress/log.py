"""The library's logger, ``logging.getLogger("hvd_compress")``: hvd_compress logs, it does
not print.

What it logs at INFO: ``auto``'s decision tables and recalibrations, Elastic Horovod's
report of the residuals lost with a worker; each on rank 0 only (:func:`info_rank0`).

So that these stay visible without any set-up, the logger has one handler of its own
which writes the message to the *current* ``sys.stdout``, but only while the root logger
has no handler: once the application configures logging (``logging.basicConfig``, a
framework, pytest's capture), records simply propagate there.  The level is INFO unless
``$HVD_COMPRESS_LOG_LEVEL`` says otherwise (e.g. ``WARNING`` silences the tables);
``logging.getLogger("hvd_compress").setLevel(...)`` works as usual.

Imports: the standard library only.
"""
import logging
import os
import sys

LEVEL_VAR = "HVD_COMPRESS_LOG_LEVEL"

logger = logging.getLogger("hvd_compress")


class _StdoutUnlessConfigured(logging.Handler):
    """Writes to the current ``sys.stdout`` while the root logger has no handler."""

    def emit(self, record):
        if logging.getLogger().handlers:
            return                      # the application's handlers get it (propagation)
        try:
            sys.stdout.write(self.format(record) + "\n")
            sys.stdout.flush()
        except Exception:               # noqa: BLE001 - logging must not raise
            self.handleError(record)


if not any(isinstance(h, _StdoutUnlessConfigured) for h in logger.handlers):
    _handler = _StdoutUnlessConfigured()
    _handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(_handler)
    level = os.environ.get(LEVEL_VAR, "INFO").upper()
    logger.setLevel(getattr(logging, level, None) if isinstance(
        getattr(logging, level, None), int) else logging.INFO)


def info_rank0(rank, message, *args):
    """Log ``message`` at INFO on rank 0 only (every rank takes the same decisions: one
    copy is enough)."""
    if rank == 0:
        logger.info(message, *args)
