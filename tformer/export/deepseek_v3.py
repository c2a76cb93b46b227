"""tformer decoder, DeepSeek-V3 flavour <-> HF ``DeepseekV3ForCausalLM``.

Llama's block with multi-head latent attention (``attention: mla``) and, from block
``moe.first_dense`` on, DeepSeek-V3's MoE: sigmoid scores, group-limited top-k, the chosen
weights renormalised and scaled by ``routed_scaling_factor``, ``num_shared_experts`` always-on
experts as one FFN of ``num_shared_experts x d_expert`` (HF's ``shared_experts``). Our
``score_bias`` buffer is HF's ``e_score_correction_bias``.

Names: ``q_down`` / ``q_norm`` / ``q_up`` are HF's ``q_a_proj`` / ``q_a_layernorm`` / ``q_b_proj``,
``kv_down`` / ``kv_norm`` / ``kv_up`` its ``kv_a_proj_with_mqa`` / ``kv_a_layernorm`` /
``kv_b_proj``. RoPE: HF's ``rope_interleave`` is our ``mla.rope_interleave`` (both ways compute
the same; DeepSeek's weights are interleaved). Multi-token prediction has no HF module: it is not
exported (HF's ``num_mtp_layers`` is written 0).
"""

from __future__ import annotations

from ..config import ModelConfig
from . import llama, mixtral
from .common import (
    ExportError,
    Rule,
    build_config,
    linear,
    need,
    need_moe,
    raise_problems,
    rope_parameters,
    rule,
    yarn_fields,
)

HF_CLASS = "DeepseekV3ForCausalLM"
AUTO_CLASS = "AutoModelForCausalLM"
MOE = True
MLA = True
YARN = True
SIGMOID_ROUTING = True
HF_BUFFERS = ("e_score_correction_bias",)


def check(cfg: ModelConfig) -> None:
    moe = cfg.moe
    raise_problems(
        HF_CLASS,
        llama.problems(cfg)
        + mixtral.moe_problems(cfg, "DeepSeek-V3")
        + [
            need(cfg, "attention", "mla", "DeepSeek-V3's attention is latent (MLA); set attention=mla"),
            need(cfg, "activation", "swiglu", "DeepSeek-V3's MLPs are SwiGLU"),
            need(cfg, "qkv_bias", (None, False), "DeepSeek-V3 has no q/k/v biases"),
        ]
        + (
            [
                need_moe(cfg, "router_score", "sigmoid", "DeepSeek-V3 scores experts by sigmoid"),
                need_moe(cfg, "moe_every", 1, "every DeepSeek-V3 block after first_dense is MoE"),
                need_moe(cfg, "num_shared_experts", lambda n: n >= 1, "DeepSeek-V3 always has shared experts"),
                need_moe(cfg, "d_shared", (None, moe.d_expert), "DeepSeek-V3's shared experts are d_expert wide"),
                need_moe(cfg, "shared_gate", False, "DeepSeek-V3's shared experts are not gated"),
            ]
            if moe.enabled
            else ["moe.num_experts=0: DeepSeek-V3 has MoE blocks; use flavour=llama for a dense model"]
        ),
    )


def drop_mtp(state: dict) -> dict:
    """The multi-token prediction modules left out: HF's DeepSeek-V3 has none (they stay in tformer's checkpoints)."""
    return {k: v for k, v in state.items() if not k.startswith("mtp.")}


def hf_config(cfg: ModelConfig):
    from transformers import DeepseekV3Config

    moe, m = cfg.moe, cfg.mla
    base = llama.decoder_config(cfg)
    base.update(num_key_value_heads=cfg.num_heads, rope_parameters=rope_parameters(cfg))
    return DeepseekV3Config(
        **base,
        intermediate_size=cfg.d_ff,
        moe_intermediate_size=moe.d_expert or cfg.d_ff,
        n_shared_experts=moe.num_shared_experts,
        n_routed_experts=moe.num_experts,
        num_experts_per_tok=moe.top_k,
        routed_scaling_factor=moe.routed_scaling_factor,
        n_group=moe.n_group,
        topk_group=moe.topk_group,
        first_k_dense_replace=min(moe.first_dense, cfg.num_layers),
        norm_topk_prob=moe.renormalize,
        kv_lora_rank=m.kv_lora_rank,
        q_lora_rank=m.q_lora_rank,
        qk_rope_head_dim=m.qk_rope_head_dim,
        qk_nope_head_dim=m.qk_nope_head_dim,
        v_head_dim=m.v_head_dim,
        rope_interleave=m.rope_interleave,
        attention_bias=False,
        num_mtp_layers=0,  # multi-token prediction is a training aid with no HF module: not exported
        architectures=[HF_CLASS],
    )


def attention_rules(cfg: ModelConfig, h: str, o: str) -> list[Rule]:
    a, s = f"{o}attn.", f"{h}self_attn."
    if cfg.mla.q_lora_rank is None:
        out = linear(f"{s}q_proj", f"{a}q_proj", False)
    else:
        out = linear(f"{s}q_a_proj", f"{a}q_down", False) + [
            rule(f"{s}q_a_layernorm.weight", f"{a}q_norm.weight"),
            *linear(f"{s}q_b_proj", f"{a}q_up", False),
        ]
    return out + [
        *linear(f"{s}kv_a_proj_with_mqa", f"{a}kv_down", False),
        rule(f"{s}kv_a_layernorm.weight", f"{a}kv_norm.weight"),
        *linear(f"{s}kv_b_proj", f"{a}kv_up", False),
        *linear(f"{s}o_proj", f"{a}o_proj", False),
    ]


def ffn_rules(cfg: ModelConfig, i: int, h: str, o: str) -> list[Rule]:
    m, f = f"{h}mlp.", f"{o}ffn."
    if not cfg.moe.is_moe_layer(i):
        return llama.mlp_rules(m, f, False)
    return (
        mixtral.expert_rules(m, f)
        + [rule(f"{m}gate.e_score_correction_bias", f"{f}score_bias")]
        + llama.mlp_rules(f"{m}shared_experts.", f"{f}shared.", False)
    )


def rules(cfg: ModelConfig) -> list[Rule]:
    out = [rule("model.embed_tokens.weight", "embed.tok.weight")]
    for i in range(cfg.num_layers):
        h, o = f"model.layers.{i}.", f"decoder.layers.{i}."
        out += attention_rules(cfg, h, o) + ffn_rules(cfg, i, h, o)
        out += [
            rule(h + "input_layernorm.weight", o + "attn_norm.weight"),
            rule(h + "post_attention_layernorm.weight", o + "ffn_norm.weight"),
        ]
    out.append(rule("model.norm.weight", "decoder.final_norm.weight"))
    if not cfg.tie_embeddings:
        out.append(rule("lm_head.weight", "lm_head.weight"))
    return out


def model_config(hf, tied: bool) -> ModelConfig:
    if hf.attention_bias:
        raise ExportError("HF DeepSeek-V3 attention_bias=true has no tformer equivalent (use false)")
    if hf.num_key_value_heads != hf.num_attention_heads:
        raise ExportError(
            f"HF DeepSeek-V3 num_key_value_heads={hf.num_key_value_heads} != num_attention_heads: "
            "latent attention expands keys for every head"
        )
    rope = dict(hf.rope_parameters or {})
    yarn = yarn_fields(rope, "DeepSeek-V3")
    hf.rope_parameters = {"rope_type": "default", "rope_theta": rope.get("rope_theta", 10000.0)}  # read below
    fields = llama.decoder_fields(hf, "deepseek_v3")
    hf.rope_parameters = rope
    fields.update(num_kv_heads=None, d_head=None)
    moe = dict(
        num_experts=hf.n_routed_experts,
        top_k=hf.num_experts_per_tok,
        d_expert=hf.moe_intermediate_size,
        num_shared_experts=hf.n_shared_experts,
        router_score="sigmoid",
        renormalize=bool(hf.norm_topk_prob),
        n_group=hf.n_group or 1,
        topk_group=hf.topk_group or 1,
        routed_scaling_factor=float(hf.routed_scaling_factor),
        first_dense=hf.first_k_dense_replace or 0,
        aux_loss_coef=0.0,
    )
    mla = dict(
        q_lora_rank=hf.q_lora_rank,
        kv_lora_rank=hf.kv_lora_rank,
        qk_nope_head_dim=hf.qk_nope_head_dim,
        qk_rope_head_dim=hf.qk_rope_head_dim,
        v_head_dim=hf.v_head_dim,
        rope_interleave=bool(hf.rope_interleave),
    )
    return build_config(
        "HF DeepSeek-V3 config",
        **fields,
        d_ff=hf.intermediate_size,
        tie_embeddings=tied,
        attention="mla",
        mla=mla,
        yarn=yarn,
        moe=moe,
    )
