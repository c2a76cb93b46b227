"""tformer encoder <-> HF ``BertForMaskedLM``.

Post-norm blocks, embeddings normed after the sum, and the MLM head (dense -> activation -> norm
-> vocabulary projection with its own bias) map one to one.
"""

from __future__ import annotations

import torch

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

HF_CLASS = "BertForMaskedLM"
AUTO_CLASS = "AutoModelForMaskedLM"


def check(cfg: ModelConfig) -> None:
    raise_problems(
        HF_CLASS,
        [
            need(cfg, "family", "encoder", "BERT is an encoder; set flavour to the family's target"),
            need(cfg, "position", "learned", "BERT has learned absolute positions"),
            need(cfg, "norm", "layernorm", "BERT uses LayerNorm"),
            need(cfg, "norm_bias", True, "BERT's LayerNorms have biases; train with norm_bias=true"),
            need(cfg, "norm_position", "post", "BERT is post-norm; train with norm_position=post"),
            need(cfg, "embed_norm", True, "BERT norms the embedding sum; train with embed_norm=true"),
            need(cfg, "activation", tuple(PLAIN_ACTS), "BERT's feed-forward is not gated"),
            need(cfg, "bias", True, "BERT always has attention and feed-forward biases"),
            need(cfg, "attn_scale", True, "BERT always scales attention by 1/sqrt(d_head)"),
            need(cfg, "num_kv_heads", lambda v: v in (None, cfg.num_heads), "BERT has no grouped-query attention"),
            need(cfg, "d_head", lambda _: default_head_dim(cfg), "BERT's head width is d_model/num_heads"),
            need(cfg, "embed_scale", False, "BERT does not scale its embeddings"),
        ],
    )


def hf_config(cfg: ModelConfig):
    from transformers import BertConfig

    return BertConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        intermediate_size=cfg.d_ff,
        hidden_act=PLAIN_ACTS[cfg.activation],
        hidden_dropout_prob=cfg.dropout,
        attention_probs_dropout_prob=cfg.attn_dropout,
        max_position_embeddings=cfg.max_seq_len,
        type_vocab_size=max(1, cfg.type_vocab_size),
        initializer_range=cfg.init_std,
        layer_norm_eps=cfg.norm_eps,
        pad_token_id=cfg.pad_token_id,
        tie_word_embeddings=cfg.tie_embeddings,
        architectures=[HF_CLASS],
    )


def rules(cfg: ModelConfig) -> list[Rule]:
    e = "bert.embeddings."
    out = [
        rule(e + "word_embeddings.weight", "embed.tok.weight"),
        rule(e + "position_embeddings.weight", "embed.pos.weight"),
        *linear(e + "LayerNorm", "embed.norm", True),
    ]
    if cfg.type_vocab_size:
        out.append(rule(e + "token_type_embeddings.weight", "embed.types.weight"))
    for i in range(cfg.num_layers):
        h, o = f"bert.encoder.layer.{i}.", f"encoder.layers.{i}."
        for hf_name, x in (("query", "q"), ("key", "k"), ("value", "v")):
            out += linear(f"{h}attention.self.{hf_name}", f"{o}attn.{x}_proj", True)
        out += [
            *linear(h + "attention.output.dense", o + "attn.o_proj", True),
            *linear(h + "attention.output.LayerNorm", o + "attn_norm", True),
            *linear(h + "intermediate.dense", o + "ffn.up", True),
            *linear(h + "output.dense", o + "ffn.down", True),
            *linear(h + "output.LayerNorm", o + "ffn_norm", True),
        ]
    out += [
        *linear("cls.predictions.transform.dense", "head_dense", True),
        *linear("cls.predictions.transform.LayerNorm", "head_norm", True),
    ]
    if not cfg.tie_embeddings:
        # untied, HF keeps the decoder's bias (the one its forward uses) apart from
        # cls.predictions.bias; both get ours, as transformers 4.x ties them regardless
        out += [*linear("cls.predictions.decoder", "lm_head", True)]
    return out + [rule("cls.predictions.bias", "lm_head.bias")]


def fill(cfg: ModelConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """HF BERT always has token-type embeddings: a model without them is exactly one with a
    single all-zero type row (token_type_ids default to 0)."""
    if cfg.type_vocab_size:
        return {}
    return {"bert.embeddings.token_type_embeddings.weight": torch.zeros(1, cfg.d_model, dtype=dtype)}


def model_config(hf, tied: bool) -> ModelConfig:
    for name in ("is_decoder", "add_cross_attention"):
        if getattr(hf, name, False):
            raise ExportError(f"HF BERT config {name}=true has no tformer equivalent")
    if getattr(hf, "position_embedding_type", "absolute") != "absolute":
        raise ExportError(
            f"HF BERT position_embedding_type={hf.position_embedding_type!r} has no tformer "
            "equivalent; only absolute positions can be imported"
        )
    if hf.hidden_act not in HF_PLAIN_ACTS:
        raise ExportError(
            f"HF BERT hidden_act={hf.hidden_act!r} has no tformer equivalent (supported: {', '.join(HF_PLAIN_ACTS)})"
        )
    return build_config(
        "HF BERT config",
        family="encoder",
        flavour="bert",
        vocab_size=hf.vocab_size,
        d_model=hf.hidden_size,
        num_layers=hf.num_hidden_layers,
        num_heads=hf.num_attention_heads,
        d_ff=hf.intermediate_size,
        max_seq_len=hf.max_position_embeddings,
        position="learned",
        norm="layernorm",
        norm_eps=hf.layer_norm_eps,
        norm_bias=True,
        norm_position="post",
        activation=HF_PLAIN_ACTS[hf.hidden_act],
        bias=True,
        attn_scale=True,
        dropout=float(hf.hidden_dropout_prob),
        attn_dropout=float(hf.attention_probs_dropout_prob),
        tie_embeddings=tied,
        type_vocab_size=hf.type_vocab_size,
        embed_norm=True,
        init_std=hf.initializer_range,
        pad_token_id=hf.pad_token_id or 0,
        bos_token_id=hf.bos_token_id,
        eos_token_id=first_id(hf.eos_token_id),
    )
