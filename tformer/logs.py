"""What a user sees on the console: tformer's own lines and the progress bar.

Library chatter is kept out of the way: Python warnings raised inside libraries (DCP's
single-process notice, deprecations) go to the log at DEBUG, `datasets`' progress bars are off,
and under torchrun only the first rank of each node prints tformer's INFO lines (its data caches
are the node's; every rank still prints its warnings and errors). ``TFORMER_LOG_LEVEL=DEBUG``
shows everything.
"""

from __future__ import annotations

import logging
import os
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
