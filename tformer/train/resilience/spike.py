"""Loss-spike detection: a loss above ``factor`` x the running median of the last ``window``
normal losses, once the run is past ``warmup`` steps.

Large runs answer a spike by restarting from a checkpoint before it and skipping the batches
around it (PaLM restarted ~100 steps earlier and skipped 200-500 batches); the trainer does that
with ``on_spike: rollback``. The window is part of the checkpoint, so a resumed run judges the
same steps the same way. Spikes and non-finite losses never enter the window.
"""

from __future__ import annotations

import math
import statistics
from collections import deque


class SpikeDetector:
    def __init__(self, factor: float, window: int, warmup: int):
        self.factor, self.warmup = factor, warmup
        self.losses: deque[float] = deque(maxlen=window)

    def check(self, step: int, loss: float) -> float | None:
        """The running median if ``loss`` at ``step`` is a spike, else None (and the loss joins
        the window)."""
        if not math.isfinite(loss):
            return None
        full = len(self.losses) == self.losses.maxlen
        if step > self.warmup and full:
            median = statistics.median(self.losses)
            if loss > self.factor * median:
                return median
        self.losses.append(loss)
        return None

    def state_dict(self) -> dict:
        return {"losses": list(self.losses)}

    def load_state_dict(self, state: dict) -> None:
        self.losses.clear()
        self.losses.extend(state.get("losses", []))
