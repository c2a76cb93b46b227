"""The time model's memory-bound work: the bytes one block's elementwise kernels move, and the
compute-bound elementwise work a profile measured.

Memory-bound work runs at ``hbm_bandwidth x hbm_efficiency``: the elementwise ops (norms, residual
adds, rotary, activations, dropout, MoE dispatch and combine; backward twice the forward's
traffic, the recomputed ones again under any checkpointing policy), the head's softmax and loss,
and the optimizer step (AdamW, the gradient norm and zeroing: 44 bytes per fp32 parameter the
rank updates, ``time.OPTIMIZER_BYTES``); on a profile that measured them (a CPU's), the
compute-bound elementwise work at its rate where that is slower than its bytes: an ungated FFN
activation at ``activation_rate``, the head's exps at ``exp_rate`` (``transcendental_seconds``,
``head_exps``), and the exps of a CPU flash kernel's scores, which never reach memory (none where
``attention_rate`` measured the kernel whole); with explicit score kernels (unfused attention,
context parallelism on a GPU), the elementwise kernels over the scores (``score_bytes``).
"""

from __future__ import annotations

from ..config import ModelConfig
from ..nn.ffn import FFN_KINDS
from .compute import Gemm
from .hardware import Hardware
from .layout import Layout


# fp32 bytes the elementwise kernels around GPU context parallelism's explicit scores move per
# score: forward, the log-sum-exp read, the subtraction and exp (read + write each), the cast to the
# value's dtype (read, plus the cast's own bytes); backward, the probabilities rebuilt (subtraction
# and exp), dP - delta and its product with P (read + write each, the product reads two)
PAIR_SCORE_FORWARD = 4 + 8 + 8 + 4
PAIR_SCORE_BACKWARD = 8 + 8 + 8 + 12


def score_bytes(cfg: ModelConfig, layout: Layout, gemms: list[Gemm], kernel: str) -> float:
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


def elementwise(cfg: ModelConfig, tp: int, sp: bool, compiled: bool, cross: bool, moe: bool = False) -> tuple[float, int]:
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


def fp32_stream_bytes(cfg: ModelConfig, tp: int, sp: bool, compiled: bool, cross: bool, recomputed: bool) -> float:
    """Bytes per token one block's norms and residual adds move beyond ``elementwise``'s elements at
    the activations' 2 bytes, when bf16 autocast runs over fp32 weights (one device, DDP: the
    residual stream stays fp32, memory.py's ``fp32_weights``), all passes of one micro-batch.

    Counted per element of the stream for each sub-layer, eager (nn/norm.py, nn/cast.py):
    forward, the norm (read 4, write 4; RMSNorm's gain another read 4, write 4), the cast of its
    output to bf16 (read 4, write 2), the residual add of the bf16 sub-layer output (read 4 + 2,
    write 4): 24 (RMSNorm 32); backward, the cast's gradient back to fp32 (read 2, write 4), the
    norm's backward (reads the input and the gradient, writes the input's gradient, and reads both
    again for the gain's: 20; RMSNorm's gain multiply as much again), the sum with the residual's
    gradient (read 8, write 4), the sub-layer output's gradient cast to bf16 (read 4, write 2): 44
    (RMSNorm 64). ``elementwise`` prices the sub-layer's norm and add as 5 elements x 2 bytes,
    twice that in backward: 30. Compiled, one kernel per chain reads and writes the stream in
    fp32: 2 bytes more on each of its four stream accesses, forward and backward: 8. A recomputed
    forward (any checkpointing) moves the forward's share again."""
    d = cfg.d_model / (tp if sp else 1)
    sublayers = 3 if cross else 2
    rms = cfg.norm == "rmsnorm"
    if compiled:
        extra, again = 8.0, 4.0
    else:
        forward, backward = (32, 64) if rms else (24, 44)
        extra, again = forward + backward - 30.0, forward - 10.0
    return sublayers * d * (extra + (again if recomputed else 0.0))


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
    write of the rows; the zeros). Kernels: about a dozen (softmax, top-k, the counts, argsort,
    gathers, the weighted index_add)."""
    moe, d = cfg.moe, cfg.d_model
    return 3 * moe.num_experts + moe.top_k * (2 + 2 + 3) * d + d, 12


def head_traffic(cfg: ModelConfig, tokens: int, tp: int, mixed: bool) -> float:
    """Logits written, their fp32 log-softmax read and written, the loss's gradient read and written,
    cast back under mixed precision: per logit 2 x (elt) + 16."""
    elt = 2 if mixed else 4
    return tokens * cfg.padded_vocab_size / tp * (2 * elt + 16)


def gpu_head_bytes(cfg: ModelConfig, layout: Layout, tokens: int) -> float:
    """Bytes the head's elementwise passes and the chunked loss's weight-gradient accumulator move on
    a GPU for ``tokens`` rows of one rank, counted op by op from the loss the trainer runs
    (models/base.py ``lm_loss``, models/loss.py ``chunked_lm_loss``); the GEMMs' own operands overlap
    their compute as everywhere in this model. Per logit, under mixed precision (fp32: the logits
    are fp32, so no copy and no cast back):

    - whole, eager (``CrossEntropy`` over the bf16 logits): the GEMM writes them (2), the
      log-softmax upcasts them (read 2, write 4) and runs over the fp32 copy (max: read 4; sum of
      exps: read 4; the result: read 4, write 4), backward's exp in place (read 4, write 4) and its
      scaling straight into the bf16 gradient (read 4, write 2): 38 bytes (62 before the loss took
      bf16 logits: the ``logsumexp`` composite's four passes, the subtraction, the scaling in fp32
      and the cast back); in fp32, ``logsumexp`` and the subtraction over the logits in place: 52;
    - whole, compiled (``compile_head``): the logits written (2), read by the fused log-sum-exp and
      again to write the saved fp32 log-probabilities (2 + 2 + 4), read in backward, which writes
      the bf16 gradient (4 + 2): 16;
    - chunked (``loss.chunk_size``; a Python loop over chunks whatever ``compile`` says): the logits
      (2), ``.float()`` (2 + 4), amax (4), the shift, exp, softmax and label-mask passes in place
      (4 + 4 each, four of them), the sum of exps (4), the bf16 copy for the input gradient (4 +
      2): 54 bytes. Each chunk's weight gradient is added in place (``add_weight_grad``: a GEMM
      with beta 1) to the fp32 (vocabulary x d) gradient, which the GEMM reads and writes whole:
      8 bytes per weight per chunk, and 12 more once (zeroed, scaled by 1 / count).

    The head's GEMMs and loss run whole under TP (loss parallelism), as ``head_time`` says."""
    mixed = layout.mixed
    elt = 2 if mixed else 4
    vocab = cfg.padded_vocab_size // layout.tp
    copies = (elt + 4) + (4 + elt) if mixed else 0  # the fp32 copy of the logits and the bf16 gradient
    chunk = layout.loss_chunk if layout.tp == 1 else None
    if chunk is not None:
        per_logit = elt + copies + 4 + 4 * 8 + 4
        chunks = -(-tokens // min(chunk, tokens)) if tokens else 0
        accumulator = (8 * chunks + 12) * vocab * cfg.d_model
        return tokens * vocab * per_logit + accumulator
    if layout.compile:
        return tokens * vocab * (4 * elt + 8)
    if mixed:
        return tokens * vocab * (elt + (elt + 4) + 16 + 8 + (4 + elt))
    return tokens * vocab * (elt + 24 + 8 + 16)


def transcendental_seconds(
    cfg: ModelConfig, layout: Layout, hw: Hardware, gemms: list[Gemm], kernel: str, tokens: int, moe: bool, passes: int
) -> float:
    """Seconds one block's compute-bound elementwise work takes beyond the bytes ``elementwise``
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


def head_exps(cfg: ModelConfig, layout: Layout, tokens: int, split: int, hw: Hardware) -> float:
    """Seconds of the head's exps at ``exp_rate`` (0 where the profile has none): the log-softmax
    takes one per logit in forward and one in backward; the chunked loss only one (models/loss.py
    turns the exps into the gradient in place)."""
    if not hw.exp_rate:
        return 0.0
    per_logit = 1 if layout.loss_chunk is not None and layout.tp == 1 else 2
    return tokens * cfg.padded_vocab_size / split * per_logit / hw.exp_rate
