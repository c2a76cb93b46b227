"""Model states per rank: the parameters a rank holds (counted on the meta device; split by tensor
parallelism and pipeline stages) and the bytes each takes with its gradient and optimizer states.

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

The device mesh (dp_replicate x dp_shard x tp ranks). Tensor parallelism of degree t gives each rank
1/t of the q/k/v and FFN up/gate weights and biases, of the o_proj and FFN down weights, of the
token embedding and LM head rows (BERT's head bias too) and of T5's relative-bias table; norms,
learned positions, token types, BERT's head dense/norm and the row-wise biases stay whole. FSDP2
then shards each rank's TP-local tensors over dp_shard (HSDP: dp_replicate copies of that), so the
model states per rank are the formulas above for the TP-local Ψ with N = dp_shard.

Pipeline parallelism gives each rank its stages' parameters (``stage_parameters``: blocks split as
evenly as possible, earlier stages taking the remainder; embeddings on the first stage, final norm
and head on the last, a tied embedding/head on both).
"""

from __future__ import annotations

from typing import Any

import functools

from ..config import ModelConfig
from ..models import build_model, spec_of
from ..nn.ffn import FFN_KINDS
from ..parallel.pipeline import stage_layers


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


def num_parameters(cfg: ModelConfig) -> int:
    """Parameters of the model, counted on the meta device (nothing allocated; cached: the search
    asks for the same model hundreds of times, and a 70B model takes seconds to build)."""
    return _module_counts(_fields(cfg))["all"]


def _fields(cfg: ModelConfig) -> tuple:
    # hashable for the cache: the nested sections (moe, mla, yarn) as sorted tuples of their items
    return tuple(sorted((k, tuple(sorted(v.items())) if isinstance(v, dict) else v) for k, v in cfg.to_dict().items()))


def config_of(fields: tuple) -> ModelConfig:
    """The ``ModelConfig`` that ``_fields`` made ``fields`` of (its sections mappings again)."""
    nested = {k for k, v in ModelConfig().to_dict().items() if isinstance(v, dict)}
    values: dict[str, Any] = {k: dict(v) if k in nested else v for k, v in fields}
    return ModelConfig(**values)


@functools.lru_cache(maxsize=16)
def _module_counts(fields: tuple) -> dict[str, Any]:
    """Elements of the model's parts, by module: ``all``; ``embed`` (token, position, type
    embeddings and their norm) and ``tok`` (the token embedding alone); per stack i (encoder or the
    one stack, then T5's decoder) ``blocks{i}`` (each block's, in order: the first ``first_dense``
    blocks of a DeepSeek-V3 stack are dense, the rest MoE), ``norm{i}`` (its final norm) and
    ``stack{i}`` (what every stage of it holds: T5's relative-bias table); ``head`` (an untied LM
    head weight, the head's bias, BERT's head dense and norm; a tied weight counts in ``embed``);
    ``mtp`` (the multi-token prediction depths: their norms, projections and blocks)."""
    import torch

    with torch.device("meta"):
        model = build_model(config_of(fields))

    def count(module) -> int:
        return sum(p.numel() for p in module.parameters()) if module is not None else 0

    own = getattr(model, "encoder_embed", None)  # an encoder's own token embedding (T5Gemma) counts with the embeddings
    out: dict[str, Any] = {"all": model.num_parameters(), "embed": count(model.embed) + count(own)}
    out["tok"] = model.embed.tok.weight.numel() + (own.tok.weight.numel() if own is not None else 0)
    for i, stack in enumerate(model.stacks()):
        out[f"blocks{i}"] = tuple(count(block) for block in stack.layers)
        out[f"norm{i}"] = count(stack.final_norm)
        out[f"stack{i}"] = count(stack) - sum(out[f"blocks{i}"]) - out[f"norm{i}"]
    embedded = {id(p) for p in model.embed.parameters()}
    out["head"] = sum(
        p.numel()
        for name in model.HEAD
        for p in (getattr(model, name).parameters() if getattr(model, name, None) is not None else ())
        if id(p) not in embedded
    )
    out["mtp"] = count(getattr(model, "mtp", None))
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


def _attention_sharded(cfg: ModelConfig) -> int:
    """Elements of one self-attention layer TP splits: MHA's q/k/v weights and biases, o_proj's
    weight, the sinks with their heads; MLA's up projections (the query's, or its one projection,
    and the latent's to keys and values) and o_proj's weight, its down projections and their norms
    staying whole (parallel/tp.py)."""
    d, h = cfg.d_model, cfg.num_heads
    if cfg.latent_attention:
        m = cfg.mla
        q = h * m.qk_head_dim * (m.q_lora_rank or d)
        return q + m.kv_lora_rank * h * (m.qk_nope_head_dim + m.v_head_dim) + h * m.v_head_dim * d
    kv, dk = cfg.kv_heads, cfg.head_dim
    attention = (h + 2 * kv) * dk * (d + int(cfg.attn_qkv_bias)) + h * dk * d  # (Qwen: q/k/v biases alone)
    return attention + (h if cfg.attn_sinks else 0)  # the sinks, split with their heads


def _tp_sharded_parts(cfg: ModelConfig) -> dict[str, Any]:
    """Of each part of ``_module_counts``, the elements tensor parallelism splits over the TP ranks
    (the rest is whole on every rank): the self-attention's (``_attention_sharded``) and a
    cross-attention's (MHA), a dense FFN's up/gate weights and biases and down weight (an MoE FFN
    runs whole on every TP rank); the token embedding, an untied LM head, BERT's head bias; T5's
    relative-bias tables (one per stack); the MTP depths' blocks (their projections stay whole)."""
    d, ff, vocab = cfg.d_model, cfg.d_ff, cfg.padded_vocab_size
    bias = int(cfg.bias)
    dense_ffn = (2 if FFN_KINDS[cfg.activation][1] else 1) * ff * (d + bias) + ff * d
    relative = cfg.rel_num_buckets * cfg.num_heads if cfg.position == "relative" else 0
    spec = spec_of(cfg)
    head = (0 if cfg.tie_embeddings else vocab * d) + (vocab if spec.model.LM_HEAD_BIAS else 0)
    tables = 1 if cfg.shared_embeddings else 2  # T5Gemma's encoder has a token embedding of its own
    out: dict[str, Any] = {"embed": tables * vocab * d, "tok": tables * vocab * d, "head": head}

    def block(index: int, cross: bool) -> int:
        ffn = 0 if cfg.moe.is_moe_layer(index) else dense_ffn
        return _attention_sharded(cfg) + (_attention_sharded(cfg.replace(attention="mha")) if cross else 0) + ffn

    for i, (n, _, cross) in enumerate(spec.stack_shapes(cfg, 1, None)):
        out[f"blocks{i}"] = tuple(block(j, cross is not None) for j in range(n))
        out.update({f"stack{i}": relative, f"norm{i}": 0})
    out["mtp"] = sum(block(cfg.num_layers + k, False) for k in range(cfg.mtp_depth))
    return out


def tp_sharded_parameters(cfg: ModelConfig) -> int:
    """Parameters tensor parallelism splits over the TP ranks (``_tp_sharded_parts`` of the whole
    model)."""
    parts = _tp_sharded_parts(cfg)
    stacks = range(len(spec_of(cfg).stack_shapes(cfg, 1, None)))
    return parts["embed"] + parts["head"] + parts["mtp"] + sum(sum(parts[f"blocks{i}"]) + parts[f"stack{i}"] for i in stacks)


def tp_local_parameters(cfg: ModelConfig, tp: int) -> int:
    """Parameters one TP rank holds: the sharded ones / tp plus the replicated ones."""
    sharded = tp_sharded_parameters(cfg)
    return num_parameters(cfg) - sharded + sharded // tp


def stage_parameters(cfg: ModelConfig, stages: int, tp: int = 1) -> list[int]:
    """Parameters each pipeline stage holds on one TP rank, as ``pipeline.build_stage`` splits the
    model: blocks as evenly as possible (earlier stages take the remainder) plus what every stage of
    the stack keeps (T5's relative-bias table); the embeddings on the first stage; the final norm
    and the head on the last, with the token embedding again when the head is tied to it; an
    encoder-decoder model's encoder (with the embedding) and decoder (with the embedding and head)."""
    counts, sharded = _module_counts(_fields(cfg)), _tp_sharded_parts(cfg)

    def local(key: str, index: int | None = None) -> int:
        whole, split = (counts[key], sharded[key]) if index is None else (counts[key][index], sharded[key][index])
        return whole - split + split // tp

    if stages == 1:
        return [tp_local_parameters(cfg, tp)]
    shapes = spec_of(cfg).stack_shapes(cfg, 1, None)
    if len(shapes) > 1:  # one stage per stack (``cut_stage``), each with the shared embedding
        return [
            local("embed")
            + local(f"stack{i}")
            + sum(local(f"blocks{i}", j) for j in range(n))
            + local(f"norm{i}")
            + (local("head") if i == len(shapes) - 1 else 0)
            for i, (n, _, _) in enumerate(shapes)
        ]
    out = []
    for stage, blocks in enumerate(stage_layers(cfg.num_layers, stages)):
        n = local("stack0") + sum(local("blocks0", j) for j in blocks)
        if stage == 0:
            n += local("embed")
        if stage == stages - 1:
            n += local("norm0") + local("head") + (local("tok") if cfg.tie_embeddings else 0)
        out.append(n)
    return out
