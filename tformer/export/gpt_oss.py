"""tformer decoder, gpt-oss flavour <-> HF ``GptOssForCausalLM``.

Llama's layout with biases on q/k/v/o, a learned sink logit per head in every softmax
(``attn_sinks``: HF's ``self_attn.sinks``), local attention on some blocks (``attn_window`` and
``global_every``: HF's ``sliding_window`` and ``layer_types``), YaRN's rotary table
(``model.yarn``) and an MoE FFN on every block: a router with a bias, softmax over the top-k
logits, experts with biases and gpt-oss's clamped SwiGLU (``moe.swiglu_limit``, ``swiglu_alpha``).

HF stores the experts transposed, ``(E, in, out)``, with gate and up interleaved column by column
(gate at even columns, up at odd): the rules map our stacked tensors to HF names in our layout and
``after_export`` / ``before_import`` turn one layout into the other.
"""

from __future__ import annotations

import torch

from ..config import ModelConfig
from . import llama
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

HF_CLASS = "GptOssForCausalLM"
AUTO_CLASS = "AutoModelForCausalLM"
MOE = True
WINDOW = True
SINKS = True
YARN = True
GPT_OSS_EXPERTS = True


def check(cfg: ModelConfig) -> None:
    moe = cfg.moe
    raise_problems(
        HF_CLASS,
        llama.problems(cfg)
        + [
            need(cfg, "activation", "swiglu", "gpt-oss's experts are SwiGLU"),
            need(cfg, "bias", True, "gpt-oss has biases on q/k/v/o; train with bias=true"),
            need(cfg, "qkv_bias", (None, True), "gpt-oss's q/k/v/o biases go together; set qkv_bias=null"),
            need(cfg, "attn_sinks", True, "every gpt-oss attention has sinks; set attn_sinks=true"),
            None if moe.enabled else "moe=(num_experts=0): every gpt-oss block is MoE; set model.moe.num_experts",
            need_moe(cfg, "moe_every", 1, "every gpt-oss block is MoE; set model.moe.moe_every=1"),
            need_moe(cfg, "num_shared_experts", 0, "gpt-oss has no shared experts"),
            need_moe(cfg, "capacity_factor", None, "gpt-oss routes without capacity"),
            need_moe(cfg, "expert_capacity", None, "gpt-oss routes without capacity"),
            need_moe(cfg, "router_bias", True, "gpt-oss's router has a bias"),
            need_moe(cfg, "expert_bias", True, "gpt-oss's experts have biases"),
            need_moe(cfg, "activation", (None, "swiglu"), "gpt-oss's experts are SwiGLU"),
            need_moe(cfg, "swiglu_limit", lambda v: v is not None, "gpt-oss clamps its SwiGLU; set model.moe.swiglu_limit"),
            None
            if moe.router_softmax == "topk" or moe.renormalize or moe.top_k == 1
            else "moe.renormalize=False: gpt-oss takes the softmax over the top-k logits; set router_softmax=topk",
        ],
    )


def hf_config(cfg: ModelConfig):
    from transformers import GptOssConfig

    moe = cfg.moe
    assert moe.swiglu_limit is not None  # check() refused a model without it
    kinds = ["full_attention" if cfg.layer_window(i) is None else "sliding_attention" for i in range(cfg.num_layers)]
    return GptOssConfig(
        **{**llama.decoder_config(cfg), "rope_parameters": rope_parameters(cfg)},
        head_dim=cfg.head_dim,
        intermediate_size=moe.d_expert or cfg.d_ff,
        num_local_experts=moe.num_experts,
        num_experts_per_tok=moe.top_k,
        swiglu_limit=moe.swiglu_limit,
        swiglu_alpha=moe.swiglu_alpha,
        router_aux_loss_coef=moe.aux_loss_coef,
        sliding_window=cfg.attn_window,
        layer_types=kinds,
        attention_bias=True,
        architectures=[HF_CLASS],
    )


def rules(cfg: ModelConfig) -> list[Rule]:
    def experts(i: int, h: str, o: str) -> list[Rule]:
        m, f = f"{h}mlp.", f"{o}ffn."
        return [
            *linear(f"{m}router", f"{f}router", True),
            rule(f"{m}experts.gate_up_proj", f"{f}experts.gate", f"{f}experts.up", dim=1),
            rule(f"{m}experts.gate_up_proj_bias", f"{f}experts.gate_bias", f"{f}experts.up_bias", dim=1),
            rule(f"{m}experts.down_proj", f"{f}experts.down"),
            rule(f"{m}experts.down_proj_bias", f"{f}experts.down_bias"),
            rule(f"{h}self_attn.sinks", f"{o}attn.sinks.logits"),
        ]

    return llama.decoder_rules(cfg, experts)


def _interleave(t: torch.Tensor) -> torch.Tensor:
    """(E, 2I, ...) as [gate; up] -> (E, 2I, ...) as gate, up, gate, up, ... (row by row)."""
    e, two, *rest = t.shape
    return t.reshape(e, 2, two // 2, *rest).transpose(1, 2).reshape(e, two, *rest)


def _deinterleave(t: torch.Tensor) -> torch.Tensor:
    e, two, *rest = t.shape
    return t.reshape(e, two // 2, 2, *rest).transpose(1, 2).reshape(e, two, *rest)


def _swap(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2).contiguous()


def after_export(cfg: ModelConfig, hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = dict(hf_state)
    for name, t in hf_state.items():
        if name.endswith("experts.gate_up_proj"):
            out[name] = _swap(_interleave(t))
        elif name.endswith("experts.gate_up_proj_bias"):
            out[name] = _interleave(t).contiguous()
        elif name.endswith("experts.down_proj"):
            out[name] = _swap(t)
    return out


def before_import(cfg: ModelConfig, hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = dict(hf_state)
    for name, t in hf_state.items():
        if name.endswith("experts.gate_up_proj"):
            out[name] = _deinterleave(_swap(t))
        elif name.endswith("experts.gate_up_proj_bias"):
            out[name] = _deinterleave(t).contiguous()
        elif name.endswith("experts.down_proj"):
            out[name] = _swap(t)
    return out


def _window(hf) -> dict:
    """HF's sliding window and layer kinds as ``attn_window`` and ``global_every``."""
    local = [kind == "sliding_attention" for kind in hf.layer_types]
    if hf.sliding_window is None or not any(local):
        return dict(attn_window=None)
    for every in range(0, len(local) + 1):
        if all(is_local == (not every or i % every != every - 1) for i, is_local in enumerate(local)):
            return dict(attn_window=hf.sliding_window, global_every=every)
    raise ExportError(f"HF gpt_oss layer_types={hf.layer_types} has no tformer equivalent (global every k-th block only)")


def model_config(hf, tied: bool) -> ModelConfig:
    rope = dict(hf.rope_parameters or {})
    yarn = yarn_fields(rope, "gpt_oss")
    plain = {**rope, "rope_type": "default"}
    hf_plain = type(hf).from_dict({**hf.to_dict(), "rope_parameters": plain, "sliding_window": None})
    fields = {**llama.decoder_fields(hf_plain, "gpt_oss"), "yarn": yarn, **_window(hf), "bias": True, "attn_sinks": True}
    moe = dict(
        num_experts=hf.num_local_experts,
        top_k=hf.num_experts_per_tok,
        d_expert=hf.intermediate_size,
        router_softmax="topk",
        router_bias=True,
        expert_bias=True,
        swiglu_limit=float(hf.swiglu_limit),
        swiglu_alpha=float(hf.swiglu_alpha),
        aux_loss_coef=hf.router_aux_loss_coef,
    )
    return build_config("HF gpt_oss config", **fields, d_ff=hf.intermediate_size, tie_embeddings=tied, moe=moe)
