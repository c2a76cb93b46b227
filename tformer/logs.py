"""What a user sees on the console: tformer's own lines and the progress bar.

Library chatter is kept out of the way: Python warnings raised inside libraries (DCP's
single-process notice, deprecations) go to the log at DEBUG, `datasets`' progress bars are off,
and under torchrun only the first rank of each node prints tformer's INFO lines (its data caches
are the node's). Warnings are printed by rank 0 only, and each message once per process (torch's
DTensor redistribution notice under TP, a deprecation hit every step); other ranks print errors.
DeepSpeed's own logger (it resets its level when imported) prints errors only: its "Setting
accelerator to CPU" line is a fact of every CPU run. ``TFORMER_LOG_LEVEL=DEBUG`` shows everything,
on every rank.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

FORMAT = "%(levelname)s %(name)s: %(message)s"


def setup_logging() -> None:
    level = os.environ.get("TFORMER_LOG_LEVEL", "INFO").upper()
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        level = "INFO"
    logging.basicConfig(level=level, format=FORMAT)
    if level == "DEBUG":
        return
    if int(os.environ.get("LOCAL_RANK", "0") or 0) != 0:
        # the first rank of each node speaks for the node (caches and data are per node)
        logging.getLogger("tformer").setLevel(logging.WARNING)
    library = logging.getLogger("tformer.lib")

    def to_debug_log(message, category, filename, lineno, file=None, line=None):
        library.debug("%s: %s (%s:%d)", category.__name__, message, filename, lineno)

    warnings.showwarning = to_debug_log
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)  # e.g. "Setting accelerator to CPU"
    quiet_repeats()


class Quiet(logging.Filter):
    """Drops a warning already shown by this process, a warning on a rank other than 0, and
    (``library_errors_only``) anything below an error. Information lines and errors pass."""

    def __init__(self, rank: int, library_errors_only: bool = False):
        super().__init__()
        self.rank, self.library_errors_only = rank, library_errors_only
        self.seen: set[tuple[str, int, str]] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if self.library_errors_only and record.levelno < logging.ERROR:
            return False
        if not logging.WARNING <= record.levelno < logging.ERROR:
            return True
        if self.rank != 0:
            return False
        key = (record.name, record.levelno, record.getMessage())
        if key in self.seen:
            return False
        self.seen.add(key)
        return True


def quiet_repeats() -> None:
    """Put ``Quiet`` on the console handlers that exist now: the root's, torch's own (its loggers
    do not propagate to the root) and DeepSpeed's logger. Called at set-up and again once torch
    and DeepSpeed are imported (the trainer's start); a handler gets one filter however often."""
    if os.environ.get("TFORMER_LOG_LEVEL", "INFO").upper() == "DEBUG":
        return
    rank = int(os.environ.get("RANK", "0") or 0)
    handlers = list(logging.getLogger().handlers)
    for name, logger in list(logging.root.manager.loggerDict.items()):  # torch's, e.g. torch.distributed.tensor
        if name.startswith("torch") and isinstance(logger, logging.Logger):
            handlers += logger.handlers
    for h in handlers:
        if not any(isinstance(f, Quiet) for f in h.filters):
            h.addFilter(Quiet(rank))
    deepspeed = logging.getLogger("DeepSpeed")
    if not any(isinstance(f, Quiet) for f in deepspeed.filters):
        deepspeed.addFilter(Quiet(rank, library_errors_only=True))


def interactive() -> bool:
    """Whether a person watches the console: a progress bar only then (a SLURM log or a pipe would
    get every redraw of it, interleaved with the step lines)."""
    return sys.stdout.isatty() and sys.stderr.isatty()
