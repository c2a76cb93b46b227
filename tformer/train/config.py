"""The run configuration: YAML recipe + dotted ``key=value`` overrides -> typed, validated dataclasses.

Unknown keys are errors with a did-you-mean suggestion; every problem is one line naming the key.
The sections live beside their owners (``data`` in tformer/data/config.py, ``parallel`` in
tformer/parallel/config.py, ``checkpoint`` in tformer/checkpoint/config.py, ``decode`` in
tformer/decode_config.py, ``model`` in tformer/config.py) and are composed here; their names stay
importable from this module. Each numeric key's range is declared once, on its field (``ranged``),
and checked by ``check_ranges``.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, get_args

import yaml

from ..config import (
    ConfigError,
    ModelConfig,
    Precision,
    _check_type,
    check_fields,
    check_keys,
    check_ranges,
    config_key,
    field_hints,
    ranged,
    ranges,
    unwrap_optional,
)

# The run's choices that the lower layers also act on are defined in tformer/config.py (the layer
# they may import); their tuples are re-exported here with the others.
from ..config import AC_MODES as AC_MODES, LENGTH_NORMS as LENGTH_NORMS, ON_EXHAUSTED as ON_EXHAUSTED
from ..config import PRECISIONS as PRECISIONS, STRATEGIES as STRATEGIES
from ..decode_config import DecodeConfig as DecodeConfig, as_number
from ..models import build_config

from .config_data import DOC_MASK_IMPLS as DOC_MASK_IMPLS, SOURCE_KEYS as SOURCE_KEYS, source_name as source_name
from .config_data import check_document_mask, check_mixture, check_synthetic
from .recipe import apply_overrides as apply_overrides, load_yaml as load_yaml
from .recipe import parse_override as parse_override

# The sections owned by lower layers, composed here (and importable from here, as before)
from ..checkpoint.config import CheckpointConfig as CheckpointConfig
from ..data.config import AUTO_OBJECTIVE as AUTO_OBJECTIVE, OBJECTIVES as OBJECTIVES, DataConfig as DataConfig
from ..data.config import Objective as Objective
from ..parallel.config import BACKENDS as BACKENDS, Backend as Backend, CPKernel as CPKernel
from ..parallel.config import ParallelConfig as ParallelConfig
from ..parallel.config import MUON_ADJUSTS as MUON_ADJUSTS, MuonConfig as MuonConfig
from ..parallel.config import FLOAT8_RECIPES as FLOAT8_RECIPES, Float8Config as Float8Config

Schedule = Literal["cosine", "linear", "constant", "wsd", "inverse_sqrt"]
OptimName = Literal["adamw", "muon"]
NonFinite = Literal["skip", "stop"]
Device = Literal["auto", "cpu", "cuda"]
SpikeAction = Literal["none", "warn", "rollback"]
ResumeChanges = Literal["refuse", "allow"]
SemiSync = Literal["none", "local_sgd", "diloco"]
FTBackend = Literal["gloo", "nccl"]

SCHEDULES: tuple[Schedule, ...] = get_args(Schedule)
OPTIMIZERS: tuple[OptimName, ...] = get_args(OptimName)
NONFINITE: tuple[NonFinite, ...] = get_args(NonFinite)
DEVICES: tuple[Device, ...] = get_args(Device)
SPIKE_ACTIONS: tuple[SpikeAction, ...] = get_args(SpikeAction)
RESUME_CHANGES: tuple[ResumeChanges, ...] = get_args(ResumeChanges)
SEMI_SYNC: tuple[SemiSync, ...] = get_args(SemiSync)


@dataclass
class OptimConfig:
    # adamw | muon (the blocks' matrices by Muon, optim.muon.*; everything else by AdamW, these keys)
    name: OptimName = "adamw"
    lr: float = ranged(3e-4, "(0, inf)")  # peak learning rate (AdamW)
    min_lr_ratio: float = ranged(0.1, "[0, 1]")  # final lr = lr * min_lr_ratio (cosine / linear / wsd)
    weight_decay: float = ranged(0.1, "[0, inf)")  # matrices only; biases, norms and 1-D params get none
    beta1: float = ranged(0.9, "[0, 1)")  # AdamW beta1
    beta2: float = ranged(0.95, "[0, 1)")  # AdamW beta2
    eps: float = ranged(1e-8, "(0, inf)")  # AdamW epsilon
    grad_clip: float = ranged(1.0, "[0, inf)")  # max gradient norm; 0 = off
    schedule: Schedule = "cosine"  # inverse_sqrt: lr * min(t / warmup, sqrt(warmup / t)) (the paper's)
    warmup_steps: int = ranged(0, "[0, inf)")  # steps of linear warmup to lr
    decay_steps: int | None = ranged(None, "[1, inf)")  # wsd: length of the final decay (default 20% of max_steps)
    fused: bool | None = None  # None = fused AdamW where torch supports it
    # the paper's epsilon_ls = 0.1; the logged train loss is the smoothed objective, val_loss /
    # val_ppl the plain NLL
    label_smoothing: float = ranged(0.0, "[0, 1)", note="the paper uses 0.1")
    muon: MuonConfig = field(default_factory=MuonConfig)  # name=muon only


@dataclass
class LossConfig:
    # tokens per chunk of the output head + cross-entropy in training (null: the whole
    # (tokens x vocabulary) logits at once; auto: sized for the device, models/loss.py
    # auto_chunk_size); the loss and gradients are the same either way
    chunk_size: int | str | None = ranged("auto", "[1, inf)", note="or auto, or null for the unchunked loss")

    def check(self) -> None:
        if isinstance(self.chunk_size, str) and self.chunk_size != "auto":
            raise ConfigError(
                f"loss.chunk_size={self.chunk_size!r} is not allowed; use a positive integer, auto (sized for "
                "the device) or null (the unchunked loss)"
            )


@dataclass
class WandbConfig:
    enabled: bool = False  # log the run to Weights & Biases (rank 0)
    project: str = "tformer"  # W&B project
    entity: str | None = None  # W&B team or user (default: yours)
    name: str | None = None  # W&B run name (default: W&B picks one)
    mode: str | None = None  # online | offline | disabled; None = WANDB_MODE or online
    tags: list = field(default_factory=list)  # W&B tags


@dataclass
class ProfileConfig:
    # steps traced by torch.profiler (tformer/train/observe/profiling.py): "20-22", 7, or a list [3, 9];
    # null = off (no profiler is created). Each step's trace: OUTPUT/profile/rank{R}/step{N}.trace.json.gz
    steps: str | int | list | None = None
    every: int | None = ranged(None, "[1, inf)", note="null = once")  # repeat the steps every this many steps
    ranks: list = field(default_factory=lambda: [0])  # the ranks that trace
    # CUDA: the allocator history from step 1, a snapshot per traced step and at an OOM (alone: only
    # at an OOM); CPU: the profiler's memory events of the traced steps
    memory: bool = False
    with_stack: bool = False  # Python stacks in the traces (larger files, slower steps)

    def check(self, max_steps: int) -> None:
        """Malformed steps, or steps outside the run: one line naming the key and the fix."""
        self.traced(max_steps)
        bad = [r for r in self.ranks if isinstance(r, bool) or not isinstance(r, int) or r < 0]
        if bad:
            raise ConfigError(f"profile.ranks={self.ranks!r}: ranks are integers >= 0, e.g. profile.ranks=[0,1]")

    def traced(self, max_steps: int) -> list[int]:
        """The steps to trace (1 = the first optimizer step), sorted; [] when off."""
        if self.steps is None:
            return []
        first = self._window()
        every = self.every or max_steps + 1
        out = sorted({s + k * every for s in first for k in range(max_steps // every + 1) if s + k * every <= max_steps})
        if first[0] < 1 or first[-1] > max_steps:
            raise ConfigError(
                f"profile.steps={self.steps!r} lies outside the run (steps 1 to max_steps={max_steps}); "
                f"pick steps in that range, e.g. profile.steps={min(3, max_steps)}-{min(4, max_steps)}"
            )
        return out

    def _window(self) -> list[int]:
        s, hint = self.steps, "use a range such as profile.steps=3-4, one step (5) or a list ([3, 9])"
        if isinstance(s, list) and s and all(isinstance(v, int) and not isinstance(v, bool) for v in s):
            return sorted(set(s))
        if isinstance(s, int) and not isinstance(s, bool):
            return [s]
        m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", s) if isinstance(s, str) else None
        if m is None or (m.group(2) is not None and int(m.group(2)) < int(m.group(1))):
            raise ConfigError(f"profile.steps={s!r} is malformed; {hint}")
        first = int(m.group(1))
        return list(range(first, int(m.group(2) or first) + 1))


@dataclass
class TensorboardConfig:
    enabled: bool = False  # TensorBoard event files under OUTPUT/tensorboard (rank 0), beside or instead of W&B


@dataclass
class FaultToleranceConfig:
    """torchft replica groups (tformer/train/resilience/ft.py, docs/fault-tolerance.md): each group is one
    torchrun job; the groups meet in a quorum every step at the lighthouse, and a step is committed
    only when the quorum says so. Read only when enabled."""

    enabled: bool = False  # the data-parallel replica dimension across torchft replica groups
    replica_id: int = ranged(0, "[0, inf)")  # this group's index, 0 .. replicas-1 (the launcher sets it)
    replicas: int = ranged(2, "[1, inf)")  # replica groups configured (the data is split over all of them)
    min_replicas: int = ranged(1, "[1, inf)")  # groups a step needs to commit (the lighthouse's --min_replicas)
    # the lighthouse's address (http://HOST:PORT); null: the TORCHFT_LIGHTHOUSE environment variable
    lighthouse: str | None = None
    # seconds for a cross-group collective, a commit vote, a recovery transfer, and to reach the
    # lighthouse at start
    timeout_s: float = ranged(60.0, "(0, inf)")
    # seconds a group waits at the lighthouse for a quorum (a restarted peer joining, min_replicas)
    quorum_timeout_s: float = ranged(120.0, "(0, inf)")
    # none: gradients averaged every step | local_sgd | diloco (synchronise every sync_every steps)
    semi_sync: SemiSync = "none"
    sync_every: int = ranged(20, "[1, inf)")  # local_sgd / diloco: inner steps between synchronisations
    fragments: int = ranged(1, "[1, inf)")  # diloco: model fragments synchronised in turn (streaming DiLoCo)
    outer_lr: float = ranged(0.7, "(0, inf)")  # diloco: the outer Nesterov SGD's learning rate
    outer_momentum: float = ranged(0.9, "[0, 1)")  # diloco: the outer SGD's momentum
    # the process group between the groups: gloo (CPU, or GPUs whose NCCL cannot be re-initialised
    # cheaply after a failure) or nccl
    backend: FTBackend = "gloo"

    def check(self) -> None:
        """The section's rules between its own keys (the rest need the device and layout: checks.py)."""
        if not self.enabled:
            return
        if self.replica_id >= self.replicas:
            raise ConfigError(
                f"fault_tolerance.replica_id={self.replica_id} is outside fault_tolerance.replicas={self.replicas}; "
                f"use a replica id in 0..{self.replicas - 1}"
            )
        if self.min_replicas > self.replicas:
            raise ConfigError(
                f"fault_tolerance.min_replicas={self.min_replicas} exceeds fault_tolerance.replicas={self.replicas}; "
                "no step could ever commit: lower min_replicas"
            )
        if self.fragments != 1 and self.semi_sync != "diloco":  # here too: tformer plan prices the same section
            raise ConfigError(
                f"fault_tolerance.fragments={self.fragments} streams DiLoCo's synchronisation; it needs "
                f"fault_tolerance.semi_sync=diloco (not {self.semi_sync}), or set fragments=1"
            )
        if self.sync_every % self.fragments:
            raise ConfigError(
                f"fault_tolerance.sync_every={self.sync_every} is not a multiple of fault_tolerance.fragments="
                f"{self.fragments} (each fragment is synchronised every sync_every / fragments steps); "
                "make sync_every a multiple of fragments"
            )


@dataclass
class TrainConfig:
    # Written as a preset plus field overrides (``model: {preset: gpt2-tiny, d_model: 64}``,
    # ``model.d_model=64``), resolved into the ModelConfig when the config is read. ``to_dict``
    # writes every field and no preset name, as the run's resolved config.yaml always has.
    model: ModelConfig = field(default_factory=lambda: build_config("gpt2-tiny"))
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    float8: Float8Config = field(default_factory=Float8Config)  # precision=fp8 only
    loss: LossConfig = field(default_factory=LossConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    tensorboard: TensorboardConfig = field(default_factory=TensorboardConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    output_dir: str = "runs/default"  # the run directory: config.yaml, metrics.jsonl, tokenizer, checkpoints/
    seed: int = ranged(0, "[0, inf)")  # seeds initialisation, data order, dropout
    micro_batch_size: int = ranged(8, "[1, inf)")  # samples per rank and forward pass
    grad_accum: int = ranged(1, "[1, inf)")  # micro-batches accumulated per optimizer step
    max_steps: int = ranged(1000, "[1, inf)")  # optimizer steps to train
    max_tokens: int | None = ranged(None, "[1, inf)")  # stop after this many tokens (all ranks together)
    max_time: float | None = ranged(None, "(0, inf)")  # stop (and save) after this many seconds
    # auto: bf16 where the device computes it natively, else fp32; fp8: the blocks' linear layers in
    # float8 (torchao, see float8.*), bf16 autocast elsewhere
    precision: Precision = "auto"
    log_every: int = ranged(10, "[1, inf)")  # steps between logged metrics
    # at each logged step the slowest rank is named when its step time is above this x the median
    slow_rank_factor: float = ranged(1.2, "(1, inf)")
    eval_every: int = ranged(100, "[0, inf)", note="0 = only at the end")  # steps between evaluations; 0 = only at the end
    eval_batches: int = ranged(8, "[1, inf)")  # validation batches per evaluation
    eval_bleu: bool = False  # seq2seq: also decode validation pairs and log BLEU / chrF
    bleu_samples: int | None = ranged(200, "[1, inf)", note="or null for all pairs")  # pairs decoded for eval_bleu
    save_every: int = ranged(200, "[0, inf)", note="0 = only at the end")  # steps between checkpoints; 0 = only at the end
    keep_checkpoints: int = ranged(3, "[1, inf)")  # newest complete checkpoints kept
    resume: str = "auto"  # auto (newest complete checkpoint, if any) | none | a path
    # a resumed run whose config changes what it trains (RESUME_FREE below says what may change):
    # refuse (one line naming each key), or allow (one warning line per key)
    resume_changes: ResumeChanges = "refuse"
    on_nonfinite: NonFinite = "skip"  # skip the step, or stop the run
    max_skipped_steps: int = ranged(10, "[0, inf)")  # stop after this many consecutive non-finite steps
    # no step progress for this many seconds: every rank dumps its stacks to OUTPUT/watchdog/, the
    # stuck ranks are named, and the job exits non-zero (torchrun restarts / SLURM requeues take
    # over); collectives time out 60 s later. null = off
    watchdog_timeout: float | None = ranged(None, "(0, inf)")
    on_spike: SpikeAction = "none"  # none | warn | rollback (to the newest checkpoint before the spike)
    spike_factor: float = ranged(3.0, "(1, inf)")  # a loss above spike_factor x the running median is a spike
    spike_window: int = ranged(50, "[3, inf)")  # steps in the running median
    spike_warmup: int = ranged(100, "[0, inf)")  # no spike detection before this step
    spike_skip_batches: int = ranged(100, "[0, inf)")  # rollback: steps of data skipped after the checkpoint
    max_rollbacks: int = ranged(3, "[1, inf)")  # rollback: at most this many per run, then stop
    # torch.compile: true = every block, and the head with its loss; model = the whole model as one
    # graph (one device or DDP); false = eager (parallel/compile.py)
    compile: bool | str = False
    progress: bool = True  # a progress bar on the console
    device: Device = "auto"  # auto | cpu | cuda

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        check_fields(self)  # types, and every choice (a Literal field) in every section
        check_ranges(self)
        for f in fields(self):  # the sections; the model validated itself when it was built
            section = getattr(self, f.name)
            if dataclasses.is_dataclass(section) and not isinstance(section, ModelConfig):
                check_ranges(section, f"{config_key(f)}.")
        check_ranges(self.optim.muon, "optim.muon.")
        self.parallel.check()
        self._check_muon()
        self.loss.check()
        self.profile.check(self.max_steps)
        self.fault_tolerance.check()
        self._check_compile()
        self._check_batching()
        check_mixture(self)
        check_synthetic(self)
        check_document_mask(self, self.model)

    def _check_compile(self) -> None:
        if self.compile not in (True, False, "model"):
            raise ConfigError(
                f"compile={self.compile!r} is not allowed; use true (every block and the head), model (the "
                "whole model as one graph) or false"
            )
        p = self.parallel
        split = [f"parallel.{k}={getattr(p, k)}" for k in ("tp", "pp", "cp") if getattr(p, k) > 1]
        if self.compile == "model" and (p.strategy != "ddp" or split):
            layout = ", ".join([f"parallel.strategy={p.strategy}"] * (p.strategy != "ddp") + split)
            raise ConfigError(
                f"compile=model does not compose with {layout} (whole-model compile graph-breaks in the "
                "sharding and splitting hooks); use compile=true (per block) there"
            )

    def _check_muon(self) -> None:
        if self.optim.name == "muon" and self.parallel.strategy == "deepspeed":
            raise ConfigError(
                "optim.name=muon does not run under parallel.strategy=deepspeed (its engine steps a flat "
                "partition, not whole matrices); use parallel.strategy=fsdp, or optim.name=adamw"
            )
        if self.optim.muon.qk_clip is not None and self.optim.name != "muon":
            raise ConfigError(
                f"optim.muon.qk_clip={self.optim.muon.qk_clip} is Muon's (Kimi K2's QK-clip); set "
                "optim.name=muon, or optim.muon.qk_clip=null"
            )

    def _check_batching(self) -> None:
        """Rules between keys of different sections (each key's own range is on its field)."""
        if self.data.tokens_per_batch is not None and self.data.objective != "seq2seq":
            raise ConfigError(
                f"data.tokens_per_batch={self.data.tokens_per_batch} batches translation pairs "
                f"(data.objective=seq2seq), not data.objective={self.data.objective!r}; use micro_batch_size"
            )
        longest = max(self.data.seq_len, self.data.target_len or self.data.seq_len)
        if self.data.tokens_per_batch is not None and self.data.tokens_per_batch < longest:
            raise ConfigError(
                f"data.tokens_per_batch={self.data.tokens_per_batch} is smaller than the longest "
                f"allowed pair ({longest} tokens: data.seq_len / data.target_len); raise it or lower those"
            )
        if self.eval_bleu and self.data.objective != "seq2seq":
            raise ConfigError(
                f"eval_bleu=true needs translation pairs (data.objective=seq2seq), not "
                f"data.objective={self.data.objective!r}; set eval_bleu=false"
            )
        if self.optim.schedule == "inverse_sqrt" and self.optim.warmup_steps < 1:
            raise ConfigError(
                "optim.schedule=inverse_sqrt needs optim.warmup_steps >= 1 (its peak is at the end "
                "of warmup; the paper uses 4000)"
            )

    def model_config(self) -> ModelConfig:
        """The model section (``cfg.model``), kept for callers written when it was a dict."""
        return self.model

    @property
    def global_batch_per_rank(self) -> int:
        return self.micro_batch_size * self.grad_accum

    def to_dict(self) -> dict[str, Any]:
        return _to_dict(self)


def _to_dict(obj: Any) -> Any:
    """``dataclasses.asdict`` with each field under its config key (``checkpoint.async``)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {config_key(f): _to_dict(getattr(obj, f.name)) for f in fields(obj)}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_dict(v) for v in obj)
    if isinstance(obj, dict):
        return {k: _to_dict(v) for k, v in obj.items()}
    return obj


# The allowed range of every numeric key, derived from the fields' declarations (the model's keys
# are tformer.config.MODEL_RANGES); docs/reference/config.md lists the same.
RANGES = {k: v for k, v in ranges(TrainConfig).items() if not k.startswith("model.")}


# What a resumed run may change (tformer/train/resilience/resume.py; docs/reliability.md, "Resuming"), as dotted keys or
# whole sections. Free: how the run is laid out and executed, and its bookkeeping -- the parallel
# layout, micro_batch_size and grad_accum (as long as the global batch, micro_batch_size x
# grad_accum x data-parallel ranks, stays the same), device, precision, compilation, attention
# kernel, loss chunking, logging, evaluation, checkpoints, W&B, stops by time, resilience. Extend:
# the run's length (max_steps, max_tokens); the LR schedule keeps the horizon it was planned with.
# Every other key (model, data, optim, seed, ...) and the global batch change what the run trains:
# refused at resume unless resume_changes=allow.
RESUME_FREE = (
    "parallel",
    "micro_batch_size",
    "grad_accum",
    "device",
    "precision",
    "float8",
    "compile",
    "model.attn_impl",
    "model.pad_vocab_multiple",  # padding rows are never looked up nor predicted (checkpoint/io.py regrows)
    "loss",
    "output_dir",
    "resume",
    "resume_changes",
    "progress",
    "log_every",
    "eval_every",
    "eval_batches",
    "eval_bleu",
    "bleu_samples",
    "decode",
    "save_every",
    "keep_checkpoints",
    "checkpoint",
    "fault_tolerance",  # on or off at resume: a run may switch it (the trainer says so in one line)
    "wandb",
    "tensorboard",
    "profile",
    "slow_rank_factor",
    "max_time",
    "watchdog_timeout",
    "on_nonfinite",
    "max_skipped_steps",
    "on_spike",
    "spike_factor",
    "spike_window",
    "spike_warmup",
    "spike_skip_batches",
    "max_rollbacks",
    "data.num_workers",
    "data.num_proc",
    "data.cache_dir",
    "data.prepared",
)
RESUME_EXTEND = ("max_steps", "max_tokens")


def _build(cls, data: Any, section: str):
    """Build dataclass ``cls`` from a mapping, recursing into nested dataclass sections."""
    if not isinstance(data, dict):
        raise ConfigError(f"section {section or 'top level'} must be a mapping, got {type(data).__name__}")
    check_keys(data, cls, section)
    hints = field_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in fields(cls):
        key = config_key(f)
        if key not in data:
            continue
        value, hint = data[key], hints[f.name]
        name = f"{section}.{key}" if section else key
        if hint is ModelConfig:  # a preset plus overrides, not the fields one by one
            if not isinstance(value, dict):
                raise ConfigError(f"{name} must be a mapping (e.g. preset: gpt2-tiny), got {value!r}")
            kwargs[f.name] = build_config(value)
        elif dataclasses.is_dataclass(hint):
            kwargs[f.name] = _build(hint, value or {}, name)
        elif hint is list:
            if not isinstance(value, list):
                raise ConfigError(f"{name} must be a list, got {value!r}")
            kwargs[f.name] = value
        else:
            if unwrap_optional(hint)[0] is float and not isinstance(value, bool):
                value = as_number(value)
            _check_type(name, value, hint)  # a choice's value is checked with the others, in validate
            kwargs[f.name] = value
    return cls(**kwargs)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None, base: dict | None = None) -> TrainConfig:
    data = load_yaml(path) if path is not None else dict(base or {})
    data = apply_overrides(data, overrides or [])
    cfg = _build(TrainConfig, data, "")
    return cfg


def config_from_dict(data: dict) -> TrainConfig:
    return _build(TrainConfig, data, "")


def dump_yaml(cfg: TrainConfig) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
