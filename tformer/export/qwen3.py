"""tformer decoder, Qwen3 flavour <-> HF ``Qwen3ForCausalLM``.

Llama's layout plus an RMSNorm over each head's query and key before RoPE (``qk_norm=head``:
HF's ``self_attn.q_norm`` / ``k_norm``, one gain of width ``head_dim`` each) and a free head width.
HF's ``attention_bias`` puts biases on q, k, v and o but never on the MLP: tformer's one ``bias``
switch cannot say that, so the flavour is bias-free, as every released Qwen3 is. Sliding windows
(HF's ``use_sliding_window``, off in every released Qwen3) are not carried.
"""

from __future__ import annotations

from ..config import ModelConfig
from . import llama
from .common import ExportError, Rule, build_config, need, raise_problems, rule

HF_CLASS = "Qwen3ForCausalLM"
AUTO_CLASS = "AutoModelForCausalLM"
QK_NORM = True


def check(cfg: ModelConfig) -> None:
    raise_problems(HF_CLASS, llama.problems(cfg) + problems(cfg, "Qwen3"))


def problems(cfg: ModelConfig, name: str) -> list[str | None]:
    """What the Qwen3 decoders (dense and MoE) add to Llama's: QK-norm, no biases anywhere."""
    return [
        need(cfg, "qk_norm", "head", f"{name} normalises each head's q and k; set qk_norm=head"),
        need(cfg, "bias", False, f"{name} has no MLP biases; train with bias=false"),
        need(cfg, "qkv_bias", (None, False), f"{name} has no q/k/v biases alone; set qkv_bias=null"),
    ]


def decoder_config(cfg: ModelConfig) -> dict:
    """Qwen3's arguments, which Qwen3-MoE's config takes too."""
    return dict(
        **llama.decoder_config(cfg),
        head_dim=cfg.head_dim,
        attention_bias=False,
        use_sliding_window=False,
        architectures=[HF_CLASS],
    )


def hf_config(cfg: ModelConfig):
    from transformers import Qwen3Config

    return Qwen3Config(**decoder_config(cfg), intermediate_size=cfg.d_ff)


def qk_norm_rules(cfg: ModelConfig) -> list[Rule]:
    out = []
    for i in range(cfg.num_layers):
        h, o = f"model.layers.{i}.self_attn.", f"decoder.layers.{i}.attn."
        out += [rule(f"{h}q_norm.weight", f"{o}q_norm.weight"), rule(f"{h}k_norm.weight", f"{o}k_norm.weight")]
    return out


def rules(cfg: ModelConfig) -> list[Rule]:
    return llama.decoder_rules(cfg, lambda i, h, o: llama.mlp_rules(f"{h}mlp.", f"{o}ffn.", False)) + qk_norm_rules(cfg)


def decoder_fields(hf, flavour: str) -> dict:
    """The Qwen3-shaped fields of an HF config (Qwen3, Qwen3-MoE), refusing what tformer lacks."""
    if hf.attention_bias:
        raise ExportError(f"HF {flavour} attention_bias=True (biases on q/k/v/o but not the MLP) has no tformer equivalent")
    if any(t != "full_attention" for t in getattr(hf, "layer_types", None) or ()):
        raise ExportError(f"HF {flavour} layer_types={hf.layer_types} (sliding windows) has no tformer equivalent")
    return {**llama.decoder_fields(hf, flavour), "qk_norm": "head"}


def model_config(hf, tied: bool) -> ModelConfig:
    fields = decoder_fields(hf, "qwen3")
    return build_config("HF Qwen3 config", **fields, d_ff=hf.intermediate_size, tie_embeddings=tied)
