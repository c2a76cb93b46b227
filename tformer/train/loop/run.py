"""A run: what it is made of and where it stands, built from its config in order and resumed
from its checkpoint. ``train/trainer.py``'s ``Trainer`` is a run that trains.

Made of: the process group and mesh, this rank's data, the model with its strategy (DDP, FSDP2,
tp, pp, DeepSpeed), optimizer and LR schedule, and the checkpoints (``loop/checkpointing.py``).
Where it stands: the step, the samples and tokens consumed, the non-finite streak, the spike
detector and rollbacks; the checkpoint's ``trainer.json`` records them (``loop/state.py``).
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

import torch

from ...checkpoint import parts
from ...checkpoint.manager import CheckpointManager
from ...checkpoint.state import TrainerState
from ...config import ConfigError
from ...models import build_model
from ...models.kernels import attention_line
from ...models.padding import pad_sequences
from ...parallel.balance import LoadBalancer
from ...parallel.build import build_strategy
from ...parallel.offload import activation_offload
from ...parallel.strategy import Pipeline, Strategy
from ..config import TrainConfig
from ..dist import barrier, device_type
from ..observe.profiling import check_ranks
from ..resilience import resume as resuming
from ..resilience import rollback
from ..resilience.ft import FaultTolerance, check_fault_tolerance
from ..resilience.spike import SpikeDetector
from . import evaluation
from .checkpointing import model_part, run_checkpoints
from .checks import check_support
from .components import Components
from .data import check_sources, train_batches
from .figures import Streak
from .head import loss_chunk_size
from ...parallel.muon import check_same_optimizer
from .optim import apply_optim_config, build_optimizer, build_scheduler
from .sdpa import math_fallback_line
from .setup import run_data, start_processes
from .state import DataPosition, Progress

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


class Run:
    """A run built from its config and resumed: its parts (``dist``, ``data``, ``model``,
    ``strategy``, ``optimizer``, ``scheduler``, ``ckpt``) and where it stands (``step``,
    ``consumed``, ``tokens``, ``streak``, ``spikes``, ``rollbacks``). ``Trainer`` trains it."""

    def __init__(self, cfg: TrainConfig):
        """Set up a run from its config, in this order: refuse what cannot run before any work, find
        the checkpoint to resume (a complete run ends there), start the process group and mesh, build
        the data, then the model, its strategy and optimizer, and last load the checkpoint."""
        self.cfg = cfg
        self._check_inputs()
        self._peek_resume()  # a complete run ends here, before any work
        self._start_processes()
        self._build_data()
        self._say_attention_kernel()
        self._check_resume_changes()  # before the model is built
        self._build_model_and_optimizer()
        self._init_counters()
        self.resolved = {**cfg.to_dict(), "model": self.model_cfg.to_dict()}
        self.ckpt = self._checkpointer()
        self._resume()  # it restores the RNG streams, which nothing may draw from afterwards

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
        """The process group and the run's one mesh (loop/setup.py); the run directory."""
        self.dist = start_processes(self.cfg, self.dims)
        self.device = self.dist.device
        self._warn_slow_precision()
        self.out = Path(self.cfg.output_dir)
        self.ckpt_root = self.out / "checkpoints"
        # each replica group logs on its own (metrics.jsonl, W&B); the checkpoints are the run's
        ft = self.cfg.fault_tolerance
        self.log_dir = self.out / "replicas" / str(ft.replica_id) if ft.enabled else self.out
        if self.dist.is_main:
            self.ckpt_root.mkdir(parents=True, exist_ok=True)
        barrier()

    def _build_data(self) -> None:
        """This rank's data, and the model config it implies (vocabulary padded for tp)."""
        self.data, self.model_cfg = run_data(self.cfg, self.dist, self.dims, self._global_batch())

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
        self.balancer = LoadBalancer.of(self.model, self.model_cfg.moe, self.dist)  # None: nothing to balance

    def _init_counters(self) -> None:
        """Where the run stands before any step (a resume then sets them from its checkpoint)."""
        self.step = 0
        self.consumed = 0  # global samples consumed by all ranks
        self.tokens = 0  # global tokens consumed
        # the non-finite accounting: the steps skipped in a row, and since which step
        self.streak = Streak(self.cfg, self.dist.is_main, lambda: rollback.last_good(self.ckpt, self.streak))
        self.spikes = SpikeDetector(self.cfg.spike_factor, self.cfg.spike_window, self.cfg.spike_warmup)
        self.rollbacks = 0  # loss-spike rollbacks done (on_spike=rollback)
        self.components = Components()  # the trainer's fit() sets the run's features (components.py)
        self.ft: FaultTolerance | None = None  # torchft's Manager (fault_tolerance.enabled), set up last
        self.wandb_id: str | None = None
        self.resumed_from: Path | None = None
        self.pending: dict | None = None  # this step's record until it is logged (saved with a checkpoint)

    def _warn_slow_precision(self) -> None:
        if self.dist.is_main and self.precision != "fp32" and self.device.type == "cpu" and not cpu_has_native_bf16():
            log.warning(
                f"precision={self.precision} on a CPU without AVX512-BF16/AMX: torch emulates bf16 matmuls here, "
                "30-100x slower than fp32; precision=auto picks fp32 on this CPU"
            )

    def _say_attention_kernel(self) -> None:
        """One line naming the attention kernel of each kind of layer (``models/kernels.py``); and
        fp32 on CUDA, one more when SDPA will run this model's attention on its math kernel."""
        if not self.dist.is_main:
            return
        said = attention_line(self.model_cfg, self.device.type, documents=self.cfg.data.document_mask)
        if self.cfg.parallel.cp > 1:  # training steps take context parallelism's attention instead
            said += f"; in training steps parallel.cp={self.cfg.parallel.cp}'s {self.cfg.parallel.cp_kernel} kernel"
        log.info("%s", said)
        line = math_fallback_line(self.model_cfg, self.precision, self.device)
        if line:
            log.warning(line)

    def _offload(self):
        return activation_offload(self.device, self.cfg.parallel.activation_offload)

    def _autocast(self):
        if self.precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=DTYPES[self.precision])

    @property
    def skipped(self) -> int:
        """Consecutive non-finite steps (loop/figures.py's ``Streak``)."""
        return self.streak.skipped

    @property
    def streak_start(self) -> int | None:
        """The first step of the current non-finite streak."""
        return self.streak.start

    # -- checkpoints -----------------------------------------------------------------------
    def _peek_resume(self) -> None:
        """The checkpoint to resume from, read cheaply (a complete run ends here); the schedule's
        horizon (resilience/resume.py's ``peek``)."""
        self._resume_peek, self._damaged, self._unlogged, self.schedule_steps = resuming.peek(self.cfg)

    def _check_resume_changes(self) -> None:
        """Refuse (or, with ``resume_changes=allow``, warn about) what the resumed run changes."""
        if self._resume_peek is None:
            return
        path, state, saved = self._resume_peek
        if not state.weights_only:  # Muon's momentum is not Adam's moments: no switch at a resume
            check_same_optimizer(saved.get("optim", {}).get("name", "adamw"), self.cfg.optim.name, path)
        model, batch = self.model_cfg.to_dict(), self._global_batch_size()
        notes = resuming.change_notes(self._resume_peek, self.cfg, model, batch, self.schedule_steps)
        if self.dist.is_main:
            for note in notes:
                log.warning("%s", note)

    def _global_batch_size(self) -> tuple[int, int]:
        """(sequences, input tokens) per optimizer step; token-budget batches: (batches, budget)."""
        per = self.cfg.data.tokens_per_batch or self.data.seq_len
        return self._global_batch(), self._global_batch() * per

    def _checkpointer(self) -> CheckpointManager:
        """Everything a resume restores, as the checkpoint's parts (loop/checkpointing.py); the run's
        own state (``trainer.json``) is the data position and the progress, read from this trainer."""
        d = self.dist
        self._record = parts.TrainerStatePart([DataPosition(self), Progress(self)], d.is_main)
        model = model_part(self.cfg, d, self.dims, self.device, self.strategy, self.model, self.optimizer)
        return run_checkpoints(
            self.ckpt_root,
            self.cfg,
            d,
            model,
            self.optimizer,
            self.scheduler,
            self.scaler,
            self._record,
            self.resolved_yaml(),
        )

    def _resume(self) -> None:
        """Load the checkpoint ``_peek_resume`` found and verified; the damaged newer ones it fell
        back past are set aside first (this run's own), each named in one warning line."""
        if self._damaged:
            own = self.cfg.resume == "auto"
            moved = self.ckpt.set_aside([p for p, _ in self._damaged]) if own else [p for p, _ in self._damaged]
            if self.dist.is_main:
                resuming.say_damaged(self._damaged, moved, own, self._resume_peek[0].name if self._resume_peek else "none")
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
            apply_optim_config(self.optimizer, self.scheduler, self.cfg.optim)
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

    # -- the data and the beats ------------------------------------------------------------
    def _batches(self):
        """This rank's training batches from the current data position (a resume's, a rollback's)."""
        return train_batches(self.cfg, self.data, self.dist.dp_rank, self.dist.dp_size, self.consumed, self.device)

    def _beat(self, phase: str) -> None:
        """The run enters ``phase`` (the watchdog's beat, where it is on)."""
        self.components.phase(self.step, phase)

    def _global_batch(self) -> int:
        return self.cfg.micro_batch_size * self.cfg.grad_accum * self.dist.dp_size

    def _close_checkpoints(self) -> None:
        """On the way out of ``fit`` after an error: still commit a save in flight (its state was
        good when it was taken), without waiting for ranks that may be gone."""
        try:
            self.ckpt.close()
        except Exception as e:  # noqa: BLE001 - the error that ended the run matters more
            log.error("rank %d: %s", self.dist.rank, e)
