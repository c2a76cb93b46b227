"""A training layout the time model prices (:class:`Layout`), its result (:class:`StepTime`), what
each of its pipeline ranks runs (:class:`Stage`), and the layouts it refuses.

Layouts the model has no terms for are refused with the reason (``NotPriced``): async TP, float8 on
a device without an fp8 peak (or emulated on a CPU), layouts tformer does not run (context
parallelism with attention dropout or DeepSpeed, expert parallelism outside FSDP2 or with pipelines,
MoE models under TP or DeepSpeed), a precision without a peak figure. A layout no run can have (ep
without experts, an ep that does not divide them or dp_shard x cp, a tp that does not divide the
heads) is a ``ConfigError`` (``check_layout``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..config import ConfigError, ModelConfig
from ..models import spec_of
from ..parallel.pipeline import stage_layers, stages_of_rank
from .hardware import Hardware
from .memory import check_expert_parallel
from .moe import expert_parameters, moe_layers
from .states import STRATEGY_NAMES, stage_parameters, tp_blocker, tp_local_parameters


AC_POLICIES = ("none", "op", "op-alternate", "full")
FLOAT8_RECIPES = ("tensorwise", "rowwise")  # torchao's, as precision=fp8 runs them (float8.recipe)
ATTENTION_KERNELS = ("flash", "unfused")


class NotPriced(ConfigError):
    """A layout the time model has no terms for; the message says what it lacks."""


@dataclass(frozen=True)
class Layout:
    """One training layout on pp x dp_replicate x dp_shard x cp x tp devices (tp innermost, as the
    mesh builds it). For ddp and zero1/2/3, dp_shard is the data-parallel degree; expert
    parallelism borrows its ep ranks from dp_shard x cp (no devices of its own)."""

    strategy: str = "fsdp"  # states.STRATEGY_NAMES
    micro_batch: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    sp: bool = True  # sequence parallel with tp > 1
    pp: int = 1
    schedule: str = "1f1b"  # gpipe | 1f1b | interleaved_1f1b
    stages_per_rank: int = 1
    n_micro: int | None = None  # pp > 1: micro-batches per step (default 4 x pp)
    grad_accum: int = 1  # pp == 1: micro-batches per step
    ac: str = "none"  # AC_POLICIES: none | op | op-alternate (torchtitan's; priced, not built) | full
    precision: str = "bf16"  # bf16 | fp16 (mixed) | fp32
    loss_parallel: bool = True
    compile: bool = False  # torch.compile fuses each elementwise chain into one read and one write
    cp: int = 1  # context parallelism: each sequence cut over cp ranks (parallel/context.py)
    ep: int = 1  # expert parallelism (MoE models): experts split over ep of the dp_shard x cp ranks
    # precision=fp8: the blocks' linear layers in float8 with this torchao recipe, the rest in
    # ``precision`` (bf16); None: off (True reads as tensorwise, the published rows' flag)
    float8: str | bool | None = None
    async_tp: bool = False  # not priced
    attention: str = "flash"  # ATTENTION_KERNELS: flash (SDPA, tformer's) | unfused (explicit S x S scores)
    loss_chunk: int | None = None  # loss.chunk_size: the head and loss over this many rows at a time (tp 1)

    def __post_init__(self) -> None:
        if isinstance(self.float8, bool):
            object.__setattr__(self, "float8", "tensorwise" if self.float8 else None)

    @property
    def devices(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.tp * self.cp

    @property
    def micro_batches(self) -> int:
        return (self.n_micro or 4 * self.pp) if self.pp > 1 else self.grad_accum

    @property
    def mixed(self) -> bool:
        return self.precision != "fp32"


@dataclass
class StepTime:
    step: float  # seconds
    tokens_per_step: int  # the global batch, in tokens (encoder-decoder: source + target)
    devices: int
    mfu: float
    breakdown: dict[str, float] = field(default_factory=dict)  # seconds by part; they add up to ``step``
    memory: float = 0.0  # predicted peak bytes per device (memory.py)

    @property
    def tokens_per_s_per_device(self) -> float:
        return self.tokens_per_step / self.step / self.devices

    def time_to_train(self, tokens: float) -> float:
        """Seconds to train ``tokens`` tokens at this step time."""
        return tokens / self.tokens_per_step * self.step


def check_layout(cfg: ModelConfig, layout: Layout) -> None:
    """A layout no run of ``cfg`` can have, refused in one line naming the field: a degree below 1,
    a tp that does not split the heads, ep without experts, or an ep that does not divide the
    experts or is not a multiple of cp dividing dp_shard x cp (what parallel/ep.py and mesh.py
    refuse)."""
    for name in ("micro_batch", "dp_replicate", "dp_shard", "tp", "pp", "cp", "ep"):
        if getattr(layout, name) < 1:
            raise ConfigError(f"Layout.{name}={getattr(layout, name)} must be >= 1")
    blocker = tp_blocker(cfg, layout.tp)
    if blocker:
        raise ConfigError(f"Layout.tp={layout.tp} does not divide {blocker}; choose a tp that divides it")
    check_expert_parallel(cfg, layout.ep, layout.dp_shard, layout.cp)


def why_not_priced(cfg: ModelConfig, layout: Layout, hw: Hardware) -> str | None:
    """Every reason the model cannot price ``layout`` of ``cfg`` on ``hw``, joined; None when it can."""
    reasons = []
    deepspeed = layout.strategy.startswith("zero")
    if layout.float8:
        if layout.float8 not in FLOAT8_RECIPES:
            reasons.append(f"float8 recipe {layout.float8!r} (priced: {', '.join(FLOAT8_RECIPES)})")
        if hw.device == "cpu":
            reasons.append("float8 on a CPU: emulated (fp32 products of float8 values), not a speed to plan with")
        elif "fp8" not in hw.peak:
            reasons.append(f"float8 on {hw.name}: no fp8 peak figure (FP8 tensor cores: Ada, Hopper, Blackwell)")
        if layout.precision != "bf16":
            reasons.append(f"float8 under precision {layout.precision} (tformer runs float8 beside bf16)")
    if layout.async_tp:
        reasons.append("async TP (TP collectives hidden behind matmuls; not modelled)")
    if layout.cp > 1:
        for refused, what in (
            (cfg.attn_dropout > 0, "with attention dropout"),
            (deepspeed, f"with DeepSpeed ({layout.strategy})"),
        ):
            if refused:
                reasons.append(f"context parallelism {what}: tformer does not run it")
        if hw.device != "cpu" and "fp32" not in hw.peak:
            reasons.append(
                f"context parallelism on {hw.name}: its chunk-pair kernel computes fp32 scores on a GPU, "
                f"and {hw.name} has no fp32 peak figure"
            )
    if cfg.moe.enabled:
        for refused, what in (
            (deepspeed, f"DeepSpeed ({layout.strategy})"),
            (layout.ep > 1 and not layout.strategy.startswith("fsdp"), f"expert parallelism with {layout.strategy}"),
        ):
            if refused:
                reasons.append(f"a mixture-of-experts model with {what}: tformer does not run it")
        for unpriced, what in (  # these run (parallel/tp.py, parallel/ep.py); the time model has no terms yet
            (layout.tp > 1, f"tensor parallelism (tp={layout.tp}: MoE FFNs run whole on every tp rank)"),
            (layout.ep > 1 and layout.pp > 1, f"expert parallelism with pipelines (pp={layout.pp})"),
        ):
            if unpriced:
                reasons.append(f"a mixture-of-experts model with {what}: no time-model terms for it yet")
    if layout.attention not in ATTENTION_KERNELS:
        reasons.append(f"attention kernel {layout.attention!r} (priced: {', '.join(ATTENTION_KERNELS)})")
    if layout.ac not in AC_POLICIES:
        reasons.append(f"activation checkpointing {layout.ac!r} (priced: {', '.join(AC_POLICIES)})")
    if layout.strategy not in STRATEGY_NAMES:
        reasons.append(f"strategy {layout.strategy!r} (priced: {', '.join(STRATEGY_NAMES)})")
    if layout.precision not in hw.peak:
        reasons.append(f"precision {layout.precision}: {hw.name} has no {layout.precision} peak figure")
    if layout.dp_replicate > 1 and not layout.strategy.startswith("fsdp"):
        reasons.append(f"dp_replicate={layout.dp_replicate} with {layout.strategy} (HSDP is FSDP2's)")
    return "; ".join(reasons) or None


@dataclass
class Stage:
    """What one pipeline rank runs: its blocks (first stack, second stack), of them the MoE ones,
    embedding, head, and its parameters (on this TP rank), of them the routed experts'."""

    blocks: tuple[int, int]
    embed: bool
    head: bool
    params: int
    moe: tuple[int, int] = (0, 0)
    experts: int = 0


def rank_stages(cfg: ModelConfig, layout: Layout) -> list[Stage]:
    pp, v = layout.pp, (layout.stages_per_rank if layout.schedule == "interleaved_1f1b" else 1)
    spec = spec_of(cfg)
    stacks = [n for n, _, _ in spec.stack_shapes(cfg, 1, None)]
    per_layer = expert_parameters(cfg) // max(1, moe_layers(cfg))

    def moe_in(blocks) -> int:  # MoE blocks among these block indices of a stack
        return sum(cfg.moe.is_moe_layer(i) for i in blocks)

    if pp == 1:
        both = (stacks[0], stacks[1] if len(stacks) > 1 else 0)
        moe = (moe_in(range(both[0])), moe_in(range(both[1])))
        # (the experts of a multi-token prediction depth too: held, though not a stack's block)
        return [Stage(both, True, True, tp_local_parameters(cfg, layout.tp), moe, per_layer * moe_layers(cfg))]
    params = stage_parameters(cfg, pp * v, layout.tp)
    if len(stacks) > 1:  # one stage per stack (the model's ``cut_stage``)
        m0, m1 = moe_in(range(stacks[0])), moe_in(range(stacks[1]))
        return [
            Stage((stacks[0], 0), True, False, params[0], (m0, 0), per_layer * m0),
            Stage((0, stacks[1]), True, True, params[1], (0, m1), per_layer * m1),
        ]
    layers = stage_layers(cfg.num_layers, pp * v)
    out = []
    for rank in range(pp):
        mine = stages_of_rank(rank, pp, pp * v)
        blocks = sum(len(layers[s]) for s in mine)
        n_moe = sum(moe_in(layers[s]) for s in mine)
        out.append(
            Stage((blocks, 0), 0 in mine, pp * v - 1 in mine, sum(params[s] for s in mine), (n_moe, 0), per_layer * n_moe)
        )
    return out
