"""Step time of one layout, from the model's shapes and a few hardware figures (hardware.py).

One step on one device is the sum of
- **compute** (compute.py): every GEMM of the step at the device's rate for its shape: forward,
  backward, what the activation-checkpointing policy recomputes, and the head;
- **memory-bound work** (memory_bound.py): the elementwise ops, the head's softmax and loss and the
  optimizer step at the memory bandwidth (a CPU's compute-bound elementwise work at its measured rate);
- **exposed communication** (comm.py): each collective priced with ring formulas over the link its
  group lies on, less what the overlap rules hide;
- **the pipeline bubble**: the busy time x b / (1 - b), b from memory.bubble;
- **the host's time** (``host/dispatch``, plan/host.py): every aten op of the step, counted on the
  model itself, at the profile's ``op_overhead``; those on DTensors at more: TP's parallelized
  modules and sharded loss at ``dtensor_op_overhead``, the optimizer over FSDP2 or TP parameters at
  ``dtensor_optimizer_overhead``; FSDP2's hooks at ``fsdp_unit_overhead`` per sharded module and
  micro-batch, ``fsdp_local_overhead`` where its group is one rank (beside tp or pp at dp_shard 1).
  On the CPU the host runs the kernels itself: it adds (and a pipeline stage's host time is part of
  what its bubble idles), and the ranks of a layout share the machine's caches and memory
  (``Hardware.shared``). A GPU's host issues work ahead of the device: only what exceeds the
  device's whole step shows (step = max(host, device)), which for any model of a useful size is
  nothing.

**Context parallelism** (``Layout.cp``, parallel/context.py): a rank holds 2 of the 2 cp chunks of
every sequence (padded to them), so every linear layer, norm and the head run over seq / cp tokens,
and attention's core over (seq / cp queries) x (seq keys), chunk pair by chunk pair: causal, the
pairs at or below the diagonal, 2 cp + 1 of them, half of the whole (load-balanced: the same on
every rank). The kernel is the device's: on the CPU torch's flash kernel per pair (the two diagonal
pairs half-computed, flash's 2.5x backward); on a GPU tformer writes each pair's scores out in fp32
(``context._pair_forward``: QK^T in fp32, P V in the run's precision, a backward of five fp32
products: QK^T again, dV, dP, dQ, dK), with the softmax's traffic over the scores. Per attention
layer and micro-batch, forward all-gathers K and V over the cp group (the activations' dtype),
backward gathers them again and reduce-scatters dK and dV (fp32, as ``_scatter_back`` sends them),
and a recomputed forward gathers once more. FSDP2 (and DDP) run over dp_shard x cp. With pipelines
each stage's ranks do this for the stage's blocks, and the stages send 1/cp of the hidden states.

**Expert parallelism** (``Layout.ep``, MoE models, parallel/ep.py): the ep ranks are ep of the
dp_shard x cp ranks, neighbours on the mesh. Per MoE layer and micro-batch, two all-to-alls in
forward (dispatch to the experts' ranks, combine back) and two in backward, each of the rank's
routed rows (tokens x top_k x d_model, the activations' dtype), (ep - 1) / ep of them leaving the
rank under balanced routing (plan/moe.py counts the same bytes), two more in a recomputed forward,
and before each forward dispatch an exchange of the row counts (latency only). Each of the rank's
num_experts / ep experts receives tokens x top_k x ep / num_experts rows (larger GEMMs than without
EP), and FSDP2 gathers the expert weights over what EP leaves of dp_shard x cp (1/ep of them each),
the other weights over all of it.

The overlap rules are comm.py's; the layouts the model refuses, layout.py's (``NotPriced``,
``check_layout``).
"""

from __future__ import annotations

from ..config import ModelConfig
from ..data.config import DataConfig
from ..models import spec_of
from ..models.flops import training_flops
from ..parallel.context import padded_length
from .comm import cp_comm, data_parallel, ep_comm, link_of, overlap, tp_comm
from .compute import (
    FLOAT8_CAST_BYTES,
    attention_kernel,
    backward_time,
    block_gemms,
    float8_casts,
    gemm_time,
    head_time,
    recomputed_gemms,
)
from .hardware import Hardware
from .host import op_counts, optimizer_ops
from .layout import Layout, NotPriced, Stage, StepTime, check_layout, rank_stages, why_not_priced
from .memory import Estimate, bubble, cp_estimate, estimate, with_expert_parallel
from .memory_bound import (
    elementwise,
    fp32_stream_bytes,
    gpu_head_bytes,
    head_exps,
    head_traffic,
    score_bytes,
    transcendental_seconds,
)


# per fp32 parameter: AdamW reads p, g, m, v and writes p, m, v (28); grad norm + clip (12); zeroing (4)
ADAMW_BYTES = 28
OPTIMIZER_BYTES = ADAMW_BYTES + 12 + 4

# per fp32 weight under bf16 autocast where the weights stay fp32 (DDP, one device; FSDP2 and
# DeepSpeed gather bf16 copies instead): the step's first use casts it to bf16 (read 4, write 2;
# autocast caches the copy for the step) and its bf16 gradient is cast back to fp32 (read 2, write 4)
AUTOCAST_WEIGHT_BYTES = 12


# kernels between context parallelism's chunk pairs, counted from context.py for ``op_overhead``: a
# pair's forward (the kernel and its log-sum-exp merge, 14) and backward (the kernel and three
# gradient accumulations, 4), averaged over the 3 passes ``_micro_batch`` counts
PAIR_KERNELS = 6


def head_rows(cfg: ModelConfig, tokens: int) -> int:
    """Rows of ``tokens`` the head runs over: a masked LM's labelled share only (models/base.py
    gathers the labelled positions first), at the data's default ``mlm_probability``."""
    if not spec_of(cfg).masked_lm:
        return tokens
    return round(tokens * DataConfig().mlm_probability)


def _lengths(cfg: ModelConfig, seq: int, target: int | None) -> tuple[int, int | None]:
    if not spec_of(cfg).seq2seq:
        return seq, None
    return seq, target or seq


def _padded(length: int, layout: Layout) -> int:
    """A sequence's length as the rank's mesh holds it: padded to 2 cp chunks (and a multiple of tp
    under sequence parallelism) under context parallelism, as is otherwise."""
    if layout.cp == 1:
        return length
    return padded_length(length, layout.cp, layout.tp if layout.sp and layout.tp > 1 else 1)


def _micro_batch(cfg: ModelConfig, layout: Layout, hw: Hardware, stage: Stage, seq: int, target: int | None) -> dict:
    """Seconds of one micro-batch's forward + backward on one rank of ``stage``, by part, before
    any data-parallel communication."""
    mb, tp, sp, mixed, cp = layout.micro_batch, layout.tp, layout.sp and layout.tp > 1, layout.mixed, layout.cp
    peak = hw.peak[layout.precision]
    elt = 2 if mixed else 4
    bandwidth = hw.hbm_bandwidth * hw.hbm_efficiency
    first, second = stage.blocks
    seq = _padded(seq, layout)
    out_len = _padded(spec_of(cfg).output_len(seq, target), layout)
    # (blocks, of them MoE, whole length, cross-attended length) per stack; a rank runs 1/cp of each
    stacks = [(first, stage.moe[0], seq, None), (second, stage.moe[1], out_len, seq)]
    flash = layout.attention == "flash"
    kernel = attention_kernel(flash, cp, hw.device)
    fp8 = hw.peak["fp8"] if layout.float8 else None  # the blocks' converted linear layers' rate
    fwd = bwd = elements = scores = kernels = transcendental = casts = float8_weights = stream = 0.0
    passes = 3 + (1 if layout.ac != "none" else 0)  # forward, backward (2x), recomputed forward
    for n, n_moe, length, cross in stacks:
        for count, moe in ((n - n_moe, False), (n_moe, True)):
            if not count:
                continue
            gemms = block_gemms(cfg, mb, length, tp, cross, flash, cp, hw.device, moe, layout.ep)
            again = recomputed_gemms(gemms, layout.ac)
            fwd += count * gemm_time(gemms, peak, hw, fp8)
            bwd += count * (backward_time(gemms, peak, hw, fp8) + gemm_time(again, peak, hw, fp8))
            if fp8:
                casts += count * float8_casts(gemms, again)
                float8_weights += count * sum(g.n * g.k for g in gemms if g.float8)
            e, k = elementwise(cfg, tp, sp, layout.compile, cross is not None, moe)
            if layout.compile:  # a compiled block issues its fused kernels and GEMMs, not its eager ops
                kernels += count * (k + len(gemms))
            elements += count * mb * length // cp * e
            if mixed and layout.strategy == "ddp":  # autocast over fp32 weights: an fp32 residual stream
                stream += (
                    count
                    * mb
                    * length
                    // cp
                    * fp32_stream_bytes(cfg, tp, sp, layout.compile, cross is not None, layout.ac != "none")
                )
            scores += count * score_bytes(cfg, layout, gemms, kernel)
            tokens = mb * length // cp
            transcendental += count * transcendental_seconds(cfg, layout, hw, gemms, kernel, tokens, moe, passes)
            if cp > 1:  # the chunk pairs' kernels, beyond what the counted block runs
                pairs = sum(g.executed / (2 * g.m * g.n * g.k) for g in gemms if g.kind == "scores") / mb
                kernels += count * PAIR_KERNELS * pairs / (cfg.num_heads // tp)
    head_tokens = head_rows(cfg, mb * out_len // cp)
    head_fwd, head_bwd = head_time(cfg, layout, head_tokens, peak, hw) if stage.head else (0.0, 0.0)
    compute = fwd + bwd + head_fwd + head_bwd
    memory = (passes * elements * elt + scores + stream + casts * FLOAT8_CAST_BYTES[layout.compile]) / bandwidth
    memory += transcendental
    if stage.head and not hw.exp_rate:  # a datasheet profile: the passes as the loss runs them on a GPU
        memory += gpu_head_bytes(cfg, layout, head_tokens) / bandwidth
    elif stage.head:  # a calibrated CPU's: its measured exp rate where slower than the bytes
        split = tp if layout.loss_parallel else 1
        memory += max(
            head_traffic(cfg, head_tokens, split, mixed) / bandwidth, head_exps(cfg, layout, head_tokens, split, hw)
        )
    if stage.embed:
        memory += 3 * mb * seq // cp * cfg.d_model * elt / bandwidth  # the lookup and its scatter-add gradient
    return {
        "compute": compute,
        "memory-bound": memory,
        "host": _host_micro_batch(cfg, layout, hw, stage) + hw.op_overhead * passes * kernels,
        "tp": overlap("tp", tp_comm(cfg, layout, hw, stage, seq, out_len), 0.0, 0.0, hw),
        "cp": overlap("cp", cp_comm(cfg, layout, hw, stage, seq, out_len), 0.0, 0.0, hw),
        "ep": overlap("ep", ep_comm(cfg, layout, hw, stage, seq, out_len), 0.0, 0.0, hw),
        "fwd": fwd + head_fwd,
        "bwd": bwd + head_bwd,
        "float8_weights": float8_weights,  # elements (not seconds): FSDP2's float8 all-gather
    }


def _fsdp2(layout: Layout) -> bool:
    return layout.strategy in ("fsdp", "fsdp-no-reshard")


def _host_micro_batch(cfg: ModelConfig, layout: Layout, hw: Hardware, stage: Stage) -> float:
    """Host seconds of one micro-batch on one rank of ``stage`` (plan/host.py): every aten op of
    its blocks' forward and backward (and a recomputed forward), of the embedding, head and loss on
    the stage holding the head, at ``op_overhead``; those TP runs on DTensors at
    ``dtensor_op_overhead`` more; FSDP2's per-module hooks at ``fsdp_unit_overhead`` for each block
    and the root. Under ``compile`` a block's ops are its fused kernels and GEMMs (``_micro_batch``)."""
    c = op_counts(cfg)
    again = layout.ac != "none"
    ops = 0.0 if layout.compile else sum(n * (c.blocks[i] + again * c.forward[i]) for i, n in enumerate(stage.blocks))
    dtensor = sum(n * c.tp_blocks[i] for i, n in enumerate(stage.blocks)) if layout.tp > 1 else 0.0
    if stage.head:
        ops += c.rest
        dtensor += c.tp_rest if layout.tp > 1 else 0
    units = sum(stage.blocks) + 1 if _fsdp2(layout) else 0
    alone = layout.dp_replicate * layout.dp_shard * layout.cp == 1  # FSDP2 over a 1-rank group
    unit = hw.fsdp_local_overhead if alone else hw.fsdp_unit_overhead
    return ops * hw.op_overhead + dtensor * hw.dtensor_op_overhead + units * unit


def _host_optimizer(cfg: ModelConfig, layout: Layout, hw: Hardware, stage: Stage) -> float:
    """Host seconds of the optimizer step on one rank (plan/host.py): torch's fused AdamW, as the
    trainer builds it for every layout (under FSDP2 / TP DTensor dispatches its kernels on the
    local shards, each op at the DTensor's extra cost), and the clip's per-parameter ops."""
    c = op_counts(cfg)
    dtensors = _fsdp2(layout) or layout.tp > 1
    # TP without FSDP2 leaves plain parameters beside the DTensors: foreach (the loop on a CPU)
    mixed = layout.tp > 1 and not _fsdp2(layout)
    kind = "fused" if not mixed else "loop" if hw.device == "cpu" else "foreach"
    params = sum(n * c.block_params[i] for i, n in enumerate(stage.blocks)) + c.rest_params
    return optimizer_ops(kind).ops(params) * (hw.op_overhead + dtensors * hw.dtensor_optimizer_overhead)


def adamw_step_seconds(cfg: ModelConfig, layout: Layout, hw: Hardware, stage: Stage) -> tuple[float, float]:
    """(memory traffic, host) seconds of the optimizer step on the rank holding ``stage``: AdamW,
    the clip and the zeroing over its shard of the parameters (``OPTIMIZER_BYTES``; under bf16
    autocast over fp32 weights also their casts, ``AUTOCAST_WEIGHT_BYTES``), and their host ops."""
    bandwidth = hw.hbm_bandwidth * hw.hbm_efficiency
    shard = 1 if layout.strategy == "ddp" else layout.dp_shard * layout.cp
    traffic = stage.params / shard * OPTIMIZER_BYTES / bandwidth
    if layout.mixed and layout.strategy == "ddp":  # autocast over fp32 weights: AUTOCAST_WEIGHT_BYTES
        traffic += stage.params * AUTOCAST_WEIGHT_BYTES / bandwidth
    return traffic, _host_optimizer(cfg, layout, hw, stage)


def _pipeline_alone(shared: dict, alone: dict, layout: Layout, m: int) -> dict:
    """A CPU pipeline stage's compute and memory-bound work: while its peer idles in the bubble it
    has the machine's caches and memory to itself. With a bubble share b of the step, a stage is
    idle b/(1 - b) of its busy time, during which its peer works alone (the idle periods of two
    stages do not overlap), so 1 - b/(1 - b) of a stage's work runs beside its peer's (at the
    shared rates) and the rest alone; with pp > 2 a stage's peers are counted as one."""
    b = bubble(layout.schedule, layout.pp, m, layout.stages_per_rank)
    beside = max(0.0, 1 - b / (1 - b))
    out = dict(shared)
    for key in ("compute", "memory-bound"):
        out[key] = beside * shared[key] + (1 - beside) * alone[key]
    return out


def step_time(
    cfg: ModelConfig,
    layout: Layout,
    hw: Hardware,
    seq_len: int,
    target_len: int | None = None,
    memory: bool = True,
) -> StepTime:
    """Predicted seconds of one optimizer step of ``layout`` on ``hw`` and its breakdown (module
    doc). Raises ``ConfigError`` for a layout no run can have (``check_layout``) and ``NotPriced``
    for one the model has no terms for."""
    check_layout(cfg, layout)
    why = why_not_priced(cfg, layout, hw)
    if why:
        raise NotPriced(f"not priced: {why}")
    seq, target = _lengths(cfg, seq_len, target_len)
    alone, hw = hw, hw.shared(min(layout.devices, hw.gpus_per_node))  # a CPU's ranks share its caches and memory
    m = layout.micro_batches
    ranks = []
    for stage in rank_stages(cfg, layout):
        mb = _micro_batch(cfg, layout, hw, stage, seq, target)
        if layout.pp > 1 and hw is not alone:
            mb = _pipeline_alone(mb, _micro_batch(cfg, layout, alone, stage, seq, target), layout, m)
        dp = data_parallel(layout, hw, stage, mb["fwd"], mb["bwd"], sum(stage.blocks), mb["float8_weights"])
        ranks.append((mb, dp, stage))
    busy = ("compute", "memory-bound", "tp", "cp", "ep") + (("host",) if hw.device == "cpu" else ())
    mb, dp, stage = max(ranks, key=lambda r: sum(r[0][k] for k in busy) + sum(r[1].values()))
    parts = {k: m * mb[k] for k in busy if k in ("compute", "memory-bound", "tp") or mb[k] > 0}
    parts["optimizer"], host_optimizer = adamw_step_seconds(cfg, layout, hw, stage)
    if layout.pp > 1:
        v = layout.stages_per_rank if layout.schedule == "interleaved_1f1b" else 1
        b = bubble(layout.schedule, layout.pp, m, v)
        parts["bubble"] = (parts["compute"] + parts["memory-bound"] + parts["tp"] + parts.get("host", 0.0)) * b / (1 - b)
        elt = 2 if layout.mixed else 4
        # a stage sends the hidden states of the rank's tokens: 1/cp of the (padded) sequence
        tokens = _padded(seq, layout) // layout.cp  # (an encoder-decoder: the encoder output)
        send = layout.micro_batch * tokens * cfg.d_model * elt / (layout.tp if layout.sp else 1)
        stride = layout.tp * layout.cp * layout.dp_shard * layout.dp_replicate
        link = link_of(hw, stride, 2)
        parts["pp"] = 2 * (layout.pp * v - 1) * (link.latency + send / link.bandwidth)
    parts.update(dp)
    host = m * mb["host"] + host_optimizer
    # the host's time (plan/host.py): on the CPU it runs the kernels itself, so it adds; a GPU's
    # host issues work ahead of the device and shows only where it outruns the device's work
    device = sum(parts.values()) - parts.pop("host", 0.0)
    parts["host/dispatch"] = host if hw.device == "cpu" else max(0.0, host - device)
    step = sum(parts.values())
    tokens = layout.micro_batch * m * layout.dp_replicate * layout.dp_shard * (seq + (target or 0))
    model_flops = training_flops(cfg, layout.micro_batch, seq, target) * m * layout.dp_replicate * layout.dp_shard
    mfu = model_flops / layout.devices / step / hw.peak[layout.precision]
    result = StepTime(step, tokens, layout.devices, mfu, parts)
    if memory:
        result.memory = predicted_memory(cfg, layout, seq, target).total
    return result


def predicted_memory(cfg: ModelConfig, layout: Layout, seq: int, target: int | None = None) -> Estimate:
    """memory.py's per-rank bytes of the layout (the trainer's loss path: no returned logits;
    tformer's flash attention: the S x S probabilities an unfused kernel keeps are not in it).
    Context parallelism: ``cp_estimate`` over the dp_shard x cp x tp ranks of one replica (with a
    pipeline: ``estimate``'s stages, each over 1/cp of the sequence). Expert
    parallelism shards the experts as FSDP2 over dp_shard x cp would (the same states per rank) and
    adds the received rows each MoE layer keeps (``moe.ep_activation_bytes``)."""
    ac = "op" if layout.ac == "op-alternate" else layout.ac  # an upper bound: it keeps fewer matmul outputs
    sp = layout.sp and layout.tp > 1
    head = {"return_logits": False, "loss_parallel": layout.loss_parallel}
    if layout.cp > 1 and layout.pp == 1:
        e = cp_estimate(
            cfg,
            layout.strategy,
            layout.dp_shard * layout.cp * layout.tp,
            layout.micro_batch,
            seq,
            target,
            ac,
            layout.mixed,
            layout.cp,
            tp=layout.tp,
            sp=sp,
            **head,
        )
    else:
        e = estimate(
            cfg,
            layout.strategy,
            layout.devices,
            layout.micro_batch,
            seq,
            target,
            ac,
            layout.mixed,
            dp_replicate=layout.dp_replicate,
            tp=layout.tp,
            sp=sp,
            pp=layout.pp,
            schedule=layout.schedule,
            stages_per_rank=layout.stages_per_rank,
            n_micro=layout.n_micro,
            cp=layout.cp,
            **head,
        )
    return with_expert_parallel(e, cfg, seq, layout.mixed, layout.ep)
