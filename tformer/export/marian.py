"""tformer encoder-decoder of the paper <-> HF ``MarianMTModel``.

Why Marian and not FSMT: ``MarianMTModel`` is the paper's model exactly: post-norm sub-layers with no
extra LayerNorm on the embeddings or after the stacks, sinusoidal positions starting at 0 (BART and
FSMT offset them by ``pad + 1``), ``scale_embedding`` = sqrt(d_model), one ``shared`` embedding for
source, target and the output projection, biases everywhere, ReLU via ``activation_function``.
FSMT keeps separate source/target vocabularies and offsets its positions past the padding index,
so a joint-vocabulary model with positions from 0 has no exact FSMT form.

Two differences are bridged here, both exactly:

- HF's sinusoidal table holds all sines in the first half of d_model and the cosines in the second;
  the paper (and tformer) interleave them. Export permutes the d_model axis of every tensor that
  reads or writes the residual stream (embeddings, the input side of q/k/v/FFN-up, the output side
  of o/FFN-down and their biases, LayerNorm gains and biases) into HF's order; LayerNorm, attention
  and the FFN are equivariant under one consistent permutation, so the logits are unchanged.
  Import applies the inverse permutation.
- HF does not save its (frozen) position tables; neither does the export. ``final_logits_bias`` (a
  buffer) is written as zeros; an imported model with a non-zero one is
  refused, since tformer's tied head has no bias.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..config import ModelConfig
from .common import PLAIN_ACTS, HF_PLAIN_ACTS, ExportError, Rule, build_config, first_id, linear, need, raise_problems, rule

HF_CLASS = "MarianMTModel"
AUTO_CLASS = "AutoModelForSeq2SeqLM"
# HF recomputes its sinusoidal tables on load and does not save them; nor do we.
NOT_SAVED = ("model.encoder.embed_positions.weight", "model.decoder.embed_positions.weight")

# Our tensor-name suffixes and the axis along which they span d_model (the residual stream).
_READS = (
    "q_proj.weight",
    "k_proj.weight",
    "v_proj.weight",
    "ffn.up.weight",
    "embed.tok.weight",
    "lm_head.weight",
)  # (out, d_model): columns
_WRITES = (
    "o_proj.weight",
    "o_proj.bias",
    "ffn.down.weight",
    "ffn.down.bias",
    "norm.weight",
    "norm.bias",
)  # (d_model, ...): rows


def check(cfg: ModelConfig) -> None:
    raise_problems(
        HF_CLASS,
        [
            need(cfg, "family", "encdec", "Marian is an encoder-decoder"),
            need(cfg, "position", "sinusoidal", "Marian uses fixed sinusoidal positions"),
            need(cfg, "norm", "layernorm", "Marian uses LayerNorm"),
            need(cfg, "norm_eps", 1e-5, "Marian's LayerNorms use torch's default eps 1e-5"),
            need(cfg, "norm_bias", True, "Marian's LayerNorms have biases"),
            need(cfg, "norm_position", "post", "Marian is post-norm (the paper's Add & Norm)"),
            need(cfg, "activation", tuple(PLAIN_ACTS), "Marian's FFN is not gated"),
            need(cfg, "bias", True, "Marian has biases in attention and feed-forward layers"),
            need(cfg, "attn_scale", True, "Marian scales attention scores by 1/sqrt(d_k)"),
            need(cfg, "num_kv_heads", lambda v: v in (None, cfg.num_heads), "Marian has no grouped-query attention"),
            need(
                cfg,
                "d_head",
                lambda v: v in (None, cfg.d_model // cfg.num_heads),
                "Marian's head width is d_model // num_heads",
            ),
            need(cfg, "type_vocab_size", 0, "Marian has no token-type embeddings"),
            need(cfg, "embed_norm", False, "Marian has no norm after the embeddings"),
            need(cfg, "tie_embeddings", True, "the export shares one embedding for source, target and output"),
            need(cfg, "tied_output_scale", False, "Marian does not rescale before its output projection"),
            need(cfg, "d_model", lambda v: v % 2 == 0, "the sinusoidal table needs an even d_model"),
        ],
    )


def hf_config(cfg: ModelConfig):
    from transformers import MarianConfig

    return MarianConfig(
        vocab_size=cfg.vocab_size,
        d_model=cfg.d_model,
        max_position_embeddings=cfg.max_seq_len,
        encoder_layers=cfg.num_layers,
        decoder_layers=cfg.decoder_layers,
        encoder_attention_heads=cfg.num_heads,
        decoder_attention_heads=cfg.num_heads,
        encoder_ffn_dim=cfg.d_ff,
        decoder_ffn_dim=cfg.d_ff,
        activation_function=PLAIN_ACTS[cfg.activation],
        dropout=cfg.dropout,
        attention_dropout=cfg.attn_dropout,
        activation_dropout=0.0,
        scale_embedding=cfg.embed_scale,
        share_encoder_decoder_embeddings=True,
        tie_word_embeddings=True,
        pad_token_id=cfg.pad_token_id,
        eos_token_id=cfg.eos_token_id,
        bos_token_id=cfg.bos_token_id,
        decoder_start_token_id=cfg.decoder_start_token_id,
        forced_eos_token_id=None,
        architectures=[HF_CLASS],
    )


def rules(cfg: ModelConfig) -> list[Rule]:
    out = [rule("model.shared.weight", "embed.tok.weight")]
    for stack, layers in (("encoder", cfg.num_layers), ("decoder", cfg.decoder_layers)):
        for i in range(layers):
            h, o = f"model.{stack}.layers.{i}.", f"{stack}.layers.{i}."
            attns = [("self_attn", "attn", "attn_norm")]
            if stack == "decoder":
                attns.append(("encoder_attn", "cross_attn", "cross_norm"))
            for hf_name, ours, norm in attns:
                for x in "qkv":
                    out += linear(f"{h}{hf_name}.{x}_proj", f"{o}{ours}.{x}_proj", True)
                out += linear(f"{h}{hf_name}.out_proj", f"{o}{ours}.o_proj", True)
                out += linear(f"{h}{hf_name}_layer_norm", o + norm, True)
            out += linear(h + "fc1", o + "ffn.up", True) + linear(h + "fc2", o + "ffn.down", True)
            out += linear(h + "final_layer_norm", o + "ffn_norm", True)
    return out


def halves_order(d_model: int) -> torch.Tensor:
    """HF column ``k`` holds our column ``order[k]``: even (sine) columns first, then odd (cosine)."""
    return torch.cat((torch.arange(0, d_model, 2), torch.arange(1, d_model, 2)))


def _permute(cfg: ModelConfig, state: dict[str, torch.Tensor], order: torch.Tensor) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in state.items():
        if name.endswith(_READS):
            t = t[:, order]
        elif name.endswith(_WRITES):
            t = t[order]
        out[name] = t.contiguous()
    return out


def before_export(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return _permute(cfg, state, halves_order(cfg.d_model))


def after_import(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return _permute(cfg, state, torch.argsort(halves_order(cfg.d_model)))


def _table(cfg: ModelConfig) -> torch.Tensor:
    from transformers.models.marian.modeling_marian import MarianSinusoidalPositionalEmbedding

    return MarianSinusoidalPositionalEmbedding(cfg.max_seq_len, cfg.d_model).create_weight()


def buffers(cfg: ModelConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {"final_logits_bias": torch.zeros(1, cfg.vocab_size, dtype=dtype)}


def drop_on_import(cfg: ModelConfig, hf_state: dict[str, torch.Tensor], source: str) -> dict[str, torch.Tensor]:
    """Remove the fixed position tables (checked to be the sinusoidal ones: tformer has no learned
    absolute positions in this flavour) and refuse a non-zero ``final_logits_bias``."""
    state = dict(hf_state)
    table = _table(cfg)
    for s in ("encoder", "decoder"):
        t = state.pop(f"model.{s}.embed_positions.weight", None)
        if t is not None and not torch.allclose(t.float(), table, atol=1e-4):
            raise ExportError(
                f"{source}: model.{s}.embed_positions.weight is not the sinusoidal table; "
                "tformer's Marian flavour has fixed positions only"
            )
    bias = _final_logits_bias(source)
    if bias is not None and bias.abs().max() > 0:
        raise ExportError(
            f"{source}: final_logits_bias is non-zero; tformer's tied output projection has "
            "no bias, so this model cannot be imported exactly"
        )
    return state


def _final_logits_bias(source: str) -> torch.Tensor | None:
    from safetensors import safe_open

    for f in sorted(Path(source).glob("*.safetensors")) if Path(source).is_dir() else []:
        with safe_open(str(f), "pt") as st:
            if "final_logits_bias" in st.keys():
                return st.get_tensor("final_logits_bias")
    return None


def model_config(hf, tied: bool) -> ModelConfig:
    problems = []
    if not tied or not getattr(hf, "share_encoder_decoder_embeddings", True):
        problems.append("separate source/target/output embeddings (tformer shares one)")
    if hf.encoder_attention_heads != hf.decoder_attention_heads or hf.encoder_ffn_dim != hf.decoder_ffn_dim:
        problems.append("different encoder and decoder widths")
    if hf.activation_function not in HF_PLAIN_ACTS:
        problems.append(f"activation_function={hf.activation_function!r}")
    if getattr(hf, "decoder_vocab_size", hf.vocab_size) != hf.vocab_size:
        problems.append("a separate decoder vocabulary")
    if problems:
        raise ExportError(f"HF Marian config has no tformer equivalent: {'; '.join(problems)}")
    return build_config(
        "HF Marian config",
        family="encdec",
        flavour="marian",
        vocab_size=hf.vocab_size,
        d_model=hf.d_model,
        num_layers=hf.encoder_layers,
        num_decoder_layers=hf.decoder_layers,
        num_heads=hf.encoder_attention_heads,
        d_ff=hf.encoder_ffn_dim,
        max_seq_len=hf.max_position_embeddings,
        position="sinusoidal",
        norm="layernorm",
        norm_eps=1e-5,
        norm_bias=True,
        norm_position="post",
        activation=HF_PLAIN_ACTS[hf.activation_function],
        bias=True,
        attn_scale=True,
        embed_scale=bool(hf.scale_embedding),
        tie_embeddings=True,
        tied_output_scale=False,
        dropout=float(hf.dropout),
        attn_dropout=float(hf.attention_dropout),
        pad_token_id=hf.pad_token_id if hf.pad_token_id is not None else 0,
        eos_token_id=first_id(hf.eos_token_id),
        bos_token_id=hf.bos_token_id,
        decoder_start_token_id=hf.decoder_start_token_id if hf.decoder_start_token_id is not None else 0,
    )
