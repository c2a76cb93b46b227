"""tformer decoder, Gemma 3 flavour <-> HF ``Gemma3ForCausalLM`` (the text model, ``gemma3_text``).

Llama's layout plus what Gemma adds, each one of tformer's switches: RMSNorm gains stored as
offsets from 1 (``norm_unit_offset``), QK-norm, a norm after attention and after the FFN as well
(``sandwich_norm``: HF's ``post_attention_layernorm`` / ``post_feedforward_layernorm``; HF's
``pre_feedforward_layernorm`` is our ``ffn_norm``), the embedding scaled by sqrt(d_model) in the
weights' dtype, attention scaled by ``query_pre_attn_scalar``, windowed and global blocks
(``attn_window``, ``global_every``/``global_offset``: HF's ``sliding_window`` and ``layer_types``),
each kind with its own RoPE (``rope_local_theta``; linear scaling on the global blocks only),
and capped output logits. HF's Gemma 3 attention never caps its logits (``attn_logit_softcapping``
is read but not applied), so ``attn_softcap`` is refused.
"""

from __future__ import annotations

from ..config import ModelConfig
from . import llama
from .common import ExportError, Rule, build_config, first_id, need, raise_problems, rule

HF_CLASS = "Gemma3ForCausalLM"
AUTO_CLASS = "AutoModelForCausalLM"
HF_MODEL_TYPE = "gemma3_text"  # the text model's config (our flavour is gemma3)
QK_NORM = True
WINDOW = True
GLOBAL_OFFSET = True
LOCAL_ROPE = True
SOFTCAP = True  # the output logits' (attn_softcap is refused in check)
QUERY_SCALAR = True
SANDWICH = True
GEMMA_NORM = True
LINEAR_ROPE = True
HF_ACTS = {"geglu": "gelu_pytorch_tanh", "swiglu": "silu"}
OUR_ACTS = {"gelu_pytorch_tanh": "geglu", "gelu_new": "geglu", "gelu": None, "silu": "swiglu", "swish": "swiglu"}


def check(cfg: ModelConfig) -> None:
    # Llama's refusals, less its unscaled embedding (Gemma scales it)
    llama_lines: list[str | None] = [p for p in llama.problems(cfg) if p and not p.startswith("embed_scale=")]
    raise_problems(HF_CLASS, llama_lines + problems(cfg))


def problems(cfg: ModelConfig) -> list[str | None]:
    windowed = any(cfg.layer_window(i) is not None for i in range(cfg.num_layers))
    return [
        need(cfg, "qk_norm", "head", "Gemma 3 normalises each head's q and k; set qk_norm=head"),
        need(cfg, "sandwich_norm", True, "every Gemma 3 block normalises its sub-layers' outputs; set sandwich_norm=true"),
        need(cfg, "norm_unit_offset", True, "Gemma 3's RMSNorm gains are offsets from 1; set norm_unit_offset=true"),
        need(cfg, "embed_scale", True, "Gemma 3 scales its embeddings by sqrt(d_model); set embed_scale=true"),
        need(cfg, "embed_scale_dtype", True, "Gemma 3 rounds that scale to the weights' dtype; set embed_scale_dtype=true"),
        need(cfg, "bias", False, "Gemma 3 has no MLP biases; train with bias=false"),
        need(cfg, "qkv_bias", (None, False), "Gemma 3 has no q/k/v biases alone; set qkv_bias=null"),
        need(cfg, "activation", tuple(HF_ACTS), "Gemma 3's MLP is gated; set activation=geglu"),
        need(cfg, "query_pre_attn_scalar", _whole, "HF takes a whole query_pre_attn_scalar; round it"),
        need(cfg, "attn_softcap", None, "HF Gemma 3 never caps its attention logits; set attn_softcap=null"),
        None
        if cfg.rope_linear == 1.0 or cfg.rope_local_theta is not None or not windowed
        else f"rope_local_theta=None: Gemma 3 scales only its global blocks' RoPE (rope_linear={cfg.rope_linear}); "
        "set rope_local_theta (Gemma 3: 10000.0)",
    ]


def _whole(value: float | None) -> bool:
    return value is None or float(value).is_integer()


def _rope(theta: float, cfg: ModelConfig | None = None) -> dict:
    if cfg is not None and cfg.rope_linear != 1.0:
        return {"rope_type": "linear", "rope_theta": theta, "factor": cfg.rope_linear}
    return {"rope_type": "default", "rope_theta": theta}


def hf_config(cfg: ModelConfig):
    from transformers import Gemma3TextConfig

    kinds = ["full_attention" if cfg.layer_window(i) is None else "sliding_attention" for i in range(cfg.num_layers)]
    local = cfg.rope_local_theta if cfg.rope_local_theta is not None else cfg.rope_theta
    base = {k: v for k, v in llama.decoder_config(cfg).items() if k not in ("hidden_act", "rope_parameters")}
    return Gemma3TextConfig(
        **base,
        hidden_activation=HF_ACTS[cfg.activation],
        rope_parameters={"full_attention": _rope(cfg.rope_theta, cfg), "sliding_attention": _rope(local)},
        intermediate_size=cfg.d_ff,
        head_dim=cfg.head_dim,
        query_pre_attn_scalar=int(cfg.query_pre_attn_scalar or cfg.head_dim),
        sliding_window=cfg.attn_window or cfg.max_seq_len,
        layer_types=kinds,
        final_logit_softcapping=cfg.final_softcap,
        attn_logit_softcapping=None,
        attention_bias=False,
        use_bidirectional_attention=False,
        architectures=[HF_CLASS],
    )


def block_rules(i: int, h: str, o: str) -> list[Rule]:
    """One Gemma block's attention norms and MLP (HF ``h``, ours ``o``); q/k/v/o come from Llama's map."""
    return [
        *llama.mlp_rules(f"{h}mlp.", f"{o}ffn.", False),
        rule(f"{h}self_attn.q_norm.weight", f"{o}attn.q_norm.weight"),
        rule(f"{h}self_attn.k_norm.weight", f"{o}attn.k_norm.weight"),
        rule(f"{h}pre_feedforward_layernorm.weight", f"{o}ffn_norm.weight"),
        rule(f"{h}post_feedforward_layernorm.weight", f"{o}ffn_post_norm.weight"),
    ]


def rules(cfg: ModelConfig) -> list[Rule]:
    out = []
    for r in llama.decoder_rules(cfg, block_rules):
        if r.hf.endswith("post_attention_layernorm.weight"):  # Llama's pre-FFN norm; Gemma's post-attention one
            r = rule(r.hf, r.ours[0].replace("ffn_norm", "attn_post_norm"))
        out.append(r)
    return out


def _layers(hf) -> dict:
    """HF's layer kinds as ``attn_window`` with ``global_every`` and ``global_offset``."""
    local = [kind == "sliding_attention" for kind in hf.layer_types]
    if not any(local):
        return dict(attn_window=None)
    n = len(local)
    for every in range(0, n + 1):
        for offset in range(max(every, 1)):
            if all(is_local == (not every or i % every != offset) for i, is_local in enumerate(local)):
                return dict(
                    attn_window=hf.sliding_window,
                    global_every=every,
                    global_offset=None if offset == every - 1 or not every else offset,
                )
    raise ExportError(f"HF gemma3 layer_types={hf.layer_types} has no tformer equivalent (global every k-th block only)")


def model_config(hf, tied: bool) -> ModelConfig:
    if hasattr(hf, "text_config"):
        raise ExportError(
            "HF gemma3 (Gemma3ForConditionalGeneration, with vision) is imported as its text model only; "
            "save Gemma3ForCausalLM's gemma3_text checkpoint first"
        )
    if hf.use_bidirectional_attention:
        raise ExportError("HF gemma3 use_bidirectional_attention=True has no tformer decoder equivalent")
    if hf.attention_bias:
        raise ExportError("HF gemma3 attention_bias=True has no tformer equivalent")
    if OUR_ACTS.get(hf.hidden_activation) is None:
        raise ExportError(f"HF gemma3 hidden_activation={hf.hidden_activation!r} has no tformer equivalent")
    rope = hf.rope_parameters
    full, sliding = dict(rope["full_attention"]), dict(rope["sliding_attention"])
    scaling: dict = {}
    if full.get("rope_type", "default") == "linear":
        scaling = dict(rope_linear=float(full["factor"]))
    elif full.get("rope_type", "default") != "default":
        raise ExportError(
            f"HF gemma3 full_attention rope_type={full['rope_type']!r} has no tformer equivalent (default, linear)"
        )
    if sliding.get("rope_type", "default") != "default":
        raise ExportError(f"HF gemma3 sliding_attention rope_type={sliding['rope_type']!r} has no tformer equivalent")
    layers = _layers(hf)
    windowed = layers["attn_window"] is not None
    theta, local = float(full["rope_theta"]), float(sliding["rope_theta"])
    scalar = float(hf.query_pre_attn_scalar)
    eos = first_id(hf.eos_token_id)
    return build_config(
        "HF gemma3 config",
        family="decoder",
        flavour="gemma3",
        vocab_size=hf.vocab_size,
        d_model=hf.hidden_size,
        num_layers=hf.num_hidden_layers,
        num_heads=hf.num_attention_heads,
        num_kv_heads=hf.num_key_value_heads,
        d_head=hf.head_dim,
        d_ff=hf.intermediate_size,
        max_seq_len=hf.max_position_embeddings,
        position="rotary",
        rope_theta=theta,
        rope_local_theta=local if windowed and (local != theta or scaling) else None,
        **scaling,
        **layers,
        norm="rmsnorm",
        norm_eps=hf.rms_norm_eps,
        norm_bias=False,
        norm_position="pre",
        norm_unit_offset=True,
        sandwich_norm=True,
        qk_norm="head",
        activation=OUR_ACTS[hf.hidden_activation],
        bias=False,
        embed_scale=True,
        embed_scale_dtype=True,
        query_pre_attn_scalar=None if scalar == hf.head_dim else scalar,
        final_softcap=hf.final_logit_softcapping,
        attn_dropout=float(hf.attention_dropout or 0.0),
        init_std=hf.initializer_range,
        bos_token_id=hf.bos_token_id,
        eos_token_id=eos,
        pad_token_id=hf.pad_token_id if hf.pad_token_id is not None else (eos or 0),
        tie_embeddings=tied,
    )
