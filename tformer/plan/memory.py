"""Per-rank memory of a training layout on the device mesh: model states (``states.py``) plus
activations (``activations.py``), for every layout the planner considers.

The mesh is pp x dp_replicate x dp_shard x cp x tp ranks (``estimate``, ``rank_memory``). Pipeline
parallelism (``parallel.pp`` ranks, tformer/parallel/pipeline.py) gives each rank its stages'
parameters (``states.stage_parameters``) and the activations of the micro-batches in flight there
at the schedule's peak (``in_flight``): GPipe keeps all m of a step, 1F1B at most pp - rank,
interleaved 1F1B what torch's ``ScheduleInterleaved1F1B`` warms up plus one. The step's idle share
is the bubble (``bubble``). Context parallelism (``cp_estimate``, tformer/parallel/context.py)
cuts each sequence over cp ranks; expert parallelism (``with_expert_parallel``, plan/moe.py) adds
the rows each MoE layer receives.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import SimpleNamespace

from ..config import ConfigError, ModelConfig, Precision
from ..models import spec_of
from ..parallel.context import padded_length
from ..parallel.mesh import check_ep
from ..parallel.pipeline import check_pipeline, stage_layers, stages_of_rank
from ..parallel.tp import pad_vocab_for_tp
from .activations import activation_bytes
from .head import run_chunk
from .moe import ep_activation_bytes
from .states import model_state_bytes, num_parameters, stage_parameters, tp_blocker, tp_local_parameters


@dataclass
class Estimate:
    strategy: str
    ac: str
    micro_batch: int
    model_states: float
    activations: float
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    sp: bool = False
    pp: int = 1
    schedule: str = ""  # pp > 1: gpipe | 1f1b | interleaved_1f1b
    stages_per_rank: int = 1
    n_micro: int = 1  # pp > 1: the pipeline's micro-batches per step (grad_accum)
    pp_rank: int = 0  # the pipeline rank these bytes are of (the layout's worst one)
    in_flight: float = 1  # micro-batches (through all of the rank's blocks) held at the peak
    bubble: float = 0.0  # the step's idle share
    cp: int = 1  # context-parallel ranks sharing each sequence (cp_estimate)
    ep: int = 1  # expert-parallel ranks (search.ep_variants: the states of FSDP2 over dp_shard x cp)

    @property
    def total(self) -> float:
        return self.model_states + self.activations


# --- pipeline parallelism: stages, micro-batches in flight, the bubble -------------------------
def pipeline_blocker(
    cfg: ModelConfig, pp: int, schedule: str = "1f1b", stages_per_rank: int = 1, n_micro: int | None = None
) -> str | None:
    """Why ``pp`` ranks of ``schedule`` cannot split the model or run ``n_micro`` micro-batches
    (the first sentence of ``pipeline.check_pipeline``'s error, or torch's schedule's condition),
    or None."""
    pcfg = SimpleNamespace(pp=pp, pp_schedule=schedule, pp_stages_per_rank=stages_per_rank, pp_layers=None)
    try:
        check_pipeline(cfg, pcfg, "fsdp")
    except ConfigError as e:
        return str(e).split(";")[0]
    if n_micro is not None and schedule != "gpipe" and n_micro < pp:  # Schedule1F1B refuses it
        return f"{schedule} needs grad_accum >= pp micro-batches (got {n_micro})"
    if n_micro is not None and schedule == "interleaved_1f1b" and n_micro % max(1, n_micro // pp):
        return f"interleaved_1f1b needs grad_accum a multiple of grad_accum // pp (got {n_micro})"
    return None


def in_flight(schedule: str, pp: int, n_micro: int, pp_rank: int = 0, stages_per_rank: int = 1) -> int:
    """Stage micro-batches (one micro-batch through one of the rank's stages) whose saved
    activations pipeline rank ``pp_rank`` holds at its peak, in the order torch's schedules run them:
    - ``gpipe``: every forward before any backward: all ``n_micro``;
    - ``1f1b`` (``Schedule1F1B``): pp - rank warm-up forwards, then a backward before each forward:
      min(m, pp - rank);
    - ``interleaved_1f1b`` (``ScheduleInterleaved1F1B``, v stages per rank, m micro-batches in
      rounds of m // max(1, m // pp)): its warm-up (``_get_warmup_ops``: (v - 1) x per-round + 2 x
      (pp - 1 - rank) forwards), then a forward before each backward: one more; at most v x m."""
    if schedule == "gpipe":
        return n_micro
    if schedule == "1f1b":
        return min(n_micro, pp - pp_rank)
    per_round = n_micro // max(1, n_micro // pp)
    return min((stages_per_rank - 1) * per_round + 2 * (pp - 1 - pp_rank) + 1, stages_per_rank * n_micro)


def bubble(schedule: str, pp: int, n_micro: int, stages_per_rank: int = 1) -> float:
    """The step's idle share: (pp - 1) / (m + pp - 1) for GPipe and 1F1B, (pp - 1) / (v m + pp - 1)
    interleaved (Narayanan et al., 2021: a bubble of (pp - 1) / v stage-passes against m)."""
    v = stages_per_rank if schedule == "interleaved_1f1b" else 1
    return (pp - 1) / (v * n_micro + pp - 1)


def _pipeline_rank(
    cfg: ModelConfig,
    strategy: str,
    dp_shard: int,
    micro_batch: int,
    seq: int,
    target: int | None,
    ac: str,
    mixed: bool,
    tp: int,
    sp: bool,
    pp: int,
    schedule: str,
    v: int,
    n_micro: int,
    rank: int,
    memory: dict,
    cp: int = 1,
) -> tuple[float, float, float]:
    """(model states, activations, micro-batches in flight) of pipeline rank ``rank``; with ``cp``
    its stages' parameters are sharded over dp_shard x cp and hold 1/cp of every sequence."""
    stages = pp * v
    mine = stages_of_rank(rank, pp, stages)
    last = stages - 1 in mine
    params = stage_parameters(cfg, stages, tp)
    states = model_state_bytes(strategy, sum(params[s] for s in mine), dp_shard * cp, mixed, as_built=True)
    shapes = spec_of(cfg).stack_shapes(cfg, seq, target)
    if len(shapes) > 1:  # rank i runs stack i
        blocks = tuple(n if i == rank else 0 for i, (n, _, _) in enumerate(shapes))
    else:  # interleaved stages are equal (the blocks divide evenly); 1F1B and GPipe: the rank's one stage
        blocks = (max(len(stage_layers(cfg.num_layers, stages)[s]) for s in mine), 0)

    def act(transient=True, head=False):
        kw = {**memory, "tp": tp, "sp": sp, "blocks": blocks, "transient": transient, "head": head}
        if cp > 1:
            return cp_activation_bytes(cfg, micro_batch, seq, target, ac, mixed, cp, **kw)
        return activation_bytes(cfg, micro_batch, seq, target, ac, mixed, **kw)

    kept = act(transient=False)
    units = in_flight(schedule, pp, n_micro, rank, v)
    # the recomputed block's and (last stage) the head's backward peak come once
    activations = units * kept + act(head=last) - kept
    if last and schedule == "gpipe":  # every micro-batch's forward ends in the loss before a backward
        if memory.get("chunk") and tp == 1 and not memory.get("return_logits", True):
            out_len = spec_of(cfg).output_len(seq, target)
            rows = micro_batch * (cp_local_length(out_len, cp, tp, sp) if cp > 1 else out_len) * memory.get("labelled", 1.0)
            head = 4 * cfg.d_model * (cfg.padded_vocab_size + rows)  # its carried weight and input gradients
        else:  # the saved log-probabilities
            head = act(head=True) - act()
        activations += (n_micro - 1) * head
    return states, activations, units / v


def estimate(
    cfg: ModelConfig,
    strategy: str,
    devices: int,
    micro_batch: int,
    seq: int,
    target: int | None = None,
    ac: str = "none",
    mixed: bool = True,
    dp_replicate: int = 1,
    tp: int = 1,
    sp: bool = False,
    pp: int = 1,
    schedule: str = "1f1b",
    stages_per_rank: int = 1,
    n_micro: int | None = None,
    pp_rank: int | None = None,
    cp: int = 1,
    outer_momentum: bool = False,
    **memory,
) -> Estimate:
    """One rank of ``devices`` = pp x dp_replicate x dp_shard x tp. ``outer_momentum``: DiLoCo's
    (``outer_momentum_bytes``), counted with the model states. ``memory``: the head and offload
    settings of ``activation_bytes`` (chunk, offload, loss_parallel, ...). With ``pp`` > 1: ``n_micro``
    micro-batches per step (default 4 x pp) through ``schedule``, and the rank ``pp_rank``, or
    (None) the worst one: the first (most micro-batches in flight, the embeddings) or the last (the
    head and loss); a middle rank holds no more than the first. A pipeline with ``cp`` > 1 (devices
    pp x dp_replicate x dp_shard x cp x tp): each stage's activations are ``cp_activation_bytes``'
    and FSDP2 shards its states over dp_shard x cp (without a pipeline, see ``cp_estimate``)."""
    if cp > 1 and pp == 1:
        raise ValueError("context parallelism without a pipeline is cp_estimate's")
    dp_shard = devices // (pp * dp_replicate * tp * cp)
    cfg = pad_vocab_for_tp(cfg, tp)  # the rows the trainer will hold
    # bf16 autocast over fp32 weights: plain data parallelism; FSDP2 and DeepSpeed compute in bf16 weights
    memory = {"fp32_weights": strategy == "ddp", **memory}
    if pp == 1:
        states = model_state_bytes(strategy, tp_local_parameters(cfg, tp), dp_shard, mixed, as_built=True)
        if outer_momentum:
            states += outer_momentum_bytes(cfg, strategy, tp, dp_shard)
        return Estimate(
            strategy,
            ac,
            micro_batch,
            states,
            activation_bytes(cfg, micro_batch, seq, target, ac, mixed, tp=tp, sp=sp, **memory),
            dp_replicate,
            dp_shard,
            tp,
            sp,
        )
    m = n_micro or 4 * pp
    v = stages_per_rank if schedule == "interleaved_1f1b" else 1
    best = None
    for rank in [pp_rank] if pp_rank is not None else sorted({0, pp - 1}):
        states, activations, held = _pipeline_rank(
            cfg, strategy, dp_shard, micro_batch, seq, target, ac, mixed, tp, sp, pp, schedule, v, m, rank, memory, cp
        )
        e = Estimate(
            strategy,
            ac,
            micro_batch,
            states,
            activations,
            dp_replicate,
            dp_shard,
            tp,
            sp,
            pp,
            schedule,
            v,
            m,
            rank,
            held,
            bubble(schedule, pp, m, v),
            cp,
        )
        if best is None or e.total > best.total:
            best = e
    assert best is not None
    return best


def outer_momentum_bytes(cfg: ModelConfig, strategy: str, tp: int, shard: int) -> float:
    """DiLoCo's outer Nesterov momentum (``fault_tolerance.semi_sync=diloco``, plan/replicas.py):
    one fp32 buffer per parameter the rank holds, on the device beside its model states (its
    parameter backup is in host memory). FSDP2 holds 1/``shard`` of the TP-local parameters; DDP
    all of them. The trainer refuses DiLoCo with pipelines, ZeRO and HSDP."""
    return 4.0 * tp_local_parameters(cfg, tp) / (1 if strategy == "ddp" else shard)


PRECISIONS: tuple[Precision, ...] = ("fp32", "bf16", "fp16")  # the run's, once precision=auto is resolved


def rank_memory(
    cfg: ModelConfig,
    *,
    seq_len: int,
    micro_batch: int = 1,
    dp_replicate: int = 1,
    dp_shard: int = 1,
    tp: int = 1,
    sp: bool = False,
    precision: str = "bf16",
    ac: str = "none",
    strategy: str = "fsdp",
    target_len: int | None = None,
    pp: int = 1,
    pp_schedule: str = "1f1b",
    pp_stages_per_rank: int = 1,
    n_micro: int | None = None,
    pp_rank: int = 0,
    cp: int = 1,
    ep: int = 1,
    **memory,
) -> Estimate:
    """Predicted bytes one rank holds on the mesh pp x dp_replicate x dp_shard x cp x tp:
    ``model_states`` (parameters, gradients, AdamW) and ``activations`` (kept for backward plus the
    backward peak), for ``bench/bench_scale.py`` to hold against measured per-rank peaks.
    ``precision`` fp32 or bf16 (mixed); ``ac`` none | op | full; ``memory``: ``activation_bytes``'s
    head settings (``return_logits=False`` and ``chunk`` for the trainer's loss path,
    ``loss_parallel``). ``pp`` > 1: pipeline rank ``pp_rank`` of ``pp_schedule`` over ``n_micro``
    micro-batches (``grad_accum``; default 4 x pp); ``in_flight`` and ``bubble`` come with it.
    ``cp`` > 1: context parallelism (``cp_estimate``; with a pipeline, ``estimate``); ``ep`` > 1:
    an MoE model's experts over ep of the dp_shard x cp ranks (``with_expert_parallel``)."""
    blocker = tp_blocker(cfg, tp)
    if blocker:
        usable = ", ".join(str(t) for t in range(1, cfg.num_heads + 1) if tp_blocker(cfg, t) is None)
        raise ConfigError(f"parallel.tp={tp} does not divide {blocker}; use one of: {usable}")
    cfg = pad_vocab_for_tp(cfg, tp)  # the rows the trainer will hold
    if precision not in PRECISIONS:
        raise ConfigError(f"precision={precision!r} is not allowed; use one of: {', '.join(PRECISIONS)}")
    if dp_replicate > 1 and not strategy.startswith("fsdp"):
        raise ConfigError(
            f"parallel.dp_replicate={dp_replicate} needs parallel.strategy=fsdp (HSDP), "
            f"not {strategy!r}; set parallel.dp_replicate=1"
        )
    if pp > 1:
        if not 0 <= pp_rank < pp:
            raise ConfigError(f"pp_rank={pp_rank} is not a rank of parallel.pp={pp}; use 0 to {pp - 1}")
        why = pipeline_blocker(cfg, pp, pp_schedule, pp_stages_per_rank, n_micro or 4 * pp)
        if why:
            raise ConfigError(why)
    check_expert_parallel(cfg, ep, dp_shard, cp)
    if ep > 1 and not strategy.startswith("fsdp"):
        raise ConfigError(f"parallel.ep={ep} needs parallel.strategy=fsdp, not {strategy!r}")
    mixed = precision != "fp32"
    if cp > 1 and pp == 1:
        e = cp_estimate(
            cfg, strategy, dp_shard * cp * tp, micro_batch, seq_len, target_len, ac, mixed, cp, tp=tp, sp=sp, **memory
        )
        return with_expert_parallel(e, cfg, seq_len, mixed, ep)
    e = estimate(
        cfg,
        strategy,
        pp * dp_replicate * dp_shard * cp * tp,
        micro_batch,
        seq_len,
        target_len,
        ac,
        precision != "fp32",
        dp_replicate=dp_replicate,
        tp=tp,
        sp=sp,
        pp=pp,
        schedule=pp_schedule,
        stages_per_rank=pp_stages_per_rank,
        n_micro=n_micro,
        pp_rank=pp_rank,
        cp=cp,
        **memory,
    )
    return with_expert_parallel(e, cfg, seq_len, mixed, ep)


def check_expert_parallel(cfg: ModelConfig, ep: int, dp_shard: int, cp: int) -> None:
    """What any ``parallel.ep`` needs (parallel/ep.py, mesh.check_ep), refused in one line: experts,
    an ep that divides them, a multiple of cp that divides dp_shard x cp."""
    if ep == 1:
        return
    if not cfg.moe.enabled:
        raise ConfigError(
            f"parallel.ep={ep} needs a mixture-of-experts model (model.moe.num_experts > 0); set parallel.ep=1"
        )
    if cfg.moe.num_experts % ep:
        raise ConfigError(
            f"model.moe.num_experts={cfg.moe.num_experts} is not divisible by parallel.ep={ep}; choose an ep that divides it"
        )
    check_ep(ep, dp_shard, cp)


def with_expert_parallel(e: Estimate, cfg: ModelConfig, seq: int, mixed: bool, ep: int) -> Estimate:
    """``e`` with its MoE layers' experts over ``ep`` ranks: the same model states (FSDP2 shards the
    experts over dp_shard x cp either way: moe.expert_states_per_rank) and the rows each MoE layer
    receives, kept for backward besides those it sent (``moe.ep_activation_bytes``)."""
    if ep == 1:
        return e
    local = cp_local_length(seq, e.cp, e.tp, e.sp) if e.cp > 1 else seq
    extra = e.micro_batch * ep_activation_bytes(cfg, local, ep, 2 if mixed else 4, e.ac)
    return replace(e, activations=e.activations + extra, ep=ep)


def training_memory(cfg, device_memory: float | None = None) -> dict:
    """``activation_bytes`` settings of a run config: the trainer's loss-only path, its chunked
    head, offload (host memory only on an accelerator) and BERT's labelled share. ``loss.chunk_size:
    auto`` is resolved as the trainer resolves it (``plan/head.py``) for the run's micro-batch on a
    device of ``device_memory`` bytes (None: a CPU, whose measured best it keeps)."""
    model_cfg = cfg.model
    p = cfg.parallel
    dims = (p.tp, p.pp, p.dp_shard, p.cp)
    precision = "fp32" if cfg.precision == "fp32" else "bf16"
    chunk = run_chunk(
        cfg, model_cfg, precision, num_parameters(model_cfg), device_memory, dims, cfg.data.seq_len, cfg.data.target_len
    )
    return {
        "return_logits": False,
        "chunk": chunk,
        "offload": cfg.parallel.activation_offload and cfg.device != "cpu",
        "labelled": cfg.data.mlm_probability if spec_of(model_cfg).masked_lm else 1.0,
    }


# --- context parallelism (parallel/context.py): each sequence cut over cp ranks ---------------------
def cp_local_length(seq: int, cp: int, tp: int = 1, sp: bool = False) -> int:
    """Tokens one rank holds of a ``seq``-token sequence (padded to 2 cp chunks, and to tp under SP)."""
    return padded_length(seq, cp, tp if sp else 1) // cp


def cp_attention_bytes(
    cfg: ModelConfig, micro_batch: int, seq: int, target: int | None, mixed: bool, cp: int, tp: int = 1
) -> float:
    """Peak bytes one context-parallel attention call adds in its backward, one call at a time: the
    whole sequence's keys and values all-gathered (the activations' dtype), their gradients (fp32,
    in the reduce-scatter's layout) and, with T5's relative bias, the chunk pair's scores, their
    gradient and bias (fp32, the math path that also gives the bias its gradient)."""
    elt = 2 if mixed else 4
    keys = max(seq, target or 0)  # the longest stream of keys (T5's cross-attention: the encoder's)
    kv = cfg.kv_heads * cfg.head_dim / tp
    gathered = 2 * kv * keys * (elt + 4)
    pair = 0.0
    if cfg.position == "relative":
        chunk = -(-keys // (2 * cp))
        pair = cfg.num_heads / tp * chunk * chunk * (3 * 4 + elt)
    return micro_batch * (gathered + pair)


def cp_activation_bytes(
    cfg: ModelConfig,
    micro_batch: int,
    seq: int,
    target: int | None,
    ac: str,
    mixed: bool,
    cp: int,
    tp: int = 1,
    sp: bool = False,
    transient: bool = True,
    blocks: tuple[int, int] | None = None,
    **memory,
) -> float:
    """``activation_bytes`` of one rank holding ``seq / cp`` tokens of every sequence (and of the
    target): its blocks keep per token what they keep on one device, except that the attention
    keeps q, k, v, its output and a log-sum-exp (fp32) per head whatever the kernel, never (queries
    x keys) probabilities or a bias; with ``transient`` the gathered K/V of one attention call
    (``cp_attention_bytes``) are added to the backward peak. ``blocks`` (and ``head`` in
    ``memory``): a pipeline stage's part of the model, as in ``activation_bytes``."""
    local = cp_local_length(seq, cp, tp, sp)
    local_target = cp_local_length(target, cp, tp, sp) if target else None
    kept_like_sdpa = cfg.replace(attn_impl="sdpa", position="none")
    total = activation_bytes(
        kept_like_sdpa, micro_batch, local, local_target, ac, mixed, transient=transient, tp=tp, sp=sp, blocks=blocks,
        **memory,
    )  # fmt: skip
    shapes = spec_of(cfg).stack_shapes(cfg, seq, target)
    first, second = blocks if blocks is not None else (shapes[0][0], shapes[1][0] if len(shapes) > 1 else 0)
    if ac == "none":  # a decoder block of an encoder-decoder model attends twice
        total += micro_batch * (first + 2 * second) * max(local, local_target or 0) * cfg.num_heads / tp * 4  # lse
    if transient:  # an encoder-only stage attends to the source alone
        total += cp_attention_bytes(cfg, micro_batch, seq, target if second else None, mixed, cp, tp)
    return total


def cp_estimate(
    cfg: ModelConfig,
    strategy: str,
    devices: int,
    micro_batch: int,
    seq: int,
    target: int | None,
    ac: str,
    mixed: bool,
    cp: int,
    tp: int = 1,
    sp: bool = False,
    outer_momentum: bool = False,
    **memory,
) -> Estimate:
    """One rank of ``devices`` = dp_shard x cp x tp (``estimate``'s mesh with cp): FSDP2 shards the
    model states over dp_shard x cp (the cp ranks hold the same parameters); DDP keeps them whole.
    ``outer_momentum``: DiLoCo's, as in ``estimate``."""
    dp_shard = devices // (cp * tp)
    cfg = pad_vocab_for_tp(cfg, tp)
    memory = {"fp32_weights": strategy == "ddp", **memory}
    states = model_state_bytes(strategy, tp_local_parameters(cfg, tp), dp_shard * cp, mixed, as_built=True)
    if outer_momentum:
        states += outer_momentum_bytes(cfg, strategy, tp, dp_shard * cp)
    activations = cp_activation_bytes(cfg, micro_batch, seq, target, ac, mixed, cp, tp=tp, sp=sp, **memory)
    return Estimate(strategy, ac, micro_batch, states, activations, 1, dp_shard, tp, sp, cp=cp)
