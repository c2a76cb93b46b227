"""The trainer: one loop for all three families, models and layouts. ``fit`` takes the steps and,
around them, saves, evaluates and logs; the step runs the micro-batches forward and backward,
sums the figures over the ranks, clips and updates. Every other feature (fault tolerance, the
profiler, the watchdog, loss spikes, slow ranks, the writers, signals) is a component the loop
calls in order (loop/components.py); the run it trains is built in loop/run.py."""

from __future__ import annotations

import logging
import time

import torch

from ..checkpoint.io import RUN_CONFIG
from ..config import ConfigError as ConfigError  # tests read it here
from ..logs import quiet_repeats
from ..models import spec_of
from ..models.flops import training_flops
from ..models.figures import model_table
from ..parallel.context import context_shard
from ..parallel.routing import note_lengths
from .config import TrainConfig
from .dist import all_reduce
from .loop.components import (
    MOVED,
    REWOUND,
    Component,
    Components,
    Console,
    FaultToleranceSteps,
    Profiling,
    SingleGroup,
    SlowRanks,
    SpikeCheck,
    StopSignals,
    WatchdogBeats,
    warn_short_timeout,
)
from .loop.data import copy_tokenizer
from .loop.figures import NonFiniteLoss as NonFiniteLoss  # raised there; cli.py and tests import it here
from .loop.figures import StepFigures, Unread, on_device, why_read_every_step
from .loop.run import DTYPES as DTYPES
from .loop.optim import optimizer_figures
from .loop.run import Run
from .loop.run import cpu_has_native_bf16 as cpu_has_native_bf16  # tests and bench read these here
from .loop.run import resolve_precision as resolve_precision
from .loop.step import _concat as _concat  # bench/bench_scale.py imports it here
from .loop.step import _host_count, step_on_device, step_reading
from .observe.console import mark_start, say, start_summary, trim_metrics
from .observe.metrics import cpu_peak_at_least, peak_flops
from .observe.profiling import OFF, build_profiler
from .observe.stragglers import StepTimes
from .observe.watchdog import Watchdog
from .resilience.ft import FaultTolerance
from .resilience.lagged import LaggedFlags
from .resilience.rollback import LossSpikeError as LossSpikeError  # raised there; cli.py and tests import it here

log = logging.getLogger("tformer.train")


class Trainer(Run):
    """A run (loop/run.py: its processes, data, model, optimizer, checkpoints) that trains: ``fit``
    runs the steps, and around them the run's features as components (loop/components.py)."""

    def __init__(self, cfg: TrainConfig, callbacks=()):
        super().__init__(cfg)  # refuses, resumes, builds, in that order; a complete run ends there
        self.callbacks = list(callbacks)
        peak, self.peak_source = peak_flops(self.device, DTYPES[self.precision])
        # on a CPU the measured peak is raised by a faster step (MFU <= 100%; observe/metrics.py)
        dtype = DTYPES[self.precision]
        raise_peak = (lambda achieved: cpu_peak_at_least(dtype, achieved)) if self.device.type == "cpu" else None
        self.figures = StepFigures(cfg, self.dims, self.dist.world_size, peak, self.streak, raise_peak)
        self.times = StepTimes()  # this rank's data wait and step time, gathered at logging steps
        if self.dist.world_size > 1 and self.dims.pp == 1:  # a rank's waits in its collectives
            self.times.watch(self.wrapped)
        # after the resume: the Manager starts at the step this group stands at
        self.ft = FaultTolerance(self) if cfg.fault_tolerance.enabled else None
        self.replicas = self.ft or SingleGroup()  # the step's commit vote (always yes without torchft)
        # None: a step that does not log reads nothing
        self.figures.reason = why_read_every_step(self.strategy, self.optimizer, self.scaler, cfg, self.ft is not None)
        # an eager masked LM on a plain layout: its labelled positions counted on the host (under tp,
        # cp or pp the model sees another part of the batch; compiled, a count would recompile)
        dims = self.dims
        self._count_labels = (
            spec_of(self.model_cfg).masked_lm and dims.tp == dims.cp == dims.pp == 1 and cfg.compile is False
        )
        self.prof = OFF  # fit() sets the run's profiler (observe/profiling.py)
        self.step_seconds = 0.0  # the last step's own time
        self._stop_reason: str | None = None
        self._signal: str | None = None
        self._start = time.perf_counter()  # fit() sets it: max_time counts from there
        self._saved_step = -1  # the last step saved (or resumed from) in this fit
        self._flags = LaggedFlags(self.device, 2)  # the stop flags, read a few steps late on a GPU

    # -- the loop --------------------------------------------------------------------------
    def fit(self) -> dict:
        """Train to ``max_steps`` (or a stop): each step, then its saving, evaluating and logging;
        the features around them are components, called in the order of ``self.components``."""
        cfg = self.cfg
        self._write_run_files()
        self.components = self._components()
        self._start = time.perf_counter()
        mark_start()
        if self.figures.reason is not None and self.dist.is_main:
            log.info("reading the step's figures from the device at every step: %s", self.figures.reason)
        last: dict = {}
        self._saved_step = self.step if self.resumed_from is not None else -1
        batches = self._batches()
        try:
            last = self._finish_pending() or last
            while self.step < cfg.max_steps and self._stop_reason is None:
                if self.components.before_step(self.step + 1) == MOVED:  # healed from a peer: its data position
                    batches = self._moved()
                record = self._train_step(batches)
                if not record.get("committed", True):  # nothing changed: the same samples again, next try
                    batches = self._batches()
                    continue
                outcome = self.components.after_step(self.step, record, self.step_seconds)
                if outcome == REWOUND:  # rolled back to an earlier checkpoint: its record, a new data position
                    self.components.log(record)
                    batches, self._saved_step = self._moved(), self.step
                    continue
                if outcome == MOVED:
                    batches = self._moved()
                self._save_evaluate_log(record)
                last = record
                for cb in self.callbacks:
                    cb(self, record)
                self.ckpt.poll()  # commits, in the background, need no collective
                self.components.end_step(self.step, record)
            self._save_last()
            self.wait_for_checkpoint()  # never leave with a save in flight
        except BaseException as e:
            self.components.on_error(self.step + 1, e)
            self._close_checkpoints()
            raise
        finally:
            self.components.close()
            self.components, self.prof = Components(), OFF
        if self.dist.is_main:
            reason = self._stop_reason or "max_steps"
            say(f"tformer: stopped at step {self.step} ({reason}); checkpoint {self.ckpt_root / f'step_{self.step:08d}'}")
        return last

    def _write_run_files(self) -> None:
        """Rank 0: the resolved config, the tokenizer and the start summary; the log directory,
        whose records after a resumed checkpoint are dropped (those steps are logged again, once)."""
        if self.dist.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / RUN_CONFIG).write_text(self.resolved_yaml())  # the run's, as in each checkpoint
            copy_tokenizer(self.data, self.out)
            say(start_summary(self))  # the whole resolved config is config.yaml
        quiet_repeats()  # torch and DeepSpeed have set up their loggers by now
        if self.dist.is_main:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            if self.resumed_from is not None:
                trim_metrics(self.log_dir, self.step)

    def _components(self) -> Components:
        """The run's features, in the order the loop calls them (loop/components.py); one that is
        off is not in the list. They start outermost first: signals, the writers, the watchdog, the
        profiler."""
        cfg, d = self.cfg, self.dist
        signals = StopSignals(lambda name: setattr(self, "_signal", name), d.is_main)
        console = Console(cfg, self.log_dir, self.resolved, self.wandb_id, self.step) if d.is_main else None
        if console is not None:
            self.wandb_id = console.run_id
        timeout = cfg.watchdog_timeout
        watchdog = Watchdog(self.out / "watchdog", d.rank, d.world_size, timeout).start() if timeout is not None else None
        self.prof = build_profiler(cfg.profile, cfg.max_steps, d, self.out, self.precision, cfg.tensorboard.enabled)
        items: list[Component | None] = [
            FaultToleranceSteps(self.ft, lambda: self._save_last(wait=True)) if self.ft is not None else None,
            Profiling(self.prof) if self.prof is not OFF else None,
            WatchdogBeats(watchdog, timeout, d.is_main) if watchdog is not None and timeout is not None else None,
            SpikeCheck(self, self.figures) if cfg.on_spike != "none" else None,
            SlowRanks(self.times, d, cfg.slow_rank_factor),
            console,
            signals,
        ]
        return Components(c for c in items if c is not None)

    def _moved(self):
        """The run's position changed under the loop (a heal, a rollback): batches from there."""
        self.components.moved(self.step)
        return self._batches()

    def _save_evaluate_log(self, record: dict) -> None:
        """A step's events: the checkpoint, then the evaluation (one that fails must not cost the
        step's checkpoint), then the record: its fields added on every rank, written on rank 0."""
        cfg = self.cfg
        stopping = self._stop_check()
        due_eval = cfg.eval_every and self.step % cfg.eval_every == 0
        final = self.step >= cfg.max_steps or stopping
        due_log = self.step % cfg.log_every == 0 or final or bool(due_eval)
        # the checkpoint carries the record it is saved before: a kill before the log line is made
        # good at resume (_finish_pending)
        self.pending = {"record": record, "evaluate": bool(due_eval or final)} if due_log else None
        if (cfg.save_every and self.step % cfg.save_every == 0) or final:
            if self._may_save():
                self.save()
            self._saved_step = self.step
        if due_eval or final:
            self._beat("eval")
            record.update(self.evaluate())
        if due_log or "val_loss" in record:
            self.components.at_log(record)  # every rank takes part
            self.components.log(record)
        self.pending = None

    def _save_last(self, wait: bool = False) -> None:
        """The run's last step, saved unless it is (or this group writes no checkpoints); with
        ``wait``, before a lost quorum ends the run (then its writer group saves it)."""
        if self.step != self._saved_step and self.step > 0 and self._may_save():
            self.save()
            if wait:
                self.wait_for_checkpoint()

    def _finish_pending(self) -> dict | None:
        """A resumed checkpoint whose step was due to be logged (and evaluated) but was killed
        before its line reached ``metrics.jsonl``: evaluate it now (the model is that step's, as it
        was then) and log it, once. All ranks decide alike: they read the same checkpoint and run
        directory."""
        pending, self._unlogged = self._unlogged, None
        if pending is None or self.resumed_from is None:
            return None
        record = dict(pending["record"])
        if pending["evaluate"]:
            self._beat("eval")
            record.update(self.evaluate())
        self.components.log(record)
        if self.dist.is_main:
            log.info("step %d: logged its record after the resume (the run was stopped before it)", self.step)
        return record

    def _may_save(self) -> bool:
        """Under fault tolerance one participating group writes the run's checkpoints; none is
        written in a non-finite streak (loop/figures.py's ``Streak``)."""
        return (self.ft is None or self.ft.writes_checkpoints()) and self.streak.allows_checkpoint(self.step)

    # -- the step --------------------------------------------------------------------------
    def _train_step(self, batches) -> dict:
        """One optimizer step: forward and backward over the micro-batches, the figures summed over
        the ranks (and the replica groups' vote), clip and update; its figures stay on the device
        unless this step reads them (loop/figures.py)."""
        cfg = self.cfg
        t0 = time.perf_counter()
        lr = self.optimizer.param_groups[0]["lr"]
        self.wrapped.train()
        loss_sum, tokens, flops = self._forward_backward(batches)
        # the loss-free MoE bias's expert loads, before the sync that sums them over replica groups
        loads = self.balancer.loads() if self.balancer is not None else None
        stats, committed = self._synchronise(loss_sum, tokens, flops, loads)
        if not committed:  # a step torchft did not commit changes nothing (it was counted)
            self.optimizer.zero_grad(set_to_none=True)
            return {"step": self.step, "committed": False}
        self._beat("optimizer step")
        clip = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")
        # a logging step's MoE routing figures and mtp_loss (this rank's last micro-batch), read with the rest
        figures = self.model_cfg.moe.enabled or self.model_cfg.mtp_depth
        table = model_table(self.model) if figures and self.logs_at(self.step + 1) else None
        must_stop = False
        row: torch.Tensor | list[float]
        if self.figures.reason is None:  # clip, then update where the loss and the norm are finite, on the device
            row = step_on_device(self.strategy, self.optimizer, self.scaler, self.prof, stats, clip)
        else:
            row, must_stop, table = step_reading(
                self.strategy, self.optimizer, self.scaler, self.prof, stats, clip, table, self.figures.mean_loss
            )
        self.scheduler.step()  # the schedule follows the step count, a skipped step's too
        if self.balancer is not None and loads is not None:  # the loss-free MoE bias, from this step's loads
            self.balancer.apply(loads)
        self.step += 1
        # samples consumed, or with token-budget batches, batches consumed (the sampler's unit)
        per_batch = 1 if cfg.data.tokens_per_batch is not None else cfg.micro_batch_size
        self.consumed += per_batch * cfg.grad_accum * self.dist.dp_size
        # the figures of every step since the last read, in one read: at a logging, saving or
        # evaluating step, a stop, or at every step where the run must decide on the host
        read = self.figures.reads_at(self.step, self.prof.active, self._stop_reason is not None)
        self.tokens = self.figures.add(Unread(self.step, lr, row, table, must_stop), self.tokens, read)
        memory = self.strategy.memory_report(self.optimizer)  # inside the step's time: it is part of the step
        # the step began with its quorum (fault tolerance), before the first batch
        dt = time.perf_counter() - t0 + self.replicas.quorum_s
        self.replicas.note_committed_time(dt)
        self.step_seconds = dt
        # a logging step's optimizer figures (Muon's QK-clip: the step's largest logit, on the device till now)
        optimizer = optimizer_figures(self.optimizer) if self.logs_at(self.step) else {}
        return self.figures.record(self.step, lr, dt, {**memory, **self.replicas.record(), **optimizer})

    def _forward_backward(self, batches) -> tuple[torch.Tensor, int, float]:
        """The step's micro-batches, forward and backward (gradients summed locally until the
        last): this rank's loss sum (on the device), its tokens and model FLOPs."""
        cfg = self.cfg
        keys = self.data.model_inputs
        loss_sum = torch.zeros((), device=self.device)
        tokens = flops = 0
        pipelined = []  # pipeline parallel: the step's micro-batches go through the schedule together
        for micro in range(cfg.grad_accum):
            self._beat("data")
            with self.prof.range("data"), self.times.data_wait():
                batch = next(batches)
            self._beat("forward-backward")
            inputs = {k: batch[k].to(self.device, non_blocking=True) for k in keys if k in batch}
            if self._count_labels:  # the masked LM head's rows, counted in the loader's host copy
                inputs["labelled_count"] = _host_count(batch["labels"])
            seq2seq = spec_of(self.model_cfg).seq2seq  # the labels are a second (target) sequence
            tokens += inputs["input_ids"].numel() + (inputs["labels"].numel() if seq2seq else 0)
            # the FLOPs of the batch as it is (token-budget batches vary in shape; padding included)
            target = inputs["labels"].shape[1] if seq2seq else None
            batch_size, seq_len = inputs["input_ids"].shape
            flops += training_flops(self.model_cfg, batch_size, seq_len, target)
            last = micro == cfg.grad_accum - 1
            note_lengths(self.model, inputs)  # MoE routing losses leave out the pad the layout adds
            inputs = self._pad_for_sp(inputs)
            if self.dims.cp > 1:  # each rank of a context-parallel group: its part of every sequence
                inputs = context_shard(inputs, self.dist.mesh, self.model_cfg)
            if self.dims.pp > 1:
                pipelined.append(inputs)
                if last:
                    with self.strategy.loss_context(), self._autocast(), self.prof.range("forward_backward"):
                        loss = self._pipeline().step(_concat(pipelined))
                    if loss is not None:  # the last stage's ranks hold the loss
                        loss_sum += loss
                continue
            with self.strategy.no_sync(last), self.strategy.loss_context():
                with self._autocast(), self._offload(), self.prof.range("forward"):
                    # loss only: no vocabulary-wide logits kept; the MLM head runs at masked positions
                    loss = (
                        self.wrapped(**inputs, return_logits=False, label_smoothing=cfg.optim.label_smoothing).loss
                        / cfg.grad_accum
                    )
                with self.prof.range("backward"):
                    self.strategy.backward(loss, last, self.scaler)
            loss_sum += loss.detach().float()
        return loss_sum, tokens, flops

    def _synchronise(
        self, loss_sum: torch.Tensor, tokens: int, flops: float, loads: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, bool]:
        """The step's figures summed over the ranks, with its stop flags (a signal here, rank 0's
        clock past max_time), so that every rank decides a stop at the same step; under fault
        tolerance, averaged over the quorum's groups with their commit vote (``loads``, the MoE
        expert loads, summed over the groups in place)."""
        self._beat("loss all-reduce")
        over_time = self.cfg.max_time is not None and time.perf_counter() - self._start >= self.cfg.max_time
        signal = 1.0 if self._signal else 0.0
        host = [float(tokens), float(flops), signal, float(over_time and self.dist.is_main)]
        stats = torch.cat([loss_sum.reshape(1), on_device(host, self.device)])
        with self.times.closing_sync():  # what this rank waits here is the others' time, not its own
            all_reduce(stats)
        stats, committed = self.replicas.sync(self.model, stats, loads)  # gradients too, under fault tolerance
        flags = self._flags.push(stats[3:5])  # the flags of a step `lag` back (lagged.py)
        if flags is not None:
            self._note_stop(*flags)
        return stats, committed

    def logs_at(self, step: int) -> bool:
        """Whether ``step`` is a logging step: every ``log_every``-th and the last."""
        return self.figures.logs_at(step)

    # -- names tests and tools read here -----------------------------------------------------
    @property
    def peak(self) -> float:
        """The device's peak FLOP/s that MFU is over (on a CPU, raised by a faster step)."""
        return self.figures.peak

    @property
    def _read_reason(self) -> str | None:
        """Why every step reads its figures (loop/figures.py's ``why_read_every_step``)."""
        return self.figures.reason

    def _read_figures(self) -> list[dict]:
        """The records of the steps not read yet, read now (as a logging step reads them)."""
        records, self.tokens = self.figures.read(self.tokens)
        return records

    def _check_watchdog_margin(self, step_time: float) -> None:
        """The watchdog component's warning for a step that took most of ``watchdog_timeout``."""
        timeout = self.cfg.watchdog_timeout
        if timeout is not None and not getattr(self, "_watchdog_warned", False):
            self._watchdog_warned = warn_short_timeout(timeout, self.step, step_time, self.dist.is_main)

    def _note_stop(self, signals: float, over_time: float) -> None:
        if self._stop_reason is None and signals > 0:
            self._stop_reason = f"signal {self._signal or 'on another rank'}"
        if self._stop_reason is None and over_time > 0:
            self._stop_reason = "max_time"

    def _stop_check(self) -> bool:
        cfg = self.cfg
        if self._stop_reason is None and cfg.max_tokens is not None and self.tokens >= cfg.max_tokens:
            self._stop_reason = "max_tokens"
        return self._stop_reason is not None
