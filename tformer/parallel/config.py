"""The run config's ``parallel`` section (the strategy, the device mesh and how the model is laid
out on it) and its ``float8`` section (how ``precision: fp8`` converts the blocks' linear layers,
``float8.py``). Their owner is this package; ``tformer/train/config.py`` composes them into the run config
(and re-exports them). Ranges are declared on the fields (``ranged``) and checked by
``check_ranges``; the layout's cross-checks (``check_strategy``, ``check_tp``, ``check_pipeline``)
need the world size and the model, so they run when the trainer builds the mesh.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from ..config import ACMode, ConfigError, StrategyName, ranged

Backend = Literal["gloo", "nccl", "mpi", "ucc"]
CPKernel = Literal["tformer", "torch"]
# torchao's float8 training recipes (``Float8LinearConfig.from_recipe_name``, torchao 0.12-0.18)
Float8Recipe = Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"]
# How Muon scales its orthogonalised update (tformer/parallel/muon.py): match_adamw = Moonlight's
# 0.2 * sqrt(max(A, B)) (an AdamW recipe's lr and decay carry over), spectral = Keller Jordan's
# sqrt(max(1, A / B)) (torch's "original"), none = the bare orthogonal matrix
MuonAdjust = Literal["match_adamw", "spectral", "none"]
# The dtype of the Newton-Schulz iteration: bf16 is torch.optim.Muon's; fp32 the same iteration in
# fp32 (CPUs without bf16 matmul instructions run bf16 30-100x slower); auto = bf16 on a GPU, fp32
# on a CPU
NSDtype = Literal["auto", "bf16", "fp32"]
BACKENDS: tuple[Backend, ...] = get_args(Backend)
FLOAT8_RECIPES: tuple[Float8Recipe, ...] = get_args(Float8Recipe)
MUON_ADJUSTS: tuple[MuonAdjust, ...] = get_args(MuonAdjust)
NS_DTYPES: tuple[NSDtype, ...] = get_args(NSDtype)


@dataclass
class ParallelConfig:
    strategy: StrategyName = "ddp"  # ddp | fsdp (FSDP2) | deepspeed
    # null: nccl on CUDA, gloo on CPU (metadata "null" says so in the not-allowed message)
    backend: Backend | None = field(default=None, metadata={"null": "nccl on CUDA, gloo on CPU"})
    # none | full (every block) | selective (every ac_every-th) | op (per op: keep matmuls + attention)
    activation_checkpointing: ACMode = "none"
    ac_every: int = ranged(2, "[1, inf)")  # selective: checkpoint every ac_every-th block
    activation_offload: bool = False  # saved activations in (pinned) host memory; no-op on CPU
    reshard_after_forward: bool = True  # fsdp: true = ZeRO-3-like, false = ZeRO-2-like
    zero_stage: int = ranged(2, "[0, 3]")  # deepspeed without deepspeed_config: ZeRO stage 0-3
    deepspeed_config: str | None = None  # deepspeed: a JSON such as configs/deepspeed/zero3.json
    # The device mesh (tformer/parallel/mesh.py): world size = dp_replicate x dp_shard x tp.
    dp_replicate: int = ranged(1, "[1, inf)")  # HSDP replicas (e.g. one per node); > 1 needs strategy=fsdp
    dp_shard: int = ranged(-1, "[-1, inf)")  # data-parallel (FSDP2 shard) group size; -1 = whatever is left
    tp: int = ranged(1, "[1, inf)")  # tensor-parallel degree (heads, FFN width, vocabulary split)
    sp: bool = False  # tp: sequence parallel for norms, dropout and residual adds
    loss_parallel: bool = True  # tp: cross-entropy over the vocabulary-sharded logits
    # Pipeline parallelism (tformer/parallel/pipeline.py): pp stages, outermost mesh dimension. The
    # pipeline's micro-batches are the grad_accum micro-batches of micro_batch_size samples each.
    pp: int = ranged(1, "[1, inf)")  # pipeline stages (ranks)
    # gpipe | 1f1b | interleaved_1f1b (PP_SCHEDULES). A string, not the PPSchedule Literal: its value
    # is checked by check_pipeline with the rest of the layout, when the trainer builds the pipeline.
    pp_schedule: str = "1f1b"
    pp_stages_per_rank: int = ranged(1, "[1, inf)")  # interleaved_1f1b: stages (virtual stages) per rank, >= 2
    pp_layers: list | None = None  # blocks per stage, e.g. [3, 5] (default: as even as possible)
    # Context parallelism (tformer/parallel/context.py): every sequence cut over cp ranks, each holding
    # 2 of 2 x cp chunks (padded to a multiple of 2 x cp); attention across them.
    cp: int = ranged(1, "[1, inf)")  # context-parallel degree
    cp_kernel: CPKernel = "tformer"  # tformer (all-gather K/V, any mask) | torch (its CUDA ring, causal only)
    # Expert parallelism (tformer/parallel/ep.py): the MoE layers' experts split over ep ranks taken
    # from the dp_shard x cp ranks (tokens exchanged by all-to-all); needs strategy=fsdp
    ep: int = ranged(1, "[1, inf)")  # expert-parallel degree

    def check(self) -> None:
        """The section's rule that is not a range: its ranges are checked with every section's."""
        if self.dp_shard == 0:
            raise ConfigError(
                "parallel.dp_shard=0 is not allowed; use a positive shard-group size, or -1 for "
                "whatever the world size leaves after dp_replicate x tp"
            )


@dataclass
class Float8Config:
    """``precision: fp8`` (tformer/parallel/float8.py): the blocks' linear layers run their matrix
    products in float8 (torchao), everything else in bf16 autocast. Read only when precision=fp8."""

    # tensorwise: one scale per tensor (fastest; FSDP2 all-gathers its weights in float8) | rowwise:
    # one scale per row, powers of two (more accurate, slower) | rowwise_with_gw_hp: rowwise with the
    # weight gradient's product in bf16 (the most accurate)
    recipe: Float8Recipe = "tensorwise"
    # true: the float8 products computed in fp32 from the float8 values (the same casts and scales,
    # no FP8 tensor cores: tests and CPUs); false needs a GPU of compute capability 8.9+
    emulate: bool | None = field(default=None, metadata={"null": "true on a CPU, false on a GPU"})


@dataclass
class MuonConfig:
    """``optim.name: muon`` (tformer/parallel/muon.py): Muon for the blocks' weight matrices
    (attention, FFN, experts), AdamW (the ``optim`` keys) for embeddings, head, norms, biases and
    the MoE router. Read only when optim.name=muon."""

    lr: float | None = ranged(None, "(0, inf)", note="null = optim.lr")  # Muon's peak learning rate
    # decoupled, as AdamW's: p *= 1 - lr * weight_decay
    weight_decay: float | None = ranged(None, "[0, inf)", note="null = optim.weight_decay")
    momentum: float = ranged(0.95, "[0, 1)")  # Muon's momentum (the buffer's decay)
    nesterov: bool = True  # orthogonalise grad.lerp(buffer, momentum) instead of the buffer
    ns_steps: int = ranged(5, "[1, 99]")  # Newton-Schulz iterations (torch's coefficients)
    ns_dtype: NSDtype = "auto"  # bf16 (torch.optim.Muon's) | fp32 | auto (bf16 on a GPU, fp32 on a CPU)
    adjust: MuonAdjust = "match_adamw"  # the update's scale by shape: match_adamw | spectral | none
    # Kimi K2's QK-clip: after each step, a head whose largest pre-softmax logit of the step exceeded
    # qk_clip has its query and key projections scaled so it would be qk_clip; null = off
    qk_clip: float | None = ranged(None, "(0, inf)")
