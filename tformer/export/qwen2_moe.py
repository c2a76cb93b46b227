"""tformer decoder, Qwen2-MoE flavour <-> HF ``Qwen2MoeForCausalLM``.

Llama's attention with biases on q/k/v only (``qkv_bias``), and on blocks ``moe_every - 1``,
``2 moe_every - 1``, ... an MoE FFN: routed experts stacked as in Mixtral (softmax over all
experts, top-k, renormalised only with ``norm_topk_prob``) plus one shared expert scaled by
``sigmoid(shared_expert_gate(x))``. Our ``num_shared_experts`` x ``d_shared`` is HF's
``shared_expert_intermediate_size`` (one wide FFN is the sum of n narrow ones). Other blocks are
dense ``intermediate_size`` MLPs.
"""

from __future__ import annotations

from ..config import ModelConfig
from . import llama, mixtral
from .common import Rule, build_config, need, need_moe, raise_problems, rule

HF_CLASS = "Qwen2MoeForCausalLM"
AUTO_CLASS = "AutoModelForCausalLM"
MOE = True
QKV_BIAS = True


def check(cfg: ModelConfig) -> None:
    moe = cfg.moe
    raise_problems(
        HF_CLASS,
        llama.problems(cfg)
        + mixtral.moe_problems(cfg, "Qwen2-MoE")
        + [
            need(cfg, "d_head", (None, cfg.d_model // cfg.num_heads), "Qwen2-MoE's head width is d_model / num_heads"),
            need_moe(cfg, "num_shared_experts", lambda n: n >= 1, "Qwen2-MoE always has a shared expert"),
            need_moe(cfg, "shared_gate", True, "Qwen2-MoE gates its shared expert by sigmoid(linear(x))"),
            None
            if moe.router_softmax == "all" or moe.renormalize or moe.top_k == 1
            else "moe.router_softmax='topk': Qwen2-MoE takes the softmax over all experts; "
            "use router_softmax=all with renormalize=true (the same weights)",
        ],
    )


def _shared_width(cfg: ModelConfig) -> int:
    moe = cfg.moe
    return moe.num_shared_experts * (moe.d_shared or moe.d_expert or cfg.d_ff)


def hf_config(cfg: ModelConfig):
    from transformers import Qwen2MoeConfig

    moe = cfg.moe
    return Qwen2MoeConfig(
        **llama.decoder_config(cfg),
        intermediate_size=cfg.d_ff,
        moe_intermediate_size=moe.d_expert or cfg.d_ff,
        shared_expert_intermediate_size=_shared_width(cfg),
        use_sliding_window=False,
        decoder_sparse_step=moe.moe_every,
        num_experts=moe.num_experts,
        num_experts_per_tok=moe.top_k,
        norm_topk_prob=moe.renormalize or moe.router_softmax == "topk",
        router_aux_loss_coef=moe.aux_loss_coef,
        mlp_only_layers=[],
        qkv_bias=cfg.attn_qkv_bias,
        architectures=[HF_CLASS],
    )


def ffn_rules(cfg: ModelConfig, i: int, h: str, o: str) -> list[Rule]:
    m, f = f"{h}mlp.", f"{o}ffn."
    if not cfg.moe.is_moe_layer(i):
        return llama.mlp_rules(m, f, False)
    return (
        mixtral.expert_rules(m, f)
        + llama.mlp_rules(f"{m}shared_expert.", f"{f}shared.", False)
        + [rule(f"{m}shared_expert_gate.weight", f"{f}shared_gate.weight")]
    )


def rules(cfg: ModelConfig) -> list[Rule]:
    out = llama.decoder_rules(cfg, lambda i, h, o: ffn_rules(cfg, i, h, o))
    if cfg.attn_qkv_bias:
        for i in range(cfg.num_layers):
            out += [
                rule(f"model.layers.{i}.self_attn.{x}_proj.bias", f"decoder.layers.{i}.attn.{x}_proj.bias") for x in "qkv"
            ]
    return out


def model_config(hf, tied: bool) -> ModelConfig:
    from .common import ExportError

    if hf.mlp_only_layers:
        raise ExportError(f"HF Qwen2-MoE mlp_only_layers={hf.mlp_only_layers} has no tformer equivalent (use [])")
    moe = dict(
        num_experts=hf.num_experts,
        top_k=hf.num_experts_per_tok,
        moe_every=hf.decoder_sparse_step,
        d_expert=hf.moe_intermediate_size,
        num_shared_experts=1,
        d_shared=hf.shared_expert_intermediate_size,
        shared_gate=True,
        renormalize=hf.norm_topk_prob,
        aux_loss_coef=hf.router_aux_loss_coef,
    )
    fields = llama.decoder_fields(hf, "qwen2_moe")
    return build_config(
        "HF Qwen2-MoE config",
        **fields,
        d_ff=hf.intermediate_size,
        qkv_bias=hf.qkv_bias,
        tie_embeddings=tied,
        moe=moe,
    )
