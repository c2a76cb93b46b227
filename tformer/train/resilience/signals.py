"""Signals that end a run cleanly: the trainer finishes its step, saves a checkpoint and exits 0.

SIGTERM and SIGUSR1 are what schedulers send before they stop a job (SLURM's ``--signal``);
SIGINT is Ctrl-C, which deserves the same care: a user who interrupts a run wants to keep it.
A Ctrl-C reaches each process of a ``torchrun`` job twice within milliseconds (from the terminal,
and forwarded by the agent), so only a SIGINT that comes ``ABORT_AFTER_S`` or more after the
first one aborts at once, without saving (``KeyboardInterrupt``): the way out of a save that
hangs.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
ABORT_AFTER_S = 2.0


def install_stop_signals(stop: Callable[[str], None], announce: bool) -> dict:
    """Call ``stop(name)`` on the first stop signal; returns the previous handlers for
    :func:`restore_signals`. ``announce``: say on stderr what a Ctrl-C does (rank 0)."""
    first: list[tuple[int, float]] = []

    def handler(signum, _frame):
        now = time.monotonic()
        if first and signum == signal.SIGINT == first[0][0] and now - first[0][1] >= ABORT_AFTER_S:
            raise KeyboardInterrupt
        if first:
            return
        first.append((signum, now))
        stop(signal.Signals(signum).name)
        if signum == signal.SIGINT and announce:  # os.write: print() may be mid-write in the main thread
            os.write(2, b"\ntformer: Ctrl-C: finishing the step and saving a checkpoint; Ctrl-C again to stop without one\n")

    previous = {}
    for sig in STOP_SIGNALS:
        try:
            previous[sig] = signal.signal(sig, handler)
        except ValueError:  # not the main thread (e.g. a notebook worker): no signal handling
            pass
    return previous


def restore_signals(previous: dict) -> None:
    for sig, h in previous.items():
        signal.signal(sig, h)


def ignore_interrupts(_worker_id: int) -> None:
    """DataLoader workers leave Ctrl-C to the trainer: the terminal sends SIGINT to the whole
    process group, and a worker that exited on it would fail the micro-batches the last step
    still reads. The DataLoader ends its workers itself."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
