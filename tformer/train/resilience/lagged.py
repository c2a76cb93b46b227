"""Device figures the host needs at every step, read a few steps late so that no step waits.

A stop (a signal on some rank, ``max_time`` on rank 0's clock) must be decided by every rank at
the same step, so its flag is all-reduced with the step's statistics. Reading that sum at once would
make the host wait for the device at every step; instead each step's flags are copied into host
memory (pinned, without blocking) as the step is queued and read ``lag`` steps later, when the
device has long finished them: on CUDA that read waits for nothing, and the host stays at most
``lag`` steps ahead. Every rank reads the same step's sum at the same step, so all agree. On a
CPU the device's memory is the host's and the lag is 0.
"""

from __future__ import annotations

import torch

CUDA_LAG = 2  # steps a CUDA run decides a stop late (at most this many steps more are trained)


class LaggedFlags:
    def __init__(self, device: torch.device, width: int, lag: int | None = None):
        cuda = device.type == "cuda"
        self.lag = (CUDA_LAG if cuda else 0) if lag is None else lag
        slots = self.lag + 1
        self.host = [torch.zeros(width, dtype=torch.float32, pin_memory=cuda) for _ in range(slots)]
        # numpy views made once: reading a slot is then a read of host memory, not a tensor op
        self.views = [h.numpy() for h in self.host]
        self.events = [torch.cuda.Event() for _ in range(slots)] if cuda else None
        self.pushed = 0

    def push(self, flags: torch.Tensor) -> tuple[float, ...] | None:
        """Queue this step's (all-reduced) flags; return those of ``lag`` steps ago (None in the
        first ``lag`` steps)."""
        slot = self.pushed % len(self.host)
        self.host[slot].copy_(flags.detach().float(), non_blocking=self.events is not None)
        if self.events is not None:
            self.events[slot].record()
        self.pushed += 1
        back = self.pushed - 1 - self.lag
        if back < 0:
            return None
        slot = back % len(self.host)
        if self.events is not None:
            self.events[slot].synchronize()  # queued `lag` steps ago: done by now on a busy device
        return tuple(float(v) for v in self.views[slot])
