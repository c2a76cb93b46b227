"""The slow rank named: every rank's step time and data-loader wait, gathered at logging steps.

Ranks that synchronise every step take equally long per step: a fast rank spends the slow one's
extra time waiting in a collective. So a rank's own time is its step time less what it waited in
the step's collectives: the closing all-reduce (the loss and token counts, every strategy's), and
the collectives inside the forward and backward, where a rank slow in its compute makes the others
wait (measured on a 2-rank DDP run with one rank stopped half of every 100 ms: counting only the
closing wait named the slow rank at 17 of 37 logging steps and the fast one at the other 20):

- DDP: a communication hook (torch's own all-reduce hook, timed): the time from the last gradient
  bucket's launch to the last bucket's completion is what the rank waited at the end of its backward;
- FSDP2: each parameter group's all-gather (its launch, which on gloo runs it, and its wait; in
  forward and backward) and its post-backward (the reduce-scatter);
- TP, CP and everything else on functional collectives (DTensor's redistributions): their
  ``wait_tensor``.

On a GPU these are host times of the waits (the host blocks in them); kernels still queued when
the host waits are not separated (CUDA events on the compute and communication streams would).
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
        self.sync = 0.0  # this step's wait in its collectives (the closing all-reduce and those of watch())
        self.own = 0.0  # the last step's time less those waits
        self.wait = 0.0  # the last step's data wait
        self._ready = self._done = 0.0  # DDP: the step's last bucket launched, its last bucket done

    def watch(self, model: torch.nn.Module) -> None:
        """Time the waits inside the forward and backward of ``model`` (what the trainer calls)."""
        from torch.nn.parallel import DistributedDataParallel

        if isinstance(model, DistributedDataParallel):
            model.register_comm_hook(None, self._ddp_hook)
        for module in model.modules():
            state = getattr(module, "_get_fsdp_state", None)
            group = getattr(state(), "_fsdp_param_group", None) if state is not None else None
            if group is not None:
                for name in ("unshard", "wait_for_unshard", "post_backward"):
                    setattr(group, name, self._timed(getattr(group, name)))
        if any(hasattr(p, "device_mesh") for p in model.parameters()):
            import torch.distributed._functional_collectives as funcol

            if not hasattr(funcol.wait_tensor, "__tformer_timed__"):
                funcol.wait_tensor = _timed_funcol(funcol.wait_tensor, self)
            else:
                funcol.wait_tensor.__tformer_timed__[0] = self

    def _timed(self, fn):
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.sync += time.perf_counter() - t

        return timed

    def _ddp_hook(self, state, bucket):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        self._ready = time.perf_counter()

        def done(fut):
            self._done = time.perf_counter()
            return fut.value()

        return allreduce_hook(state, bucket).then(done)

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
        ddp = max(0.0, self._done - self._ready)  # the end of the backward, waiting for the last bucket
        self.own, self.wait = step_time - self.sync - ddp, self.data
        self.data = self.sync = self._ready = self._done = 0.0

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


def _timed_funcol(wait_tensor, times: StepTimes):
    """``funcol.wait_tensor`` timed into the trainer's ``StepTimes`` (module-wide: DTensor's
    redistributions and the async collective tensors look it up there)."""
    owner = [times]

    def timed(tensor):
        t = time.perf_counter()
        try:
            return wait_tensor(tensor)
        finally:
            owner[0].sync += time.perf_counter() - t

    timed.__tformer_timed__ = owner  # type: ignore[attr-defined]
    return timed
