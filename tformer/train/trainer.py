"""One trainer for all three families: accumulation, mixed precision, DDP, evaluation,
checkpoints with exact resume, signals, metrics (JSONL, W&B, progress bar)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import sys
import time
from collections.abc import Sized
from pathlib import Path
from typing import Any, cast

import torch

from ..checkpoint import parts
from ..checkpoint.io import RUN_CONFIG
from ..checkpoint.manager import CheckpointManager
from ..checkpoint.state import TrainerState
from ..config import ConfigError
from ..data import MixtureDataset
from ..logs import interactive, quiet_repeats
from ..models import build_model, spec_of
from ..models.flops import training_flops
from ..models.padding import pad_sequences
from ..nn.moe import moe_figures, moe_table
from ..parallel.build import build_strategy
from ..parallel.context import context_shard
from ..parallel.offload import activation_offload
from ..parallel.routing import note_lengths
from ..parallel.strategy import Pipeline, StepResult, Strategy, skips_on_device
from ..parallel.tp import pad_vocab_for_tp
from .loop import evaluation
from .resilience import rollback
from .resilience import resume as resuming
from .loop.checks import check_support
from .config import TrainConfig
from .observe.console import METRICS, log_step, start_summary, trim_metrics
from .loop.data import build_data, check_sources, copy_tokenizer, train_batches
from .dist import all_reduce, barrier, device_type, init_distributed
from .resilience.ft import FaultTolerance, QuorumLost, check_fault_tolerance, lighthouse_address, wait_for_lighthouse
from .loop.head import loss_chunk_size
from .resilience.lagged import LaggedFlags
from .observe.metrics import peak_flops
from .loop.optim import build_optimizer, build_scheduler
from .observe.profiling import OFF, build_profiler, check_ranks
from .resilience.rollback import LossSpikeError as LossSpikeError  # raised there; cli.py and tests import it here
from .loop.sdpa import math_fallback_line
from .resilience.signals import install_stop_signals, restore_signals
from .resilience.spike import SpikeDetector
from .loop.state import DataPosition, Progress
from .observe.stragglers import StepTimes
from .observe.tracking import Trackers
from .observe.watchdog import Watchdog, enable_flight_recorder

log = logging.getLogger("tformer.train")

# fp8: bf16 autocast, with the blocks' linear layers in float8 (parallel/float8.py)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8": torch.bfloat16}


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: without them bf16 matmuls on CPU are emulated and slower than fp32.
    ``TFORMER_CPU_BF16=1|0`` overrides the check, so a test lane can take either path on any CPU."""
    forced = os.environ.get("TFORMER_CPU_BF16", "")
    if forced:
        if forced not in ("0", "1"):
            raise ConfigError(f"TFORMER_CPU_BF16={forced} must be 1 or 0; unset it to read the CPU's flags")
        return forced == "1"
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_precision(precision: str, device: torch.device) -> str:
    if precision != "auto":
        return precision
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp32"
    return "bf16" if cpu_has_native_bf16() else "fp32"


class NonFiniteLoss(RuntimeError):
    """The run stopped on a non-finite loss (``on_nonfinite: stop``)."""


class Trainer:
    def __init__(self, cfg: TrainConfig, callbacks=()):
        """Set up a run from its config, in this order: refuse what cannot run before any work, find
        the checkpoint to resume (a complete run ends there), start the process group and mesh, build
        the data, then the model, its strategy and optimizer, and last load the checkpoint."""
        self.cfg = cfg
        self.callbacks = list(callbacks)
        self._check_inputs()
        self._peek_resume()  # a complete run ends here, before any work
        self._start_processes()
        self._build_data()
        self._say_attention_kernel()
        self._check_resume_changes()  # before the model is built
        self._build_model_and_optimizer()
        self._init_counters()
        self.resolved = {**cfg.to_dict(), "model": self.model_cfg.to_dict()}
        self.peak, self.peak_source = peak_flops(self.device, DTYPES[self.precision])
        self.ckpt = self._checkpointer()
        self._resume()  # it restores the RNG streams, which nothing may draw from afterwards
        # after the resume: the Manager starts at the step this group stands at
        self.ft: FaultTolerance | None = FaultTolerance(self) if cfg.fault_tolerance.enabled else None
        self._read_reason: str | None = self._why_read_every_step()  # None: a step that does not log reads nothing
        # an eager masked LM on a plain layout: its labelled positions counted on the host (under tp,
        # cp or pp the model sees another part of the batch; compiled, a count would recompile)
        dims = self.dims
        self._count_labels = (
            self.model_cfg.family == "encoder" and dims.tp == dims.cp == dims.pp == 1 and cfg.compile is False
        )

    # -- setup -----------------------------------------------------------------------------
    def _check_inputs(self) -> None:
        """Refuse what this device cannot run before any work (process group, data, model)."""
        self.device = torch.device(device_type(self.cfg.device))
        self.precision = resolve_precision(self.cfg.precision, self.device)
        self.dims = check_support(self.cfg, self.precision, self.device)  # the mesh's sizes, checked
        check_ranks(self.cfg.profile, self.dims.world_size)
        check_fault_tolerance(self.cfg, self.device)  # torchft missing, layouts it cannot run
        check_sources(self.cfg)  # a missing or empty data source: refused before the run directory exists

    def _start_processes(self) -> None:
        """The process group and the run's one mesh (tformer/parallel/mesh.py); the run directory."""
        cfg = self.cfg
        # collectives outlive the watchdog by a minute, so a hang is reported before gloo/NCCL fail
        timeout = 600 if cfg.watchdog_timeout is None else cfg.watchdog_timeout + 60
        if cfg.watchdog_timeout is not None:
            enable_flight_recorder()  # before the process group: its collectives are recorded
        self.dist = init_distributed(
            cfg.device,
            cfg.parallel.backend,
            timeout_s=timeout,
            always=cfg.parallel.strategy != "ddp" or self.dims.tp > 1 or self.dims.pp > 1,
        )
        self.device = self.dist.device
        self.dist.dims = self.dims
        ft = cfg.fault_tolerance
        if ft.enabled:  # the data is split over every replica group; the lighthouse must answer
            self.dist.replica, self.dist.replicas = ft.replica_id, ft.replicas
            wait_for_lighthouse(lighthouse_address(ft), ft.timeout_s)
        if torch.distributed.is_initialized():
            self.dist.mesh = self.dims.build_mesh(self.device.type)
        self._warn_slow_precision()
        self.out = Path(cfg.output_dir)
        self.ckpt_root = self.out / "checkpoints"
        # each replica group logs on its own (metrics.jsonl, W&B); the checkpoints are the run's
        self.log_dir = self.out / "replicas" / str(ft.replica_id) if ft.enabled else self.out
        if self.dist.is_main:
            self.ckpt_root.mkdir(parents=True, exist_ok=True)
        barrier()

    def _build_data(self) -> None:
        """This rank's data, and the model config it implies (vocabulary padded for tp)."""
        cfg = self.cfg
        torch.manual_seed(cfg.seed)  # the same initial weights on every rank, before any sharding
        self.data = build_data(cfg, self.dist.rank, self.dist.dp_size)
        if isinstance(self.data.train, MixtureDataset):  # refuse (on_exhausted=stop) or log re-epochs now
            self.data.train.check_exhaustion(cfg.max_steps * self._global_batch())
        per_step = cfg.micro_batch_size * self.dist.dp_size
        train_size = len(cast(Sized, self.data.train))
        if per_step > train_size:
            raise ConfigError(
                f"micro_batch_size={cfg.micro_batch_size} x {self.dist.dp_size} rank(s) needs "
                f"{per_step} samples per micro-step but the training set has {train_size}; "
                "lower micro_batch_size or use more data"
            )
        self.model_cfg = self.data.model_config
        self.model_cfg = pad_vocab_for_tp(self.model_cfg, self.dims.tp)  # recorded in config.yaml and checkpoints

    def _build_model_and_optimizer(self) -> None:
        """AC -> per-block compile -> DDP / FSDP2, then the optimizer over the (sharded) parameters."""
        cfg = self.cfg
        self.model = build_model(self.model_cfg).to(self.device)
        self.num_parameters = self.model.num_parameters()  # the whole model's, before any split
        self.model.loss_chunk_size = loss_chunk_size(  # the training loss's head, in chunks (auto: by device)
            cfg,
            self.model_cfg,
            self.device,
            self.precision,
            self.num_parameters,
            self.dims,
            self.data.seq_len,
            self.data.target_len,
        )
        self.strategy: Strategy = build_strategy(self.model, cfg, self.dist, DTYPES[self.precision])
        self.model = self.strategy.model  # under pipeline parallelism: this rank's stages
        base = build_optimizer(self.model, cfg.optim, self.device, allow_fused=self.strategy.fused_optimizer_ok())
        # The schedule drives the torch optimizer's param groups, which DeepSpeed's wrapper shares.
        self.scheduler = build_scheduler(base, cfg.optim, self.schedule_steps)
        self.optimizer = self.strategy.setup_optimizer(base)
        self.wrapped = self.strategy.wrapped
        self.scaler = torch.amp.GradScaler(self.device.type) if self.precision == "fp16" else None

    def _init_counters(self) -> None:
        """Where the run stands before any step (a resume then sets them from its checkpoint)."""
        self.step = 0
        self.consumed = 0  # global samples consumed by all ranks
        self.tokens = 0  # global tokens consumed
        self.skipped = 0  # consecutive non-finite steps
        # since the last logged step: seconds inside steps, global tokens, model FLOPs (the rates a
        # logged step reports are over its logging interval: a step that does not log need not wait
        # for the device, so only the interval, which ends in a read, has a true wall time)
        self._window = [0.0, 0, 0.0, 0]  # seconds, tokens, FLOPs, steps
        self.streak_start: int | None = None  # first step of the current non-finite streak
        self.spikes = SpikeDetector(self.cfg.spike_factor, self.cfg.spike_window, self.cfg.spike_warmup)
        self.rollbacks = 0  # loss-spike rollbacks done (on_spike=rollback)
        self.watchdog: Watchdog | None = None
        self.prof = OFF  # fit() sets the run's profiler (tformer/train/profiling.py)
        self.times = StepTimes()  # this rank's data wait and step time, gathered at logging steps
        self.ft = None  # torchft's Manager (fault_tolerance.enabled), set up last
        self._watchdog_warned = False
        self.wandb_id: str | None = None
        self.resumed_from: Path | None = None
        self.pending: dict | None = None  # this step's record until it is logged (saved with a checkpoint)
        self._stop_reason: str | None = None
        self._signal: str | None = None
        self._start = time.perf_counter()  # fit() sets it: max_time counts from there
        self._unread: list[_Unread] = []  # steps whose figures are still on the device
        self._replayed: list[dict] = []  # the records read with the last step's, before it
        self._flags = LaggedFlags(self.device, 2)  # the stop flags, read a few steps late on a GPU

    def _warn_slow_precision(self) -> None:
        if self.dist.is_main and self.precision != "fp32" and self.device.type == "cpu" and not cpu_has_native_bf16():
            log.warning(
                f"precision={self.precision} on a CPU without AVX512-BF16/AMX: torch emulates bf16 matmuls here, "
                "30-100x slower than fp32; precision=auto picks fp32 on this CPU"
            )

    def _say_attention_kernel(self) -> None:
        """fp32 on CUDA: one line when SDPA will run this model's attention on its math kernel."""
        line = math_fallback_line(self.model_cfg, self.precision, self.device)
        if line and self.dist.is_main:
            log.warning(line)

    def _offload(self):
        return activation_offload(self.device, self.cfg.parallel.activation_offload)

    def _autocast(self):
        if self.precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=DTYPES[self.precision])

    # -- checkpoints -----------------------------------------------------------------------
    def _peek_resume(self) -> None:
        """The checkpoint to resume from, read cheaply (``trainer.json``, ``config.yaml``; verified
        when loaded): a run already complete raises ``RunComplete``; the schedule's horizon."""
        cfg = self.cfg
        manager = CheckpointManager(Path(cfg.output_dir) / "checkpoints")
        path, self._damaged = manager.locate(cfg.resume)
        self._resume_peek = None
        self._unlogged: dict | None = None
        if path is not None and path.is_dir():
            state, saved = manager.read(path), resuming.saved_config(path)
            if not cfg.fault_tolerance.enabled:  # under torchft each group logs apart (replicas/<id>/)
                self._unlogged = resuming.unlogged_record(state, path, Path(cfg.output_dir))
            if self._unlogged is None:  # a record still to log (and evaluate) is work left
                resuming.check_not_complete(cfg, path, state)
            self._resume_peek = (path, state, saved)
        self.schedule_steps = resuming.schedule_steps(cfg, *(self._resume_peek or (None, None, {}))[1:])

    def _check_resume_changes(self) -> None:
        """Refuse (or, with ``resume_changes=allow``, warn about) what the resumed run changes."""
        if self._resume_peek is None:
            return
        path, state, saved = self._resume_peek
        current = {**self.cfg.to_dict(), "model": self.model_cfg.to_dict()}
        if state.weights_only:  # an import starts a run: only the model its weights belong to counts
            saved, current = {"model": state.model_config or {}}, {"model": current["model"]}
        resuming.check_padding(saved, current, self.cfg.parallel.strategy)
        changes = resuming.meaning_changes(saved, current, weights_only=state.weights_only)
        changes += resuming.batch_change(resuming.saved_global_batch(state, saved), self._global_batch_size())
        changes += resuming.float8_change(saved, self.cfg.precision)
        notes: list[str | None] = list(resuming.judge(changes, self.cfg, path, state.step))
        notes.append(resuming.horizon_note(self.cfg, saved, self.schedule_steps, state.step))
        notes.append(resuming.fault_tolerance_note(saved, self.cfg, state.step))
        if self.dist.is_main:
            for note in filter(None, notes):
                log.warning("%s", note)

    def _apply_optim_config(self) -> None:
        """A loaded optimizer and schedule carry the hyperparameters they were saved with; under
        ``resume_changes=allow`` this run's ``optim`` section replaces them (the moments stay)."""
        o, sched = self.cfg.optim, self.scheduler
        decays = [o.weight_decay, 0.0]  # the groups of optim.param_groups: matrices, then the rest
        for group, decay in zip(self.optimizer.param_groups, decays):
            group.update(betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=decay, initial_lr=o.lr)
        sched.base_lrs = [o.lr] * len(sched.base_lrs)
        for group, factor in zip(self.optimizer.param_groups, sched.lr_lambdas):
            group["lr"] = o.lr * factor(sched.last_epoch)

    def _global_batch_size(self) -> tuple[int, int]:
        """(sequences, input tokens) per optimizer step; token-budget batches: (batches, budget)."""
        per = self.cfg.data.tokens_per_batch or self.data.seq_len
        return self._global_batch(), self._global_batch() * per

    def _checkpointer(self) -> CheckpointManager:
        """Everything a resume restores, as the checkpoint's parts, in load order: model and
        optimizer (DCP, or DeepSpeed's engine), the LR schedule and loss scaler, this rank's RNG
        streams, the data position and the run's own state (``trainer.json``), the run config."""
        cfg, d, trust = self.cfg, self.dist, self.cfg.checkpoint.trust
        record = parts.TrainerStatePart([DataPosition(self), Progress(self)], d.is_main)
        self._record = record
        return CheckpointManager(
            self.ckpt_root,
            d.rank,
            d.world_size,
            cfg.keep_checkpoints,
            background=cfg.checkpoint.async_,
            trust=trust,
            parts={
                "model": self._model_part(),
                "schedule": parts.SharedPart(
                    {"scheduler": parts.Schedule(self.scheduler, self.optimizer), "scaler": self.scaler}, d.is_main, trust
                ),
                "rng": parts.PerRankPart(parts.RNGState(), d.rank, d.world_size, trust),
                "trainer": record,
                "config": parts.TextPart(self.resolved_yaml(), d.is_main),
            },
        )

    def _model_part(self) -> parts.Part:
        s, d, trust = self.strategy, self.dist, self.cfg.checkpoint.trust
        if s.engine is not None:  # DeepSpeed's engine saves and loads its own ZeRO partitions
            from ..checkpoint.deepspeed import DeepSpeedPart

            return DeepSpeedPart(s.engine, self.optimizer, s.base_optimizer, d.rank, d.world_size, trust)
        split = self.dims.tp > 1 or self.dims.pp > 1
        # ddp without tp/pp holds the full model on rank 0 anyway: it also writes the weights file
        weights = d.is_main and self.cfg.parallel.strategy == "ddp" and not split
        return parts.DCPPart(parts.ModelOptimizer(self.model, self.optimizer), self.device, trust, weights, split)

    def _resume(self) -> None:
        """Load the checkpoint ``_peek_resume`` found and verified; the damaged newer ones it fell
        back past are set aside first (this run's own), each named in one warning line."""
        if self._damaged:
            own = self.cfg.resume == "auto"
            moved = self.ckpt.set_aside([p for p, _ in self._damaged]) if own else [p for p, _ in self._damaged]
            if self.dist.is_main:
                back = self._resume_peek[0].name if self._resume_peek else "none"
                for (path, why), where in zip(self._damaged, moved):
                    aside = f"; set aside as {where.name}" if own else ""
                    log.warning(
                        "%s is damaged (%s)%s; resuming from %s: the steps after it are trained again",
                        path.name,
                        why.split("; use an")[0],
                        aside,
                        back,
                    )
        if self._resume_peek is not None and self._load(self._resume_peek[0], verified=True):
            rollback.apply_pending_rollback(self)
            if self.dist.is_main:
                log.info("resumed from %s at step %d", self.resumed_from, self.step)

    def _load(self, target: str | Path, verified: bool = False) -> bool:
        """Every part of the checkpoint ``target`` names (``resume``'s values or a path); False if
        there is none."""
        found = self.ckpt.load(target, verified)
        if found is None:
            return False
        self.resumed_from, saved = found
        if not saved.weights_only and self.cfg.resume_changes == "allow":
            self._apply_optim_config()
        return True

    def save(self) -> Path:
        """A checkpoint of this step (all ranks take part); with ``checkpoint.async`` it returns
        once the state is copied to host memory, and is committed when its write ends."""
        self._beat("save")
        final = self.ckpt.save(self.step)
        self._beat("save done")
        return final

    def state(self) -> TrainerState:
        """The record of ``trainer.json``: where the run stands, and what it trains."""
        return self._record.record()

    def wait_for_checkpoint(self) -> Path | None:
        """Finish the background save in flight, if any (all ranks)."""
        self._beat("save wait")
        return self.ckpt.wait()

    def resolved_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(self.resolved, sort_keys=False)

    # -- evaluation (evaluation.py) ---------------------------------------------------------
    def evaluate(self) -> dict:
        """Validation loss (and perplexity, MLM accuracy, BLEU with ``eval_bleu``), all ranks."""
        return evaluation.evaluate(self)

    def evaluate_bleu(self, samples: int | None = None):
        """BLEU / chrF of the first ``samples`` validation pairs, decoded with ``cfg.decode``."""
        return evaluation.evaluate_bleu(self, samples)

    def _pipeline(self) -> Pipeline:
        assert self.strategy.pipeline is not None, "parallel.pp > 1 builds a pipeline"
        return self.strategy.pipeline

    def _pad_for_sp(self, inputs: dict) -> dict:
        """A batch as every forward under sequence parallelism takes it (training and both
        evaluations): padded to a multiple of tp. Decoding pads with the same function (generate.py)."""
        multiple = self.dims.tp if self.cfg.parallel.sp else 1
        return pad_sequences(inputs, multiple, self.model_cfg.pad_token_id, self.model_cfg.family)

    # -- the loop --------------------------------------------------------------------------
    def _batches(self):
        """This rank's training batches from the current data position (a resume's, a rollback's)."""
        return train_batches(self.cfg, self.data, self.dist.dp_rank, self.dist.dp_size, self.consumed, self.device)

    def _install_signals(self):
        return install_stop_signals(lambda name: setattr(self, "_signal", name), self.dist.is_main)

    def fit(self) -> dict:
        cfg, main = self.cfg, self.dist.is_main
        if main:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / RUN_CONFIG).write_text(self.resolved_yaml())  # the run's, as in each checkpoint
            copy_tokenizer(self.data, self.out)
            print(start_summary(self), flush=True)  # the whole resolved config is config.yaml
        quiet_repeats()  # torch and DeepSpeed have set up their loggers by now
        previous = self._install_signals()
        if main:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            if self.resumed_from is not None:  # the steps after the checkpoint are logged again, once
                trim_metrics(self.log_dir, self.step)
        tracker = Trackers(cfg, self.log_dir, self.resolved, self.wandb_id, self.step) if main else None
        if tracker is not None:
            self.wandb_id = tracker.run_id
        metrics_file = open(self.log_dir / METRICS, "a") if main else None
        bar = None
        if main and cfg.progress and interactive():
            from tqdm import tqdm

            bar = tqdm(
                total=cfg.max_steps, initial=self.step, unit="step", dynamic_ncols=True, file=sys.stderr, mininterval=1.0
            )
        self._start = time.perf_counter()
        if self._read_reason is not None and main:
            log.info("reading the step's figures from the device at every step: %s", self._read_reason)
        last: dict = {}
        saved_step = self.step if self.resumed_from is not None else -1
        batches = self._batches()
        if cfg.watchdog_timeout is not None:
            self.watchdog = Watchdog(
                self.out / "watchdog", self.dist.rank, self.dist.world_size, cfg.watchdog_timeout
            ).start()
        self.prof = build_profiler(cfg.profile, cfg.max_steps, self.dist, self.out, self.precision, cfg.tensorboard.enabled)
        try:
            last = self._finish_pending(metrics_file, tracker, bar) or last
            while self.step < cfg.max_steps and self._stop_reason is None:
                try:
                    healed = self.ft is not None and self.ft.start_step()
                except QuorumLost:  # nothing lost: the last committed step is saved by its writer group
                    if self.step != saved_step and self.step > 0 and self._may_save():
                        self.save()
                        self.wait_for_checkpoint()
                    raise
                if healed:  # healed from a peer: its data position
                    batches = self._batches()
                    if bar is not None:
                        bar.n = self.step
                self.prof.before_step(self.step + 1)
                record = self._train_step(batches)
                if not record.get("committed", True):  # nothing changed: the same samples again, next try
                    batches = self._batches()
                    continue
                self.prof.after_step(self.step, record["step_time"])
                if self.ft is not None and self.ft.take_healed():  # local_sgd / diloco: healed at a sync
                    batches = self._batches()
                # the losses read at this step, in order (those of the steps since the last read too)
                spike = next((r for r in [*self._replayed, record] if "loss" in r and rollback.handle_spike(self, r)), None)
                if spike is not None:  # rolled back to an earlier checkpoint: new data position
                    if main:  # the interval's rates and memory are the read's (this step's)
                        log_step({**record, **spike}, metrics_file, tracker, bar)
                    if bar is not None:
                        bar.n = self.step
                    batches = self._batches()
                    saved_step = self.step
                    continue
                stopping = self._stop_check()
                due_eval = cfg.eval_every and self.step % cfg.eval_every == 0
                final = self.step >= cfg.max_steps or stopping
                due_log = self.step % cfg.log_every == 0 or final or bool(due_eval)
                # the checkpoint carries the record it is saved before: a kill before the log line
                # is made good at resume (_finish_pending)
                self.pending = {"record": record, "evaluate": bool(due_eval or final)} if due_log else None
                # save before evaluating: an evaluation that fails must not cost the step's checkpoint
                if (cfg.save_every and self.step % cfg.save_every == 0) or final:
                    if self._may_save():
                        self.save()
                    saved_step = self.step
                if due_eval or final:
                    self._beat("eval")
                    record.update(self.evaluate())
                if due_log or "val_loss" in record:
                    record.update(self.times.gather(self.dist, cfg.slow_rank_factor))  # every rank takes part
                    if main:
                        log_step(record, metrics_file, tracker, bar)
                self.pending = None
                if bar is not None:
                    bar.update(1)
                    if "loss" in record:
                        bar.set_postfix(loss=f"{record['loss']:.4f}", refresh=False)
                last = record
                for cb in self.callbacks:
                    cb(self, record)
                self.ckpt.poll()  # commits, in the background, need no collective
                self._beat("train", arm=True)
            if self.step != saved_step and self.step > 0 and self._may_save():
                self.save()
            self.wait_for_checkpoint()  # never leave with a save in flight
        except BaseException as e:
            if isinstance(e, torch.OutOfMemoryError):
                self.prof.on_oom(self.step + 1)
            self._close_checkpoints()
            raise
        finally:
            self.prof.close()
            self.prof = OFF
            if self.ft is not None:
                self.ft.shutdown()
            if self.watchdog is not None:
                self.watchdog.close()
                self.watchdog = None
            if bar is not None:
                bar.close()
            if metrics_file is not None:
                metrics_file.close()
            if tracker is not None:
                tracker.finish()
            restore_signals(previous)
        if main:
            reason = self._stop_reason or "max_steps"
            print(
                f"tformer: stopped at step {self.step} ({reason}); checkpoint {self.ckpt_root / f'step_{self.step:08d}'}",
                flush=True,
            )
        return last

    def _finish_pending(self, metrics_file, tracker, bar) -> dict | None:
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
        if metrics_file is not None:
            log_step(record, metrics_file, tracker, bar)
        if self.dist.is_main:
            log.info("step %d: logged its record after the resume (the run was stopped before it)", self.step)
        return record

    def _close_checkpoints(self) -> None:
        """On the way out of ``fit`` after an error: still commit a save in flight (its state was
        good when it was taken), without waiting for ranks that may be gone."""
        try:
            self.ckpt.close()
        except Exception as e:  # noqa: BLE001 - the error that ended the run matters more
            log.error("rank %d: %s", self.dist.rank, e)

    def _beat(self, phase: str, arm: bool = False) -> None:
        if self.watchdog is not None:
            self.watchdog.beat(self.step, phase)
            if arm and not self.watchdog._armed:
                self.watchdog.arm()

    def _may_save(self) -> bool:
        """No checkpoint while the run is in a non-finite streak: it would be offered to resume
        from although its weights may be what makes the loss non-finite. Under fault tolerance one
        participating group writes the run's checkpoints."""
        if self.ft is not None and not self.ft.writes_checkpoints():
            return False
        if self.skipped == 0:
            return True
        if self.dist.is_main:
            log.warning(
                "step %d: checkpoint not written: the loss is non-finite since step %d; the newest good checkpoint is %s",
                self.step,
                self.streak_start,
                rollback.last_good(self) or "none",
            )
        return False

    def _global_batch(self) -> int:
        return self.cfg.micro_batch_size * self.cfg.grad_accum * self.dist.dp_size

    def _train_step(self, batches) -> dict:
        cfg = self.cfg
        t0 = time.perf_counter()
        lr = self.optimizer.param_groups[0]["lr"]
        keys = self.data.model_inputs
        loss_sum = torch.zeros((), device=self.device)
        tokens = flops = 0
        self.wrapped.train()
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
        self._beat("loss all-reduce")
        over_time = cfg.max_time is not None and time.perf_counter() - self._start >= cfg.max_time
        # the step's figures, summed over the ranks; its stop flags (a signal here, rank 0's clock
        # past max_time) join them, so that every rank decides a stop at the same step
        signal = 1.0 if self._signal else 0.0
        host = [float(tokens), float(flops), signal, float(over_time and self.dist.is_main)]
        stats = torch.cat([loss_sum.reshape(1), _on_device(host, self.device)])
        with self.times.closing_sync():  # what this rank waits here is the others' time, not its own
            all_reduce(stats)
        committed = True
        if self.ft is not None:  # gradients and statistics averaged over the quorum's groups; the commit vote
            stats, committed = self.ft.sync(self.model, stats)
        flags = self._flags.push(stats[3:5])  # the flags of a step `lag` back (lagged.py)
        if flags is not None:
            self._note_stop(*flags)
        if not committed:  # a step torchft did not commit changes nothing (it was counted)
            self.optimizer.zero_grad(set_to_none=True)
            return {"step": self.step, "committed": False}
        self._beat("optimizer step")
        clip = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")
        # a logging step's MoE routing figures (this rank's last micro-batch), read with the rest
        table = moe_table(self.model) if self.model_cfg.moe.enabled and self.logs_at(self.step + 1) else None
        must_stop = False
        if self._read_reason is None:
            # clip, then update where the loss and the norm are finite, all on the device
            with self.prof.range("optimizer"):
                norm = cast(Any, self.strategy).clip_for_step(self.optimizer, self.scaler, clip)
                ok = torch.isfinite(stats[0]) & torch.isfinite(norm)
                cast(Any, self.strategy).finish_step_on_device(self.optimizer, ok)
            row: torch.Tensor | list[float] = torch.cat(
                [stats[:3], norm.detach().reshape(1).to(stats.dtype), ok.reshape(1).to(stats.dtype)]
            )
        else:
            row, must_stop, table = self._step_reading(stats, clip, table)
        self.scheduler.step()  # the schedule follows the step count, a skipped step's too
        self.step += 1
        # samples consumed, or with token-budget batches, batches consumed (the sampler's unit)
        per_batch = 1 if cfg.data.tokens_per_batch is not None else cfg.micro_batch_size
        self.consumed += per_batch * cfg.grad_accum * self.dist.dp_size
        self._unread.append(_Unread(self.step, lr, row, table, must_stop))
        # the figures of every step since the last read, in one read: at a logging, saving or
        # evaluating step, a stop, or at every step where the run must decide on the host
        replayed = self._read_figures() if self._reads_at(self.step) else []
        memory = self.strategy.memory_report(self.optimizer)  # inside the step's time: it is part of the step
        dt = time.perf_counter() - t0
        if self.ft is not None:  # the step began with its quorum, before the first batch
            dt += self.ft.quorum_s
            self.ft.note_committed_time(dt)
        self.times.step_done(dt)
        self._check_watchdog_margin(dt)
        window = self._window
        window[0] += dt
        window[3] += 1
        record = {
            "step": self.step,
            "lr": lr,
            "step_time": dt,
            **memory,
            **(self.ft.record() if self.ft is not None else {}),
        }
        if replayed:
            # this step's loss, norm and count; the rates over the interval since the last
            # logged step (only that interval, which ends in this read, has a true wall time)
            seconds, window_tokens, window_flops, steps_in_window = window
            record.update(replayed.pop())
            record.update(
                tokens_per_s=window_tokens / seconds,
                mfu=window_flops / self.dist.world_size / seconds / self.peak,
                step_time=seconds / steps_in_window,
            )
            if self.logs_at(self.step):
                self._window = [0.0, 0, 0.0, 0]
        self._replayed = replayed  # earlier steps' records, read with this one (fit judges their losses)
        return record

    def _step_reading(self, stats: torch.Tensor, clip: float, table) -> tuple[list[float], bool, Any]:
        """The optimizer step where the host decides (``_read_reason``): the step's figures, the
        norm and a logging step's MoE figures read now, in one read."""
        clip_first = getattr(self.strategy, "clip_for_step", None)  # DeepSpeed's engine steps in one call
        stats = stats[:3]
        if clip_first is not None:
            # clipped on the device first, so that the norm joins the one read below
            with self.prof.range("optimizer"):
                norm = clip_first(self.optimizer, self.scaler, clip)
            stats = torch.cat([stats, norm.detach().reshape(1).to(stats.dtype)])
        fixed = len(stats)
        if table is not None:
            stats = torch.cat([stats, table[1].flatten().to(stats)])
        read = stats.tolist()
        loss_sum_all, tokens_all, flops_all, *norm_read = read[:fixed]
        if table is not None:
            table = (table[0], read[fixed:])
        loss = self._mean_loss(loss_sum_all)
        with self.prof.range("optimizer"):
            if clip_first is not None:
                ok = math.isfinite(loss) and math.isfinite(norm_read[0])
                applied = cast(Any, self.strategy).finish_step(self.optimizer, self.scaler, ok).applied
                result = StepResult(norm_read[0] if math.isfinite(loss) else float("nan"), applied)
            else:
                result = self.strategy.step(self.optimizer, self.scaler, clip, math.isfinite(loss))
        ok = result.applied and math.isfinite(loss) and not result.must_stop
        return [loss_sum_all, tokens_all, flops_all, result.grad_norm, float(ok)], result.must_stop, table

    def _mean_loss(self, loss_sum: float) -> float:
        """The step's loss from its sum over the ranks: the tp ranks of a group agree; of a
        pipeline, only the last stage's ranks hold the loss."""
        return loss_sum / (self.dist.world_size // self.dims.pp)

    def _reads_at(self, step: int) -> bool:
        cfg = self.cfg
        return (
            self._read_reason is not None
            or self.logs_at(step)
            or self.prof.active  # a traced step's time (steps.json) is then the device's too
            or self._stop_reason is not None
            or bool(cfg.save_every and step % cfg.save_every == 0)
            or bool(cfg.eval_every and step % cfg.eval_every == 0)
        )

    def _read_figures(self) -> list[dict]:
        """The records of the steps not read yet, in order, from one read of the device; their
        losses and norms replayed through the non-finite accounting (which may stop the run here,
        naming the step it happened at)."""
        unread, self._unread = self._unread, []
        on_device = [u.row for u in unread if isinstance(u.row, torch.Tensor)]
        values: list[float] = []
        if on_device:
            rows = torch.stack(on_device).flatten()
            tables = [u.table[1].flatten().to(rows) for u in unread if u.table is not None and torch.is_tensor(u.table[1])]
            values = torch.cat([rows, *tables]).tolist()
        width = 5
        at = 0
        tables_at = width * len(on_device)
        group = self.dims.tp * self.dims.pp * self.dims.cp
        records = []
        for u in unread:
            if isinstance(u.row, torch.Tensor):
                row, at = values[at : at + width], at + width
            else:
                row = u.row
            loss_sum_all, tokens_all, flops_all, norm, ok = row
            loss = self._mean_loss(loss_sum_all)
            global_tokens = int(tokens_all) // group  # each counted its group's batch
            self.tokens += global_tokens
            # every rank of a tp / pp / cp group counted its group's batch: the model FLOPs of the
            # step are sum / (tp pp cp), shared by all world_size devices
            self._window[1] += global_tokens
            self._window[2] += flops_all / group
            if ok > 0:
                self.skipped, self.streak_start = 0, None
            else:
                self._nonfinite(u.step, loss, norm, u.must_stop)
            record = {"step": u.step, "loss": loss, "lr": u.lr, "grad_norm": norm, "tokens": self.tokens}
            if u.table is not None:
                keys, figures = u.table
                if isinstance(figures, torch.Tensor):
                    n = figures.numel()
                    figures, tables_at = values[tables_at : tables_at + n], tables_at + n
                cols = len(keys)
                # routing of this rank's last micro-batch: balance / z-loss, max/mean tokens per
                # expert, dropped share (read at a logging step only)
                record.update(moe_figures(keys, [figures[i : i + cols] for i in range(0, len(figures), cols)]))
            records.append(record)
        return records

    def logs_at(self, step: int) -> bool:
        """Whether ``step`` is a logging step: every ``log_every``-th and the last."""
        return step % self.cfg.log_every == 0 or step >= self.cfg.max_steps

    def _check_watchdog_margin(self, step_time: float) -> None:
        timeout = self.cfg.watchdog_timeout
        if (
            timeout is not None
            and self.step > 1
            and step_time > timeout / 2
            and self.dist.is_main
            and not self._watchdog_warned
        ):
            self._watchdog_warned = True
            log.warning(
                "watchdog_timeout=%g s is short: a step took %.1f s here; raise it to at least %d s, or "
                "a slow step will be taken for a hang",
                timeout,
                step_time,
                math.ceil(4 * step_time),
            )

    def _nonfinite(self, step: int, loss: float, grad_norm: float, must_stop: bool = False) -> None:
        """Step ``step``'s update was skipped (a non-finite loss or gradient norm): count the streak,
        or stop the run (``on_nonfinite: stop``, the streak too long, or an engine that could not
        skip). Where the skip is decided on the device this runs when the step's figures are read
        (at the next logging or saving step), so a stop comes up to ``log_every`` steps late; the
        skipped steps changed nothing and no checkpoint is written in a streak."""
        what = f"loss={loss}" if not math.isfinite(loss) else f"grad_norm={grad_norm}"
        self.skipped += 1
        if self.streak_start is None:
            self.streak_start = step
        if must_stop or self.cfg.on_nonfinite == "stop" or self.skipped > self.cfg.max_skipped_steps:
            last = rollback.last_good(self)
            why = (
                "the engine could not skip it"
                if must_stop
                else f"on_nonfinite={self.cfg.on_nonfinite}, {self.skipped} bad step(s) in a row"
            )
            raise NonFiniteLoss(
                f"non-finite {what} at step {step}; stopping ({why}); the last good "
                f"checkpoint is {last or 'none'}; lower optim.lr or check the data"
            )
        if self.dist.is_main:
            log.warning("step %d: non-finite %s; update skipped (%d in a row)", step, what, self.skipped)

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

    def _why_read_every_step(self) -> str | None:
        """Why this run reads its figures from the device at every step; None where a step that
        does not log or save reads nothing (the skip of a non-finite step decided on the device)."""
        strategy = cast(Any, self.strategy)
        if not hasattr(strategy, "clip_for_step"):
            return "DeepSpeed's engine decides a non-finite step's skip in its own step"
        if self.ft is not None:
            return "torchft's commit vote is taken on the host"
        if self.scaler is not None:
            return "fp16's GradScaler reads its overflow flag"
        if not skips_on_device(self.optimizer, self.scaler):
            if self.cfg.optim.fused is False:
                return "optim.fused=false: a non-finite step's skip is decided on the host"
            return (
                "this layout holds plain and DTensor parameters side by side: they take the foreach AdamW, "
                "which cannot skip a non-finite step on the device"
            )
        if self.cfg.max_tokens is not None:
            return "max_tokens stops at the step's global token count"
        return None


@dataclasses.dataclass
class _Unread:
    """A step whose figures are still on the device (``row``: loss sum, tokens, FLOPs, norm, ok),
    or were read at once (a list)."""

    step: int
    lr: float
    row: torch.Tensor | list[float]
    table: Any  # a logging step's MoE figures: (keys, tensor or list)
    must_stop: bool


def _host_count(labels: torch.Tensor) -> int:
    """The labels set in a batch still in host memory (the loader's copy): no device involved."""
    return int(torch.count_nonzero(labels != -100))


def _on_device(values: list[float], device: torch.device) -> torch.Tensor:
    """Host figures on the device without waiting for it: a blocking copy to a CUDA device
    synchronises its stream (the host would wait for the step queued so far); from pinned memory
    the copy is queued like a kernel."""
    host = torch.tensor(values, dtype=torch.float32, pin_memory=device.type == "cuda")
    return host if device.type == "cpu" else host.to(device, non_blocking=True)


def _concat(batches: list[dict]) -> dict:
    """One batch of the step's micro-batches, in order (the pipeline schedule splits it again)."""
    if len(batches) == 1:
        return batches[0]
    out = {}
    for k in batches[0]:
        parts = [b[k] for b in batches]
        width = max(p.shape[1] for p in parts) if parts[0].dim() > 1 else None
        if width is not None and any(p.shape[1] != width for p in parts):
            raise ConfigError(
                f"pipeline parallelism needs micro-batches of one sequence length ({k} has "
                f"lengths {[p.shape[1] for p in parts]}); use fixed-length batches"
            )
        out[k] = torch.cat(parts)
    return out
