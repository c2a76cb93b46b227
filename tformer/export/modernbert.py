"""tformer encoder, ModernBERT flavour <-> HF ``ModernBertForMaskedLM``.

A pre-norm encoder with rotary positions, a gated FFN (``Wi`` holds gate | up), fused q|k|v
(``Wqkv``), LayerNorms (no biases in the released models), the embeddings normed and that norm
standing in for block 0's attention norm (``first_attn_norm=false``: HF's ``Identity``), a final
norm, and the MLM head (dense -> GELU -> norm -> vocabulary projection with its bias).

Local and global blocks: HF's ``layer_types`` list (``sliding_attention`` / ``full_attention``) is
our ``attn_window`` (HF ``local_attention``: |i - j| <= window // 2) on the blocks that
``global_every`` / ``global_offset`` leave local; each kind has its RoPE base
(``rope_parameters``; ours ``rope_theta`` global, ``rope_local_theta`` local).
"""

from __future__ import annotations

from typing import Final

from ..config import ModelConfig
from .common import ExportError, Rule, build_config, default_head_dim, first_id, linear, need, raise_problems, rule

HF_CLASS = "ModernBertForMaskedLM"
AUTO_CLASS = "AutoModelForMaskedLM"
# the block switches of export/hf.py's SWITCHES it carries
WINDOW = True
GLOBAL_OFFSET = True
LOCAL_ROPE = True
FIRST_ATTN_NORM = True
HEAD_BIAS_OFF = True

# the gated FFN kinds <-> HF hidden_activation (the GLU's activation)
GATED = {"geglu_exact": "gelu", "geglu": "gelu_pytorch_tanh", "swiglu": "silu"}
HF_GATED = {"gelu": "geglu_exact", "gelu_pytorch_tanh": "geglu", "gelu_new": "geglu", "silu": "swiglu", "swish": "swiglu"}
FULL: Final = "full_attention"
SLIDING: Final = "sliding_attention"


def check(cfg: ModelConfig) -> None:
    raise_problems(
        HF_CLASS,
        [
            need(cfg, "family", "encoder", "ModernBERT is an encoder; set flavour to the family's target"),
            need(cfg, "position", "rotary", "ModernBERT uses rotary positions"),
            need(cfg, "norm", "layernorm", "ModernBERT uses LayerNorm"),
            need(cfg, "norm_position", "pre", "ModernBERT is pre-norm; train with norm_position=pre"),
            need(cfg, "embed_norm", True, "ModernBERT norms its embeddings; train with embed_norm=true"),
            need(cfg, "first_attn_norm", False, "ModernBERT's block 0 has no attention norm; set first_attn_norm=false"),
            need(cfg, "activation", tuple(GATED), "ModernBERT's MLP is gated; use geglu_exact, geglu or swiglu"),
            need(cfg, "attn_scale", True, "ModernBERT always scales attention by 1/sqrt(d_head)"),
            need(cfg, "num_kv_heads", lambda v: v in (None, cfg.num_heads), "ModernBERT has no grouped-query attention"),
            need(cfg, "d_head", lambda _: default_head_dim(cfg), "ModernBERT's head width is d_model/num_heads"),
            need(cfg, "type_vocab_size", 0, "ModernBERT has no token-type embeddings"),
            need(cfg, "embed_scale", False, "ModernBERT does not scale its embeddings"),
            need(cfg, "tied_output_scale", False, "ModernBERT does not scale its tied head"),
        ],
    )


def layer_types(cfg: ModelConfig) -> list[str]:
    return [FULL if cfg.layer_window(i) is None else SLIDING for i in range(cfg.num_layers)]


def hf_config(cfg: ModelConfig):
    from transformers import ModernBertConfig

    local_theta = cfg.rope_local_theta if cfg.rope_local_theta is not None else cfg.rope_theta
    return ModernBertConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.d_ff,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        hidden_activation=GATED[cfg.activation],
        max_position_embeddings=cfg.max_seq_len,
        initializer_range=cfg.init_std,
        norm_eps=cfg.norm_eps,
        norm_bias=cfg.norm_bias,
        pad_token_id=cfg.pad_token_id,
        bos_token_id=cfg.bos_token_id,
        eos_token_id=cfg.eos_token_id,
        cls_token_id=cfg.bos_token_id,
        sep_token_id=cfg.eos_token_id,
        attention_bias=cfg.bias,
        mlp_bias=cfg.bias,
        attention_dropout=cfg.attn_dropout,
        embedding_dropout=cfg.dropout,
        mlp_dropout=cfg.dropout,
        layer_types=layer_types(cfg),
        local_attention=cfg.attn_window or 128,
        rope_parameters={
            FULL: {"rope_type": "default", "rope_theta": cfg.rope_theta},
            SLIDING: {"rope_type": "default", "rope_theta": local_theta},
        },
        decoder_bias=True,
        classifier_bias=cfg.head_bias,
        classifier_activation="gelu",  # our head's activation under a gated FFN (models/encoder.py)
        tie_word_embeddings=cfg.tie_embeddings,
        architectures=[HF_CLASS],
    )


def rules(cfg: ModelConfig) -> list[Rule]:
    b, nb = cfg.bias, cfg.norm_bias
    out = [
        rule("model.embeddings.tok_embeddings.weight", "embed.tok.weight"),
        *linear("model.embeddings.norm", "embed.norm", nb),
    ]
    for i in range(cfg.num_layers):
        h, o = f"model.layers.{i}.", f"encoder.layers.{i}."
        if i:
            out += linear(h + "attn_norm", o + "attn_norm", nb)
        out.append(rule(h + "attn.Wqkv.weight", *(f"{o}attn.{x}_proj.weight" for x in "qkv")))
        if b:
            out.append(rule(h + "attn.Wqkv.bias", *(f"{o}attn.{x}_proj.bias" for x in "qkv")))
        out += [*linear(h + "attn.Wo", o + "attn.o_proj", b), *linear(h + "mlp_norm", o + "ffn_norm", nb)]
        # HF's Wi output is (input | gate): act(input) * gate; ours act(gate(x)) * up(x)
        out.append(rule(h + "mlp.Wi.weight", o + "ffn.gate.weight", o + "ffn.up.weight"))
        if b:
            out.append(rule(h + "mlp.Wi.bias", o + "ffn.gate.bias", o + "ffn.up.bias"))
        out += linear(h + "mlp.Wo", o + "ffn.down", b)
    out += [
        *linear("model.final_norm", "encoder.final_norm", nb),
        *linear("head.dense", "head_dense", cfg.head_bias),
        *linear("head.norm", "head_norm", nb),
    ]
    if not cfg.tie_embeddings:
        out.append(rule("decoder.weight", "lm_head.weight"))
    return out + [rule("decoder.bias", "lm_head.bias")]


def window_pattern(types: list[str]) -> tuple[int, int | None]:
    """(global_every, global_offset) whose global blocks are ``types``' full-attention ones; an
    ExportError when no period-and-offset pattern gives them."""
    n = len(types)
    full = [t == FULL for t in types]
    if not any(full):
        return 0, None
    for every in range(1, n + 1):
        for offset in range(every):
            if all(full[i] == (i % every == offset) for i in range(n)):
                return every, (None if offset == every - 1 else offset)
    raise ExportError(
        f"HF ModernBERT layer_types={types} is no periodic pattern of global blocks; tformer cannot express it"
    )


def model_config(hf, tied: bool) -> ModelConfig:
    unknown = sorted(set(hf.layer_types) - {FULL, SLIDING})
    if unknown:
        raise ExportError(f"HF ModernBERT layer_types holds {unknown[0]!r}, which tformer lacks")
    rope = hf.rope_parameters
    for kind in (FULL, SLIDING):
        if rope[kind].get("rope_type", "default") != "default":
            raise ExportError(
                f"HF ModernBERT rope_parameters[{kind!r}].rope_type={rope[kind]['rope_type']!r} has no tformer equivalent"
            )
    if hf.hidden_activation not in HF_GATED:
        raise ExportError(
            f"HF ModernBERT hidden_activation={hf.hidden_activation!r} has no tformer equivalent "
            f"(supported: {', '.join(HF_GATED)})"
        )
    if hf.classifier_activation != "gelu":
        raise ExportError(
            f"HF ModernBERT classifier_activation={hf.classifier_activation!r}: tformer's head under a gated FFN is GELU"
        )
    if not hf.decoder_bias:
        raise ExportError("HF ModernBERT decoder_bias=false has no tformer equivalent (our MLM head always has its bias)")
    if hf.attention_bias != hf.mlp_bias:
        raise ExportError(
            f"HF ModernBERT attention_bias={hf.attention_bias} with mlp_bias={hf.mlp_bias}: "
            "tformer has one bias switch for both"
        )
    every, offset = window_pattern(list(hf.layer_types))
    windowed = SLIDING in hf.layer_types
    local = rope[SLIDING]["rope_theta"]
    return build_config(
        "HF ModernBERT config",
        family="encoder",
        flavour="modernbert",
        vocab_size=hf.vocab_size,
        d_model=hf.hidden_size,
        num_layers=hf.num_hidden_layers,
        num_heads=hf.num_attention_heads,
        d_ff=hf.intermediate_size,
        max_seq_len=hf.max_position_embeddings,
        position="rotary",
        rope_theta=rope[FULL]["rope_theta"],
        rope_local_theta=local if windowed and local != rope[FULL]["rope_theta"] else None,
        attn_window=hf.local_attention if windowed else None,
        global_every=every if windowed else 0,
        global_offset=offset if windowed else None,
        norm="layernorm",
        norm_eps=hf.norm_eps,
        norm_bias=hf.norm_bias,
        norm_position="pre",
        activation=HF_GATED[hf.hidden_activation],
        bias=hf.attention_bias,
        attn_scale=True,
        dropout=float(hf.mlp_dropout),
        attn_dropout=float(hf.attention_dropout),
        tie_embeddings=tied,
        embed_norm=True,
        first_attn_norm=False,
        head_bias=hf.classifier_bias,
        init_std=hf.initializer_range,
        pad_token_id=hf.pad_token_id or 0,
        bos_token_id=hf.bos_token_id,
        eos_token_id=first_id(hf.eos_token_id),
    )
