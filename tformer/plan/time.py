"""Step time of one layout, from the model's shapes and a few hardware figures (hardware.py).

One step on one device is the sum of
- **compute**: every GEMM of the step at ``peak x gemm_efficiency(m, n, k)``: the forward; the
  backward, two GEMMs of a linear layer's size per linear layer (input and weight gradients) and 2.5
  times the forward for attention's core, because flash / memory-efficient kernels recompute the
  scores (forward: QK^T and PV; backward: QK^T again, dV, dP, dQ, dK: 5 products against 2); the
  GEMMs the activation-checkpointing policy runs again (``recomputed_gemms``: full recomputes the
  block's forward; tformer's op policy keeps every matmul and attention output; op-alternate is
  torchtitan's "selective op" policy, which recomputes every second linear ``mm`` of a block: k, o
  and up of a Llama block, priced so that its published rows can be; tformer's trainer does not
  offer it); the head (forward and a 2x backward). Causal attention executes half of its S x S
  products (flash kernels skip the masked blocks), while MFU counts all of them (models/flops.py,
  the field's convention). ``Layout.attention="unfused"`` prices the explicit kernels other systems
  ran before flash attention (Megatron-LM 2021: two batched GEMMs around a fused
  scale-mask-softmax): all S x S products executed, a backward of 2 x the forward;
- **memory-bound work** at ``hbm_bandwidth x hbm_efficiency``: the elementwise ops (norms, residual
  adds, rotary, activations, dropout; backward twice the forward's traffic, the recomputed ones again
  under any checkpointing policy), the head's softmax and loss, and the optimizer step (AdamW, the gradient norm
  and zeroing: 44 bytes per fp32 parameter the rank updates); with unfused attention, the softmax
  and dropout kernels over the S x S scores (``_score_bytes``);
- **exposed communication** by kind, priced with ring formulas (all-gather or reduce-scatter of S
  bytes over n ranks: (n-1)/n S / bandwidth + (n-1) latency; all-reduce twice that) over the link
  the group lies on: inside a node when its ranks fit in one (``_link``), the network otherwise;
- **the pipeline bubble**: the busy time x b / (1 - b), b from memory.bubble.

The overlap rules, all here and nowhere else (``_overlap``):
1. FSDP2 / ZeRO-3 all-gathers (and backward reduce-scatters) are prefetched one block ahead: what
   exceeds the compute of the pass is exposed, plus the first block's gather, which nothing hides.
2. DDP's bucketed all-reduce, ZeRO-1/2's gradient reduce-scatter and HSDP's replica all-reduce run
   during the last micro-batch's backward: what exceeds it is exposed, plus the last bucket (25 MB).
3. Tensor-parallel collectives sit between dependent matmuls: always exposed (async TP would hide
   them; it is not priced). ZeRO-1/2's parameter all-gather after the optimizer step: exposed.
4. Pipeline sends overlap other micro-batches, except along the fill and drain: 2 (pp v - 1) sends.
5. On hardware without separate communication engines (``overlap=False``: the CPU, where gloo uses
   the cores that compute), nothing overlaps.

Layouts the model has no terms for are refused with the reason (``NotPriced``): float8 matmuls, async
TP, context and expert parallelism (not built in tformer yet), a precision without a peak figure.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from ..config import ConfigError, ModelConfig
from ..models import spec_of
from ..models.flops import training_flops
from ..nn.ffn import FFN_KINDS
from . import memory as memory_plan
from .hardware import Hardware

BUCKET_BYTES = 25 * 2**20  # DDP's default bucket: the last one is never hidden
OPTIMIZER_BYTES = (
    44  # per fp32 parameter: AdamW reads p, g, m, v and writes p, m, v (28); grad norm + clip (12); zeroing (4)
)


ATTENTION_BACKWARD = 2.5  # flash attention's backward: 5 matmuls of the forward's 2 (``_backward_time``)
AC_POLICIES = ("none", "op", "op-alternate", "full")
ATTENTION_KERNELS = ("flash", "unfused")


class NotPriced(ConfigError):
    """A layout the time model has no terms for; the message says what it lacks."""


@dataclass(frozen=True)
class Layout:
    """One training layout on pp x dp_replicate x dp_shard x tp devices (tp innermost, as the
    mesh builds it). For ddp and zero1/2/3, dp_shard is the data-parallel degree."""

    strategy: str = "fsdp"  # memory.STRATEGY_NAMES
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
    cp: int = 1  # context parallelism: not built, not priced
    ep: int = 1  # expert parallelism: not built, not priced
    float8: bool = False  # not priced
    async_tp: bool = False  # not priced
    attention: str = "flash"  # ATTENTION_KERNELS: flash (SDPA, tformer's) | unfused (explicit S x S scores)

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


def why_not_priced(layout: Layout, hw: Hardware) -> str | None:
    """Every reason the model cannot price ``layout`` on ``hw``, joined; None when it can."""
    reasons = []
    if layout.float8:
        reasons.append("float8 matmuls (two peak rates in one step; no efficiency figure for them)")
    if layout.async_tp:
        reasons.append("async TP (TP collectives hidden behind matmuls; not modelled)")
    if layout.cp > 1:
        reasons.append(f"context parallelism cp={layout.cp} (not built in tformer yet)")
    if layout.ep > 1:
        reasons.append(f"expert parallelism ep={layout.ep} (not built in tformer yet)")
    if layout.attention not in ATTENTION_KERNELS:
        reasons.append(f"attention kernel {layout.attention!r} (priced: {', '.join(ATTENTION_KERNELS)})")
    if layout.ac not in AC_POLICIES:
        reasons.append(f"activation checkpointing {layout.ac!r} (priced: {', '.join(AC_POLICIES)})")
    if layout.strategy not in memory_plan.STRATEGY_NAMES:
        reasons.append(f"strategy {layout.strategy!r} (priced: {', '.join(memory_plan.STRATEGY_NAMES)})")
    if layout.precision not in hw.peak:
        reasons.append(f"precision {layout.precision}: {hw.name} has no {layout.precision} peak figure")
    if layout.dp_replicate > 1 and not layout.strategy.startswith("fsdp"):
        reasons.append(f"dp_replicate={layout.dp_replicate} with {layout.strategy} (HSDP is FSDP2's)")
    return "; ".join(reasons) or None


# --- compute: the GEMMs of one micro-batch's forward on one rank ------------------------------------
def gemm_efficiency(m: float, n: float, k: float, hw: Hardware) -> float:
    """The share of the peak a GEMM of (m x k) @ (k x n) reaches: ``gemm_max`` x, per dimension,
    x / (x + gemm_half). One curve for every shape and device (hardware.py states its constants)."""
    eff = hw.gemm_max
    for x in (m, n, k):
        eff *= x / (x + hw.gemm_half)
    return eff


class Gemm(NamedTuple):
    """One GEMM of a forward pass: the FLOPs it executes and the FLOPs MFU counts (they differ for
    causal attention's scores), its shape (m x k) @ (k x n), and whether it is a linear layer's
    ``mm`` (what an op-level AC policy counts) or attention's core (scores, weighted values)."""

    executed: float
    counted: float
    m: float
    n: float
    k: float
    linear: bool = True


def _linear(tokens: float, n_out: float, k_in: float) -> Gemm:
    return Gemm(2 * tokens * n_out * k_in, 2 * tokens * n_out * k_in, tokens, n_out, k_in)


def _attention_gemms(
    cfg: ModelConfig, batch: int, q_len: int, kv_len: int, tp: int, causal: bool, flash: bool
) -> list[Gemm]:
    """One attention layer in execution order: the q, k, v projections over the tokens, scores and
    weighted values per sample and head, the output projection. A flash kernel skips the masked
    half of causal scores; explicit (unfused) score GEMMs compute all of them."""
    d, h, kv, dk = cfg.d_model, cfg.num_heads // tp, cfg.kv_heads // tp, cfg.head_dim
    tq, tk = batch * q_len, batch * kv_len
    core = 2 * batch * h * q_len * kv_len * dk
    executed = core / 2 if causal and flash else core
    return [
        _linear(tq, h * dk, d),  # q
        _linear(tk, kv * dk, d),  # k
        _linear(tk, kv * dk, d),  # v
        Gemm(executed, core, q_len, kv_len, dk, linear=False),  # scores
        Gemm(executed, core, q_len, dk, kv_len, linear=False),  # probabilities x values
        _linear(tq, d, h * dk),  # output
    ]


def _ffn_gemms(cfg: ModelConfig, tokens: int, tp: int) -> list[Gemm]:
    """In execution order: gate (gated kinds only), up, down."""
    d, ff = cfg.d_model, cfg.d_ff // tp
    gated = FFN_KINDS[cfg.activation][1]
    return [_linear(tokens, ff, d)] * (2 if gated else 1) + [_linear(tokens, d, ff)]


def block_gemms(
    cfg: ModelConfig, batch: int, seq: int, tp: int = 1, cross_len: int | None = None, flash: bool = True
) -> list[Gemm]:
    """The forward GEMMs of one block in execution order (``cross_len``: an encoder-decoder's
    decoder block)."""
    causal = not spec_of(cfg).masked_lm
    out = _attention_gemms(cfg, batch, seq, seq, tp, causal, flash)
    if cross_len is not None:
        out += _attention_gemms(cfg, batch, seq, cross_len, tp, False, flash)
    return out + _ffn_gemms(cfg, batch * seq, tp)


def recomputed_gemms(gemms: list[Gemm], ac: str) -> list[Gemm]:
    """The GEMMs of one block's forward that the backward runs again under ``ac``: all of them
    (full), none (none, op: tformer's op policy keeps every matmul and attention output), or every
    second linear ``mm`` in execution order (op-alternate: torchtitan's op policy, whose counter
    starts at 1 for each block and recomputes the even ones; attention's core is saved)."""
    if ac == "full":
        return gemms
    if ac != "op-alternate":
        return []
    linear = [g for g in gemms if g.linear]
    return linear[1::2]


def head_gemms(cfg: ModelConfig, tokens: int, tp: int) -> list[Gemm]:
    d, vocab = cfg.d_model, cfg.padded_vocab_size // tp
    out = [_linear(tokens, vocab, d)]
    if spec_of(cfg).masked_lm:  # the MLM head's dense layer
        out.append(_linear(tokens, d, d))
    return out


def _gemm_time(gemms: list[Gemm], peak: float, hw: Hardware) -> float:
    return sum(g.executed / (peak * gemm_efficiency(g.m, g.n, g.k, hw)) for g in gemms)


def _backward_time(gemms: list[Gemm], peak: float, hw: Hardware, flash: bool = True) -> float:
    """A linear layer's backward is two GEMMs of its forward's size (input and weight gradients);
    attention's core under flash / memory-efficient kernels is 2.5 times its forward: the kernel
    recomputes the scores (QK^T) and then makes dV, dP, dQ and dK, five products against two.
    Unfused attention keeps its probabilities and makes only the last four: 2 times."""
    core = ATTENTION_BACKWARD if flash else 2.0
    return sum((2.0 if g.linear else core) * _gemm_time([g], peak, hw) for g in gemms)


def _score_bytes(cfg: ModelConfig, layout: Layout, batch: int, q_len: int, kv_len: int) -> float:
    """Bytes the elementwise kernels of unfused attention move over the S x S scores of one
    attention layer in one step (flash keeps them on chip: 0). Per score, forward: the fused
    scale-mask-softmax reads and writes (2 elements), dropout on the probabilities reads, writes
    and stores a 1-byte mask; backward: dropout's backward reads, writes and reads the mask, the
    softmax's backward reads the probabilities and their gradient and writes the scores' (3); the
    forward once more under full recomputation. The GEMMs' own reads and writes overlap their
    compute, as everywhere in this model."""
    if layout.attention == "flash":
        return 0.0
    elt = 2 if layout.mixed else 4
    drop = cfg.attn_dropout > 0
    forward = (2 + 2 * drop) * elt + drop
    backward = (3 + 2 * drop) * elt + drop
    scores = batch * cfg.num_heads / layout.tp * q_len * kv_len
    return scores * (forward * (2 if layout.ac == "full" else 1) + backward)


# --- memory-bound work ------------------------------------------------------------------------------
def _elementwise(cfg: ModelConfig, tp: int, sp: bool, compiled: bool, cross: bool) -> tuple[float, int]:
    """(elements read + written per token, kernels) of one block's forward elementwise ops on one TP
    rank. Eager: a norm reads and writes its width, a residual add reads two and writes one, rotary
    (rotate-half: a cat, two products, a sum) moves q and k 11 times, a gated activation 5 times the
    FFN width (2 for the activation, 3 for the product), an ungated one 2 times, dropout 3 (input,
    output, mask). Compiled, each sub-layer's norm + residual + dropout is one kernel (4 d) and each
    activation or rotary one read and one write."""
    d = cfg.d_model / (tp if sp else 1)
    sublayers = 3 if cross else 2
    qk = (cfg.num_heads + cfg.kv_heads) * cfg.head_dim / tp
    ff = cfg.d_ff / tp
    gated = FFN_KINDS[cfg.activation][1]
    rotary = cfg.position == "rotary"
    drop = cfg.dropout > 0
    if compiled:
        elements = sublayers * 4 * d + (2 * qk if rotary else 0) + (3 if gated else 2) * ff
        return elements, sublayers + int(rotary) + 1
    elements = sublayers * (2 * d + 3 * d + (3 * d if drop else 0)) + (11 * qk if rotary else 0) + (5 if gated else 2) * ff
    kernels = sublayers * (2 + int(drop)) + (8 if rotary else 0) + (2 if gated else 1) + 6 * sublayers  # + views
    return elements, kernels


def _head_bytes(cfg: ModelConfig, tokens: int, tp: int, mixed: bool) -> float:
    """Logits written, their fp32 log-softmax read and written, the loss's gradient read and written,
    cast back under mixed precision: per logit 2 x (elt) + 16."""
    elt = 2 if mixed else 4
    return tokens * cfg.padded_vocab_size / tp * (2 * elt + 16)


# --- communication ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Link:
    bandwidth: float
    latency: float


def _link(hw: Hardware, stride: int, size: int) -> _Link:
    """A group of ``size`` ranks ``stride`` apart lies inside one node when it spans at most a node's
    GPUs (the mesh places ranks contiguously); otherwise its slowest hop is the network."""
    if stride * size <= hw.gpus_per_node:
        return _Link(hw.intra_bandwidth, hw.intra_latency)
    return _Link(hw.inter_bandwidth, hw.inter_latency)


def ring(kind: str, nbytes: float, n: int, link: _Link) -> float:
    """Seconds of a ring collective over ``n`` ranks of a buffer of ``nbytes`` (the whole, unsharded
    size): all_gather / reduce_scatter move (n-1)/n of it through each link, all_reduce twice that."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    hops = 2 * (n - 1) if kind == "all_reduce" else n - 1
    return hops * link.latency + hops / n * nbytes / link.bandwidth


def _overlap(rule: str, comm: float, window: float, first: float, hw: Hardware) -> float:
    """Exposed seconds of ``comm`` under overlap ``rule`` (module doc, rules 1-5)."""
    if not hw.overlap:
        return comm
    if rule in ("prefetch", "during_backward"):  # 1: the first block's gather waits; 2: the last bucket
        return first + max(0.0, comm - first - window)
    if rule in ("exposed", "tp"):  # 3
        return comm
    raise ValueError(rule)


# --- one rank's step --------------------------------------------------------------------------------
@dataclass
class _Stage:
    """What one pipeline rank runs: its blocks (first stack, second stack), embedding, head."""

    blocks: tuple[int, int]
    embed: bool
    head: bool
    params: int  # on this TP rank


def _stages(cfg: ModelConfig, layout: Layout) -> list[_Stage]:
    from ..parallel.pipeline import stage_layers, stages_of_rank

    pp, v = layout.pp, (layout.stages_per_rank if layout.schedule == "interleaved_1f1b" else 1)
    stacks = [n for n, _, _ in spec_of(cfg).stack_shapes(cfg, 1, None)]
    if pp == 1:
        both = (stacks[0], stacks[1] if len(stacks) > 1 else 0)
        return [_Stage(both, True, True, memory_plan.tp_local_parameters(cfg, layout.tp))]
    params = memory_plan.stage_parameters(cfg, pp * v, layout.tp)
    if len(stacks) > 1:  # one stage per stack (the model's ``cut_stage``)
        return [_Stage((stacks[0], 0), True, False, params[0]), _Stage((0, stacks[1]), True, True, params[1])]
    layers = stage_layers(cfg.num_layers, pp * v)
    out = []
    for rank in range(pp):
        mine = stages_of_rank(rank, pp, pp * v)
        blocks = sum(len(layers[s]) for s in mine)
        out.append(_Stage((blocks, 0), 0 in mine, pp * v - 1 in mine, sum(params[s] for s in mine)))
    return out


def _lengths(cfg: ModelConfig, seq: int, target: int | None) -> tuple[int, int | None]:
    if not spec_of(cfg).seq2seq:
        return seq, None
    return seq, target or seq


def _micro_batch(cfg: ModelConfig, layout: Layout, hw: Hardware, stage: _Stage, seq: int, target: int | None) -> dict:
    """Seconds of one micro-batch's forward + backward on one rank of ``stage``, by part, before
    any data-parallel communication."""
    mb, tp, sp, mixed = layout.micro_batch, layout.tp, layout.sp and layout.tp > 1, layout.mixed
    peak = hw.peak[layout.precision]
    elt = 2 if mixed else 4
    bandwidth = hw.hbm_bandwidth * hw.hbm_efficiency
    first, second = stage.blocks
    out_len = spec_of(cfg).output_len(seq, target)
    stacks = [(first, seq, None), (second, out_len, seq)]
    flash = layout.attention == "flash"
    fwd = bwd = 0.0
    for n, length, cross in stacks:
        gemms = block_gemms(cfg, mb, length, tp, cross, flash)
        fwd += n * _gemm_time(gemms, peak, hw)
        bwd += n * (_backward_time(gemms, peak, hw, flash) + _gemm_time(recomputed_gemms(gemms, layout.ac), peak, hw))
    head = _gemm_time(head_gemms(cfg, mb * out_len, tp), peak, hw) if stage.head else 0.0
    compute = fwd + bwd + 3 * head
    elements = kernels = 0.0
    for n, length, cross in stacks:
        e, k = _elementwise(cfg, tp, sp, layout.compile, cross is not None)
        elements, kernels = elements + n * mb * length * e, kernels + n * k
    passes = 3 + (1 if layout.ac != "none" else 0)  # forward, backward (2x), recomputed forward
    memory = passes * elements * elt / bandwidth
    for n, length, cross in stacks:
        scores = _score_bytes(cfg, layout, mb, length, length) + (
            _score_bytes(cfg, layout, mb, length, cross) if cross else 0
        )
        memory += n * scores / bandwidth
    if stage.head:
        memory += _head_bytes(cfg, mb * out_len, tp if layout.loss_parallel else 1, mixed) / bandwidth
    if stage.embed:
        memory += 3 * mb * seq * cfg.d_model * elt / bandwidth  # the lookup and its scatter-add gradient
    launches = sum(n * len(block_gemms(cfg, 1, 1, 1, cross)) for n, _, cross in stacks)
    overhead = hw.op_overhead * passes * (kernels + launches)
    tp_comm = _tp_comm(cfg, layout, hw, stage, seq, out_len)
    return {
        "compute": compute,
        "memory-bound": memory + overhead,
        "tp": tp_comm,
        "fwd": fwd + head,
        "bwd": bwd + 2 * head,
    }


def _tp_comm(cfg: ModelConfig, layout: Layout, hw: Hardware, stage: _Stage, seq: int, out_len: int) -> float:
    """One micro-batch's TP collectives (all exposed): per sub-layer, all-gather + reduce-scatter of
    the (tokens x d) activations with sequence parallelism, one all-reduce without, in forward, in
    backward and in the recomputed forward; the embedding's and the head's; with loss parallelism
    the loss's two (tokens)-sized all-reduces, without it the gathered logits."""
    tp = layout.tp
    if tp == 1:
        return 0.0
    link = _link(hw, 1, tp)
    elt = 2 if layout.mixed else 4
    mb = layout.micro_batch
    passes = 3 if layout.ac == "full" else 2

    def activation(tokens: int) -> float:
        nbytes = tokens * cfg.d_model * elt
        if layout.sp:
            return ring("all_gather", nbytes, tp, link) + ring("reduce_scatter", nbytes, tp, link)
        return ring("all_reduce", nbytes, tp, link)

    first, second = stage.blocks
    total = passes * (2 * first * activation(mb * seq) + 3 * second * activation(mb * out_len))
    if stage.embed:
        total += 2 * activation(mb * seq) / (2 if layout.sp else 1)
    if stage.head:
        total += 2 * activation(mb * out_len) / (2 if layout.sp else 1)
        if layout.loss_parallel:
            total += 2 * ring("all_reduce", mb * out_len * 4, tp, link)
        else:
            total += ring("all_gather", mb * out_len * cfg.padded_vocab_size * elt, tp, link)
    return total


def _data_parallel(layout: Layout, hw: Hardware, stage: _Stage, fwd: float, bwd: float, blocks: int) -> dict:
    """Exposed seconds of the data-parallel collectives of a step (rules 1-2 of ``_overlap``), for
    one micro-batch of forward ``fwd`` and backward ``bwd`` compute seconds, by kind."""
    s, n, rep = layout.strategy, layout.dp_shard, layout.dp_replicate
    tp = layout.tp
    pe = 2 if layout.mixed else 4
    params = stage.params
    shard_link, rep_link = _link(hw, tp, n), _link(hw, tp * n, rep)
    m = layout.micro_batches
    units = max(1, blocks)
    out: dict[str, float] = {}
    if s in ("fsdp", "fsdp-no-reshard", "zero3"):
        grad = 4 if s.startswith("fsdp") else pe  # FSDP2 reduces in fp32; DeepSpeed in the model's dtype
        gather = ring("all_gather", params * pe, n, shard_link)
        scatter = ring("reduce_scatter", params * grad, n, shard_link)
        again = 0.0 if s == "fsdp-no-reshard" else gather
        per_micro = _overlap("prefetch", gather, fwd, gather / units, hw) + _overlap(
            "prefetch", again + scatter, bwd, (again + scatter) / units, hw
        )
        out["fsdp"] = m * per_micro
        if rep > 1:
            reduce = ring("all_reduce", params * 4 / n, rep, rep_link)
            out["hsdp"] = _overlap(
                "during_backward", reduce, bwd, min(reduce, ring("all_reduce", BUCKET_BYTES, rep, rep_link)), hw
            )
    elif s == "ddp":
        reduce = ring("all_reduce", params * 4, n, shard_link)  # fp32 gradients (autocast over fp32 weights)
        out["ddp"] = _overlap(
            "during_backward", reduce, bwd, min(reduce, ring("all_reduce", BUCKET_BYTES, n, shard_link)), hw
        )
    else:  # zero1, zero2: gradients reduce-scattered during backward, parameters gathered after the step
        scatter = ring("reduce_scatter", params * pe, n, shard_link)
        bucket = min(scatter, ring("reduce_scatter", BUCKET_BYTES, n, shard_link))
        out[s] = _overlap("during_backward", scatter, bwd, bucket, hw) + _overlap(
            "exposed", ring("all_gather", params * pe, n, shard_link), 0.0, 0.0, hw
        )
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
    doc). Raises ``NotPriced`` for a layout the model has no terms for."""
    why = why_not_priced(layout, hw)
    if why:
        raise NotPriced(f"not priced: {why}")
    seq, target = _lengths(cfg, seq_len, target_len)
    ranks = []
    for stage in _stages(cfg, layout):
        mb = _micro_batch(cfg, layout, hw, stage, seq, target)
        dp = _data_parallel(layout, hw, stage, mb["fwd"], mb["bwd"], sum(stage.blocks))
        ranks.append((mb, dp, stage))
    mb, dp, stage = max(ranks, key=lambda r: r[0]["compute"] + r[0]["memory-bound"] + r[0]["tp"] + sum(r[1].values()))
    m = layout.micro_batches
    parts = {"compute": m * mb["compute"], "memory-bound": m * mb["memory-bound"], "tp": m * mb["tp"]}
    shard = 1 if layout.strategy == "ddp" else layout.dp_shard
    parts["optimizer"] = stage.params / shard * OPTIMIZER_BYTES / (hw.hbm_bandwidth * hw.hbm_efficiency)
    if layout.pp > 1:
        v = layout.stages_per_rank if layout.schedule == "interleaved_1f1b" else 1
        b = memory_plan.bubble(layout.schedule, layout.pp, m, v)
        parts["bubble"] = (parts["compute"] + parts["memory-bound"] + parts["tp"]) * b / (1 - b)
        elt = 2 if layout.mixed else 4
        send = layout.micro_batch * (target or seq) * cfg.d_model * elt / (layout.tp if layout.sp else 1)
        stride = layout.tp * layout.dp_shard * layout.dp_replicate
        link = _link(hw, stride, 2)
        parts["pp"] = 2 * (layout.pp * v - 1) * (link.latency + send / link.bandwidth)
    parts.update(dp)
    step = sum(parts.values())
    tokens = layout.micro_batch * m * layout.dp_replicate * layout.dp_shard * (seq + (target or 0))
    model_flops = training_flops(cfg, layout.micro_batch, seq, target) * m * layout.dp_replicate * layout.dp_shard
    mfu = model_flops / layout.devices / step / hw.peak[layout.precision]
    result = StepTime(step, tokens, layout.devices, mfu, parts)
    if memory:
        result.memory = predicted_memory(cfg, layout, seq, target).total
    return result


def predicted_memory(cfg: ModelConfig, layout: Layout, seq: int, target: int | None = None) -> memory_plan.Estimate:
    """memory.py's per-rank bytes of the layout (the trainer's loss path: no returned logits;
    tformer's flash attention: the S x S probabilities an unfused kernel keeps are not in it)."""
    return memory_plan.estimate(
        cfg,
        layout.strategy,
        layout.devices,
        layout.micro_batch,
        seq,
        target,
        "op" if layout.ac == "op-alternate" else layout.ac,  # an upper bound: it keeps fewer matmul outputs
        layout.mixed,
        dp_replicate=layout.dp_replicate,
        tp=layout.tp,
        sp=layout.sp and layout.tp > 1,
        pp=layout.pp,
        schedule=layout.schedule,
        stages_per_rank=layout.stages_per_rank,
        n_micro=layout.n_micro,
        return_logits=False,
        loss_parallel=layout.loss_parallel,
    )
