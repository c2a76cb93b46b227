"""tformer decoder, Qwen3-MoE flavour <-> HF ``Qwen3MoeForCausalLM``.

Qwen3's attention (QK-norm, free head width, no biases) and, on blocks ``moe_every - 1``,
``2 moe_every - 1``, ..., routed experts as Qwen2-MoE routes them without its shared expert: a
softmax over every expert, the top k, renormalised to sum 1 with ``norm_topk_prob`` (our
``renormalize``, or ``router_softmax=topk``, the same weights). Experts stacked as in Mixtral
(``gate_up_proj`` is our ``gate`` and ``up`` concatenated). Other blocks are dense
``intermediate_size`` MLPs.
"""

from __future__ import annotations

from ..config import ModelConfig
from . import llama, mixtral, qwen3
from .common import ExportError, Rule, build_config, need_moe, raise_problems

HF_CLASS = "Qwen3MoeForCausalLM"
AUTO_CLASS = "AutoModelForCausalLM"
MOE = True
QK_NORM = True


def check(cfg: ModelConfig) -> None:
    raise_problems(
        HF_CLASS,
        llama.problems(cfg)
        + qwen3.problems(cfg, "Qwen3-MoE")
        + mixtral.moe_problems(cfg, "Qwen3-MoE")
        + [need_moe(cfg, "num_shared_experts", 0, "Qwen3-MoE has no shared experts; use flavour=qwen2_moe")],
    )


def hf_config(cfg: ModelConfig):
    from transformers import Qwen3MoeConfig

    moe = cfg.moe
    return Qwen3MoeConfig(
        **qwen3.decoder_config(cfg),
        intermediate_size=cfg.d_ff,
        moe_intermediate_size=moe.d_expert or cfg.d_ff,
        decoder_sparse_step=moe.moe_every,
        num_experts=moe.num_experts,
        num_experts_per_tok=moe.top_k,
        norm_topk_prob=moe.renormalize or moe.router_softmax == "topk",
        router_aux_loss_coef=moe.aux_loss_coef,
        mlp_only_layers=[],
    )


def rules(cfg: ModelConfig) -> list[Rule]:
    def ffn(i: int, h: str, o: str) -> list[Rule]:
        if cfg.moe.is_moe_layer(i):
            return mixtral.expert_rules(f"{h}mlp.", f"{o}ffn.")
        return llama.mlp_rules(f"{h}mlp.", f"{o}ffn.", False)

    return llama.decoder_rules(cfg, ffn) + qwen3.qk_norm_rules(cfg)


def model_config(hf, tied: bool) -> ModelConfig:
    if hf.mlp_only_layers:
        raise ExportError(f"HF Qwen3-MoE mlp_only_layers={hf.mlp_only_layers} has no tformer equivalent (use [])")
    moe = dict(
        num_experts=hf.num_experts,
        top_k=hf.num_experts_per_tok,
        moe_every=hf.decoder_sparse_step,
        d_expert=hf.moe_intermediate_size,
        renormalize=hf.norm_topk_prob,
        aux_loss_coef=hf.router_aux_loss_coef,
    )
    fields = qwen3.decoder_fields(hf, "qwen3_moe")
    return build_config("HF Qwen3-MoE config", **fields, d_ff=hf.intermediate_size, tie_embeddings=tied, moe=moe)
