"""Activations per rank: the tensors autograd saves for backward, counted per token and layer from
the model's shapes, and the peak a backward adds (the recomputed block, the head and loss).
Activation checkpointing keeps only each block's input (full) or its matmul and attention outputs
(op) plus one block's worth rebuilt at a time.

Under tensor parallelism (one rank of the device mesh; ``states.py`` for the parameters) the
activations per token split into what TP divides by t (heads, FFN width), the inputs of the
column-wise projections (whole on every rank, all-gathered under sequence parallelism) and the
norms, residuals and dropout masks (whole, or split along the sequence by t with SP); the logits are
split by t with loss parallelism.
"""

from __future__ import annotations

from ..config import ModelConfig
from ..models import spec_of
from ..nn.ffn import FFN_KINDS


def _gated(cfg: ModelConfig) -> bool:
    """A gated FFN (SwiGLU, GEGLU): gate and up projections (nn/ffn.py says which kinds are)."""
    return FFN_KINDS[cfg.activation][1]


def _block_parts(
    cfg: ModelConfig, seq: int, cross_len: int | None = None, elt: int = 4, tp: int = 1, res: float = 1
) -> tuple[float, float, float]:
    """Elements autograd keeps per token for one block, as (whole, sequence, heads) by what tensor
    parallelism does to them: ``whole``, the norm outputs that feed the column-wise projections,
    stays whole on every TP rank without SP (under SP it is all-gathered, but backward keeps only
    this rank's sequence shard and gathers it again: tp.KeepSequenceShard); ``sequence``, the norm
    inputs (the residual stream: an add saves nothing), is split along the sequence by SP only;
    ``heads``, q, k, v, attention and the FFN's hidden width, is split by tp.

    Counted tensor by tensor against what autograd saves (unique storages; tests/test_plan.py
    measures every family): a LayerNorm keeps its input, an RMSNorm its input and the normalised
    value (the gain multiplies it). SDPA returns its output in the layout the o_proj reads, so the
    two share storage; the math path keeps the (heads x keys) probabilities and, for grouped KV
    heads, the repeated keys and values; an additive bias (T5's relative positions) sends SDPA on
    this CPU to a path that keeps the probabilities too (CUDA's memory-efficient kernel does not:
    an over-estimate there). The FFN keeps the activation's input (ReLU: its output), a gated unit
    the gate and up projections: the activation's output and the gated product are rebuilt in
    backward (nn/rebuild.py), except the down projection's input under TP (a DTensor: kept).
    Dropout keeps a mask per sub-layer output: one byte per element on CUDA (``elt``: the
    activations' bytes; on this CPU the mask is a float, four bytes); attention dropout inside
    SDPA keeps nothing on CUDA (its kernels replay the random numbers).

    ``res`` > 1: bf16 autocast over fp32 weights (one device, DDP; ``res`` = 2). The residual stream
    then stays fp32, so the norms keep fp32 tensors (``res`` elements of ``elt`` bytes each),
    while each sub-layer's input is cast once to bf16 for its projections (nn/cast.py) and every
    cross-attention layer keeps its own bf16 copy of the encoder output for its k and v. (Under
    FSDP2's or DeepSpeed's bf16 parameters the stream itself is bf16.)"""
    d, h, dk, ff = cfg.d_model, cfg.num_heads, cfg.head_dim, cfg.d_ff
    kv = cfg.kv_heads * dk
    norm_in = (2 if cfg.norm == "rmsnorm" else 1) * d * res
    mask = d / elt if cfg.dropout > 0 else 0  # one dropout mask, in elements

    def attention(keys: int, self_attention: bool) -> float:
        """q, k, v (cross-attention's k, v are counted per source token by the caller) and the
        output (= the o_proj input). Sinks send SDPA to the math path (one more key column: a zero
        key and value per head, repeated to every query head)."""
        if self_attention and cfg.latent_attention:
            return _latent_heads(cfg, keys, elt)
        sinks = self_attention and cfg.attn_sinks
        out: float = h * dk + (2 * kv if self_attention else 0) + h * dk
        if cfg.attn_impl == "math" or sinks:
            column = 1 if sinks else 0
            out += h * (keys + column) * (1 + (1 / elt + 1 if cfg.attn_dropout > 0 else 0))  # probs (+ mask, dropped)
            if self_attention and (kv != h * dk or sinks):
                out += 2 * (h * dk * (keys + column) / keys - kv)  # keys and values repeated to every head
        elif cfg.position == "relative" and self_attention:
            out += h * keys
        return out

    ffn: float = (2 if _gated(cfg) else 1) * ff
    if tp > 1 and cfg.activation != "relu":
        ffn += ff
    whole: float = 2 * d + _latent_whole(cfg)  # attention and FFN norm outputs (MLA's latents)
    sequence = 2 * norm_in + 2 * mask  # attention and FFN norm inputs; the dropout masks
    heads = attention(seq, True) + ffn
    if cross_len is not None:  # cross-attention norm and dropout, queries, output (K/V: the caller)
        whole, sequence, heads = whole + d, sequence + norm_in + mask, heads + attention(cross_len, False)
        if res > 1:
            whole += d * cross_len / seq
    return whole, sequence, heads


def _latent_whole(cfg: ModelConfig) -> float:
    """Elements per token latent attention keeps whole on every TP rank (its down projections are
    replicated): the query's low-rank output, normalised value and norm output, the latent and
    rotary key (kv_down's output), the latent's normalised value and norm output."""
    if not cfg.latent_attention:
        return 0
    m = cfg.mla
    return 3 * (m.q_lora_rank or 0) + m.kv_lora_rank + m.qk_rope_head_dim + 2 * m.kv_lora_rank


def _latent_heads(cfg: ModelConfig, keys: int, elt: int) -> float:
    """Elements per token latent attention keeps per head (split by TP): the queries and keys at
    qk_nope + qk_rope width, the values, the output and the o_proj's input (a copy: the output is
    transposed). Queries and values of different widths send SDPA on this CPU to its math kernel,
    which keeps the probabilities and a contiguous copy of the values instead of the output and of
    kv_up's output (CUDA's memory-efficient kernel takes unequal widths: an over-estimate there);
    measured in tests/test_plan.py."""
    m, h = cfg.mla, cfg.num_heads
    qk, v = m.qk_head_dim, m.v_head_dim
    out = 2 * h * qk + h * v  # q, k, the o_proj input
    if cfg.attn_impl == "math" or qk != v:
        return out + h * v + h * keys * (1 + (1 / elt + 1 if cfg.attn_dropout > 0 else 0))  # values, probs
    return out + h * (m.qk_nope_head_dim + v) + h * v  # kv_up's output (the values' storage), the output


def _self_attention_weights(cfg: ModelConfig, tp: int) -> int:
    """Weights one self-attention layer's matmuls read on one TP rank."""
    d, q, kv = cfg.d_model, cfg.num_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    if not cfg.latent_attention:
        return (2 * d * q + 2 * d * kv) // tp
    m, h = cfg.mla, cfg.num_heads
    down = d * (m.q_lora_rank or 0) + d * (m.kv_lora_rank + m.qk_rope_head_dim)  # whole on every rank
    up = (m.q_lora_rank or d) * h * m.qk_head_dim + m.kv_lora_rank * h * (m.qk_nope_head_dim + m.v_head_dim)
    return down + (up + h * m.v_head_dim * d) // tp


def block_matmul_parameters(cfg: ModelConfig, cross: bool = False, tp: int = 1) -> int:
    """Weights one block's matmuls read (on one TP rank): what bf16 autocast over fp32 weights
    keeps a bf16 copy of, from the forward to the block's backward (2 bytes each)."""
    d, q, kv = cfg.d_model, cfg.num_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    cross_attention = (2 * d * q + 2 * d * kv) // tp if cross else 0
    ffn = (3 if _gated(cfg) else 2) * d * cfg.d_ff
    return _self_attention_weights(cfg, tp) + cross_attention + ffn // tp


def _op_ac_parts(cfg: ModelConfig, cross_len: int | None = None, res: float = 1) -> tuple[float, float, float]:
    """``_block_parts`` of what one block keeps under op-level checkpointing: its input and the
    outputs of its matmuls and attention. The row-wise o_proj and FFN down outputs are whole on
    every TP rank: each rank's matmul gives (S x d) partial sums, and the reduction after it is
    recomputed, not saved."""
    d, h, dk, ff = cfg.d_model, cfg.num_heads, cfg.head_dim, cfg.d_ff
    kv = cfg.kv_heads * cfg.head_dim
    heads = (h * dk + 2 * kv) + h * dk + (2 * ff if _gated(cfg) else ff)
    whole, sequence = 2 * d, d * res  # o_proj and down outputs; the block input (``res``: fp32, in elements)
    if cfg.latent_attention:  # q_down, kv_down (whole); q_up / q_proj, kv_up, attention (per head)
        m = cfg.mla
        whole += (m.q_lora_rank or 0) + m.kv_lora_rank + m.qk_rope_head_dim
        heads += h * (m.qk_head_dim + m.qk_nope_head_dim + 2 * m.v_head_dim) - (2 * h * dk + 2 * kv)
    if cross_len is not None:
        whole, heads = whole + d, heads + h * dk + h * dk  # cross o_proj output; q, attention
    return whole, sequence, heads


def _split(parts: tuple[float, float, float], tp: int, sp: bool) -> float:
    whole, sequence, heads = parts
    return whole + sequence / (tp if sp else 1) + heads / tp


def _block_elements_per_token(
    cfg: ModelConfig,
    seq: int,
    cross_len: int | None = None,
    tp: int = 1,
    sp: bool = False,
    elt: int = 4,
    res: float = 1,
) -> float:
    """Elements autograd keeps per token for one block on one TP rank (``res``: ``_block_parts``)."""
    whole, sequence, heads = _block_parts(cfg, seq, cross_len, elt, tp, res)
    if sp:  # the gathered norm outputs are kept as sequence shards (tp.KeepSequenceShard); the
        # latents are computed from the gathered stream, whole on every rank
        latent = _latent_whole(cfg)
        whole, sequence = latent, sequence + whole - latent
    return _split((whole, sequence, heads), tp, sp)


def _block_elements_op_ac(
    cfg: ModelConfig, cross_len: int | None = None, tp: int = 1, sp: bool = False, res: float = 1
) -> float:
    """Elements per token one block keeps under op-level checkpointing on one TP rank: its input and
    the outputs of its matmuls and attention (q, k, v, attention, o_proj, FFN up(/gate) and down)."""
    return _split(_op_ac_parts(cfg, cross_len, res), tp, sp)


def head_bytes(cfg: ModelConfig, tokens: int, mixed: bool, chunk: int | None = None) -> float:
    """Peak bytes the training loss's head adds on top of the model states, for ``tokens`` labelled
    positions (all samples of a micro-batch): the fp32 log-softmax, written over the logits in
    forward (``models/base.lm_loss``: under mixed precision over their fp32 copy, beside the bf16
    logits) and over their gradient in backward (beside its bf16 cast). Chunked, the same for
    ``chunk`` rows at a time (measured: bench/bench_memory.py)."""
    per_logit = 6 if mixed else 4
    rows = tokens if chunk is None else min(chunk, tokens)
    return rows * cfg.padded_vocab_size * per_logit


def _score_bytes(cfg: ModelConfig, micro_batch: int, stacks: list[tuple[int, int]], ac: str, elt: int, tp: int):
    """(kept, backward peak) bytes of the score-sized (heads x queries x keys) tensors the per-token
    counts miss, for ``stacks`` of (blocks, tokens) self-attending blocks, where attention builds its
    scores (the math path, or an additive bias: T5's relative positions send SDPA on this CPU to the
    math path). Kept under activation checkpointing: each stack's bias (1, heads, S, S), made once
    (fp32) and an input of every checkpointed block (with AC none no saved tensor holds it: the
    add of scores and bias saves nothing). Backward: a block's attention backward holds the
    probabilities' and the scores' gradients at once (two per sample); under activation
    checkpointing the peak recurs at every block, so from the second block on the bias's gradient,
    accumulating over the stack, is live too (with AC none the peak is the first block's backward,
    before any has accumulated). Zero where the kernel never builds scores (flash /
    memory-efficient SDPA, context parallelism's chunk pairs)."""
    relative = cfg.position == "relative"
    if cfg.attn_impl != "math" and not relative:
        return 0.0, 0.0
    kept = peak = 0.0
    for blocks, tokens in stacks:
        if not blocks:
            continue
        unit = cfg.num_heads / tp * tokens * tokens
        kept += unit * 4 if relative and ac != "none" else 0
        grads = 2 * micro_batch * unit * elt
        if relative and ac != "none" and blocks > 1:
            grads += unit * 4
        peak = max(peak, grads)
    return kept, peak


def _ends_elements(cfg: ModelConfig, shapes, counts, whole: bool, head: bool, labelled: float, res: float, split: int):
    """Elements per sample kept outside the blocks: the embedding norm's input (BERT), each
    stack's final norm (``_block_parts``' norm inputs) and a masked LM's head transform (dense,
    activation and norm inputs, at labelled positions). A pipeline stage (not ``whole``) counts
    the last stage's share only (``head``: the last stack's final norm and the head). ``split``:
    the sequence-parallel degree that shards the norms. Small beside the blocks of a real model,
    not of a tiny one."""
    d = cfg.d_model
    norm_in = (2 if cfg.norm == "rmsnorm" else 1) * d * res / split
    out = 0.0
    if whole:
        out += shapes[0][1] * d * res / split if cfg.embed_norm else 0
        out += sum(tokens * norm_in for count, (_, tokens, _) in zip(counts, shapes) if count)
    elif head:
        out += shapes[-1][1] * norm_in
    if head and spec_of(cfg).model.MASKED_LM:
        out += round(shapes[-1][1] * labelled) * 3 * d
    return out


def activation_bytes(
    cfg: ModelConfig,
    micro_batch: int,
    seq: int,
    target: int | None,
    ac: str,
    mixed: bool,
    transient: bool = True,
    chunk: int | None = None,
    offload: bool = False,
    labelled: float = 1.0,
    return_logits: bool = True,
    tp: int = 1,
    sp: bool = False,
    loss_parallel: bool = True,
    blocks: tuple[int, int] | None = None,
    head: bool = True,
    fp32_weights: bool = False,
) -> float:
    """Bytes of activations for one micro-batch: what autograd keeps from forward to backward, plus
    (``transient``) the peak added during backward: the recomputed block under activation
    checkpointing, the head and loss.

    ``chunk``: the chunked head + loss (``loss.chunk_size``); ``offload``: saved activations wait in
    host memory (on the device: one block's worth at a time, brought back for its backward);
    ``labelled``: the share of output positions with a label (BERT's head runs only there);
    ``return_logits``: the evaluation path, which keeps the whole logits (and so cannot chunk).
    ``tp``, ``sp``, ``loss_parallel``: one rank of a tensor-parallel group (module doc); its head is
    vocabulary-sharded, which the chunked loss does not take, so ``chunk`` is ignored there.
    ``blocks`` (encoder or only stack, decoder stack) and ``head``: a pipeline stage's part of the
    model (default: all of it). ``fp32_weights``: mixed precision as bf16 autocast over fp32 weights
    (one device, DDP; not FSDP2's or DeepSpeed's bf16 parameters): the residual stream stays fp32
    and every matmul keeps a bf16 copy of its weight until its backward (``_block_parts``)."""
    elt = 2 if mixed else 4
    autocast = mixed and fp32_weights
    res = 4 / elt if autocast else 1  # the residual stream's elements, in units of ``elt`` bytes
    if tp > 1:
        chunk = None
    block_input = cfg.d_model * res / (tp if sp else 1)  # in the sequence-parallel region
    shapes = spec_of(cfg).stack_shapes(cfg, seq, target)  # (blocks, tokens, cross-attended tokens)
    counts = blocks if blocks is not None else tuple(n for n, _, _ in shapes) + (0,)
    layers: list[tuple[int, float]] = []  # (tokens, elements per token) of every block, stack by stack
    op_elements: list[float] = []
    crosses: list[int | None] = []
    for count, (_, tokens, cross) in zip(counts, shapes):
        # a cross-attending block also keeps the k and v of the memory, per source token
        memory_kv = 0 if cross is None else 2 * cfg.kv_heads * cfg.head_dim * cross / tokens / tp
        per_block = _block_elements_per_token(cfg, tokens, cross_len=cross, tp=tp, sp=sp, elt=elt, res=res)
        layers += [(tokens, per_block + memory_kv if cross is not None else per_block)] * count
        op_block = _block_elements_op_ac(cfg, cross_len=cross, tp=tp, sp=sp, res=res)
        op_elements += [op_block + memory_kv if cross is not None else op_block] * count
        crosses += [cross] * count
    out_tokens = shapes[-1][1]
    if ac == "full":  # each block keeps only its input; one block is recomputed at a time
        kept = sum(tokens * block_input for tokens, _ in layers)
        recompute = max(tokens * e for tokens, e in layers)
    elif ac == "op":  # each block keeps its matmul and attention outputs; the rest is recomputed
        kept = sum(tokens * e for (tokens, _), e in zip(layers, op_elements))
        # backward rebuilds what AC none keeps, less what op kept of it: all but the row-wise
        # outputs (o_proj, FFN down), which AC none never saves (an add keeps nothing)
        own = [_op_ac_parts(cfg, cross_len=cross)[0] for cross in crosses]
        recompute = max(max(0, tokens * (e - o + p)) for (tokens, e), o, p in zip(layers, op_elements, own))
    else:
        kept = sum(tokens * e for tokens, e in layers)
        recompute = 0
    if ac in ("op", "full"):  # the rebuilt block is whole when its backward starts making gradients
        ffn_grads = (3 if _gated(cfg) else 2) * cfg.d_ff / tp + 2 * cfg.d_model
        recompute += max(tokens for tokens, _ in layers) * ffn_grads
    if offload:  # kept in host memory; a block's saved tensors come back for its backward
        recompute += (
            max(tokens * e for tokens, e in layers) if ac == "none" else max(tokens * block_input for tokens, _ in layers)
        )
        kept = 0
    vocab_split = tp if loss_parallel else 1  # without loss parallelism the logits are gathered
    if return_logits:  # the logits are returned: fp32 copy and log-softmax kept, then the gradient
        vocab = out_tokens * cfg.padded_vocab_size / vocab_split
        head_kept, head_peak = vocab * ((elt if mixed else 0) + 4 + 4), vocab * 4
    else:
        head_kept = 0
        labelled_tokens = round(micro_batch * out_tokens * labelled)
        head_peak = head_bytes(cfg, labelled_tokens, mixed, chunk) / micro_batch / vocab_split
    if not head:
        head_kept = head_peak = 0
    total = kept * elt + head_kept
    stacks = [(count, tokens) for count, (_, tokens, _) in zip(counts, shapes)]
    scores_kept, scores_peak = _score_bytes(cfg, micro_batch, stacks, ac, elt, tp)
    total += _ends_elements(cfg, shapes, counts, blocks is None, head, labelled, res, tp if sp else 1) * elt
    if transient:
        # the head's peak (its log-softmax, written over the logits in forward, then over their
        # gradient) and a block's backward (its recomputed tensors, its score gradients) come
        # one after the other
        total += max(head_peak, recompute * elt + scores_peak / micro_batch)
    weights = 0.0  # bf16 copies of the weights, each held from its matmul's forward to its backward
    if autocast:
        copies = [block_matmul_parameters(cfg, cross is not None, tp) for cross in crosses]
        if ac == "none" and not offload:
            weights += 2 * sum(copies)
        elif transient and copies:  # only the block being recomputed (or brought back) holds them
            weights += 2 * max(copies)
        if head:
            weights += 2 * cfg.padded_vocab_size * cfg.d_model / vocab_split
    return micro_batch * total + weights + scores_kept + _window_mask_bytes(cfg, counts, shapes, ac, elt)


def _window_mask_bytes(cfg: ModelConfig, counts, shapes, ac: str, elt: int) -> float:
    """SDPA's explicit (S x S) mask of each windowed block, built by the block in the activations'
    dtype and kept for its backward (one per micro-batch, shared by its samples): S^2 per block, not
    per token, so a long sequence pays for it (8192: 128 MiB per block in bf16). None under
    activation checkpointing (rebuilt with the block), on the math path (it keeps the
    probabilities) or with sinks (the math path too). A pipeline stage holds its share of the
    stack's windowed blocks."""
    if ac != "none" or cfg.attn_impl == "math" or cfg.attn_sinks or cfg.attn_window is None:
        return 0.0
    out = 0.0
    for count, (n, tokens, _) in zip(counts, shapes):
        if count and n:
            windowed = sum(cfg.layer_window(i) is not None and cfg.layer_window(i) < tokens for i in range(n))
            out += round(windowed * count / n) * tokens * tokens * elt
    return out
