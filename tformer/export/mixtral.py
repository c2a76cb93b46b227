"""tformer decoder, Mixtral flavour (Llama with an MoE FFN in every block) <-> HF ``MixtralForCausalLM``.

HF stores each block's experts stacked like ours, with gate and up fused: ``gate_up_proj``
``(E, 2 * d_expert, d)`` is our ``gate`` and ``up`` concatenated along dim 1. Routing must be
Mixtral's: dropless, softmax over the top-k (or over all, renormalised). The balance-loss
coefficient is carried as ``router_aux_loss_coef``; the router z-loss (a training term HF Mixtral
lacks) does not change the model and is not carried.
"""

from __future__ import annotations

from ..config import ModelConfig
from . import llama
from .common import Rule, build_config, need, need_moe, raise_problems, rule

HF_CLASS = "MixtralForCausalLM"
AUTO_CLASS = "AutoModelForCausalLM"
MOE = True


def check(cfg: ModelConfig) -> None:
    raise_problems(HF_CLASS, llama.problems(cfg) + moe_problems(cfg, "Mixtral") + mixtral_problems(cfg))


def moe_problems(cfg: ModelConfig, name: str) -> list[str | None]:
    """What the HF top-k MoE decoders (Mixtral, Qwen2-MoE) share: dropless top-k routing over
    bias-free experts of the model's gated FFN kind, no router bias."""
    return [
        need(cfg, "bias", False, f"{name} has no attention or MLP biases; train with bias=false"),
        need_moe(cfg, "capacity_factor", None, f"{name} routes without capacity; set model.moe.capacity_factor=null"),
        need_moe(cfg, "expert_capacity", None, f"{name} routes without capacity; set model.moe.expert_capacity=null"),
        need_moe(cfg, "router_bias", False, f"{name}'s router has no bias"),
        need_moe(cfg, "activation", (None, cfg.activation), f"{name}'s experts use the model's hidden_act"),
    ]


def mixtral_problems(cfg: ModelConfig) -> list[str | None]:
    moe = cfg.moe
    normalised = moe.router_softmax == "topk" or moe.renormalize
    return [
        need_moe(cfg, "moe_every", 1, "every Mixtral block is MoE; set model.moe.moe_every=1"),
        need_moe(cfg, "num_shared_experts", 0, "Mixtral has no shared experts; use flavour=qwen2_moe"),
        None if normalised else "moe.renormalize=False: Mixtral renormalises the top-k weights; set router_softmax=topk",
    ]


def hf_config(cfg: ModelConfig):
    from transformers import MixtralConfig

    return MixtralConfig(
        **llama.decoder_config(cfg),
        intermediate_size=cfg.moe.d_expert or cfg.d_ff,
        head_dim=cfg.head_dim,
        num_local_experts=cfg.moe.num_experts,
        num_experts_per_tok=cfg.moe.top_k,
        router_aux_loss_coef=cfg.moe.aux_loss_coef,
        router_jitter_noise=cfg.moe.jitter,
        architectures=[HF_CLASS],
    )


def expert_rules(hf: str, ours: str) -> list[Rule]:
    """Stacked experts with fused gate|up (Mixtral, Qwen2-MoE in transformers 5)."""
    return [
        rule(f"{hf}gate.weight", f"{ours}router.weight"),
        rule(f"{hf}experts.gate_up_proj", f"{ours}experts.gate", f"{ours}experts.up", dim=1),
        rule(f"{hf}experts.down_proj", f"{ours}experts.down"),
    ]


def rules(cfg: ModelConfig) -> list[Rule]:
    return llama.decoder_rules(cfg, lambda i, h, o: expert_rules(f"{h}mlp.", f"{o}ffn."))


def model_config(hf, tied: bool) -> ModelConfig:
    moe = dict(
        num_experts=hf.num_local_experts,
        top_k=hf.num_experts_per_tok,
        router_softmax="topk",
        aux_loss_coef=hf.router_aux_loss_coef,
        jitter=hf.router_jitter_noise,
    )
    fields = llama.decoder_fields(hf, "mixtral")
    return build_config("HF Mixtral config", **fields, d_ff=hf.intermediate_size, tie_embeddings=tied, moe=moe)
