"""The slow rank named: every rank's step time and data-loader wait, gathered at logging steps.

Ranks that synchronise every step take equally long per step: a fast rank spends the slow one's
extra time waiting in a collective. So a rank's own time is its step time less what it waited in
the step's closing all-reduce (the loss and token counts), the one collective every strategy has.
What a fast rank waits inside the gradient collectives of the backward pass (DDP, FSDP, TP) is
not separated here: a rank slow in its data or in its work after the backward is named, one slow
in its forward/backward shows in the traces of ``profile`` (``tformer profile-report``).

One all-gather of two numbers per rank, at logging steps only; between them, a few clock reads.
"""

from __future__ import annotations

import contextlib
import statistics
import time

import torch


class StepTimes:
    def __init__(self) -> None:
        self.data = 0.0  # this step's data-loader wait (all micro-batches)
        self.sync = 0.0  # this step's wait in the closing all-reduce
        self.own = 0.0  # the last step's time less that wait
        self.wait = 0.0  # the last step's data wait

    @contextlib.contextmanager
    def data_wait(self):
        t = time.perf_counter()
        try:
            yield
        finally:
            self.data += time.perf_counter() - t

    @contextlib.contextmanager
    def closing_sync(self):
        t = time.perf_counter()
        try:
            yield
        finally:
            self.sync += time.perf_counter() - t

    def step_done(self, step_time: float) -> None:
        self.own, self.wait = step_time - self.sync, self.data
        self.data = self.sync = 0.0

    def gather(self, dist, factor: float) -> dict:
        """At a logging step, on every rank: the ranks' own step times and data waits (min, median,
        max), the slowest rank, and ``slow_rank`` when it is above ``factor`` x the median."""
        mine = torch.tensor([self.own, self.wait], dtype=torch.float64)
        world = dist.world_size
        if world > 1 and torch.distributed.is_initialized():
            device = dist.device if dist.device.type != "cpu" else torch.device("cpu")
            everyone = [torch.zeros(2, dtype=torch.float64, device=device) for _ in range(world)]
            torch.distributed.all_gather(everyone, mine.to(device))
            rows = [t.tolist() for t in everyone]
        else:
            rows = [mine.tolist()]
        own, wait = [r[0] for r in rows], [r[1] for r in rows]
        slowest = max(range(len(own)), key=own.__getitem__)
        median = statistics.median(own)
        ratio = own[slowest] / median if median > 0 else 1.0
        record = {
            "data_wait": self.wait,
            "rank_step_time_min": min(own),
            "rank_step_time_median": median,
            "rank_step_time_max": own[slowest],
            "slowest_rank": slowest,
            "slowest_rank_ratio": ratio,
            "data_wait_min": min(wait),
            "data_wait_median": statistics.median(wait),
            "data_wait_max": max(wait),
            "data_wait_max_rank": max(range(len(wait)), key=wait.__getitem__),
        }
        if world > 1 and ratio > factor:
            record["slow_rank"] = slowest  # the console line names it
        return record
