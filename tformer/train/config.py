"""The run configuration: YAML recipe + dotted ``key=value`` overrides -> typed, validated dataclasses.

Unknown keys are errors with a did-you-mean suggestion; every problem is one line naming the key.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, get_args

import yaml

from ..config import (
    ACMode,
    AttnImpl,
    ConfigError,
    Family,
    LengthNorm,
    ModelConfig,
    OnExhausted,
    Precision,
    StrategyName,
    _check_type,
    check_fields,
    check_keys,
    check_ranges,
    check_table,
    config_key,
    field_hints,
    unwrap_optional,
)

# The run's choices that the lower layers also act on are defined in tformer/config.py (the layer
# they may import); their tuples are re-exported here with the others.
from ..config import AC_MODES as AC_MODES, LENGTH_NORMS as LENGTH_NORMS, ON_EXHAUSTED as ON_EXHAUSTED
from ..config import PRECISIONS as PRECISIONS, STRATEGIES as STRATEGIES
from ..models import build_config

Schedule = Literal["cosine", "linear", "constant", "wsd", "inverse_sqrt"]
NonFinite = Literal["skip", "stop"]
Device = Literal["auto", "cpu", "cuda"]
Objective = Literal["auto", "causal", "mlm", "span", "seq2seq"]
SpikeAction = Literal["none", "warn", "rollback"]
Backend = Literal["gloo", "nccl", "mpi", "ucc"]
ResumeChanges = Literal["refuse", "allow"]
CPKernel = Literal["tformer", "torch"]

SCHEDULES: tuple[Schedule, ...] = get_args(Schedule)
NONFINITE: tuple[NonFinite, ...] = get_args(NonFinite)
DEVICES: tuple[Device, ...] = get_args(Device)
OBJECTIVES: tuple[Objective, ...] = get_args(Objective)
SPIKE_ACTIONS: tuple[SpikeAction, ...] = get_args(SpikeAction)
BACKENDS: tuple[Backend, ...] = get_args(Backend)
RESUME_CHANGES: tuple[ResumeChanges, ...] = get_args(ResumeChanges)
DOC_MASK_IMPLS: tuple[AttnImpl, ...] = ("sdpa", "math")  # attention implementations that take a document mask
# data.objective=auto: the objective of each family
AUTO_OBJECTIVE: dict[Family, Objective] = {"decoder": "causal", "encoder": "mlm", "encdec": "span"}
check_table(AUTO_OBJECTIVE, Family, "AUTO_OBJECTIVE")


@dataclass
class DataConfig:
    source: str = "default"  # "default" (bundled corpus), a file/dir/glob, or a dataset name
    text_column: str = "text"
    source_column: str = "src"  # seq2seq pairs
    target_column: str = "tgt"
    objective: Objective = "auto"  # auto: decoder->causal, encoder->mlm, encdec->span
    tokenizer: str = "auto"  # path to tokenizer.json, or "auto": train one on the source, cached
    tokenizer_vocab_size: int | None = None  # for "auto"; default = model.vocab_size
    seq_len: int = 128
    target_len: int | None = None  # seq2seq decoder length (span corruption computes its own)
    tokens_per_batch: int | None = None  # seq2seq: batches of similar-length pairs up to this many
    # source (and target) tokens, padding included; replaces
    # micro_batch_size for training
    mlm_probability: float = 0.15
    whole_word_mask: bool = False
    noise_density: float = 0.15
    mean_span_length: float = 3.0
    val_fraction: float = 0.01  # ignored for the bundled corpus (its split is fixed)
    tokenizer_max_rows: int | None = None  # "auto" trains on the first N rows (Unigram is slow)
    num_proc: int | None = None
    cache_dir: str | None = None  # default: $TFORMER_CACHE or ~/.cache/tformer
    num_workers: int = 0
    # A weighted mixture instead of one source: [{source: PATH|NAME|default, weight: W, name: web,
    # text_column: text (optional)}, ...]; see tformer/data/mixture.py
    sources: list = field(default_factory=list)
    # The mixture changing at given steps: [{until_step: N, sources: [...]}, ...]; the last stage
    # must reach max_steps. Sources are matched across stages by name.
    stages: list = field(default_factory=list)
    on_exhausted: OnExhausted = "repeat"  # a mixture source read to its end: repeat (re-epoch, logged) | stop
    document_mask: bool = False  # packed documents (pairs) attend only within themselves
    pack_len: int | None = None  # seq2seq + document_mask: source / target tokens per packed row
    # (default: data.seq_len / data.target_len, the longest pair)
    prepared: bool = False  # require the token cache of `tformer data prepare`; never tokenize here


@dataclass
class OptimConfig:
    lr: float = 3e-4
    min_lr_ratio: float = 0.1  # final lr = lr * min_lr_ratio (cosine / linear / wsd)
    weight_decay: float = 0.1  # matrices only; biases, norms and 1-D params get none
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # 0 = off
    schedule: Schedule = "cosine"  # inverse_sqrt: lr * min(t / warmup, sqrt(warmup / t)) (the paper's)
    warmup_steps: int = 0
    decay_steps: int | None = None  # wsd: length of the final decay (default 20% of max_steps)
    fused: bool | None = None  # None = fused AdamW where torch supports it
    label_smoothing: float = 0.0  # the paper's epsilon_ls = 0.1; the logged train loss is the
    # smoothed objective, val_loss / val_ppl the plain NLL


@dataclass
class DecodeConfig:
    """How the run translates when BLEU is measured (``eval_bleu``, ``tformer evaluate --bleu``)."""

    num_beams: int = 4  # the paper: 4
    length_penalty: float = 0.6  # the paper: alpha 0.6
    length_norm: LengthNorm = "gnmt"  # gnmt: ((5 + len) / 6) ** alpha; power: len ** alpha (HF's)
    max_new_tokens: int | None = None  # default: the run's target length
    batch_size: int = 32


@dataclass
class ParallelConfig:
    strategy: StrategyName = "ddp"  # ddp | fsdp (FSDP2) | deepspeed
    # null: nccl on CUDA, gloo on CPU (metadata "null" says so in the not-allowed message)
    backend: Backend | None = field(default=None, metadata={"null": "nccl on CUDA, gloo on CPU"})
    # none | full (every block) | selective (every ac_every-th) | op (per op: keep matmuls + attention)
    activation_checkpointing: ACMode = "none"
    ac_every: int = 2
    activation_offload: bool = False  # saved activations in (pinned) host memory; no-op on CPU
    reshard_after_forward: bool = True  # fsdp: true = ZeRO-3-like, false = ZeRO-2-like
    zero_stage: int = 2  # deepspeed without deepspeed_config: ZeRO stage 0-3
    deepspeed_config: str | None = None  # deepspeed: a JSON such as configs/deepspeed/zero3.json
    # The device mesh (tformer/parallel/mesh.py): world size = dp_replicate x dp_shard x tp.
    dp_replicate: int = 1  # HSDP replicas (e.g. one per node); > 1 needs strategy=fsdp
    dp_shard: int = -1  # data-parallel (FSDP2 shard) group size; -1 = whatever is left
    tp: int = 1  # tensor-parallel degree (heads, FFN width, vocabulary split)
    sp: bool = False  # tp: sequence parallel for norms, dropout and residual adds
    loss_parallel: bool = True  # tp: cross-entropy over the vocabulary-sharded logits
    # Pipeline parallelism (tformer/parallel/pipeline.py): pp stages, outermost mesh dimension. The
    # pipeline's micro-batches are the grad_accum micro-batches of micro_batch_size samples each.
    pp: int = 1
    # gpipe | 1f1b | interleaved_1f1b (PP_SCHEDULES). A string, not the PPSchedule Literal: its value
    # is checked by check_pipeline with the rest of the layout, when the trainer builds the pipeline.
    pp_schedule: str = "1f1b"
    pp_stages_per_rank: int = 1  # interleaved_1f1b: stages (virtual stages) per rank, >= 2
    pp_layers: list | None = None  # blocks per stage, e.g. [3, 5] (default: as even as possible)
    # Context parallelism (tformer/parallel/context.py): every sequence cut over cp ranks, each holding
    # 2 of 2 x cp chunks (padded to a multiple of 2 x cp); attention across them.
    cp: int = 1
    cp_kernel: CPKernel = "tformer"  # tformer (all-gather K/V, any mask) | torch (its CUDA ring, causal only)
    # Expert parallelism (tformer/parallel/ep.py): the MoE layers' experts split over ep ranks taken
    # from the dp_shard x cp ranks (tokens exchanged by all-to-all); needs strategy=fsdp
    ep: int = 1


@dataclass
class CheckpointConfig:
    # true: load this run's checkpoints' pickles (DCP metadata, DeepSpeed states) without the
    # allow-list. DANGEROUS: a pickle can run any code; only for checkpoints of trusted origin.
    trust: bool = False
    # true: ddp/fsdp write with DCP's async_save; the loop waits only for the copy of the state
    # to host memory, the write and the commit happen in the background (DeepSpeed: synchronous)
    async_: bool = field(default=False, metadata={"key": "async"})


@dataclass
class LossConfig:
    # tokens per chunk of the output head + cross-entropy in training (null: the whole
    # (tokens x vocabulary) logits at once); the loss and gradients are the same either way
    chunk_size: int | None = 128


@dataclass
class WandbConfig:
    enabled: bool = False
    project: str = "tformer"
    entity: str | None = None
    name: str | None = None
    mode: str | None = None  # online | offline | disabled; None = WANDB_MODE or online
    tags: list = field(default_factory=list)


@dataclass
class TrainConfig:
    # Written as a preset plus field overrides (``model: {preset: gpt2-tiny, d_model: 64}``,
    # ``model.d_model=64``), resolved into the ModelConfig when the config is read. ``to_dict``
    # writes every field and no preset name, as the run's resolved config.yaml always has.
    model: ModelConfig = field(default_factory=lambda: build_config("gpt2-tiny"))
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    output_dir: str = "runs/default"
    seed: int = 0
    micro_batch_size: int = 8
    grad_accum: int = 1
    max_steps: int = 1000
    max_tokens: int | None = None  # stop after this many tokens (all ranks together)
    max_time: float | None = None  # stop (and save) after this many seconds
    precision: Precision = "auto"  # auto: bf16 where the device computes it natively, else fp32
    log_every: int = 10
    eval_every: int = 100  # 0 = only at the end
    eval_batches: int = 8
    eval_bleu: bool = False  # seq2seq: also decode validation pairs and log BLEU / chrF
    bleu_samples: int | None = 200  # validation pairs decoded for eval_bleu (None = all)
    save_every: int = 200  # 0 = only at the end
    keep_checkpoints: int = 3
    resume: str = "auto"  # auto (newest complete checkpoint, if any) | none | a path
    # a resumed run whose config changes what it trains (RESUME_FREE below says what may change):
    # refuse (one line naming each key), or allow (one warning line per key)
    resume_changes: ResumeChanges = "refuse"
    on_nonfinite: NonFinite = "skip"  # skip the step, or stop the run
    max_skipped_steps: int = 10  # stop after this many consecutive non-finite steps
    # no step progress for this many seconds: every rank dumps its stacks to OUTPUT/watchdog/, the
    # stuck ranks are named, and the job exits non-zero (torchrun restarts / SLURM requeues take
    # over); collectives time out 60 s later. null = off
    watchdog_timeout: float | None = None
    on_spike: SpikeAction = "none"  # none | warn | rollback (to the newest checkpoint before the spike)
    spike_factor: float = 3.0  # a loss above spike_factor x the running median is a spike
    spike_window: int = 50  # steps in the running median
    spike_warmup: int = 100  # no spike detection before this step
    spike_skip_batches: int = 100  # rollback: optimizer steps' worth of data skipped after the checkpoint
    max_rollbacks: int = 3  # rollback: at most this many per run, then stop
    compile: bool = False
    progress: bool = True
    device: Device = "auto"  # auto | cpu | cuda

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        check_fields(self)  # types, and every choice (a Literal field) in every section
        if self.parallel.dp_shard == 0:
            raise ConfigError(
                "parallel.dp_shard=0 is not allowed; use a positive shard-group size, or -1 for "
                "whatever the world size leaves after dp_replicate x tp"
            )
        if self.parallel.ac_every < 1:
            raise ConfigError(f"parallel.ac_every={self.parallel.ac_every} must be >= 1")
        if self.loss.chunk_size is not None and self.loss.chunk_size < 1:
            raise ConfigError(
                f"loss.chunk_size={self.loss.chunk_size} must be >= 1 (tokens per chunk), or null for the unchunked loss"
            )
        for name in ("micro_batch_size", "grad_accum", "max_steps", "log_every", "eval_batches", "keep_checkpoints"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 1")
        for name in ("eval_every", "save_every"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 0 (0 = only at the end)")
        if self.data.seq_len < 1:
            raise ConfigError(f"data.seq_len={self.data.seq_len} must be >= 1")
        if self.optim.lr <= 0:
            raise ConfigError(f"optim.lr={self.optim.lr} must be > 0")
        if self.data.tokens_per_batch is not None and self.data.objective != "seq2seq":
            raise ConfigError(
                f"data.tokens_per_batch={self.data.tokens_per_batch} batches translation pairs "
                f"(data.objective=seq2seq), not data.objective={self.data.objective!r}; use micro_batch_size"
            )
        if self.data.tokens_per_batch is not None and self.data.tokens_per_batch < max(
            self.data.seq_len, self.data.target_len or self.data.seq_len
        ):
            raise ConfigError(
                f"data.tokens_per_batch={self.data.tokens_per_batch} is smaller than the longest "
                f"allowed pair ({max(self.data.seq_len, self.data.target_len or self.data.seq_len)} "
                "tokens: data.seq_len / data.target_len); raise it or lower those"
            )
        if self.eval_bleu and self.data.objective != "seq2seq":
            raise ConfigError(
                f"eval_bleu=true needs translation pairs (data.objective=seq2seq), not "
                f"data.objective={self.data.objective!r}; set eval_bleu=false"
            )
        if self.decode.num_beams < 1:
            raise ConfigError(f"decode.num_beams={self.decode.num_beams} must be >= 1 (1 = greedy)")
        if self.bleu_samples is not None and self.bleu_samples < 1:
            raise ConfigError(f"bleu_samples={self.bleu_samples} must be >= 1 (or null for all pairs)")
        if self.optim.schedule == "inverse_sqrt" and self.optim.warmup_steps < 1:
            raise ConfigError(
                "optim.schedule=inverse_sqrt needs optim.warmup_steps >= 1 (its peak is at the end "
                "of warmup; the paper uses 4000)"
            )
        if not 0.0 <= self.optim.label_smoothing < 1.0:
            raise ConfigError(f"optim.label_smoothing={self.optim.label_smoothing} must be in [0, 1) (the paper uses 0.1)")
        check_ranges(self, RANGES)
        check_mixture(self)
        check_document_mask(self, self.model)

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


# Allowed range of every numeric key (README "Allowed ranges" lists the same); null is allowed
# where the type says so and is not checked.
RANGES = {
    "seed": "[0, inf)",
    "micro_batch_size": "[1, inf)",
    "grad_accum": "[1, inf)",
    "max_steps": "[1, inf)",
    "max_tokens": "[1, inf)",
    "max_time": "(0, inf)",
    "log_every": "[1, inf)",
    "eval_every": "[0, inf)",
    "eval_batches": "[1, inf)",
    "save_every": "[0, inf)",
    "keep_checkpoints": "[1, inf)",
    "max_skipped_steps": "[0, inf)",
    "watchdog_timeout": "(0, inf)",
    "spike_factor": "(1, inf)",
    "spike_window": "[3, inf)",
    "spike_warmup": "[0, inf)",
    "spike_skip_batches": "[0, inf)",
    "max_rollbacks": "[1, inf)",
    "data.tokenizer_vocab_size": "[1, inf)",
    "data.seq_len": "[1, inf)",
    "data.target_len": "[1, inf)",
    "data.mlm_probability": "(0, 1)",
    "data.noise_density": "(0, 1)",
    "data.mean_span_length": "[1, inf)",
    "data.val_fraction": "[0, 1)",
    "data.tokenizer_max_rows": "[1, inf)",
    "data.num_proc": "[1, inf)",
    "data.num_workers": "[0, inf)",
    "data.pack_len": "[1, inf)",
    "optim.lr": "(0, inf)",
    "optim.min_lr_ratio": "[0, 1]",
    "optim.weight_decay": "[0, inf)",
    "optim.beta1": "[0, 1)",
    "optim.beta2": "[0, 1)",
    "optim.eps": "(0, inf)",
    "optim.grad_clip": "[0, inf)",
    "optim.warmup_steps": "[0, inf)",
    "optim.decay_steps": "[1, inf)",
    "parallel.ac_every": "[1, inf)",
    "parallel.zero_stage": "[0, 3]",
    "parallel.dp_replicate": "[1, inf)",
    "parallel.dp_shard": "[-1, inf)",
    "parallel.tp": "[1, inf)",
    "parallel.pp": "[1, inf)",
    "parallel.cp": "[1, inf)",
    "parallel.ep": "[1, inf)",
    "parallel.pp_stages_per_rank": "[1, inf)",
    "loss.chunk_size": "[1, inf)",
    "optim.label_smoothing": "[0, 1)",
    "data.tokens_per_batch": "[1, inf)",
    "bleu_samples": "[1, inf)",
    "decode.num_beams": "[1, inf)",
    "decode.length_penalty": "[0, inf)",
    "decode.max_new_tokens": "[1, inf)",
    "decode.batch_size": "[1, inf)",
}


# What a resumed run may change (tformer/train/resume.py; README "Resuming"), as dotted keys or
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
    "compile",
    "model.attn_impl",
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
    "wandb",
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


SOURCE_KEYS = ("source", "weight", "name", "text_column")


def source_name(entry: dict) -> str:
    """A mixture source's name: its ``name``, else its file name up to the first dot."""
    return entry.get("name") or Path(str(entry["source"])).name.split(".")[0]


def _check_sources(entries: Any, where: str) -> list[str]:
    """One mixture's source list: a non-empty list of {source, weight, name}; returns the names."""
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{where} must be a non-empty list of {{source: PATH, weight: W, name: NAME}}")
    names = []
    for i, e in enumerate(entries):
        at = f"{where}[{i}]"
        if not isinstance(e, dict):
            raise ConfigError(f"{at} must be a mapping like {{source: data/web.jsonl, weight: 0.7, name: web}}")
        unknown = sorted(set(e) - set(SOURCE_KEYS))
        if unknown:
            raise ConfigError(f"{at} has unknown key(s) {', '.join(unknown)}; allowed: {', '.join(SOURCE_KEYS)}")
        if not isinstance(e.get("source"), str) or not e["source"]:
            raise ConfigError(f"{at}.source is missing: give a file, directory, glob, dataset name or default")
        w = e.get("weight", 1.0)
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0:
            raise ConfigError(f"{at}.weight={w!r} must be a number >= 0")
        name = source_name(e)
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
            raise ConfigError(f"{at}.name={name!r} may hold only letters, digits, _ . - (it names val_loss/NAME)")
        if name in names:
            raise ConfigError(f"{at}.name={name!r} is used twice in {where}; give each source its own name")
        names.append(name)
    if sum(float(e.get("weight", 1.0)) for e in entries) <= 0:
        raise ConfigError(f"{where}: the weights are all zero; give at least one source a weight > 0")
    return names


def check_mixture(cfg: "TrainConfig") -> None:
    d = cfg.data
    if (d.sources or d.stages) and d.source != "default":
        raise ConfigError("data.source and data.sources/data.stages are both set; give one (a single source, or a mixture)")
    if d.sources and d.stages:
        raise ConfigError("data.sources and data.stages are both set; put the sources in the stages")
    if (d.sources or d.stages) and d.objective == "seq2seq":
        raise ConfigError("data.sources/data.stages mix text corpora; data.objective=seq2seq takes one data.source of pairs")
    if (d.sources or d.stages) and d.tokens_per_batch is not None:
        raise ConfigError("data.tokens_per_batch batches one source of pairs; unset it for a mixture")
    if d.sources:
        _check_sources(d.sources, "data.sources")
    if not d.stages:
        return
    if not isinstance(d.stages, list):
        raise ConfigError("data.stages must be a list of {until_step: N, sources: [...]}")
    last = 0
    for i, st in enumerate(d.stages):
        at = f"data.stages[{i}]"
        if not isinstance(st, dict) or set(st) - {"until_step", "sources"}:
            raise ConfigError(f"{at} must be a mapping with keys until_step and sources")
        step = st.get("until_step")
        if isinstance(step, bool) or not isinstance(step, int):
            raise ConfigError(f"{at}.until_step={step!r} must be an integer step")
        if step <= last:
            raise ConfigError(
                f"{at}.until_step={step} must be greater than the previous stage's ({last}); "
                "list the stages in order of increasing until_step"
            )
        last = step
        _check_sources(st.get("sources"), f"{at}.sources")
    if last < cfg.max_steps:
        raise ConfigError(
            f"data.stages end at until_step={last} but max_steps={cfg.max_steps}; raise the last "
            f"stage's until_step to >= {cfg.max_steps}"
        )


def check_document_mask(cfg: "TrainConfig", model: ModelConfig) -> None:
    d = cfg.data
    if not d.document_mask:
        if d.pack_len is not None:
            raise ConfigError(f"data.pack_len={d.pack_len} sizes packed rows; it needs data.document_mask=true")
        return
    objective = d.objective if d.objective != "auto" else AUTO_OBJECTIVE[model.family]
    if objective == "span":
        raise ConfigError(
            "data.document_mask=true cannot be honoured by span corruption (its spans are cut "
            "across documents); use data.objective=seq2seq for packed pairs, or "
            "data.document_mask=false"
        )
    if d.tokens_per_batch is not None:
        raise ConfigError(
            "data.document_mask=true packs pairs into rows; unset data.tokens_per_batch "
            "(padded token-budget batches) or set data.document_mask=false"
        )
    if d.pack_len is not None and objective != "seq2seq":
        raise ConfigError(
            f"data.pack_len={d.pack_len} sizes rows of packed pairs (data.objective=seq2seq); "
            f"{objective} packing fills data.seq_len: unset data.pack_len"
        )
    if d.pack_len is not None and model.position in ("learned", "sinusoidal") and d.pack_len > model.max_seq_len:
        raise ConfigError(
            f"data.pack_len={d.pack_len} exceeds model.max_seq_len={model.max_seq_len} (the "
            f"position table); use data.pack_len <= {model.max_seq_len}"
        )
    if model.attn_impl not in DOC_MASK_IMPLS:
        raise ConfigError(
            f"data.document_mask=true needs model.attn_impl in {', '.join(DOC_MASK_IMPLS)}, not {model.attn_impl!r}"
        )


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
                value = _as_float(value)
            _check_type(name, value, hint)  # a choice's value is checked with the others, in validate
            kwargs[f.name] = value
    return cls(**kwargs)


def _as_float(value: Any) -> Any:
    """YAML 1.1 reads ``1e-3`` as a string; accept it (and ints) where a number is expected."""
    if isinstance(value, (int, str)):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not key=value (e.g. max_steps=100 or optim.lr=1e-3)")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw != "" else None
    except yaml.YAMLError:
        value = raw
    return key.strip().split("."), value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    data = dict(data)
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for part in path[:-1]:
            child = node.get(part)
            child = dict(child) if isinstance(child, dict) else {}
            node[part] = child
            node = child
        node[path[-1]] = value
    return data


def load_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist; pass a recipe such as configs/gpt2-tiny.yaml")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or "invalid YAML"
        raise ConfigError(f"{path}{where}: {problem}; fix the YAML syntax") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of config keys, not a {type(data).__name__}")
    return data


def load_config(path: str | Path | None = None, overrides: list[str] | None = None, base: dict | None = None) -> TrainConfig:
    data = load_yaml(path) if path is not None else dict(base or {})
    data = apply_overrides(data, overrides or [])
    cfg = _build(TrainConfig, data, "")
    return cfg


def config_from_dict(data: dict) -> TrainConfig:
    return _build(TrainConfig, data, "")


def dump_yaml(cfg: TrainConfig) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
