"""The time model's compute: the GEMMs of one micro-batch's forward on one rank and their seconds.

Every GEMM of the step is priced at ``peak x gemm_efficiency(m, n, k)``: the forward; the backward,
two GEMMs of a linear layer's size per linear layer (input and weight gradients) and 2.5 times the
forward for attention's core, because flash / memory-efficient kernels recompute the
scores (forward: QK^T and PV; backward: QK^T again, dV, dP, dQ, dK: 5 products against 2); the
GEMMs the activation-checkpointing policy runs again (``recomputed_gemms``: full recomputes the
block's forward; tformer's op policy keeps every matmul and attention output; op-alternate is
torchtitan's "selective op" policy, which recomputes every second linear ``mm`` of a block: k, o
and up of a Llama block, priced so that its published rows can be; tformer's trainer does not
offer it); the head (forward and a 2x backward; with the chunked loss, ``Layout.loss_chunk``, as
its real GEMMs of chunk rows x vocabulary, once per chunk). On a profile with a measured
``gemm_table`` (the CPU's, hardware.py) each GEMM is priced at the table's rate for its shape,
interpolated in log space, a linear layer's two backward products each at its own rate, instead
of the curve. Causal attention executes half of its S x S products (flash kernels skip the masked
blocks), while MFU counts all of them (models/flops.py,
the field's convention). ``Layout.attention="unfused"`` prices the explicit kernels other systems
ran before flash attention (Megatron-LM 2021: two batched GEMMs around a fused
scale-mask-softmax): all S x S products executed, a backward of 2 x the forward. A mixture-of-
experts block computes its active FLOPs (models/flops.py): the router, each token's top-k
experts as grouped GEMMs of the rows each expert receives, the shared experts.

Under context parallelism (``cp``, time.py's module doc) a rank's queries and own keys are 1/cp of
each sequence and attention's core runs them against every key, chunk pair by chunk pair.
"""

from __future__ import annotations

from typing import NamedTuple

from ..config import ModelConfig
from ..models import spec_of
from ..nn.ffn import FFN_KINDS
from .hardware import Hardware
from .layout import Layout


ATTENTION_BACKWARD = 2.5  # flash attention's backward: 5 matmuls of the forward's 2 (``backward_time``)


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
    float8: bool = False  # a linear layer precision=fp8 converts (parallel/float8.float8_filter)

    @property
    def linear(self) -> bool:
        return self.kind == "linear"


def _linear(tokens: float, n_out: float, k_in: float, block: bool = False) -> Gemm:
    """A linear layer's forward GEMM; ``block``: one of a transformer block's projections, FFN or
    shared experts, which precision=fp8 converts when both of its sizes are multiples of 16 (what
    the FP8 tensor cores' GEMM needs; the router, the shared-expert gate, the head stay bf16)."""
    f8 = block and n_out % 16 == 0 and k_in % 16 == 0
    return Gemm(2 * tokens * n_out * k_in, 2 * tokens * n_out * k_in, tokens, n_out, k_in, float8=f8)


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
        _linear(tq, h * dk, d, True),  # q
        _linear(tk, kv * dk, d, True),  # k
        _linear(tk, kv * dk, d, True),  # v
        scores,
        values,
        _linear(tq, d, h * dk, True),  # output
    ]


def _ffn_gemms(cfg: ModelConfig, tokens: int, tp: int) -> list[Gemm]:
    """In execution order: gate (gated kinds only), up, down."""
    d, ff = cfg.d_model, cfg.d_ff // tp
    gated = FFN_KINDS[cfg.activation][1]
    return [_linear(tokens, ff, d, True)] * (2 if gated else 1) + [_linear(tokens, d, ff, True)]


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
        out += [_linear(tokens, shared, d, True)] * (2 if gated else 1) + [_linear(tokens, d, shared, True)]
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


def _seconds(g: Gemm, peak: float, hw: Hardware, fp32: bool, which: int = 0, fp8: float | None = None) -> float:
    """Seconds of ``g``'s forward (``which`` 0) or, for a linear layer, one of its backward products
    (1: input gradient, 2: weight gradient): from the measured table where the profile has one (a
    CPU's), else at the peak times the efficiency curve; a float8 layer's at the fp8 peak ``fp8``
    when the run converts it (the same share of that peak as a bf16 GEMM of its shape reaches of
    bf16's: no float8 GEMM has been measured for the curve yet)."""
    if hw.attention_rate and g.mask:  # the CPU's flash kernel as measured, its exps included
        flops = g.executed if g.mask == "causal" else g.counted  # a masked kernel computes every score
        return flops / hw.attention_flops(g.m, g.mask)
    if hw.gemm_table:
        return g.executed / hw.gemm_rate(g.m, g.n, g.k, which if g.linear else 0)
    rate = hw.peak["fp32"] if fp32 else fp8 if fp8 and g.float8 else peak
    return g.executed / (rate * gemm_efficiency(g.m, g.n, g.k, hw))


def gemm_time(gemms: list[Gemm], peak: float, hw: Hardware, fp8: float | None = None) -> float:
    return sum(_seconds(g, peak, hw, g.fp32, fp8=fp8) for g in gemms)


def backward_time(gemms: list[Gemm], peak: float, hw: Hardware, fp8: float | None = None) -> float:
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
            total += g.backward / 2 * (_seconds(g, peak, hw, fp32, 1, fp8) + _seconds(g, peak, hw, fp32, 2, fp8))
        else:
            total += g.backward * _seconds(g, peak, hw, fp32, fp8=fp8)
    return total


# Bytes moved per element of one dynamic float8 cast (torchao's ``hp_tensor_to_float8_dynamic``
# on a bf16 tensor). Eager, op by op: abs (read 2, write 2), max (read 2), the scale multiply in
# fp32 (read 2, write 4), clamp (read 4, write 4), the cast (read 4, write 1): 25. Compiled: the
# amax a reduction over the tensor (read 2), then one kernel reads it again and writes float8 (2 + 1): 5.
FLOAT8_CAST_BYTES = {False: 25.0, True: 5.0}


def float8_casts(gemms: list[Gemm], recomputed: list[Gemm]) -> float:
    """Elements cast to float8 for one micro-batch of these GEMMs' converted layers: forward casts
    the input (m x k) and the weight (n x k); backward casts the output gradient twice (one layout
    for the input gradient, one for the weight gradient) and the input and weight again (torchao
    keeps them in high precision for the backward); a recomputed forward casts its two again."""
    total = 0.0
    for g in gemms:
        if g.float8:
            total += 2 * (g.m * g.k + g.n * g.k + g.m * g.n)
    for g in recomputed:
        if g.float8:
            total += g.m * g.k + g.n * g.k
    return total


def head_time(cfg: ModelConfig, layout: Layout, tokens: int, peak: float, hw: Hardware) -> tuple[float, float]:
    """(forward, backward) GEMM seconds of the head over ``tokens`` rows of one rank: with the
    chunked loss (``Layout.loss_chunk``; the trainer drops it under TP) as its real GEMMs, chunk
    rows against the vocabulary, once per chunk (models/loss.py computes the input and weight
    gradients in forward, the same two products a linear layer's backward makes, both at ``peak``
    under mixed precision: ``models/loss.add_weight_grad``)."""
    chunked = layout.loss_chunk is not None and layout.tp == 1
    rows = min(layout.loss_chunk, tokens) if chunked and layout.loss_chunk else tokens
    if not rows:
        return 0.0, 0.0
    chunks, last = divmod(tokens, rows)
    # a vocabulary that is not a multiple of 8 leaves the head's GEMMs misaligned: eager at the
    # share of the aligned rate the profile measured (compiled and whole, inductor pads them)
    vocab = cfg.padded_vocab_size // layout.tp
    slow = hw.misaligned_gemm if vocab % 8 and (chunked or not layout.compile) and hw.misaligned_gemm else 1.0
    total = [0.0, 0.0]
    for n, size in ((chunks, rows), (1 if last else 0, last)):
        if n:
            gemms = head_gemms(cfg, size, layout.tp)
            total[0] += n * gemm_time(gemms, peak, hw)
            total[1] += n * backward_time(gemms, peak, hw)
    return total[0] / slow, total[1] / slow
