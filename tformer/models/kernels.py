"""Which attention kernel each kind of layer takes, from the config: the run's start-up line.

The answer comes from the function the layers call (``nn.flex.attention_kernel``), asked with the
switches a training batch hands each kind of layer: its window, sinks and cap, the stack's causal
rule, the family's data (packed causal rows, padded rows; an encoder-decoder's relative bias and
cross-attention; ``data.document_mask``'s packed documents), read from the spec, never the
flavour's name. So the line names the kernel that runs.
"""

from __future__ import annotations

from ..config import ModelConfig
from ..nn.flex import attention_kernel
from .spec import spec_of


def attention_kernels(cfg: ModelConfig, device_type: str, *, documents: bool = False) -> list[tuple[str, str]]:
    """(layer kind, kernel) of every kind of attention layer the model has, in stack order: e.g.
    ``[("global layers", "sdpa-causal"), ("local layers (window 128)", "flex")]`` for gpt-oss on
    CUDA. ``documents``: batches of packed documents (``data.document_mask``)."""
    spec = spec_of(cfg)
    latent = cfg.latent_attention  # latent attention takes no window, sinks or cap
    dims = (cfg.mla.qk_nope_head_dim + cfg.mla.qk_rope_head_dim, cfg.mla.v_head_dim) if latent else (cfg.head_dim,) * 2
    bias = cfg.position == "relative"
    shapes = spec.model.stack_shapes(cfg, 1, 1)
    names = ("encoder ", "decoder ") if len(shapes) == 2 else ("",)
    kinds: list[tuple[str, str]] = []
    for prefix, (blocks, _, cross) in zip(names, shapes):
        causal = spec.causal_lm or prefix == "decoder "
        windows = sorted({None if latent else cfg.layer_window(i) for i in range(blocks)}, key=lambda w: w or 0)
        for window in windows:
            kernel = attention_kernel(
                device_type,
                cfg.attn_impl,
                causal=causal,
                window=window,
                sinks=cfg.attn_sinks and not latent,
                softcap=None if latent else cfg.attn_softcap,
                documents=documents,
                padded=not causal,  # an encoder's rows carry a padding mask; causal rows are packed
                bias=bias,
                dropout=cfg.attn_dropout > 0,
                head_dims=dims,
            )
            if window is not None:
                what = f"local layers (window {window})"
            elif len(windows) > 1:
                what = "global layers"
            else:
                what = "layers" if prefix else "every layer"
            kinds.append((prefix + what, kernel))
        if cross is not None:
            kernel = attention_kernel(
                device_type,
                cfg.attn_impl,
                causal=False,
                softcap=cfg.attn_softcap,
                documents=documents,
                padded=True,
                dropout=cfg.attn_dropout > 0,
                head_dims=(cfg.head_dim,) * 2,
            )
            kinds.append(("cross-attention", kernel))
    return kinds


def attention_line(cfg: ModelConfig, device_type: str, *, documents: bool = False) -> str:
    """The start-up line: ``attention: global layers sdpa-causal, local layers (window 128) flex``,
    with a word on why where a cap sends layers to the math path (no SDPA kernel caps scores)."""
    kinds = attention_kernels(cfg, device_type, documents=documents)
    line = "attention: " + ", ".join(f"{what} {kernel}" for what, kernel in kinds)
    if cfg.attn_softcap is not None and cfg.attn_impl != "math" and any(k == "math" for _, k in kinds):
        line += (
            f" (model.attn_softcap={cfg.attn_softcap}: no SDPA kernel caps scores; FlexAttention, which does, runs "
            "on CUDA, heads 16 wide or more, no attention dropout; elsewhere the math path materialises them)"
        )
    return line
