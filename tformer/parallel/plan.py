"""``tformer plan``: per-device memory for each strategy, and the cheapest one that fits.

Model states follow the ZeRO paper (Rajbhandari et al., 2020) for Ψ parameters on N devices. With
bf16 mixed precision and fp32 master weights (DeepSpeed):
    DP 16Ψ,  ZeRO-1 4Ψ + 12Ψ/N,  ZeRO-2 2Ψ + 14Ψ/N,  ZeRO-3 16Ψ/N.
tformer's ddp and fsdp keep fp32 parameters and compute in bf16 (autocast / FSDP2 mixed precision):
    ddp 16Ψ (4 param + 4 grad + 8 Adam),  fsdp 16Ψ/N (+ 2Ψ bf16 copies held between forward and
    backward when reshard_after_forward is false).
In fp32 every strategy holds 4 (param) + 4 (grad) + 8 (Adam m, v) bytes per parameter:
    DP 16Ψ, ZeRO-1 8Ψ + 8Ψ/N, ZeRO-2 4Ψ + 12Ψ/N, ZeRO-3 16Ψ/N (the paper's arithmetic).
DeepSpeed as built keeps a separate fp32 master copy of each partition even in fp32, and reduces
ZeRO-1 gradients to partitions like ZeRO-2 (measured to 0.1% by bench/bench_scale.py):
    ZeRO-1 and ZeRO-2 4Ψ + 16Ψ/N, ZeRO-3 20Ψ/N; the planner predicts these (``as_built``).
Activations are the tensors autograd saves for backward, counted per token and layer from the
model's shapes; activation checkpointing keeps only each block's input plus one block's worth.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from ..config import ConfigError, ModelConfig

STRATEGY_NAMES = ("ddp", "zero1", "zero2", "zero3", "fsdp", "fsdp-no-reshard")
# bytes per parameter of DeepSpeed's fp32 ZeRO as built, by device count N (see the module doc)
DEEPSPEED_FP32_AS_BUILT = {"zero1": ("4Ψ+16Ψ/N", lambda n: 4 + 16 / n), "zero2": ("4Ψ+16Ψ/N", lambda n: 4 + 16 / n),
                           "zero3": ("20Ψ/N", lambda n: 20 / n)}


def model_state_bytes(strategy: str, params: int, devices: int, mixed: bool, as_built: bool = False) -> float:
    """Bytes of parameters + gradients + optimizer states per device: the ZeRO paper's formulas, or
    (``as_built``) what DeepSpeed really holds where it differs (fp32 ZeRO)."""
    n, p = devices, params
    if not mixed and as_built and strategy in DEEPSPEED_FP32_AS_BUILT:
        return DEEPSPEED_FP32_AS_BUILT[strategy][1](n) * p
    if not mixed:
        return {"ddp": 16 * p, "zero1": 8 * p + 8 * p / n, "zero2": 4 * p + 12 * p / n,
                "zero3": 16 * p / n, "fsdp": 16 * p / n, "fsdp-no-reshard": 16 * p / n}[strategy]
    return {"ddp": 16 * p, "zero1": 4 * p + 12 * p / n, "zero2": 2 * p + 14 * p / n, "zero3": 16 * p / n,
            "fsdp": 16 * p / n, "fsdp-no-reshard": 16 * p / n + 2 * p}[strategy]


def _block_elements_per_token(cfg: ModelConfig, seq: int, cross_len: int | None = None) -> float:
    """Elements autograd keeps per token for one block (SDPA attention: no S x S scores kept)."""
    d, h, dk, ff = cfg.d_model, cfg.num_heads, cfg.head_dim, cfg.d_ff
    kv = cfg.kv_heads * dk
    attn = d + d + h * dk + 2 * kv + h * dk + h * dk  # norm in/out, q, k, v, attn out, o_proj input
    ffn = 2 * d + (3 * ff if cfg.activation in ("swiglu", "geglu") else 2 * ff)  # norm, up(/gate), act
    residual = 2 * d
    total = attn + ffn + residual
    if cfg.attn_impl == "math":
        total += 2 * h * seq  # scores and probabilities
    if cross_len is not None:
        total += 2 * d + 2 * h * dk  # cross-attention queries / output (its K/V counted per source token)
    return total


def activation_bytes(cfg: ModelConfig, micro_batch: int, seq: int, target: int | None, ac: str,
                     mixed: bool, transient: bool = True) -> float:
    """Bytes of activations for one micro-batch: what autograd keeps from forward to backward, plus
    (``transient``) the peak added during backward: the recomputed block under activation
    checkpointing and the gradient of the logits."""
    elt = 2 if mixed else 4
    layers = [(seq, _block_elements_per_token(cfg, seq))] * cfg.num_layers
    out_tokens = seq
    if cfg.family == "encdec":
        t = target or seq
        layers += [(t, _block_elements_per_token(cfg, t, cross_len=seq)
                    + 2 * cfg.kv_heads * cfg.head_dim * seq / t)] * cfg.decoder_layers
        out_tokens = t
    if ac == "full":  # each block keeps only its input; one block is recomputed at a time
        kept = sum(tokens * cfg.d_model for tokens, _ in layers)
        recompute = max(tokens * e for tokens, e in layers)
    else:
        kept = sum(tokens * e for tokens, e in layers)
        recompute = 0
    vocab = out_tokens * cfg.padded_vocab_size
    logits_kept = vocab * ((elt if mixed else 0) + 4 + 4)  # (bf16 logits,) fp32 copy, log-softmax
    logits_grad = vocab * 4
    total = kept * elt + logits_kept
    if transient:
        total += recompute * elt + logits_grad
    return micro_batch * total


@dataclass
class Estimate:
    strategy: str
    ac: str
    micro_batch: int
    model_states: float
    activations: float

    @property
    def total(self) -> float:
        return self.model_states + self.activations


def estimate(cfg: ModelConfig, strategy: str, devices: int, micro_batch: int, seq: int,
             target: int | None = None, ac: str = "none", mixed: bool = True) -> Estimate:
    from ..models import build_model
    import torch
    with torch.device("meta"):
        params = build_model(cfg).num_parameters()
    return Estimate(strategy, ac, micro_batch, model_state_bytes(strategy, params, devices, mixed, as_built=True),
                    activation_bytes(cfg, micro_batch, seq, target, ac, mixed))


def parse_bytes(text: str) -> float:
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]i?B?|B)?\s*", text, re.IGNORECASE)
    if not m:
        raise ConfigError(f"--device-memory {text!r} is not a size; write e.g. 80GB or 24GiB")
    unit = (m.group(2) or "B").upper().rstrip("B").rstrip("I")
    return float(m.group(1)) * {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[unit]


def recommend(cfg: ModelConfig, devices: int, memory: float, seq: int, target: int | None,
              mixed: bool = True, headroom: float = 0.9) -> list[Estimate]:
    """Every (strategy, AC, micro-batch) that fits, cheapest communication first, largest
    micro-batch first within a strategy."""
    fits = []
    for strategy in STRATEGY_NAMES:
        for ac in ("none", "full"):
            for mb in (64, 32, 16, 8, 4, 2, 1):
                e = estimate(cfg, strategy, devices, mb, seq, target, ac, mixed)
                if e.total <= headroom * memory:
                    fits.append(e)
                    break
    return fits


def plan_main(config: str, overrides: list[str], devices: int, device_memory: str) -> int:
    from ..train.config import load_config

    cfg = load_config(config, overrides)
    model_cfg = cfg.model_config()
    memory = parse_bytes(device_memory)
    mixed = cfg.precision != "fp32"
    target = None
    if model_cfg.family == "encdec":
        from ..data import t5_lengths
        target = cfg.data.target_len or t5_lengths(cfg.data.seq_len)[1]
    gib = 2**30
    print(f"model: {model_cfg.family}, {config}; {devices} devices x {memory / gib:.1f} GiB; seq "
          f"{cfg.data.seq_len}; {'bf16 mixed' if mixed else 'fp32'}")
    print(f"{'strategy':<16}{'AC':<6}{'micro':>6}{'states GiB':>12}{'activ. GiB':>12}{'total GiB':>11}  fits")
    for strategy in STRATEGY_NAMES:
        for ac in ("none", "full"):
            e = estimate(model_cfg, strategy, devices, cfg.micro_batch_size, cfg.data.seq_len, target, ac, mixed)
            print(f"{strategy:<16}{ac:<6}{e.micro_batch:>6}{e.model_states / gib:>12.2f}"
                  f"{e.activations / gib:>12.2f}{e.total / gib:>11.2f}  {'yes' if e.total <= 0.9 * memory else 'no'}")
    fits = recommend(model_cfg, devices, memory, cfg.data.seq_len, target, mixed)
    if not fits:
        print("recommendation: nothing fits; use more devices, a shorter sequence or a smaller model")
        return 1
    best = fits[0]
    flag = {"ddp": "parallel.strategy=ddp", "fsdp": "parallel.strategy=fsdp",
            "fsdp-no-reshard": "parallel.strategy=fsdp parallel.reshard_after_forward=false"}.get(
        best.strategy, f"parallel.strategy=deepspeed parallel.deepspeed_config=configs/deepspeed/{best.strategy}.json")
    ac = "" if best.ac == "none" else " parallel.activation_checkpointing=full"
    print(f"recommendation: {best.strategy}, micro_batch_size={best.micro_batch}, AC {best.ac} "
          f"({best.total / gib:.2f} GiB per device)\n  overrides: {flag} micro_batch_size={best.micro_batch}{ac}")
    return 0
