"""tformer encoder-decoder, Switch flavour (T5 v1.0 with top-1 MoE FFNs) <-> HF
``SwitchTransformersForConditionalGeneration``.

T5's layout (``export/t5.py``) with ``mlp.`` FFN modules: dense ones ``mlp.wi`` / ``mlp.wo``, sparse
ones a router ``mlp.router.classifier`` and one module per expert ``mlp.experts.expert_{e}``, each a
row of our stacked experts. HF routes top-1 with a fixed ``expert_capacity`` per sequence (first
come, first served) on blocks ``i % step == 1`` (every block at step 1), and always rescales a tied
head by ``d_model**-0.5``.
"""

from __future__ import annotations

from ..config import ModelConfig
from . import t5
from .common import (
    HF_PLAIN_ACTS,
    PLAIN_ACTS,
    ExportError,
    Rule,
    build_config,
    need,
    need_moe,
    raise_problems,
    rule,
)

HF_CLASS = "SwitchTransformersForConditionalGeneration"
AUTO_CLASS = "AutoModelForSeq2SeqLM"
MOE = True


def check(cfg: ModelConfig) -> None:
    moe = cfg.moe
    raise_problems(
        HF_CLASS,
        t5.problems(cfg)
        + [
            need(cfg, "activation", tuple(PLAIN_ACTS), "Switch's FFNs are not gated (wi/wo); use relu or gelu"),
            # untied, HF Switch also unties its encoder's and decoder's input embeddings from ``shared``
            need(cfg, "tie_embeddings", True, "HF Switch shares one embedding with its head (v1.0 style)"),
            need(cfg, "tied_output_scale", True, "HF Switch rescales its tied head by d_model**-0.5"),
            need_moe(cfg, "top_k", 1, "Switch routes each token to one expert"),
            need_moe(cfg, "router_softmax", "all", "Switch weights by the softmax over all experts"),
            need_moe(cfg, "renormalize", False, "Switch keeps the top-1 probability as the weight"),
            need_moe(cfg, "moe_every", (1, 2), "HF Switch puts experts on every block or on blocks 1, 3, 5, ..."),
            need_moe(cfg, "num_shared_experts", 0, "Switch has no shared experts"),
            need_moe(cfg, "d_expert", (None, cfg.d_ff), "Switch's experts are as wide as its dense FFNs (d_ff)"),
            need_moe(cfg, "activation", (None, cfg.activation), "Switch's experts use the model's dense_act_fn"),
            need_moe(
                cfg,
                "expert_capacity",
                lambda v: v is not None,
                "HF Switch caps each expert at a fixed expert_capacity per sequence; set model.moe.expert_capacity "
                "(and capacity_factor=null)",
            ),
            None
            if cfg.num_layers % moe.moe_every == 0 and cfg.decoder_layers % moe.moe_every == 0
            else f"moe.moe_every={moe.moe_every}: HF Switch places experts every num_layers // num_sparse layers; "
            "use stack depths divisible by it",
        ],
    )


def hf_config(cfg: ModelConfig):
    from transformers import SwitchTransformersConfig

    moe = cfg.moe
    assert moe.expert_capacity is not None  # check() refuses capacity-free routing
    hf = SwitchTransformersConfig(
        vocab_size=cfg.vocab_size,
        d_model=cfg.d_model,
        d_kv=cfg.head_dim,
        d_ff=cfg.d_ff,
        num_layers=cfg.num_layers,
        num_decoder_layers=cfg.decoder_layers,
        num_sparse_encoder_layers=cfg.num_layers // moe.moe_every,
        num_sparse_decoder_layers=cfg.decoder_layers // moe.moe_every,
        num_heads=cfg.num_heads,
        num_experts=moe.num_experts,
        expert_capacity=moe.expert_capacity,
        router_bias=moe.router_bias,
        router_jitter_noise=moe.jitter,
        router_z_loss_coef=moe.z_loss_coef,
        router_aux_loss_coef=moe.aux_loss_coef,
        relative_attention_num_buckets=cfg.rel_num_buckets,
        relative_attention_max_distance=cfg.rel_max_distance,
        dropout_rate=cfg.dropout,
        layer_norm_epsilon=cfg.norm_eps,
        dense_act_fn=PLAIN_ACTS[cfg.activation],
        pad_token_id=cfg.pad_token_id,
        eos_token_id=cfg.eos_token_id,
        tie_word_embeddings=cfg.tie_embeddings,
        architectures=[HF_CLASS],
    )
    hf.decoder_start_token_id = cfg.decoder_start_token_id  # not a declared field of the v5 config class
    return hf


def ffn_rules(cfg: ModelConfig, stack: str, i: int, h: str, o: str) -> list[Rule]:
    out = [rule(h + "layer_norm.weight", o + "ffn_norm.weight")]
    m, f = f"{h}mlp.", f"{o}ffn."
    if not cfg.moe.is_moe_layer(i):
        return out + [rule(m + "wi.weight", f + "up.weight"), rule(m + "wo.weight", f + "down.weight")]
    out.append(rule(m + "router.classifier.weight", f + "router.weight"))
    if cfg.moe.router_bias:
        out.append(rule(m + "router.classifier.bias", f + "router.bias"))
    for e in range(cfg.moe.num_experts):
        x = f"{m}experts.expert_{e}."
        out += [rule(x + "wi.weight", f + "experts.up", index=e), rule(x + "wo.weight", f + "experts.down", index=e)]
    return out


def rules(cfg: ModelConfig) -> list[Rule]:
    return t5.stack_rules(cfg, ffn_rules)


def model_config(hf, tied: bool) -> ModelConfig:
    if hf.dense_act_fn not in HF_PLAIN_ACTS:
        raise ExportError(f"HF Switch dense_act_fn={hf.dense_act_fn!r} has no tformer equivalent")
    steps = {hf.encoder_sparse_step, hf.decoder_sparse_step}
    if len(steps) != 1 or not steps <= {1, 2}:
        raise ExportError(
            f"HF Switch sparse steps encoder={hf.encoder_sparse_step}, decoder={hf.decoder_sparse_step} have no "
            "tformer equivalent (one moe_every for both stacks, 1 or 2)"
        )
    return build_config(
        "HF Switch Transformers config",
        **t5.encdec_fields(hf, "switch_transformers"),
        activation=HF_PLAIN_ACTS[hf.dense_act_fn],
        tie_embeddings=tied,
        tied_output_scale=tied,
        moe=dict(
            num_experts=hf.num_experts,
            top_k=1,
            moe_every=steps.pop(),
            expert_capacity=hf.expert_capacity,
            router_bias=hf.router_bias,
            jitter=float(hf.router_jitter_noise),
            aux_loss_coef=hf.router_aux_loss_coef,
            z_loss_coef=hf.router_z_loss_coef,
        ),
    )
