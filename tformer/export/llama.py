"""tformer decoder, Llama flavour <-> HF ``LlamaForCausalLM``.

Same layout as ours (separate q/k/v, gate/up/down, rotate-half RoPE): a rename only.
"""

from __future__ import annotations

from ..config import ModelConfig
from .common import ExportError, Rule, build_config, first_id, linear, need, raise_problems, rule

HF_CLASS = "LlamaForCausalLM"
AUTO_CLASS = "AutoModelForCausalLM"
GATED_ACTS = {"swiglu": "silu", "geglu": "gelu_pytorch_tanh", "geglu_exact": "gelu"}
HF_GATED_ACTS = {
    "silu": "swiglu",
    "swish": "swiglu",
    "gelu_pytorch_tanh": "geglu",
    "gelu_new": "geglu",
    "gelu": "geglu_exact",
}


def check(cfg: ModelConfig) -> None:
    raise_problems(HF_CLASS, problems(cfg))


def problems(cfg: ModelConfig) -> list[str | None]:
    """What a Llama-shaped HF decoder (Llama, Mixtral, Qwen2-MoE) cannot express."""
    return [
        need(cfg, "family", "decoder", "Llama is a decoder; set flavour to the family's target"),
        need(cfg, "position", "rotary", "Llama uses rotary positions; use flavour=gpt2 for learned ones"),
        need(cfg, "norm", "rmsnorm", "Llama uses RMSNorm; use flavour=gpt2 for LayerNorm"),
        need(cfg, "norm_position", "pre", "Llama is pre-norm; train with norm_position=pre"),
        need(
            cfg,
            "activation",
            tuple(GATED_ACTS),
            "Llama's MLP is gated (gate_proj/up_proj); use flavour=gpt2 for a plain MLP",
        ),
        need(cfg, "attn_scale", True, "Llama always scales attention by 1/sqrt(d_head)"),
        need(cfg, "type_vocab_size", 0, "Llama has no token-type embeddings"),
        need(cfg, "embed_norm", False, "Llama has no norm after the embeddings"),
        need(cfg, "embed_scale", False, "Llama does not scale its embeddings"),
    ]


def decoder_config(cfg: ModelConfig) -> dict:
    """The keyword arguments every Llama-shaped HF decoder config (Llama, Mixtral, Qwen2-MoE) takes
    from ours alike; each exporter adds its own."""
    return dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.kv_heads,
        hidden_act=GATED_ACTS[cfg.activation],
        max_position_embeddings=cfg.max_seq_len,
        initializer_range=cfg.init_std,
        rms_norm_eps=cfg.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        attention_dropout=cfg.attn_dropout,
        bos_token_id=cfg.bos_token_id,
        eos_token_id=cfg.eos_token_id,
        pad_token_id=cfg.pad_token_id,
        tie_word_embeddings=cfg.tie_embeddings,
    )


def hf_config(cfg: ModelConfig):
    from transformers import LlamaConfig

    return LlamaConfig(
        **decoder_config(cfg),
        intermediate_size=cfg.d_ff,
        head_dim=cfg.head_dim,
        attention_bias=cfg.bias,
        mlp_bias=cfg.bias,
        architectures=[HF_CLASS],
    )


def rules(cfg: ModelConfig) -> list[Rule]:
    return decoder_rules(cfg, lambda i, h, o: mlp_rules(f"{h}mlp.", f"{o}ffn.", cfg.bias))


def mlp_rules(hf: str, ours: str, bias: bool) -> list[Rule]:
    """A gated MLP: HF ``gate_proj`` / ``up_proj`` / ``down_proj``, ours ``gate`` / ``up`` / ``down``."""
    out = []
    for hf_name, name in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down")):
        out += linear(hf + hf_name, ours + name, bias)
    return out


def decoder_rules(cfg: ModelConfig, ffn) -> list[Rule]:
    """A Llama-shaped decoder's map; ``ffn(i, hf_prefix, our_prefix)`` maps layer i's FFN."""
    out = [rule("model.embed_tokens.weight", "embed.tok.weight")]
    for i in range(cfg.num_layers):
        h, o = f"model.layers.{i}.", f"decoder.layers.{i}."
        for x in "qkvo":
            out += linear(f"{h}self_attn.{x}_proj", f"{o}attn.{x}_proj", cfg.bias)
        out += ffn(i, h, o)
        out += [
            rule(h + "input_layernorm.weight", o + "attn_norm.weight"),
            rule(h + "post_attention_layernorm.weight", o + "ffn_norm.weight"),
        ]
    out.append(rule("model.norm.weight", "decoder.final_norm.weight"))
    if not cfg.tie_embeddings:
        out.append(rule("lm_head.weight", "lm_head.weight"))
    return out


def model_config(hf, tied: bool) -> ModelConfig:
    rope = dict(getattr(hf, "rope_parameters", None) or {})
    if rope.get("rope_type", "default") != "default":
        raise ExportError(
            f"HF Llama rope_parameters.rope_type={rope['rope_type']!r} (RoPE scaling) has no "
            "tformer equivalent; only the default RoPE can be imported"
        )
    if hf.attention_bias != hf.mlp_bias:
        raise ExportError(
            f"HF Llama attention_bias={hf.attention_bias} with mlp_bias={hf.mlp_bias} has no "
            "tformer equivalent (one bias switch for both)"
        )
    if hf.hidden_act not in HF_GATED_ACTS:
        raise ExportError(
            f"HF Llama hidden_act={hf.hidden_act!r} has no tformer equivalent (supported: {', '.join(HF_GATED_ACTS)})"
        )
    fields = {**decoder_fields(hf, "llama"), "bias": hf.attention_bias}
    return build_config("HF Llama config", **fields, d_ff=hf.intermediate_size, tie_embeddings=tied)


def decoder_fields(hf, flavour: str) -> dict:
    """The Llama-shaped fields of an HF decoder config (Llama, Mixtral, Qwen2-MoE)."""
    rope = dict(getattr(hf, "rope_parameters", None) or {})
    if rope.get("rope_type", "default") != "default":
        raise ExportError(f"HF {flavour} rope_parameters.rope_type={rope['rope_type']!r} has no tformer equivalent")
    if hf.hidden_act not in HF_GATED_ACTS:
        raise ExportError(f"HF {flavour} hidden_act={hf.hidden_act!r} has no tformer equivalent")
    if getattr(hf, "sliding_window", None) is not None and getattr(hf, "use_sliding_window", True):
        raise ExportError(f"HF {flavour} sliding_window={hf.sliding_window} has no tformer equivalent; set it to null")
    eos = first_id(hf.eos_token_id)
    return dict(
        family="decoder",
        flavour=flavour,
        vocab_size=hf.vocab_size,
        d_model=hf.hidden_size,
        num_layers=hf.num_hidden_layers,
        num_heads=hf.num_attention_heads,
        num_kv_heads=hf.num_key_value_heads,
        d_head=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
        max_seq_len=hf.max_position_embeddings,
        position="rotary",
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        norm="rmsnorm",
        norm_eps=hf.rms_norm_eps,
        norm_bias=False,
        norm_position="pre",
        activation=HF_GATED_ACTS[hf.hidden_act],
        bias=False,
        attn_dropout=float(hf.attention_dropout),
        init_std=hf.initializer_range,
        bos_token_id=hf.bos_token_id,
        eos_token_id=eos,
        pad_token_id=hf.pad_token_id if hf.pad_token_id is not None else (eos or 0),
    )
