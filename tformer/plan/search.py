"""The layouts ``tformer plan`` tries, and the memory-first ranking of those that fit.

A layout is a strategy on the mesh pp x dp_replicate x dp_shard x cp x tp (``layouts``: no pipeline;
``pp_layouts``: pipelines; ``cp_layouts``: context parallelism), for an MoE model with its experts
over ep of the dp_shard x cp ranks (``ep_variants``); ``recommend`` and ``recommend_cp`` keep every
layout and activation-checkpointing mode that fits a device, each at its largest micro-batch,
ordered by what a practitioner would try first when memory is the only question. Only what the
trainer runs is offered (an MoE model: tp 1, no DeepSpeed; CP: no attention dropout, no pipeline).
The per-rank bytes come from memory.py; which of the fitting layouts is fastest, from time.py
(report.py prints both).
"""

from __future__ import annotations

from ..config import ModelConfig
from .memory import Estimate, cp_estimate, estimate, pipeline_blocker, with_expert_parallel
from .states import STRATEGY_NAMES, tp_blocker

# what the planner offers a mixture-of-experts model (parallel/ep.py, check_moe_layout): no DeepSpeed
# (its experts would be partitioned like dense weights); tp = 1 (tp > 1 runs, but is not planned yet)
MOE_STRATEGIES = ("ddp", "fsdp", "fsdp-no-reshard")


def tp_degrees(cfg: ModelConfig, devices: int) -> tuple[list[int], dict[int, str]]:
    """The tp values a layout of ``devices`` can use (divisors of the device count that split the
    model), and the others with what they do not divide (or, for an MoE model, that it runs tp=1)."""
    usable, skipped = [], {}
    for tp in (t for t in range(1, devices + 1) if devices % t == 0):
        blocker = tp_blocker(cfg, tp) or (
            "model.moe: MoE models run at tp > 1 (MoE FFNs whole on every tp rank) but are not planned there yet"
            if cfg.moe.enabled and tp > 1
            else None
        )
        if blocker:
            skipped[tp] = blocker
        else:
            usable.append(tp)
    return usable, skipped


# the schedules the search tries, with their stages per rank: GPipe is left out (1F1B's bubble, with
# all m micro-batches in flight instead of at most pp), interleaving at 2 stages per rank
PP_SEARCHED = (("1f1b", 1), ("interleaved_1f1b", 2))


# a pipeline whose idle share exceeds what full recomputation costs (its second forward: ~1/4 of a
# step that becomes 4/3 as long) ranks with full AC
MAX_BUBBLE = 0.25


def layouts(
    cfg: ModelConfig, devices: int, gpus_per_node: int = 8, replica_group: bool = False
) -> list[tuple[str, int, int]]:
    """(strategy, dp_replicate, tp) of every layout the planner tries, cheapest communication first
    within one tp: without TP each strategy, HSDP (one replica per node, FSDP2 inside it) before
    FSDP2 over every device; with TP (sequence parallel on) FSDP2 on the rest, HSDP first.
    ``replica_group``: the layouts of one fault-tolerance replica group, which the trainer runs
    without DeepSpeed (ZeRO) and without an HSDP replica dimension (torchft's groups are the
    replicas: train/resilience/ft.py)."""
    nodes = devices // gpus_per_node if devices % gpus_per_node == 0 and not replica_group else 1
    out = []
    for tp in tp_degrees(cfg, devices)[0]:
        hsdp = nodes > 1 and gpus_per_node % tp == 0 and gpus_per_node // tp > 1
        strategies: tuple[str, ...] = (MOE_STRATEGIES if cfg.moe.enabled else STRATEGY_NAMES) if tp == 1 else ("fsdp",)
        if replica_group:
            strategies = tuple(s for s in strategies if not s.startswith("zero"))
        for strategy in strategies:
            if strategy == "fsdp" and hsdp:
                out.append((strategy, nodes, tp))
            out.append((strategy, 1, tp))
    return out


def pp_layouts(
    cfg: ModelConfig, devices: int, gpus_per_node: int = 8, n_micro: int | None = None, max_pp: int | None = None
) -> tuple[list[tuple[str, int, int, int, str, int, int]], dict[int, str]]:
    """(strategy, dp_replicate, tp, pp, schedule, stages_per_rank, n_micro) of every pipeline layout
    the planner tries, and the pp degrees it skips with why. pp divides the device count (at most
    ``max_pp``); ``n_micro`` micro-batches per step (grad_accum; default 4 x pp, a bubble under 1/5);
    each stage's ranks run FSDP2 (HSDP first when a stage spans nodes) with every tp of ``layouts``
    that divides them; the schedules are ``PP_SEARCHED`` that split the model. A stage's ranks are
    contiguous (pp is the outermost mesh dimension), so pipelines cross nodes before TP does."""
    usable = tp_degrees(cfg, devices)[0]
    out, skipped = [], {}
    for pp in range(2, (max_pp or devices) + 1):
        if devices % pp:
            continue
        m = n_micro or 4 * pp
        why = pipeline_blocker(cfg, pp, "1f1b", 1, m)
        if why:
            skipped[pp] = why
            continue
        schedules = [(name, v) for name, v in PP_SEARCHED if pipeline_blocker(cfg, pp, name, v, m) is None]
        per_stage = devices // pp
        nodes = per_stage // gpus_per_node if per_stage % gpus_per_node == 0 else 1
        for tp in (t for t in usable if per_stage % t == 0):
            hsdp = nodes > 1 and gpus_per_node % tp == 0 and gpus_per_node // tp > 1
            for replicate in (nodes, 1) if hsdp else (1,):
                out += [("fsdp", replicate, tp, pp, name, v, m) for name, v in schedules]
    return out, skipped


def layout_estimate(
    cfg: ModelConfig,
    layout: tuple[str, int, int, int, str, int, int],
    devices: int,
    micro_batch: int,
    seq: int,
    target: int | None,
    ac: str,
    mixed: bool,
    settings: dict,
) -> Estimate:
    """``estimate`` of one searched layout, (strategy, dp_replicate, tp, pp, schedule, stages_per_rank,
    n_micro) as ``layouts`` and ``pp_layouts`` give them: TP layouts run sequence parallel."""
    strategy, replicate, tp, pp, schedule, v, m = layout
    return estimate(
        cfg,
        strategy,
        devices,
        micro_batch,
        seq,
        target,
        ac,
        mixed,
        dp_replicate=replicate,
        tp=tp,
        sp=tp > 1,
        pp=pp,
        schedule=schedule,
        stages_per_rank=v,
        n_micro=m,
        **settings,
    )


def recommend(
    cfg: ModelConfig,
    devices: int,
    memory: float,
    seq: int,
    target: int | None,
    mixed: bool = True,
    headroom: float = 0.9,
    settings: dict | None = None,
    gpus_per_node: int = 8,
    max_pp: int = 1,
    n_micro: int | None = None,
    replica_group: bool = False,
) -> list[Estimate]:
    """Every layout (``layouts``; with ``max_pp`` > 1 also ``pp_layouts``; ``replica_group``: those
    of one fault-tolerance group) and AC that fits, each with its largest micro-batch, best first:
    1. no full recomputation: AC full runs the forward twice (~1/3 more compute per step), more than
       TP with sequence parallelism costs inside a node (Korthikanti et al., 2022); nor a pipeline
       bubble above ``MAX_BUBBLE`` (as costly);
    2. a tp within a node (``gpus_per_node``) before one across nodes;
    3. no pipeline, then the fewest stages: TP within a node, then pipeline stages across nodes
       (Narayanan et al., 2021), before TP across nodes;
    4. no TP, then the smallest tp;
    5. the cheapest communication (ddp, ZeRO-1/2/3, HSDP, FSDP2: the order of ``layouts``);
    6. the cheapest recomputation (none, op, full);
    7. the smallest bubble (interleaving, when it fits);
    8. the largest micro-batch.
    TP layouts run sequence parallel (it only removes memory) and the unchunked, vocabulary-
    sharded head (the chunked loss does not take a TP head)."""
    candidates = [
        (strategy, replicate, tp, 1, "1f1b", 1, 1)
        for strategy, replicate, tp in layouts(cfg, devices, gpus_per_node, replica_group)
    ]
    if max_pp > 1:
        candidates += pp_layouts(cfg, devices, gpus_per_node, n_micro, max_pp)[0]
    comm: dict[tuple, int] = {}  # communication order: the schedules of one layout share it
    fits = []
    for strategy, replicate, tp, pp, schedule, v, m in candidates:
        index = comm.setdefault((strategy, replicate, tp, pp), len(comm))
        for ac_rank, ac in enumerate(("none", "op", "full")):
            for mb in (64, 32, 16, 8, 4, 2, 1):
                layout = (strategy, replicate, tp, pp, schedule, v, m)
                e = layout_estimate(cfg, layout, devices, mb, seq, target, ac, mixed, settings or {})
                if e.total <= headroom * memory:
                    fits.append(
                        (
                            (
                                ac == "full" or e.bubble > MAX_BUBBLE,
                                tp > gpus_per_node,
                                pp,
                                tp,
                                index,
                                ac_rank,
                                e.bubble,
                                -mb,
                            ),
                            e,
                        )
                    )
                    break
    return [e for _, e in sorted(fits, key=lambda pair: pair[0])]


# --- context parallelism: each sequence cut over cp ranks ------------------------------------------
CP_DEGREES = (2, 4, 8, 16, 32)


def cp_blocker(cfg: ModelConfig) -> str | None:
    """Why the trainer runs no context parallelism for this model (parallel/context.py), or None."""
    if cfg.attn_dropout > 0:
        return f"model.attn_dropout={cfg.attn_dropout} (context parallelism has no attention dropout)"
    return None


def cp_layouts(cfg: ModelConfig, devices: int, max_cp: int | None = None) -> list[tuple[str, int, int]]:
    """(strategy, tp, cp) of every context-parallel layout tried: cp a power of two dividing the
    devices (with tp; at most ``max_cp``), FSDP2 (and DDP without TP) over the rest; none where the
    model cannot run it (``cp_blocker``). Pipelines with cp run and are priced (``rank_memory``,
    ``time.step_time``), but are not searched here."""
    if cp_blocker(cfg):
        return []
    out = []
    for cp in (c for c in CP_DEGREES if devices % c == 0 and c <= (max_cp or devices)):
        for tp in (t for t in tp_degrees(cfg, devices)[0] if devices % (cp * t) == 0):
            out += [(strategy, tp, cp) for strategy in (("ddp", "fsdp") if tp == 1 else ("fsdp",))]
    return out


def recommend_cp(
    cfg: ModelConfig,
    devices: int,
    memory: float,
    seq: int,
    target: int | None,
    mixed: bool = True,
    headroom: float = 0.9,
    settings: dict | None = None,
    gpus_per_node: int = 8,
    max_cp: int | None = None,
) -> list[Estimate]:
    """The context-parallel layouts that fit (cp up to ``max_cp``), best first, for a sequence no
    other layout fits (``recommend`` is asked first): the smallest cp (its K/V all-gather per
    attention call is the cost), no full recomputation, then ``recommend``'s order (tp within a
    node, no tp, the cheapest communication and recomputation, the largest micro-batch)."""
    fits = []
    for index, (strategy, tp, cp) in enumerate(cp_layouts(cfg, devices, max_cp)):
        for ac_rank, ac in enumerate(("none", "op", "full")):
            for mb in (64, 32, 16, 8, 4, 2, 1):
                e = cp_estimate(cfg, strategy, devices, mb, seq, target, ac, mixed, cp, tp=tp, sp=tp > 1, **(settings or {}))
                if e.total <= headroom * memory:
                    fits.append(((ac == "full", cp, tp > gpus_per_node, tp, index, ac_rank, -mb), e))
                    break
    return [e for _, e in sorted(fits, key=lambda pair: pair[0])]


# --- expert parallelism: an MoE model's experts split over ep of the dp_shard x cp ranks -------------
def ep_degrees(cfg: ModelConfig, dp_shard: int, cp: int = 1) -> list[int]:
    """The ep > 1 a layout of dp_shard x cp ranks can take: divisors of the experts that are a
    multiple of cp dividing dp_shard x cp (parallel/mesh.check_ep); none for a dense model."""
    if not cfg.moe.enabled:
        return []
    return [
        ep
        for ep in range(2, cfg.moe.num_experts + 1)
        if cfg.moe.num_experts % ep == 0 and ep % cp == 0 and dp_shard % (ep // cp) == 0
    ]


def ep_variants(
    cfg: ModelConfig,
    fits: list[Estimate],
    devices: int,
    memory: float,
    seq: int,
    target: int | None,
    mixed: bool = True,
    headroom: float = 0.9,
    settings: dict | None = None,
) -> list[Estimate]:
    """The expert-parallel versions of the FSDP2 layouts in ``fits`` (``recommend``'s and
    ``recommend_cp``'s; tp 1, no pipeline: what parallel.ep runs), one per ``ep_degrees``, each at
    the largest micro-batch up to its base layout's that still fits. EP saves no memory: FSDP2
    shards the experts over dp_shard x cp either way (moe.expert_states_per_rank), and each MoE
    layer keeps the rows it received as well (``ep_activation_bytes``); what it saves is time (the
    expert weights FSDP2 would gather, time.py), so the memory-first order puts these last."""
    settings = settings or {}
    out = []
    for e in fits:
        if not e.strategy.startswith("fsdp") or e.tp > 1 or e.pp > 1:
            continue
        for ep in ep_degrees(cfg, e.dp_shard, e.cp):
            for mb in (m for m in (64, 32, 16, 8, 4, 2, 1) if m <= e.micro_batch):
                if e.cp > 1:
                    base = cp_estimate(cfg, e.strategy, devices, mb, seq, target, e.ac, mixed, e.cp, **settings)
                else:
                    layout = (e.strategy, e.dp_replicate, 1, 1, "1f1b", 1, 1)
                    base = layout_estimate(cfg, layout, devices, mb, seq, target, e.ac, mixed, settings)
                variant = with_expert_parallel(base, cfg, seq, mixed, ep)
                if variant.total <= headroom * memory:
                    out.append(variant)
                    break
    return out
