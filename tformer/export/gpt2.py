"""tformer decoder, GPT-2 flavour <-> HF ``GPT2LMHeadModel``.

GPT-2 fuses q|k|v into one ``c_attn`` and stores its ``Conv1D`` weights as (in, out): the only
two differences from our layout.
"""

from __future__ import annotations

from ..config import ModelConfig
from .common import (
    HF_PLAIN_ACTS,
    PLAIN_ACTS,
    ExportError,
    Rule,
    build_config,
    default_head_dim,
    first_id,
    linear,
    need,
    raise_problems,
    rule,
)

HF_CLASS = "GPT2LMHeadModel"
AUTO_CLASS = "AutoModelForCausalLM"


def check(cfg: ModelConfig) -> None:
    raise_problems(
        HF_CLASS,
        [
            need(cfg, "family", "decoder", "GPT-2 is a decoder; set flavour to the family's target"),
            need(cfg, "position", "learned", "GPT-2 has learned absolute positions; use flavour=llama for rotary"),
            need(cfg, "norm", "layernorm", "GPT-2 uses LayerNorm; use flavour=llama for RMSNorm"),
            need(cfg, "norm_bias", True, "GPT-2's LayerNorms have biases; train with norm_bias=true"),
            need(cfg, "norm_position", "pre", "GPT-2 is pre-norm; train with norm_position=pre"),
            need(cfg, "activation", tuple(PLAIN_ACTS), "GPT-2's MLP is not gated; use flavour=llama for swiglu/geglu"),
            need(cfg, "bias", True, "HF GPT-2 always has attention and MLP biases; use flavour=llama for bias=false"),
            need(
                cfg,
                "num_kv_heads",
                lambda v: v in (None, cfg.num_heads),
                "GPT-2 has no grouped-query attention; use flavour=llama",
            ),
            need(
                cfg,
                "d_head",
                lambda _: default_head_dim(cfg),
                "GPT-2's head width is d_model/num_heads; use flavour=llama for another d_head",
            ),
            need(cfg, "type_vocab_size", 0, "GPT-2 has no token-type embeddings"),
            need(cfg, "embed_norm", False, "GPT-2 has no norm after the embeddings"),
            need(cfg, "embed_scale", False, "GPT-2 does not scale its embeddings"),
        ],
    )


def hf_config(cfg: ModelConfig):
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=cfg.vocab_size,
        n_positions=cfg.max_seq_len,
        n_embd=cfg.d_model,
        n_layer=cfg.num_layers,
        n_head=cfg.num_heads,
        n_inner=cfg.d_ff,
        activation_function=PLAIN_ACTS[cfg.activation],
        resid_pdrop=cfg.dropout,
        embd_pdrop=cfg.dropout,
        attn_pdrop=cfg.attn_dropout,
        layer_norm_epsilon=cfg.norm_eps,
        initializer_range=cfg.init_std,
        scale_attn_weights=cfg.attn_scale,
        bos_token_id=cfg.bos_token_id,
        eos_token_id=cfg.eos_token_id,
        pad_token_id=cfg.pad_token_id,
        tie_word_embeddings=cfg.tie_embeddings,
        architectures=[HF_CLASS],
    )


def rules(cfg: ModelConfig) -> list[Rule]:
    out = [rule("transformer.wte.weight", "embed.tok.weight"), rule("transformer.wpe.weight", "embed.pos.weight")]
    for i in range(cfg.num_layers):
        h, o = f"transformer.h.{i}.", f"decoder.layers.{i}."
        qkv = [f"{o}attn.{x}_proj" for x in "qkv"]
        out += [
            *linear(h + "ln_1", o + "attn_norm", True),
            rule(h + "attn.c_attn.weight", *(p + ".weight" for p in qkv), transpose=True),
            rule(h + "attn.c_attn.bias", *(p + ".bias" for p in qkv)),
            *linear(h + "attn.c_proj", o + "attn.o_proj", True, transpose=True),
            *linear(h + "ln_2", o + "ffn_norm", True),
            *linear(h + "mlp.c_fc", o + "ffn.up", True, transpose=True),
            *linear(h + "mlp.c_proj", o + "ffn.down", True, transpose=True),
        ]
    out += linear("transformer.ln_f", "decoder.final_norm", True)
    if not cfg.tie_embeddings:
        out.append(rule("lm_head.weight", "lm_head.weight"))
    return out


def model_config(hf, tied: bool) -> ModelConfig:
    if hf.scale_attn_by_inverse_layer_idx:
        raise ExportError("HF GPT-2 config scale_attn_by_inverse_layer_idx=true has no tformer equivalent")
    if hf.add_cross_attention:
        raise ExportError("HF GPT-2 config add_cross_attention=true has no tformer equivalent")
    if hf.activation_function not in HF_PLAIN_ACTS:
        raise ExportError(
            f"HF GPT-2 activation_function={hf.activation_function!r} has no tformer "
            f"equivalent (supported: {', '.join(HF_PLAIN_ACTS)})"
        )
    eos = first_id(hf.eos_token_id)
    return build_config(
        "HF GPT-2 config",
        family="decoder",
        flavour="gpt2",
        vocab_size=hf.vocab_size,
        d_model=hf.n_embd,
        num_layers=hf.n_layer,
        num_heads=hf.n_head,
        d_ff=hf.n_inner or 4 * hf.n_embd,
        max_seq_len=hf.n_positions,
        position="learned",
        norm="layernorm",
        norm_eps=hf.layer_norm_epsilon,
        norm_bias=True,
        norm_position="pre",
        activation=HF_PLAIN_ACTS[hf.activation_function],
        bias=True,
        attn_scale=hf.scale_attn_weights,
        dropout=float(hf.resid_pdrop),
        attn_dropout=float(hf.attn_pdrop),
        tie_embeddings=tied,
        init_std=hf.initializer_range,
        bos_token_id=hf.bos_token_id,
        eos_token_id=eos,
        pad_token_id=hf.pad_token_id if hf.pad_token_id is not None else (eos or 0),
    )
