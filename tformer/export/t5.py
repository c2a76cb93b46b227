"""tformer encoder-decoder <-> HF ``T5ForConditionalGeneration``.

Our one relative-bias table per stack lives in HF's block 0 (later blocks reuse it). A tied head
(T5 v1.0) is rescaled by ``d_model**-0.5`` (``tied_output_scale`` / ``scale_decoder_outputs``); an
untied one (v1.1) writes ``lm_head.weight`` and ``tie_word_embeddings: false``.
"""

from __future__ import annotations

from ..config import ModelConfig
from .common import HF_PLAIN_ACTS, PLAIN_ACTS, ExportError, Rule, build_config, first_id, need, raise_problems, rule

HF_CLASS = "T5ForConditionalGeneration"
AUTO_CLASS = "AutoModelForSeq2SeqLM"
# feed_forward_proj: "{act}" or "gated-{act}"; HF's "gated-gelu" is the tanh approximation.
FF_PROJ = {**PLAIN_ACTS, "geglu": "gated-gelu", "swiglu": "gated-silu"}


def check(cfg: ModelConfig) -> None:
    raise_problems(HF_CLASS, problems(cfg))


def problems(cfg: ModelConfig) -> list[str | None]:
    """What a T5-shaped HF encoder-decoder (T5, Switch Transformers) cannot express."""
    return [
        need(cfg, "family", "encdec", "T5 is an encoder-decoder; set flavour to the family's target"),
        need(cfg, "position", "relative", "T5 uses relative position biases"),
        need(cfg, "norm", "rmsnorm", "T5 uses RMSNorm"),
        need(cfg, "norm_position", "pre", "T5 is pre-norm; train with norm_position=pre"),
        need(
            cfg,
            "attn_scale",
            False,
            "HF T5 never scales attention scores (the scale is folded into its initialisation); train with attn_scale=false",
        ),
        need(cfg, "bias", False, "HF T5 has no biases in attention or feed-forward; train with bias=false"),
        need(cfg, "num_kv_heads", lambda v: v in (None, cfg.num_heads), "T5 has no grouped-query attention"),
        need(cfg, "type_vocab_size", 0, "T5 has no token-type embeddings"),
        need(cfg, "embed_norm", False, "T5 has no norm after the embeddings"),
        need(cfg, "embed_scale", False, "T5 does not scale its embeddings"),
        need(cfg, "activation", tuple(FF_PROJ), "HF T5's gated-gelu is the tanh GELU (geglu)"),
    ]


def hf_config(cfg: ModelConfig):
    from transformers import T5Config

    hf = T5Config(
        vocab_size=cfg.vocab_size,
        d_model=cfg.d_model,
        d_kv=cfg.head_dim,
        d_ff=cfg.d_ff,
        num_layers=cfg.num_layers,
        num_decoder_layers=cfg.decoder_layers,
        num_heads=cfg.num_heads,
        relative_attention_num_buckets=cfg.rel_num_buckets,
        relative_attention_max_distance=cfg.rel_max_distance,
        dropout_rate=cfg.dropout,
        layer_norm_epsilon=cfg.norm_eps,
        feed_forward_proj=FF_PROJ[cfg.activation],
        pad_token_id=cfg.pad_token_id,
        eos_token_id=cfg.eos_token_id,
        decoder_start_token_id=cfg.decoder_start_token_id,
        tie_word_embeddings=cfg.tie_embeddings,
        architectures=[HF_CLASS],
    )
    # T5Config forces tie_word_embeddings=True and keeps the head scaling apart: an untied head
    # must say so in config.json, or transformers 4.x ties and rescales it. A tied head without
    # the rescaling (tied_output_scale=false) is expressible in transformers 5 only.
    hf.tie_word_embeddings = cfg.tie_embeddings
    hf.scale_decoder_outputs = cfg.tie_embeddings and cfg.tied_output_scale
    return hf


def rules(cfg: ModelConfig) -> list[Rule]:
    return stack_rules(cfg, ffn_rules)


def ffn_rules(cfg: ModelConfig, stack: str, i: int, h: str, o: str) -> list[Rule]:
    """T5's FFN sub-layer ``h`` (``...layer.{1|2}.``) of block i <-> our ``o`` (``...layers.{i}.``)."""
    d = f"{h}DenseReluDense."
    out = [rule(d + "wo.weight", o + "ffn.down.weight"), rule(h + "layer_norm.weight", o + "ffn_norm.weight")]
    if cfg.activation in ("geglu", "swiglu"):
        return [rule(d + "wi_0.weight", o + "ffn.gate.weight"), rule(d + "wi_1.weight", o + "ffn.up.weight")] + out
    return [rule(d + "wi.weight", o + "ffn.up.weight")] + out


def stack_rules(cfg: ModelConfig, ffn) -> list[Rule]:
    """A T5-shaped model's map; ``ffn(cfg, stack, i, hf_prefix, our_prefix)`` maps an FFN sub-layer."""
    out = [rule("shared.weight", "embed.tok.weight")]
    for stack, layers in (("encoder", cfg.num_layers), ("decoder", cfg.decoder_layers)):
        for i in range(layers):
            h, o = f"{stack}.block.{i}.layer.", f"{stack}.layers.{i}."
            out += [rule(f"{h}0.SelfAttention.{x}.weight", f"{o}attn.{x}_proj.weight") for x in "qkvo"]
            out.append(rule(h + "0.layer_norm.weight", o + "attn_norm.weight"))
            ff = 1
            if stack == "decoder":
                out += [rule(f"{h}1.EncDecAttention.{x}.weight", f"{o}cross_attn.{x}_proj.weight") for x in "qkvo"]
                out.append(rule(h + "1.layer_norm.weight", o + "cross_norm.weight"))
                ff = 2
            out += ffn(cfg, stack, i, f"{h}{ff}.", o)
        out += [
            rule(
                f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight", f"{stack}.rel_bias.embedding.weight"
            ),
            rule(f"{stack}.final_layer_norm.weight", f"{stack}.final_norm.weight"),
        ]
    if not cfg.tie_embeddings:
        out.append(rule("lm_head.weight", "lm_head.weight"))
    return out


def model_config(hf, tied: bool) -> ModelConfig:
    scaled = getattr(hf, "scale_decoder_outputs", tied)
    if scaled and not tied:
        raise ExportError(
            "HF T5 with a separate lm_head and scale_decoder_outputs=true has no tformer "
            "equivalent (tformer rescales only a tied head)"
        )
    act = hf.dense_act_fn
    if hf.is_gated_act:
        gated = {"gelu_new": "geglu", "gelu_pytorch_tanh": "geglu", "silu": "swiglu", "swish": "swiglu"}
        if act not in gated:
            raise ExportError(
                f"HF T5 feed_forward_proj={hf.feed_forward_proj!r} has no tformer equivalent "
                "(supported gated forms: gated-gelu, gated-silu)"
            )
        activation = gated[act]
    else:
        if act not in HF_PLAIN_ACTS:
            raise ExportError(f"HF T5 feed_forward_proj={hf.feed_forward_proj!r} has no tformer equivalent")
        activation = HF_PLAIN_ACTS[act]
    return build_config(
        "HF T5 config", **encdec_fields(hf, "t5"), activation=activation, tie_embeddings=tied, tied_output_scale=scaled
    )


def encdec_fields(hf, flavour: str) -> dict:
    """The T5-shaped fields of an HF encoder-decoder config (T5, Switch Transformers)."""
    start = getattr(hf, "decoder_start_token_id", None)
    return dict(
        family="encdec",
        flavour=flavour,
        vocab_size=hf.vocab_size,
        d_model=hf.d_model,
        d_head=hf.d_kv,
        d_ff=hf.d_ff,
        num_layers=hf.num_layers,
        num_decoder_layers=hf.num_decoder_layers,
        num_heads=hf.num_heads,
        max_seq_len=getattr(hf, "n_positions", None) or 512,
        position="relative",
        rel_num_buckets=hf.relative_attention_num_buckets,
        rel_max_distance=hf.relative_attention_max_distance,
        norm="rmsnorm",
        norm_eps=hf.layer_norm_epsilon,
        norm_bias=False,
        norm_position="pre",
        bias=False,
        attn_scale=False,
        dropout=float(hf.dropout_rate),
        attn_dropout=float(hf.dropout_rate),
        pad_token_id=hf.pad_token_id or 0,
        eos_token_id=first_id(hf.eos_token_id),
        decoder_start_token_id=start if start is not None else (hf.pad_token_id or 0),
    )
