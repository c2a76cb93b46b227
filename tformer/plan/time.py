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
  offer it); the head (forward and a 2x backward; with the chunked loss, ``Layout.loss_chunk``, as
  its real GEMMs of chunk rows x vocabulary, once per chunk). On a profile with a measured
  ``gemm_table`` (the CPU's, hardware.py) each GEMM is priced at the table's rate for its shape,
  interpolated in log space, a linear layer's two backward products each at its own rate, instead
  of the curve. Causal attention executes half of its S x S
  products (flash kernels skip the masked blocks), while MFU counts all of them (models/flops.py,
  the field's convention). ``Layout.attention="unfused"`` prices the explicit kernels other systems
  ran before flash attention (Megatron-LM 2021: two batched GEMMs around a fused
  scale-mask-softmax): all S x S products executed, a backward of 2 x the forward. A mixture-of-
  experts block computes its active FLOPs (models/flops.py): the router, each token's top-k
  experts as grouped GEMMs of the rows each expert receives, the shared experts;
- **memory-bound work** at ``hbm_bandwidth x hbm_efficiency``: the elementwise ops (norms, residual
  adds, rotary, activations, dropout, MoE dispatch and combine; backward twice the forward's
  traffic, the recomputed ones again under any checkpointing policy), the head's softmax and loss,
  and the optimizer step (AdamW, the gradient norm and zeroing: 44 bytes per fp32 parameter the
  rank updates); on a profile that measured them (a CPU's), the compute-bound elementwise work at
  its rate where that is slower than its bytes: an ungated FFN activation at ``activation_rate``,
  the head's exps at ``exp_rate`` (``_transcendental``, ``_head_exps``), and the exps of a CPU
  flash kernel's scores, which never reach memory (none where ``attention_rate`` measured the
  kernel whole); with explicit score kernels (unfused attention, context parallelism on a GPU),
  the elementwise kernels over the scores (``_score_bytes``);
- **exposed communication** by kind, priced with ring formulas (all-gather or reduce-scatter of S
  bytes over n ranks: (n-1)/n S / bandwidth + (n-1) latency; all-reduce twice that; an all-to-all
  sends (n-1)/n of a rank's S bytes away, as many hops) over the link the group lies on: inside a
  node when its ranks fit in one (``_link``), the network otherwise;
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

The overlap rules, all here and nowhere else (``_overlap``):
1. FSDP2 / ZeRO-3 all-gathers (and backward reduce-scatters) are prefetched one block ahead: what
   exceeds the compute of the pass is exposed, plus the first block's gather, which nothing hides.
2. DDP's bucketed all-reduce, ZeRO-1/2's gradient reduce-scatter and HSDP's replica all-reduce run
   during the last micro-batch's backward: what exceeds it is exposed, plus the last bucket (25 MB).
3. Collectives inside a block sit right before (or after) the computation that needs their result:
   always exposed. Tensor parallelism's between dependent matmuls (async TP would hide them; it is
   not priced); context parallelism's K/V all-gathers right before the attention that reads them
   and the dK/dV reduce-scatters right after the backward that makes them; expert parallelism's
   all-to-alls between the router and the experts and between the experts and the combine. Any
   checkpointing policy runs the CP and EP collectives again in its recomputed forward (no policy
   saves an all-gather or an all-to-all). ZeRO-1/2's parameter all-gather after the optimizer
   step: exposed.
4. Pipeline sends overlap other micro-batches, except along the fill and drain: 2 (pp v - 1) sends.
5. On hardware without separate communication engines (``overlap=False``: the CPU, where gloo uses
   the cores that compute), nothing overlaps.

Layouts the model has no terms for are refused with the reason (``NotPriced``): float8 matmuls, async
TP, layouts tformer does not run (context parallelism with attention dropout or DeepSpeed, expert
parallelism outside FSDP2 or with pipelines, MoE models under TP or DeepSpeed), a precision without
a peak figure. A layout no run can have (ep without experts, an ep that does not divide them or
dp_shard x cp, a tp that does not divide the heads) is a ``ConfigError`` (``check_layout``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from ..config import ConfigError, ModelConfig
from ..models import spec_of
from ..models.flops import training_flops
from ..nn.ffn import FFN_KINDS
from . import memory as memory_plan
from . import moe as moe_plan
from .hardware import Hardware

BUCKET_BYTES = 25 * 2**20  # DDP's default bucket: the last one is never hidden
OPTIMIZER_BYTES = (
    44  # per fp32 parameter: AdamW reads p, g, m, v and writes p, m, v (28); grad norm + clip (12); zeroing (4)
)


ATTENTION_BACKWARD = 2.5  # flash attention's backward: 5 matmuls of the forward's 2 (``_backward_time``)
AC_POLICIES = ("none", "op", "op-alternate", "full")
ATTENTION_KERNELS = ("flash", "unfused")
# kernels between context parallelism's chunk pairs, counted from context.py for ``op_overhead``: a
# pair's forward (the kernel and its log-sum-exp merge, 14) and backward (the kernel and three
# gradient accumulations, 4), averaged over the 3 passes ``_micro_batch`` counts
PAIR_KERNELS = 6
# fp32 bytes the elementwise kernels around GPU context parallelism's explicit scores move per
# score: forward, the log-sum-exp read, the subtraction and exp (read + write each), the cast to the
# value's dtype (read, plus the cast's own bytes); backward, the probabilities rebuilt (subtraction
# and exp), dP - delta and its product with P (read + write each, the product reads two)
PAIR_SCORE_FORWARD = 4 + 8 + 8 + 4
PAIR_SCORE_BACKWARD = 8 + 8 + 8 + 12


class NotPriced(ConfigError):
    """A layout the time model has no terms for; the message says what it lacks."""


@dataclass(frozen=True)
class Layout:
    """One training layout on pp x dp_replicate x dp_shard x cp x tp devices (tp innermost, as the
    mesh builds it). For ddp and zero1/2/3, dp_shard is the data-parallel degree; expert
    parallelism borrows its ep ranks from dp_shard x cp (no devices of its own)."""

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
    cp: int = 1  # context parallelism: each sequence cut over cp ranks (parallel/context.py)
    ep: int = 1  # expert parallelism (MoE models): experts split over ep of the dp_shard x cp ranks
    float8: bool = False  # not priced
    async_tp: bool = False  # not priced
    attention: str = "flash"  # ATTENTION_KERNELS: flash (SDPA, tformer's) | unfused (explicit S x S scores)
    loss_chunk: int | None = None  # loss.chunk_size: the head and loss over this many rows at a time (tp 1)

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
    blocker = memory_plan.tp_blocker(cfg, layout.tp)
    if blocker:
        raise ConfigError(f"Layout.tp={layout.tp} does not divide {blocker}; choose a tp that divides it")
    memory_plan.check_expert_parallel(cfg, layout.ep, layout.dp_shard, layout.cp)


def why_not_priced(cfg: ModelConfig, layout: Layout, hw: Hardware) -> str | None:
    """Every reason the model cannot price ``layout`` of ``cfg`` on ``hw``, joined; None when it can."""
    reasons = []
    deepspeed = layout.strategy.startswith("zero")
    if layout.float8:
        reasons.append("float8 matmuls (two peak rates in one step; no efficiency figure for them)")
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
    causal attention's scores), its shape (m x k) @ (k x n), its ``kind`` (a linear layer's ``mm``,
    what an op-level AC policy counts, or attention's core: ``scores`` QK^T, ``values`` P V), its
    backward in multiples of its forward's FLOPs, and whether its forward or backward runs in fp32
    whatever the run's precision (context parallelism's explicit chunk-pair kernel)."""

    executed: float
    counted: float
    m: float
    n: float
    k: float
    kind: str = "linear"  # linear | scores | values
    backward: float = 2.0  # a linear layer's: the input and the weight gradients
    fp32: bool = False
    fp32_backward: bool = False
    mask: str = ""  # attention's core without context parallelism: causal | bias | plain (hardware.attention_rate)

    @property
    def linear(self) -> bool:
        return self.kind == "linear"


def _linear(tokens: float, n_out: float, k_in: float) -> Gemm:
    return Gemm(2 * tokens * n_out * k_in, 2 * tokens * n_out * k_in, tokens, n_out, k_in)


def attention_kernel(flash: bool, cp: int, device: str) -> str:
    """The kernel of attention's core: ``flash`` or ``unfused`` without context parallelism; under
    it tformer's own, per chunk pair: ``pairs-cpu`` (torch's CPU flash kernel) or ``pairs`` (a
    GPU: the scores written out in fp32, context._pair_forward)."""
    if cp > 1:
        return "pairs-cpu" if device == "cpu" else "pairs"
    return "flash" if flash else "unfused"


def _attention_gemms(
    cfg: ModelConfig,
    batch: int,
    q_len: int,
    kv_len: int,
    tp: int,
    causal: bool,
    kernel: str,
    cp: int = 1,
    bias: bool = False,
) -> list[Gemm]:
    """One attention layer on one rank in execution order: the q, k, v projections over its tokens,
    scores and weighted values per sample and head, the output projection. ``q_len`` and ``kv_len``
    are whole (padded) sequences; under context parallelism (``cp``) the rank's queries and own keys
    are 1/cp of them and its core runs them against every key (module doc). A flash kernel skips the
    masked half of causal scores; explicit (unfused) score GEMMs compute all of them. ``bias``: an
    additive bias (T5's relative positions), which under context parallelism sends a chunk pair's
    backward through the explicit fp32 path on the CPU too (the bias needs the scores' gradient) and
    makes a diagonal pair whole."""
    d, h, kv, dk = cfg.d_model, cfg.num_heads // tp, cfg.kv_heads // tp, cfg.head_dim
    tq, tk = batch * q_len // cp, batch * kv_len // cp
    core = 2 * batch * h * (q_len // cp) * kv_len * dk  # what MFU counts: each query against every key
    if cp == 1:
        flash = kernel == "flash"
        executed = core / 2 if causal and flash else core
        back = ATTENTION_BACKWARD if flash else 2.0
        mask = "bias" if bias else "causal" if causal else "plain"
        scores = Gemm(executed, core, q_len, kv_len, dk, "scores", back, mask=mask)
        values = Gemm(executed, core, q_len, dk, kv_len, "values", back, mask=mask)
    else:
        qc, kc = q_len // (2 * cp), kv_len // (2 * cp)  # chunk lengths
        pairs = 2 * cp + 1 if causal else 4 * cp  # causal: chunk i's i + 1 pairs, its mirror's 2 cp - i
        if causal and kernel == "pairs-cpu" and not bias:
            pairs -= 1  # the two diagonal pairs, half each
        executed = 2 * batch * h * pairs * qc * kc * dk
        explicit = kernel == "pairs" or bias
        gpu = kernel == "pairs"
        scores = Gemm(executed, core, qc, kc, dk, "scores", 2.0 if explicit else ATTENTION_BACKWARD, gpu, explicit)
        values = Gemm(executed, core, qc, dk, kc, "values", 3.0 if explicit else ATTENTION_BACKWARD, False, explicit)
    return [
        _linear(tq, h * dk, d),  # q
        _linear(tk, kv * dk, d),  # k
        _linear(tk, kv * dk, d),  # v
        scores,
        values,
        _linear(tq, d, h * dk),  # output
    ]


def _ffn_gemms(cfg: ModelConfig, tokens: int, tp: int) -> list[Gemm]:
    """In execution order: gate (gated kinds only), up, down."""
    d, ff = cfg.d_model, cfg.d_ff // tp
    gated = FFN_KINDS[cfg.activation][1]
    return [_linear(tokens, ff, d)] * (2 if gated else 1) + [_linear(tokens, d, ff)]


def _moe_gemms(cfg: ModelConfig, tokens: int, ep: int) -> list[Gemm]:
    """One MoE FFN's active GEMMs over ``tokens`` tokens of a rank (models/flops.py counts the same):
    the router; the experts' gate, up and down as grouped GEMMs over the tokens x top_k routed rows,
    each of the rank's num_experts / ep experts taking tokens x top_k x ep / num_experts of them
    (balanced routing); the shared experts and their gate."""
    moe, d = cfg.moe, cfg.d_model
    width, kind = moe.d_expert or cfg.d_ff, moe.activation or cfg.activation
    gated = FFN_KINDS[kind][1]
    rows = tokens * moe.top_k
    per_expert = rows * ep / moe.num_experts

    def grouped(n_out: int, k_in: int) -> Gemm:
        return Gemm(2 * rows * n_out * k_in, 2 * rows * n_out * k_in, per_expert, n_out, k_in)

    out = [_linear(tokens, moe.num_experts, d)] + [grouped(width, d)] * (2 if gated else 1) + [grouped(d, width)]
    if moe.num_shared_experts:
        shared = moe.num_shared_experts * (moe.d_shared or width)
        out += [_linear(tokens, shared, d)] * (2 if gated else 1) + [_linear(tokens, d, shared)]
        if moe.shared_gate:
            out.append(_linear(tokens, 1, d))
    return out


def block_gemms(
    cfg: ModelConfig,
    batch: int,
    seq: int,
    tp: int = 1,
    cross_len: int | None = None,
    flash: bool = True,
    cp: int = 1,
    device: str = "cuda",
    moe: bool = False,
    ep: int = 1,
) -> list[Gemm]:
    """The forward GEMMs of one block on one rank in execution order (``cross_len``: an
    encoder-decoder's decoder block; ``cp``: context parallelism over whole (padded) lengths
    ``seq`` and ``cross_len``, on ``device``'s kernel; ``moe``: a mixture-of-experts block, its
    experts split over ``ep`` ranks)."""
    causal = not spec_of(cfg).masked_lm
    kernel = attention_kernel(flash, cp, device)
    out = _attention_gemms(cfg, batch, seq, seq, tp, causal, kernel, cp, bias=cfg.position == "relative")
    if cross_len is not None:
        out += _attention_gemms(cfg, batch, seq, cross_len, tp, False, kernel, cp)
    tokens = batch * seq // cp
    return out + (_moe_gemms(cfg, tokens, ep) if moe else _ffn_gemms(cfg, tokens, tp))


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


def _seconds(g: Gemm, peak: float, hw: Hardware, fp32: bool, which: int = 0) -> float:
    """Seconds of ``g``'s forward (``which`` 0) or, for a linear layer, one of its backward products
    (1: input gradient, 2: weight gradient): from the measured table where the profile has one (a
    CPU's), else at the peak times the efficiency curve."""
    if hw.attention_rate and g.mask:  # the CPU's flash kernel as measured, its exps included
        flops = g.executed if g.mask == "causal" else g.counted  # a masked kernel computes every score
        return flops / hw.attention_flops(g.m, g.mask)
    if hw.gemm_table:
        return g.executed / hw.gemm_rate(g.m, g.n, g.k, which if g.linear else 0)
    return g.executed / ((hw.peak["fp32"] if fp32 else peak) * gemm_efficiency(g.m, g.n, g.k, hw))


def _gemm_time(gemms: list[Gemm], peak: float, hw: Hardware) -> float:
    return sum(_seconds(g, peak, hw, g.fp32) for g in gemms)


def _backward_time(gemms: list[Gemm], peak: float, hw: Hardware) -> float:
    """Each GEMM's backward: a linear layer's is two GEMMs of its forward's size (input and weight
    gradients); attention's core under flash / memory-efficient kernels is 2.5 times its forward:
    the kernel recomputes the scores (QK^T) and then makes dV, dP, dQ and dK, five products against
    two. Unfused attention keeps its probabilities and makes only the last four: 2 times. The
    explicit chunk-pair kernel of context parallelism rebuilds QK^T and makes dP (2 x the scores'
    size) and dV, dQ, dK (3 x the values'), all in fp32."""
    total = 0.0
    for g in gemms:
        fp32 = g.fp32_backward or g.fp32
        if g.linear and hw.gemm_table:  # the table has each of the two products' own rate
            total += g.backward / 2 * (_seconds(g, peak, hw, fp32, 1) + _seconds(g, peak, hw, fp32, 2))
        else:
            total += g.backward * _seconds(g, peak, hw, fp32)
    return total


def head_time(cfg: ModelConfig, layout: Layout, tokens: int, peak: float, hw: Hardware) -> tuple[float, float]:
    """(forward, backward) GEMM seconds of the head over ``tokens`` rows of one rank: with the
    chunked loss (``Layout.loss_chunk``; the trainer drops it under TP) as its real GEMMs, chunk
    rows against the vocabulary, once per chunk (models/loss.py computes the input and weight
    gradients in forward, the same two products a linear layer's backward makes)."""
    rows = tokens if layout.loss_chunk is None or layout.tp > 1 else min(layout.loss_chunk, tokens)
    chunks, last = divmod(tokens, rows)
    total = [0.0, 0.0]
    for n, size in ((chunks, rows), (1 if last else 0, last)):
        if n:
            gemms = head_gemms(cfg, size, layout.tp)
            total[0] += n * _gemm_time(gemms, peak, hw)
            total[1] += n * _backward_time(gemms, peak, hw)
    return total[0], total[1]


def _score_bytes(cfg: ModelConfig, layout: Layout, gemms: list[Gemm], kernel: str) -> float:
    """Bytes the elementwise kernels around explicit score GEMMs move over the scores of one
    block in one micro-batch (flash keeps them on chip: 0; the scores are counted from the
    ``scores`` GEMMs, executed FLOPs / 2 d_k).

    Unfused attention, per score, forward: the fused scale-mask-softmax reads and writes (2
    elements), dropout on the probabilities reads, writes and stores a 1-byte mask; backward:
    dropout's backward reads, writes and reads the mask, the softmax's backward reads the
    probabilities and their gradient and writes the scores' (3). Context parallelism's explicit
    pairs: ``PAIR_SCORE_FORWARD`` and ``PAIR_SCORE_BACKWARD`` fp32 bytes (plus the cast's). The
    forward once more under full recomputation. The GEMMs' own reads and writes overlap their
    compute, as everywhere in this model."""
    elt = 2 if layout.mixed else 4
    again = 2 if layout.ac == "full" else 1
    drop = cfg.attn_dropout > 0
    total = 0.0
    for g in (g for g in gemms if g.kind == "scores"):
        scores = g.executed / (2 * g.k)
        if kernel == "unfused":
            total += scores * (((2 + 2 * drop) * elt + drop) * again + (3 + 2 * drop) * elt + drop)
        elif g.fp32_backward:  # an explicit chunk pair: its forward too on a GPU (``fp32``)
            total += scores * ((PAIR_SCORE_FORWARD + elt) * again * g.fp32 + PAIR_SCORE_BACKWARD)
    return total


# --- memory-bound work ------------------------------------------------------------------------------
def _elementwise(cfg: ModelConfig, tp: int, sp: bool, compiled: bool, cross: bool, moe: bool = False) -> tuple[float, int]:
    """(elements read + written per token, kernels) of one block's forward elementwise ops on one TP
    rank. Eager: a norm reads and writes its width, a residual add reads two and writes one, rotary
    (rotate-half: a cat, two products, a sum) moves q and k 11 times, a gated activation 5 times the
    FFN width (2 for the activation, 3 for the product), an ungated one 2 times, dropout 3 (input,
    output, mask). Compiled, each sub-layer's norm + residual + dropout is one kernel (4 d) and each
    activation or rotary one read and one write. An MoE FFN (``moe``) applies its activation to
    each of a token's top-k rows and its shared experts' width, and moves the rows around the
    experts (``_moe_traffic``)."""
    d = cfg.d_model / (tp if sp else 1)
    sublayers = 3 if cross else 2
    qk = (cfg.num_heads + cfg.kv_heads) * cfg.head_dim / tp
    rotary = cfg.position == "rotary"
    drop = cfg.dropout > 0
    ffn_width, ffn_kernels = (_moe_widths(cfg), 1 + bool(cfg.moe.num_shared_experts)) if moe else (cfg.d_ff / tp, 1)
    gated = FFN_KINDS[(cfg.moe.activation or cfg.activation) if moe else cfg.activation][1]
    moved, moe_kernels = _moe_traffic(cfg) if moe else (0.0, 0)
    if compiled:
        elements = sublayers * 4 * d + (2 * qk if rotary else 0) + (3 if gated else 2) * ffn_width + moved
        return elements, sublayers + int(rotary) + ffn_kernels + moe_kernels
    elements = (
        sublayers * (2 * d + 3 * d + (3 * d if drop else 0))
        + (11 * qk if rotary else 0)
        + (5 if gated else 2) * ffn_width
        + moved
    )
    kernels = sublayers * (2 + int(drop)) + (8 if rotary else 0) + (2 if gated else 1) * ffn_kernels + 6 * sublayers
    return elements, kernels + moe_kernels  # (+ views)


def _moe_widths(cfg: ModelConfig) -> float:
    """Hidden values per token an MoE FFN applies its activation to: top_k experts' and the shared
    experts' widths."""
    moe = cfg.moe
    width = moe.d_expert or cfg.d_ff
    return moe.top_k * width + moe.num_shared_experts * (moe.d_shared or width)


def _moe_traffic(cfg: ModelConfig) -> tuple[float, int]:
    """(elements per token, kernels) of an MoE FFN's routing, apart from its GEMMs (nn/moe.py): the
    router's softmax and top-k over the expert logits (about 3 reads and writes of num_experts);
    dispatch gathers each of the token's top_k rows into expert order (read + write); combine
    scales each row by its weight (read + write) and adds it into a zeroed output (2 reads, 1
    write of the rows; the zeros). Kernels: about a dozen (softmax, top-k, bincount, argsort,
    gathers, the weighted index_add)."""
    moe, d = cfg.moe, cfg.d_model
    return 3 * moe.num_experts + moe.top_k * (2 + 2 + 3) * d + d, 12


def _head_bytes(cfg: ModelConfig, tokens: int, tp: int, mixed: bool) -> float:
    """Logits written, their fp32 log-softmax read and written, the loss's gradient read and written,
    cast back under mixed precision: per logit 2 x (elt) + 16."""
    elt = 2 if mixed else 4
    return tokens * cfg.padded_vocab_size / tp * (2 * elt + 16)


def _transcendental(
    cfg: ModelConfig, layout: Layout, hw: Hardware, gemms: list[Gemm], kernel: str, tokens: int, moe: bool, passes: int
) -> float:
    """Seconds one block's compute-bound elementwise work takes beyond the bytes ``_elementwise``
    prices for it, on a profile that measured its rates (a CPU's; hardware.py): an ungated
    activation (GELU, SiLU) over the FFN's width at its ``activation_rate`` (its forward, the forward
    rebuilt in backward and the backward, each a third of it; a recomputed forward one third more)
    against the 2 elements a pass it moves (gated kinds: their bytes only, no rate measured);
    and the exp of every score a CPU flash kernel executes, in forward and again in backward (it
    rebuilds the probabilities), at ``exp_rate``: those stay in cache, so nothing else prices them."""
    extra = 0.0
    rate = hw.activation_rate.get(cfg.activation)
    if rate and not moe:
        elements = tokens * cfg.d_ff / layout.tp
        elt = 2 if layout.mixed else 4
        moved = passes * 2 * elements * elt / (hw.hbm_bandwidth * hw.hbm_efficiency)
        extra += max(0.0, elements * (passes / 3) / rate - moved)
    if hw.exp_rate and kernel in ("flash", "pairs-cpu") and not hw.attention_rate:
        extra += 2 * sum(g.executed / (2 * g.k) for g in gemms if g.kind == "scores") / hw.exp_rate
    return extra


def _head_exps(cfg: ModelConfig, layout: Layout, tokens: int, split: int, hw: Hardware) -> float:
    """Seconds of the head's exps at ``exp_rate`` (0 where the profile has none): the log-softmax
    takes one per logit in forward and one in backward; the chunked loss only one (models/loss.py
    turns the exps into the gradient in place)."""
    if not hw.exp_rate:
        return 0.0
    per_logit = 1 if layout.loss_chunk is not None and layout.tp == 1 else 2
    return tokens * cfg.padded_vocab_size / split * per_logit / hw.exp_rate


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
    """Seconds of a collective over ``n`` ranks of a buffer of ``nbytes`` (the whole, unsharded size;
    an all-to-all's: what one rank holds before it): all_gather / reduce_scatter move (n-1)/n of it
    through each link in n - 1 ring steps, all_reduce twice that; an all_to_all sends (n-1)/n of a
    rank's buffer away, to the n - 1 others."""
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
    if rule in ("exposed", "tp", "cp", "ep"):  # 3
        return comm
    raise ValueError(rule)


# --- one rank's step --------------------------------------------------------------------------------
@dataclass
class _Stage:
    """What one pipeline rank runs: its blocks (first stack, second stack), of them the MoE ones,
    embedding, head, and its parameters (on this TP rank), of them the routed experts'."""

    blocks: tuple[int, int]
    embed: bool
    head: bool
    params: int
    moe: tuple[int, int] = (0, 0)
    experts: int = 0


def _stages(cfg: ModelConfig, layout: Layout) -> list[_Stage]:
    from ..parallel.pipeline import stage_layers, stages_of_rank

    pp, v = layout.pp, (layout.stages_per_rank if layout.schedule == "interleaved_1f1b" else 1)
    spec = spec_of(cfg)
    stacks = [n for n, _, _ in spec.stack_shapes(cfg, 1, None)]
    per_layer = moe_plan.expert_parameters(cfg) // max(1, spec.model.moe_layer_count(cfg))

    def moe_in(blocks) -> int:  # MoE blocks among these block indices of a stack
        return sum(cfg.moe.is_moe_layer(i) for i in blocks)

    if pp == 1:
        both = (stacks[0], stacks[1] if len(stacks) > 1 else 0)
        moe = (moe_in(range(both[0])), moe_in(range(both[1])))
        return [_Stage(both, True, True, memory_plan.tp_local_parameters(cfg, layout.tp), moe, per_layer * sum(moe))]
    params = memory_plan.stage_parameters(cfg, pp * v, layout.tp)
    if len(stacks) > 1:  # one stage per stack (the model's ``cut_stage``)
        m0, m1 = moe_in(range(stacks[0])), moe_in(range(stacks[1]))
        return [
            _Stage((stacks[0], 0), True, False, params[0], (m0, 0), per_layer * m0),
            _Stage((0, stacks[1]), True, True, params[1], (0, m1), per_layer * m1),
        ]
    layers = stage_layers(cfg.num_layers, pp * v)
    out = []
    for rank in range(pp):
        mine = stages_of_rank(rank, pp, pp * v)
        blocks = sum(len(layers[s]) for s in mine)
        n_moe = sum(moe_in(layers[s]) for s in mine)
        out.append(
            _Stage((blocks, 0), 0 in mine, pp * v - 1 in mine, sum(params[s] for s in mine), (n_moe, 0), per_layer * n_moe)
        )
    return out


def _lengths(cfg: ModelConfig, seq: int, target: int | None) -> tuple[int, int | None]:
    if not spec_of(cfg).seq2seq:
        return seq, None
    return seq, target or seq


def _padded(length: int, layout: Layout) -> int:
    """A sequence's length as the rank's mesh holds it: padded to 2 cp chunks (and a multiple of tp
    under sequence parallelism) under context parallelism, as is otherwise."""
    if layout.cp == 1:
        return length
    from ..parallel.context import padded_length

    return padded_length(length, layout.cp, layout.tp if layout.sp and layout.tp > 1 else 1)


def _micro_batch(cfg: ModelConfig, layout: Layout, hw: Hardware, stage: _Stage, seq: int, target: int | None) -> dict:
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
    fwd = bwd = elements = scores = kernels = transcendental = 0.0
    passes = 3 + (1 if layout.ac != "none" else 0)  # forward, backward (2x), recomputed forward
    for n, n_moe, length, cross in stacks:
        for count, moe in ((n - n_moe, False), (n_moe, True)):
            if not count:
                continue
            gemms = block_gemms(cfg, mb, length, tp, cross, flash, cp, hw.device, moe, layout.ep)
            fwd += count * _gemm_time(gemms, peak, hw)
            bwd += count * (_backward_time(gemms, peak, hw) + _gemm_time(recomputed_gemms(gemms, layout.ac), peak, hw))
            e, k = _elementwise(cfg, tp, sp, layout.compile, cross is not None, moe)
            if layout.compile:  # a compiled block issues its fused kernels and GEMMs, not its eager ops
                kernels += count * (k + len(gemms))
            elements += count * mb * length // cp * e
            scores += count * _score_bytes(cfg, layout, gemms, kernel)
            tokens = mb * length // cp
            transcendental += count * _transcendental(cfg, layout, hw, gemms, kernel, tokens, moe, passes)
            if cp > 1:  # the chunk pairs' kernels, beyond what the counted block runs
                pairs = sum(g.executed / (2 * g.m * g.n * g.k) for g in gemms if g.kind == "scores") / mb
                kernels += count * PAIR_KERNELS * pairs / (cfg.num_heads // tp)
    head_fwd, head_bwd = head_time(cfg, layout, mb * out_len // cp, peak, hw) if stage.head else (0.0, 0.0)
    compute = fwd + bwd + head_fwd + head_bwd
    memory = (passes * elements * elt + scores) / bandwidth + transcendental
    if stage.head:
        head_tokens = mb * out_len // cp
        split = tp if layout.loss_parallel else 1
        memory += max(
            _head_bytes(cfg, head_tokens, split, mixed) / bandwidth, _head_exps(cfg, layout, head_tokens, split, hw)
        )
    if stage.embed:
        memory += 3 * mb * seq // cp * cfg.d_model * elt / bandwidth  # the lookup and its scatter-add gradient
    return {
        "compute": compute,
        "memory-bound": memory,
        "host": _host_micro_batch(cfg, layout, hw, stage) + hw.op_overhead * passes * kernels,
        "tp": _overlap("tp", _tp_comm(cfg, layout, hw, stage, seq, out_len), 0.0, 0.0, hw),
        "cp": _overlap("cp", _cp_comm(cfg, layout, hw, stage, seq, out_len), 0.0, 0.0, hw),
        "ep": _overlap("ep", _ep_comm(cfg, layout, hw, stage, seq, out_len), 0.0, 0.0, hw),
        "fwd": fwd + head_fwd,
        "bwd": bwd + head_bwd,
    }


def _fsdp2(layout: Layout) -> bool:
    return layout.strategy in ("fsdp", "fsdp-no-reshard")


def _host_micro_batch(cfg: ModelConfig, layout: Layout, hw: Hardware, stage: _Stage) -> float:
    """Host seconds of one micro-batch on one rank of ``stage`` (plan/host.py): every aten op of
    its blocks' forward and backward (and a recomputed forward), of the embedding, head and loss on
    the stage holding the head, at ``op_overhead``; those TP runs on DTensors at
    ``dtensor_op_overhead`` more; FSDP2's per-module hooks at ``fsdp_unit_overhead`` for each block
    and the root. Under ``compile`` a block's ops are its fused kernels and GEMMs (``_micro_batch``)."""
    from .host import op_counts

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


def _host_optimizer(cfg: ModelConfig, layout: Layout, hw: Hardware, stage: _Stage) -> float:
    """Host seconds of the optimizer step on one rank (plan/host.py): AdamW as the trainer builds it,
    fused over plain parameters (DDP on its own, DeepSpeed's client), else the per-parameter loop on
    the CPU and foreach on a GPU, each op on DTensors when FSDP2 or TP made the parameters ones."""
    from .host import op_counts, optimizer_ops

    c = op_counts(cfg)
    dtensors = _fsdp2(layout) or layout.tp > 1
    fused = not dtensors and layout.pp == 1
    kind = "fused" if fused else "loop" if hw.device == "cpu" else "foreach"
    params = sum(n * c.block_params[i] for i, n in enumerate(stage.blocks)) + c.rest_params
    return optimizer_ops(kind).ops(params) * (hw.op_overhead + dtensors * hw.dtensor_optimizer_overhead)


def _tp_comm(cfg: ModelConfig, layout: Layout, hw: Hardware, stage: _Stage, seq: int, out_len: int) -> float:
    """One micro-batch's TP collectives (all exposed): per sub-layer, all-gather + reduce-scatter of
    the (tokens x d) activations with sequence parallelism, one all-reduce without, in forward, in
    backward and in the recomputed forward; the embedding's and the head's; with loss parallelism
    the loss's two (tokens)-sized all-reduces, without it the gathered logits. Under context
    parallelism the rank's tokens are 1/cp of the (padded) ``seq`` and ``out_len``."""
    tp = layout.tp
    if tp == 1:
        return 0.0
    link = _link(hw, 1, tp)
    elt = 2 if layout.mixed else 4
    mb = layout.micro_batch
    passes = 3 if layout.ac == "full" else 2
    seq, out_len = seq // layout.cp, out_len // layout.cp

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


def _cp_comm(cfg: ModelConfig, layout: Layout, hw: Hardware, stage: _Stage, seq: int, out_len: int) -> float:
    """One micro-batch's context-parallel collectives over the cp group (stride tp on the mesh),
    all exposed (rule 3): per attention layer, K and V of every key (``seq`` or, for a decoder's
    cross-attention, the encoder's) all-gathered in forward, again in backward and in a recomputed
    forward, in the activations' dtype; dK and dV reduce-scattered once, in fp32; and the
    micro-batch's labelled-token counts (one per sample) all-reduced (context.loss_tokens)."""
    cp = layout.cp
    if cp == 1:
        return 0.0
    link = _link(hw, layout.tp, cp)
    elt = 2 if layout.mixed else 4
    gathers = 2 + (layout.ac != "none")
    kv = cfg.kv_heads // layout.tp * cfg.head_dim

    def layer(keys: int) -> float:
        whole = 2 * layout.micro_batch * keys * kv  # K and V of every key, in elements
        return gathers * ring("all_gather", whole * elt, cp, link) + ring("reduce_scatter", whole * 4, cp, link)

    first, second = stage.blocks
    counts = ring("all_reduce", 8 * layout.micro_batch, cp, link)
    return first * layer(seq) + second * (layer(out_len) + layer(seq)) + counts


def _ep_comm(cfg: ModelConfig, layout: Layout, hw: Hardware, stage: _Stage, seq: int, out_len: int) -> float:
    """One micro-batch's expert-parallel all-to-alls over the ep group (ep neighbouring ranks of
    dp_shard x cp, stride tp), all exposed (rule 3): per MoE layer, the rank's routed rows (its
    tokens x top_k, d_model wide, the activations' dtype) dispatched and combined in forward, their
    gradients likewise in backward, once more in a recomputed forward; and before each forward
    dispatch the row counts (a few bytes: latency only)."""
    ep = layout.ep
    if ep == 1:
        return 0.0
    link = _link(hw, layout.tp, ep)
    elt = 2 if layout.mixed else 4
    forwards = 1 + (layout.ac != "none")

    def layer(length: int) -> float:
        rows = layout.micro_batch * length // layout.cp * cfg.moe.top_k
        exchange = ring("all_to_all", rows * cfg.d_model * elt, ep, link)
        return (2 * forwards + 2) * exchange + forwards * (ep - 1) * link.latency

    return stage.moe[0] * layer(seq) + stage.moe[1] * layer(out_len)


def _data_parallel(layout: Layout, hw: Hardware, stage: _Stage, fwd: float, bwd: float, blocks: int) -> dict:
    """Exposed seconds of the data-parallel collectives of a step (rules 1-2 of ``_overlap``), for
    one micro-batch of forward ``fwd`` and backward ``bwd`` compute seconds, by kind. The group is
    dp_shard x cp (the cp ranks hold the same parameters); under expert parallelism FSDP2 moves the
    routed experts' 1/ep over what EP leaves of it (ranks tp x ep apart), the rest over all of it."""
    s, n, rep = layout.strategy, layout.dp_shard * layout.cp, layout.dp_replicate
    tp, ep = layout.tp, layout.ep
    pe = 2 if layout.mixed else 4
    params = stage.params
    shard_link, rep_link = _link(hw, tp, n), _link(hw, tp * n, rep)
    m = layout.micro_batches
    units = max(1, blocks)

    def sharded(kind: str, per_param: float) -> float:
        """One pass of ``kind`` over every parameter of the stage, ``per_param`` bytes each."""
        if ep == 1:
            return ring(kind, params * per_param, n, shard_link)
        dense, experts = params - stage.experts, stage.experts / ep
        return ring(kind, dense * per_param, n, shard_link) + ring(
            kind, experts * per_param, n // ep, _link(hw, tp * ep, n // ep)
        )

    out: dict[str, float] = {}
    if s in ("fsdp", "fsdp-no-reshard", "zero3"):
        grad = 4 if s.startswith("fsdp") else pe  # FSDP2 reduces in fp32; DeepSpeed in the model's dtype
        gather = sharded("all_gather", pe)
        scatter = sharded("reduce_scatter", grad)
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


def _pipeline_alone(shared: dict, alone: dict, layout: Layout, m: int) -> dict:
    """A CPU pipeline stage's compute and memory-bound work: while its peer idles in the bubble it
    has the machine's caches and memory to itself. With a bubble share b of the step, a stage is
    idle b/(1 - b) of its busy time, during which its peer works alone (the idle periods of two
    stages do not overlap), so 1 - b/(1 - b) of a stage's work runs beside its peer's (at the
    shared rates) and the rest alone; with pp > 2 a stage's peers are counted as one."""
    b = memory_plan.bubble(layout.schedule, layout.pp, m, layout.stages_per_rank)
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
    for stage in _stages(cfg, layout):
        mb = _micro_batch(cfg, layout, hw, stage, seq, target)
        if layout.pp > 1 and hw is not alone:
            mb = _pipeline_alone(mb, _micro_batch(cfg, layout, alone, stage, seq, target), layout, m)
        dp = _data_parallel(layout, hw, stage, mb["fwd"], mb["bwd"], sum(stage.blocks))
        ranks.append((mb, dp, stage))
    busy = ("compute", "memory-bound", "tp", "cp", "ep") + (("host",) if hw.device == "cpu" else ())
    mb, dp, stage = max(ranks, key=lambda r: sum(r[0][k] for k in busy) + sum(r[1].values()))
    parts = {k: m * mb[k] for k in busy if k in ("compute", "memory-bound", "tp") or mb[k] > 0}
    shard = 1 if layout.strategy == "ddp" else layout.dp_shard * layout.cp
    parts["optimizer"] = stage.params / shard * OPTIMIZER_BYTES / (hw.hbm_bandwidth * hw.hbm_efficiency)
    if layout.pp > 1:
        v = layout.stages_per_rank if layout.schedule == "interleaved_1f1b" else 1
        b = memory_plan.bubble(layout.schedule, layout.pp, m, v)
        parts["bubble"] = (parts["compute"] + parts["memory-bound"] + parts["tp"] + parts.get("host", 0.0)) * b / (1 - b)
        elt = 2 if layout.mixed else 4
        # a stage sends the hidden states of the rank's tokens: 1/cp of the (padded) sequence
        tokens = _padded(seq, layout) // layout.cp  # (an encoder-decoder: the encoder output)
        send = layout.micro_batch * tokens * cfg.d_model * elt / (layout.tp if layout.sp else 1)
        stride = layout.tp * layout.cp * layout.dp_shard * layout.dp_replicate
        link = _link(hw, stride, 2)
        parts["pp"] = 2 * (layout.pp * v - 1) * (link.latency + send / link.bandwidth)
    parts.update(dp)
    host = m * mb["host"] + _host_optimizer(cfg, layout, hw, stage)
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


def predicted_memory(cfg: ModelConfig, layout: Layout, seq: int, target: int | None = None) -> memory_plan.Estimate:
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
        e = memory_plan.cp_estimate(
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
        e = memory_plan.estimate(
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
    return memory_plan.with_expert_parallel(e, cfg, seq, layout.mixed, layout.ep)
