"""Per-rank memory of a training layout: model states (parameters, gradients, optimizer) and activations.

Model states follow the ZeRO paper (Rajbhandari et al., 2020) for Ψ parameters on N devices. With
bf16 mixed precision and fp32 master weights (DeepSpeed):
    DP 16Ψ,  ZeRO-1 4Ψ + 12Ψ/N,  ZeRO-2 2Ψ + 14Ψ/N,  ZeRO-3 16Ψ/N.
tformer's ddp and fsdp keep fp32 parameters and compute in bf16 (autocast / FSDP2 mixed precision):
    ddp 16Ψ (4 param + 4 grad + 8 Adam),  fsdp 16Ψ/N (+ 2Ψ bf16 copies held between forward and
    backward when reshard_after_forward is false).
In fp32 every strategy holds 4 (param) + 4 (grad) + 8 (Adam m, v) bytes per parameter:
    DP 16Ψ, ZeRO-1 8Ψ + 8Ψ/N, ZeRO-2 4Ψ + 12Ψ/N, ZeRO-3 16Ψ/N (the paper's arithmetic).
DeepSpeed as built keeps a separate fp32 master copy of each partition even in fp32, and reduces
ZeRO-1 gradients to partitions like ZeRO-2 (measured to 0.1% by bench/bench_scale.py):
    ZeRO-1 and ZeRO-2 4Ψ + 16Ψ/N, ZeRO-3 20Ψ/N; the planner predicts these (``as_built``).
Activations are the tensors autograd saves for backward, counted per token and layer from the
model's shapes; activation checkpointing keeps only each block's input plus one block's worth.

The device mesh (dp_replicate x dp_shard x tp ranks). Tensor parallelism of degree t gives each rank
1/t of the q/k/v and FFN up/gate weights and biases, of the o_proj and FFN down weights, of the
token embedding and LM head rows (BERT's head bias too) and of T5's relative-bias table; norms,
learned positions, token types, BERT's head dense/norm and the row-wise biases stay whole. FSDP2
then shards each rank's TP-local tensors over dp_shard (HSDP: dp_replicate copies of that), so the
model states per rank are the formulas above for the TP-local Ψ with N = dp_shard. Activations per
token split into what TP divides by t (heads, FFN width), the inputs of the column-wise projections
(whole on every rank, all-gathered under sequence parallelism) and the norms, residuals and dropout
masks (whole, or split along the sequence by t with SP); the logits are split by t with loss
parallelism.

Pipeline parallelism (``parallel.pp`` ranks, tformer/parallel/pipeline.py) gives each rank its
stages' parameters (blocks split as evenly as possible, earlier stages taking the remainder;
embeddings on the first stage, final norm and head on the last, a tied embedding/head on both) and
the activations of the micro-batches in flight there at the schedule's peak (``in_flight``): GPipe
keeps all m of a step, 1F1B at most pp - rank, interleaved 1F1B what torch's
``ScheduleInterleaved1F1B`` warms up plus one. The step's idle share is the bubble (``bubble``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from ..config import ConfigError, ModelConfig, Precision
from ..models import spec_of
from ..nn.ffn import FFN_KINDS
from ..parallel.tp import pad_vocab_for_tp

STRATEGY_NAMES = ("ddp", "zero1", "zero2", "zero3", "fsdp", "fsdp-no-reshard")
# bytes per parameter of DeepSpeed's fp32 ZeRO as built, by device count N (see the module doc)
DEEPSPEED_FP32_AS_BUILT = {
    "zero1": ("4Ψ+16Ψ/N", lambda n: 4 + 16 / n),
    "zero2": ("4Ψ+16Ψ/N", lambda n: 4 + 16 / n),
    "zero3": ("20Ψ/N", lambda n: 20 / n),
}


def model_state_bytes(strategy: str, params: int, devices: int, mixed: bool, as_built: bool = False) -> float:
    """Bytes of parameters + gradients + optimizer states per device: the ZeRO paper's formulas, or
    (``as_built``) what DeepSpeed really holds where it differs (fp32 ZeRO)."""
    n, p = devices, params
    if not mixed and as_built and strategy in DEEPSPEED_FP32_AS_BUILT:
        return DEEPSPEED_FP32_AS_BUILT[strategy][1](n) * p
    if not mixed:
        return {
            "ddp": 16 * p,
            "zero1": 8 * p + 8 * p / n,
            "zero2": 4 * p + 12 * p / n,
            "zero3": 16 * p / n,
            "fsdp": 16 * p / n,
            "fsdp-no-reshard": 16 * p / n,
        }[strategy]
    return {
        "ddp": 16 * p,
        "zero1": 4 * p + 12 * p / n,
        "zero2": 2 * p + 14 * p / n,
        "zero3": 16 * p / n,
        "fsdp": 16 * p / n,
        "fsdp-no-reshard": 16 * p / n + 2 * p,
    }[strategy]


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
        output (= the o_proj input)."""
        out: float = h * dk + (2 * kv if self_attention else 0) + h * dk
        if cfg.attn_impl == "math":
            out += h * keys * (1 + (1 / elt + 1 if cfg.attn_dropout > 0 else 0))  # probs (+ mask, dropped)
            if self_attention and kv != h * dk:
                out += 2 * (h * dk - kv)  # repeat_interleave'd keys and values
        elif cfg.position == "relative" and self_attention:
            out += h * keys
        return out

    ffn: float = (2 if _gated(cfg) else 1) * ff
    if tp > 1 and cfg.activation != "relu":
        ffn += ff
    whole: float = 2 * d  # attention and FFN norm outputs
    sequence = 2 * norm_in + 2 * mask  # attention and FFN norm inputs; the dropout masks
    heads = attention(seq, True) + ffn
    if cross_len is not None:  # cross-attention norm and dropout, queries, output (K/V: the caller)
        whole, sequence, heads = whole + d, sequence + norm_in + mask, heads + attention(cross_len, False)
        if res > 1:
            whole += d * cross_len / seq
    return whole, sequence, heads


def block_matmul_parameters(cfg: ModelConfig, cross: bool = False, tp: int = 1) -> int:
    """Weights one block's matmuls read (on one TP rank): what bf16 autocast over fp32 weights
    keeps a bf16 copy of, from the forward to the block's backward (2 bytes each)."""
    d, q, kv = cfg.d_model, cfg.num_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    attention = 2 * d * q + 2 * d * kv
    ffn = (3 if _gated(cfg) else 2) * d * cfg.d_ff
    return (attention * (2 if cross else 1) + ffn) // tp


def _op_ac_parts(cfg: ModelConfig, cross_len: int | None = None, res: float = 1) -> tuple[float, float, float]:
    """``_block_parts`` of what one block keeps under op-level checkpointing: its input and the
    outputs of its matmuls and attention. The row-wise o_proj and FFN down outputs are whole on
    every TP rank: each rank's matmul gives (S x d) partial sums, and the reduction after it is
    recomputed, not saved."""
    d, h, dk, ff = cfg.d_model, cfg.num_heads, cfg.head_dim, cfg.d_ff
    kv = cfg.kv_heads * cfg.head_dim
    heads = (h * dk + 2 * kv) + h * dk + (2 * ff if _gated(cfg) else ff)
    whole, sequence = 2 * d, d * res  # o_proj and down outputs; the block input (``res``: fp32, in elements)
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
    if sp:  # the gathered norm outputs are kept as sequence shards (tp.KeepSequenceShard)
        whole, sequence = 0, sequence + whole
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
    return micro_batch * total + weights + scores_kept


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


# --- the device mesh: tensor parallel (+ sequence parallel) x FSDP2 / HSDP -------------------------
def num_parameters(cfg: ModelConfig) -> int:
    """Parameters of the model, counted on the meta device (nothing allocated; cached: the search
    asks for the same model hundreds of times, and a 70B model takes seconds to build)."""
    return _module_counts(_fields(cfg))["all"]


def _fields(cfg: ModelConfig) -> tuple:
    # hashable for the cache: the nested ``moe`` section as a sorted tuple of its items
    return tuple(sorted((k, tuple(sorted(v.items())) if isinstance(v, dict) else v) for k, v in cfg.to_dict().items()))


@functools.lru_cache(maxsize=16)
def _module_counts(fields: tuple) -> dict[str, int]:
    """Elements of the model's parts, by module: ``all``; ``embed`` (token, position, type
    embeddings and their norm) and ``tok`` (the token embedding alone); per stack i (encoder or the
    one stack, then T5's decoder) ``block{i}`` (one block), ``norm{i}`` (its final norm) and
    ``stack{i}`` (what every stage of it holds: T5's relative-bias table); ``head`` (an untied LM
    head weight, the head's bias, BERT's head dense and norm; a tied weight counts in ``embed``)."""
    import torch

    from ..models import build_model

    with torch.device("meta"):
        values: dict[str, Any] = {k: dict(v) if k == "moe" else v for k, v in fields}
        model = build_model(ModelConfig(**values))

    def count(module) -> int:
        return sum(p.numel() for p in module.parameters()) if module is not None else 0

    out = {"all": model.num_parameters(), "embed": count(model.embed), "tok": model.embed.tok.weight.numel()}
    for i, stack in enumerate(model.stacks()):
        out[f"block{i}"] = count(stack.layers[0])  # the blocks of a stack are alike
        out[f"norm{i}"] = count(stack.final_norm)
        out[f"stack{i}"] = count(stack) - len(stack.layers) * out[f"block{i}"] - out[f"norm{i}"]
    embedded = {id(p) for p in model.embed.parameters()}
    out["head"] = sum(
        p.numel()
        for name in model.HEAD
        for p in (getattr(model, name).parameters() if getattr(model, name, None) is not None else ())
        if id(p) not in embedded
    )
    return out


def tp_blocker(cfg: ModelConfig, tp: int) -> str | None:
    """The first size that ``tp`` does not divide (TP splits heads, KV heads and the FFN width;
    the vocabulary it pads itself, ``pad_vocab_for_tp``), as ``name=value``; None when ``tp`` can
    split them all."""
    for name, value in (
        ("num_heads", cfg.num_heads),
        ("num_kv_heads", cfg.kv_heads),
        ("d_ff", cfg.d_ff),
    ):
        if value % tp:
            return f"{name}={value}"
    return None


def _tp_sharded_parts(cfg: ModelConfig) -> dict[str, int]:
    """Of each part of ``_module_counts``, the elements tensor parallelism splits over the TP ranks
    (the rest is whole on every rank): q/k/v weights and biases, o_proj and FFN down weights, FFN
    up/gate weights and biases, in self- and cross-attention; the token embedding, an untied LM head,
    BERT's head bias; T5's relative-bias tables (one per stack)."""
    d, h, kv, dk, ff, vocab = (cfg.d_model, cfg.num_heads, cfg.kv_heads, cfg.head_dim, cfg.d_ff, cfg.padded_vocab_size)
    bias = int(cfg.bias)
    attention = (h + 2 * kv) * dk * (d + int(cfg.attn_qkv_bias)) + h * dk * d  # (Qwen: q/k/v biases alone)
    ffn = (2 if _gated(cfg) else 1) * ff * (d + bias) + ff * d
    if cfg.moe.is_moe_layer(0):  # an MoE FFN runs whole on every TP rank (parallel/tp.py); blocks as block 0
        ffn = 0
    relative = cfg.rel_num_buckets * h if cfg.position == "relative" else 0
    spec = spec_of(cfg)
    head = (0 if cfg.tie_embeddings else vocab * d) + (vocab if spec.model.LM_HEAD_BIAS else 0)
    out = {"embed": vocab * d, "tok": vocab * d, "head": head}
    for i, (_, _, cross) in enumerate(spec.stack_shapes(cfg, 1, None)):
        out.update({f"block{i}": (2 if cross is not None else 1) * attention + ffn, f"stack{i}": relative, f"norm{i}": 0})
    return out


def tp_sharded_parameters(cfg: ModelConfig) -> int:
    """Parameters tensor parallelism splits over the TP ranks (``_tp_sharded_parts`` of the whole
    model)."""
    parts = _tp_sharded_parts(cfg)
    stacks = enumerate(n for n, _, _ in spec_of(cfg).stack_shapes(cfg, 1, None))
    return parts["embed"] + parts["head"] + sum(n * parts[f"block{i}"] + parts[f"stack{i}"] for i, n in stacks)


def tp_local_parameters(cfg: ModelConfig, tp: int) -> int:
    """Parameters one TP rank holds: the sharded ones / tp plus the replicated ones."""
    sharded = tp_sharded_parameters(cfg)
    return num_parameters(cfg) - sharded + sharded // tp


# --- pipeline parallelism: stages, micro-batches in flight, the bubble -------------------------
def pipeline_blocker(
    cfg: ModelConfig, pp: int, schedule: str = "1f1b", stages_per_rank: int = 1, n_micro: int | None = None
) -> str | None:
    """Why ``pp`` ranks of ``schedule`` cannot split the model or run ``n_micro`` micro-batches
    (the first sentence of ``pipeline.check_pipeline``'s error, or torch's schedule's condition),
    or None."""
    from types import SimpleNamespace

    from ..parallel.pipeline import check_pipeline

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


def stage_parameters(cfg: ModelConfig, stages: int, tp: int = 1) -> list[int]:
    """Parameters each pipeline stage holds on one TP rank, as ``pipeline.build_stage`` splits the
    model: blocks as evenly as possible (earlier stages take the remainder) plus what every stage of
    the stack keeps (T5's relative-bias table); the embeddings on the first stage; the final norm
    and the head on the last, with the token embedding again when the head is tied to it; an
    encoder-decoder model's encoder (with the embedding) and decoder (with the embedding and head)."""
    from ..parallel.pipeline import stage_layers

    counts, sharded = _module_counts(_fields(cfg)), _tp_sharded_parts(cfg)
    local = {k: counts[k] - n + n // tp for k, n in sharded.items()}
    if stages == 1:
        return [tp_local_parameters(cfg, tp)]
    shapes = spec_of(cfg).stack_shapes(cfg, 1, None)
    if len(shapes) > 1:  # one stage per stack (``cut_stage``), each with the shared embedding
        return [
            local["embed"]
            + local[f"stack{i}"]
            + n * local[f"block{i}"]
            + local[f"norm{i}"]
            + (local["head"] if i == len(shapes) - 1 else 0)
            for i, (n, _, _) in enumerate(shapes)
        ]
    out = []
    for stage, blocks in enumerate(stage_layers(cfg.num_layers, stages)):
        n = local["stack0"] + len(blocks) * local["block0"]
        if stage == 0:
            n += local["embed"]
        if stage == stages - 1:
            n += local["norm0"] + local["head"] + (local["tok"] if cfg.tie_embeddings else 0)
        out.append(n)
    return out


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
    from ..parallel.pipeline import stage_layers, stages_of_rank

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
    **memory,
) -> Estimate:
    """One rank of ``devices`` = pp x dp_replicate x dp_shard x tp. ``memory``: the head and offload
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
    from ..parallel.mesh import check_ep

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
    from dataclasses import replace

    from .moe import ep_activation_bytes

    local = cp_local_length(seq, e.cp, e.tp, e.sp) if e.cp > 1 else seq
    extra = e.micro_batch * ep_activation_bytes(cfg, local, ep, 2 if mixed else 4, e.ac)
    return replace(e, activations=e.activations + extra, ep=ep)


def training_memory(cfg) -> dict:
    """``activation_bytes`` settings of a run config: the trainer's loss-only path, its chunked
    head, offload (host memory only on an accelerator) and BERT's labelled share."""
    model_cfg = cfg.model
    return {
        "return_logits": False,
        "chunk": cfg.loss.chunk_size,
        "offload": cfg.parallel.activation_offload and cfg.device != "cpu",
        "labelled": cfg.data.mlm_probability if spec_of(model_cfg).masked_lm else 1.0,
    }


# --- context parallelism (parallel/context.py): each sequence cut over cp ranks ---------------------
def cp_local_length(seq: int, cp: int, tp: int = 1, sp: bool = False) -> int:
    """Tokens one rank holds of a ``seq``-token sequence (padded to 2 cp chunks, and to tp under SP)."""
    from ..parallel.context import padded_length

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
    **memory,
) -> Estimate:
    """One rank of ``devices`` = dp_shard x cp x tp (``estimate``'s mesh with cp): FSDP2 shards the
    model states over dp_shard x cp (the cp ranks hold the same parameters); DDP keeps them whole."""
    dp_shard = devices // (cp * tp)
    cfg = pad_vocab_for_tp(cfg, tp)
    memory = {"fp32_weights": strategy == "ddp", **memory}
    states = model_state_bytes(strategy, tp_local_parameters(cfg, tp), dp_shard * cp, mixed, as_built=True)
    activations = cp_activation_bytes(cfg, micro_batch, seq, target, ac, mixed, cp, tp=tp, sp=sp, **memory)
    return Estimate(strategy, ac, micro_batch, states, activations, 1, dp_shard, tp, sp, cp=cp)
