"""tformer encoder-decoder, T5Gemma flavour <-> HF ``T5GemmaForConditionalGeneration``.

Gemma 2 blocks in both stacks: RMSNorm gains stored as offsets from 1, a norm before and after
every sub-layer (``sandwich_norm``; cross-attention too), GeGLU, RoPE, GQA, attention scaled by
``query_pre_attn_scalar`` and its logits capped (``attn_softcap``, in cross-attention too), the
output logits capped (``final_softcap``), windowed blocks alternating with global ones
(``attn_window``, ``global_every``), the embeddings scaled by sqrt(d_model) in the weights' dtype.
HF gives each stack a token embedding (ours: ``shared_embeddings=false``, the encoder's is
``encoder_embed``) and ties the head to the decoder's. HF counts the encoder's (bidirectional)
window as the keys up to ``sliding_window`` away on either side, the decoder's as the last
``sliding_window`` keys: ours are ``encoder_window = 2 x`` the first and ``attn_window`` the second.
Both stacks have the same width, heads and FFN (HF's "unbalanced" 9B-2B is refused on import).
"""

from __future__ import annotations

from ..config import ModelConfig
from .common import ExportError, Rule, build_config, first_id, linear, need, raise_problems, rule
from .gemma3 import HF_ACTS, OUR_ACTS, _whole

HF_CLASS = "T5GemmaForConditionalGeneration"
AUTO_CLASS = "AutoModelForSeq2SeqLM"
WINDOW = True
SOFTCAP = True
QUERY_SCALAR = True
SANDWICH = True
GEMMA_NORM = True
OWN_ENCODER_EMBED = True


def check(cfg: ModelConfig) -> None:
    raise_problems(
        HF_CLASS,
        [
            need(cfg, "family", "encdec", "T5Gemma is an encoder-decoder; set flavour to the family's target"),
            need(cfg, "position", "rotary", "T5Gemma uses rotary positions"),
            need(cfg, "norm", "rmsnorm", "T5Gemma uses RMSNorm"),
            need(cfg, "norm_position", "pre", "T5Gemma is pre-norm; train with norm_position=pre"),
            need(cfg, "sandwich_norm", True, "T5Gemma normalises each sub-layer's output; set sandwich_norm=true"),
            need(cfg, "norm_unit_offset", True, "T5Gemma's RMSNorm gains are offsets from 1; set norm_unit_offset=true"),
            need(cfg, "embed_scale", True, "T5Gemma scales its embeddings by sqrt(d_model); set embed_scale=true"),
            need(cfg, "embed_scale_dtype", True, "T5Gemma rounds it to the weight dtype; set embed_scale_dtype=true"),
            need(cfg, "activation", tuple(HF_ACTS), "T5Gemma's MLP is gated; set activation=geglu"),
            need(cfg, "bias", False, "T5Gemma has no biases; train with bias=false"),
            need(cfg, "qkv_bias", (None, False), "T5Gemma has no q/k/v biases; set qkv_bias=null"),
            need(cfg, "attn_scale", True, "T5Gemma scales attention by query_pre_attn_scalar**-0.5; set attn_scale=true"),
            need(cfg, "query_pre_attn_scalar", _whole, "HF takes a whole query_pre_attn_scalar; round it"),
            need(cfg, "type_vocab_size", 0, "T5Gemma has no token-type embeddings"),
            need(cfg, "embed_norm", False, "T5Gemma has no norm after the embeddings"),
            need(cfg, "tied_output_scale", False, "T5Gemma does not rescale its decoder output before the head"),
            need(
                cfg,
                "bos_token_id",
                (None, cfg.decoder_start_token_id),
                "HF T5Gemma starts decoding with its bos token; set bos_token_id=null (decoder_start_token_id is written)",
            ),
        ],
    )


def _module(cfg: ModelConfig, layers: int, window: int | None):
    from transformers import T5GemmaModuleConfig

    kinds = ["full_attention" if cfg.layer_window(i) is None else "sliding_attention" for i in range(layers)]
    return T5GemmaModuleConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.d_ff,
        num_hidden_layers=layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.head_dim,
        hidden_activation=HF_ACTS[cfg.activation],
        max_position_embeddings=cfg.max_seq_len,
        initializer_range=cfg.init_std,
        rms_norm_eps=cfg.norm_eps,
        pad_token_id=cfg.pad_token_id,
        eos_token_id=cfg.eos_token_id,
        bos_token_id=cfg.decoder_start_token_id,  # HF shifts labels behind the decoder's bos
        tie_word_embeddings=cfg.tie_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        attention_bias=False,
        attention_dropout=cfg.attn_dropout,
        query_pre_attn_scalar=int(cfg.query_pre_attn_scalar or cfg.head_dim),
        sliding_window=window or cfg.max_seq_len,
        layer_types=kinds,
        final_logit_softcapping=cfg.final_softcap,
        attn_logit_softcapping=cfg.attn_softcap,
    )


def hf_config(cfg: ModelConfig):
    from transformers import T5GemmaConfig

    encoder_window = cfg.encoder_window or cfg.attn_window
    # special ids the base config class takes (T5GemmaConfig's own signature does not list them)
    ids: dict = dict(
        pad_token_id=cfg.pad_token_id,
        eos_token_id=cfg.eos_token_id,
        bos_token_id=cfg.decoder_start_token_id,
        decoder_start_token_id=cfg.decoder_start_token_id,
    )
    return T5GemmaConfig(
        encoder=_module(cfg, cfg.num_layers, encoder_window // 2 if encoder_window else None).to_dict(),
        decoder=_module(cfg, cfg.decoder_layers, cfg.attn_window).to_dict(),
        vocab_size=cfg.vocab_size,
        dropout_rate=cfg.dropout,
        attention_dropout=cfg.attn_dropout,
        tie_word_embeddings=cfg.tie_embeddings,
        **ids,
        architectures=[HF_CLASS],
    )


def _mlp(h: str, o: str) -> list[Rule]:
    return [rule(f"{h}mlp.{x}_proj.weight", f"{o}ffn.{x}.weight") for x in ("gate", "up", "down")]


def rules(cfg: ModelConfig) -> list[Rule]:
    encoder_embed = "embed.tok.weight" if cfg.shared_embeddings else "encoder_embed.tok.weight"
    out = [rule("model.decoder.embed_tokens.weight", "embed.tok.weight")]
    out.append(rule("model.encoder.embed_tokens.weight", encoder_embed))
    for stack, layers in (("encoder", cfg.num_layers), ("decoder", cfg.decoder_layers)):
        for i in range(layers):
            h, o = f"model.{stack}.layers.{i}.", f"{stack}.layers.{i}."
            sublayers = [("self_attn", "attn")] + ([("cross_attn", "cross_attn")] if stack == "decoder" else [])
            for theirs, ours in sublayers:
                for x in "qkvo":
                    out += linear(f"{h}{theirs}.{x}_proj", f"{o}{ours}.{x}_proj", False)
                norm = "cross" if ours == "cross_attn" else "attn"
                out += [
                    rule(f"{h}pre_{theirs}_layernorm.weight", f"{o}{norm}_norm.weight"),
                    rule(f"{h}post_{theirs}_layernorm.weight", f"{o}{norm}_post_norm.weight"),
                ]
            out += _mlp(h, o)
            out += [
                rule(f"{h}pre_feedforward_layernorm.weight", f"{o}ffn_norm.weight"),
                rule(f"{h}post_feedforward_layernorm.weight", f"{o}ffn_post_norm.weight"),
            ]
        out.append(rule(f"model.{stack}.norm.weight", f"{stack}.final_norm.weight"))
    if not cfg.tie_embeddings:
        out.append(rule("lm_head.out_proj.weight", "lm_head.weight"))
    return out


def _pattern(kinds: list[str]) -> tuple[int, int | None] | None:
    """(global_every, global_offset) of a stack's layer kinds; None: every block global."""
    local = [kind == "sliding_attention" for kind in kinds]
    if not any(local):
        return None
    for every in range(0, len(local) + 1):
        for offset in range(max(every, 1)):
            if all(is_local == (not every or i % every != offset) for i, is_local in enumerate(local)):
                return every, None if offset == every - 1 or not every else offset
    raise ExportError(f"HF t5gemma layer_types={kinds} has no tformer equivalent (global every k-th block only)")


def model_config(hf, tied: bool) -> ModelConfig:
    # ``tied`` compares the head with the *input* (the encoder's) embedding; HF ties it to the decoder's
    tied = bool(hf.tie_word_embeddings)
    enc, dec = hf.encoder, hf.decoder
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "hidden_activation", "rms_norm_eps", "query_pre_attn_scalar", "attn_logit_softcapping",
                "rope_parameters"):  # fmt: skip
        if getattr(enc, key) != getattr(dec, key):
            raise ExportError(
                f"HF t5gemma encoder {key}={getattr(enc, key)} but decoder {key}={getattr(dec, key)} "
                "(an unbalanced model) has no tformer equivalent: both stacks share one shape"
            )
    if enc.attention_bias or dec.attention_bias:
        raise ExportError("HF t5gemma attention_bias=True has no tformer equivalent")
    if OUR_ACTS.get(dec.hidden_activation) is None:
        raise ExportError(f"HF t5gemma hidden_activation={dec.hidden_activation!r} has no tformer equivalent")
    rope = dict(dec.rope_parameters or {})
    if rope.get("rope_type", "default") != "default":
        raise ExportError(f"HF t5gemma rope_type={rope['rope_type']!r} has no tformer equivalent")
    pattern, enc_pattern = _pattern(dec.layer_types), _pattern(enc.layer_types)
    shorter = min(enc.num_hidden_layers, dec.num_hidden_layers)
    if enc.layer_types[:shorter] != dec.layer_types[:shorter] or (pattern is None) != (enc_pattern is None):
        raise ExportError(
            f"HF t5gemma encoder layer_types={enc.layer_types} differ from the decoder's {dec.layer_types}; "
            "tformer's stacks share one pattern"
        )
    windows: dict = dict(attn_window=None)
    if pattern is not None:
        every, offset = pattern
        encoder_window = 2 * enc.sliding_window
        windows = dict(
            attn_window=dec.sliding_window,
            encoder_window=None if encoder_window == dec.sliding_window else encoder_window,
            global_every=every,
            global_offset=offset,
        )
    scalar = float(dec.query_pre_attn_scalar)
    return build_config(
        "HF t5gemma config",
        family="encdec",
        flavour="t5gemma",
        vocab_size=dec.vocab_size,
        d_model=dec.hidden_size,
        num_layers=enc.num_hidden_layers,
        num_decoder_layers=dec.num_hidden_layers,
        num_heads=dec.num_attention_heads,
        num_kv_heads=dec.num_key_value_heads,
        d_head=dec.head_dim,
        d_ff=dec.intermediate_size,
        max_seq_len=max(enc.max_position_embeddings, dec.max_position_embeddings),
        position="rotary",
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        **windows,
        norm="rmsnorm",
        norm_eps=dec.rms_norm_eps,
        norm_bias=False,
        norm_position="pre",
        norm_unit_offset=True,
        sandwich_norm=True,
        activation=OUR_ACTS[dec.hidden_activation],
        bias=False,
        embed_scale=True,
        embed_scale_dtype=True,
        shared_embeddings=False,
        query_pre_attn_scalar=None if scalar == dec.head_dim else scalar,
        attn_softcap=dec.attn_logit_softcapping,
        final_softcap=dec.final_logit_softcapping,
        dropout=float(hf.dropout_rate),
        attn_dropout=float(hf.attention_dropout),
        init_std=dec.initializer_range,
        pad_token_id=dec.pad_token_id if dec.pad_token_id is not None else 0,
        eos_token_id=first_id(dec.eos_token_id),
        decoder_start_token_id=dec.bos_token_id if dec.bos_token_id is not None else 0,
        tie_embeddings=tied,
    )
