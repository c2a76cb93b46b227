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

from dataclasses import dataclass

from ..args import parse_bytes
from ..config import ModelConfig

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


def _block_elements_op_ac(cfg: ModelConfig, cross_len: int | None = None) -> float:
    """Elements per token one block keeps under op-level checkpointing: its input and the outputs
    of its matmuls and attention (q, k, v, attention, o_proj, FFN up(/gate) and down)."""
    d, h, dk, ff = cfg.d_model, cfg.num_heads, cfg.head_dim, cfg.d_ff
    kv = cfg.kv_heads * cfg.head_dim
    total = d + (h * dk + 2 * kv) + h * dk + d + (2 * ff if cfg.activation in ("swiglu", "geglu") else ff) + d
    if cross_len is not None:
        total += h * dk + h * dk + d  # cross-attention q, attention output, o_proj output
    return total


def head_bytes(cfg: ModelConfig, tokens: int, mixed: bool, chunk: int | None = None) -> float:
    """Peak bytes the training loss's head adds on top of the model states, for ``tokens`` labelled
    positions (all samples of a micro-batch). Its peak is in backward, next to the weight gradient
    (a model state): the log-softmax, overwritten by the logits' gradient, plus its bf16 cast under
    mixed precision. (Forward holds the logits and their log-softmax too, but before any gradient
    exists.) Chunked, the same for ``chunk`` rows at a time (measured: bench/bench_memory.py)."""
    per_logit = 6 if mixed else 4
    rows = tokens if chunk is None else min(chunk, tokens)
    return rows * cfg.padded_vocab_size * per_logit


def activation_bytes(cfg: ModelConfig, micro_batch: int, seq: int, target: int | None, ac: str,
                     mixed: bool, transient: bool = True, chunk: int | None = None, offload: bool = False,
                     labelled: float = 1.0, return_logits: bool = True) -> float:
    """Bytes of activations for one micro-batch: what autograd keeps from forward to backward, plus
    (``transient``) the peak added during backward: the recomputed block under activation
    checkpointing, the head and loss.

    ``chunk``: the chunked head + loss (``loss.chunk_size``); ``offload``: saved activations wait in
    host memory (on the device: one block's worth at a time, brought back for its backward);
    ``labelled``: the share of output positions with a label (BERT's head runs only there);
    ``return_logits``: the evaluation path, which keeps the whole logits (and so cannot chunk)."""
    elt = 2 if mixed else 4
    op_elements = [_block_elements_op_ac(cfg)] * cfg.num_layers
    layers = [(seq, _block_elements_per_token(cfg, seq))] * cfg.num_layers
    out_tokens = seq
    if cfg.family == "encdec":
        t = target or seq
        memory_kv = 2 * cfg.kv_heads * cfg.head_dim * seq / t
        layers += [(t, _block_elements_per_token(cfg, t, cross_len=seq) + memory_kv)] * cfg.decoder_layers
        op_elements += [_block_elements_op_ac(cfg, cross_len=seq) + memory_kv] * cfg.decoder_layers
        out_tokens = t
    if ac == "full":  # each block keeps only its input; one block is recomputed at a time
        kept = sum(tokens * cfg.d_model for tokens, _ in layers)
        recompute = max(tokens * e for tokens, e in layers)
    elif ac == "op":  # each block keeps its matmul and attention outputs; the rest is recomputed
        kept = sum(tokens * e for (tokens, _), e in zip(layers, op_elements))
        recompute = max(tokens * (e - o) for (tokens, e), o in zip(layers, op_elements))
    else:
        kept = sum(tokens * e for tokens, e in layers)
        recompute = 0
    if ac in ("op", "full"):  # the rebuilt block is whole when its backward starts making gradients
        ffn_grads = (3 if cfg.activation in ("swiglu", "geglu") else 2) * cfg.d_ff + 2 * cfg.d_model
        recompute += max(tokens for tokens, _ in layers) * ffn_grads
    if offload:  # kept in host memory; a block's saved tensors come back for its backward
        recompute += max(tokens * e for tokens, e in layers) if ac == "none" else max(
            tokens * cfg.d_model for tokens, _ in layers)
        kept = 0
    if return_logits:  # the logits are returned: fp32 copy and log-softmax kept, then the gradient
        vocab = out_tokens * cfg.padded_vocab_size
        head_kept, head_peak = vocab * ((elt if mixed else 0) + 4 + 4), vocab * 4
    else:
        head_kept = 0
        head_peak = head_bytes(cfg, round(micro_batch * out_tokens * labelled), mixed, chunk) / micro_batch
    total = kept * elt + head_kept
    if transient:
        total += recompute * elt + head_peak
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
             target: int | None = None, ac: str = "none", mixed: bool = True, **memory) -> Estimate:
    """``memory``: the head and offload settings of ``activation_bytes`` (chunk, offload, ...)."""
    from ..models import build_model
    import torch
    with torch.device("meta"):
        params = build_model(cfg).num_parameters()
    return Estimate(strategy, ac, micro_batch, model_state_bytes(strategy, params, devices, mixed, as_built=True),
                    activation_bytes(cfg, micro_batch, seq, target, ac, mixed, **memory))


def training_memory(cfg) -> dict:
    """``activation_bytes`` settings of a run config: the trainer's loss-only path, its chunked
    head, offload (host memory only on an accelerator) and BERT's labelled share."""
    model_cfg = cfg.model_config()
    return {"return_logits": False, "chunk": cfg.loss.chunk_size,
            "offload": cfg.parallel.activation_offload and cfg.device != "cpu",
            "labelled": cfg.data.mlm_probability if model_cfg.family == "encoder" else 1.0}


def print_savings(cfg: ModelConfig, micro_batch: int, seq: int, target: int | None, mixed: bool,
                  settings: dict) -> None:
    """Activation memory per device of each memory setting alone, against none of them (the
    unchunked head, no checkpointing, no offload), and of this run's choice."""
    gib = 2**30
    plain = {**settings, "chunk": None, "offload": False}
    chunk = settings["chunk"] or 1024

    def act(ac="none", **change):
        return activation_bytes(cfg, micro_batch, seq, target, ac, mixed, **{**plain, **change})

    base = act()
    rows = [("none of them (baseline)", base), (f"loss.chunk_size={chunk}", act(chunk=chunk)),
            ("activation_checkpointing=op", act("op")), ("activation_checkpointing=full", act("full")),
            ("activation_offload=true (on a GPU)", act(offload=True)),
            (f"chunk {chunk} + op + offload", act("op", chunk=chunk, offload=True))]
    print(f"\nwhat each memory setting saves per device (activations, micro-batch {micro_batch}):")
    print(f"{'setting':<38}{'activ. GiB':>11}{'saves GiB':>11}{'saves':>7}")
    for name, value in rows:
        print(f"{name:<38}{value / gib:>11.2f}{(base - value) / gib:>11.2f}{1 - value / base:>7.0%}")


def recommend(cfg: ModelConfig, devices: int, memory: float, seq: int, target: int | None,
              mixed: bool = True, headroom: float = 0.9, settings: dict | None = None) -> list[Estimate]:
    """Every (strategy, AC, micro-batch) that fits, cheapest communication first, then the
    cheapest recomputation (none, op, full), largest micro-batch first."""
    fits = []
    for strategy in STRATEGY_NAMES:
        for ac in ("none", "op", "full"):
            for mb in (64, 32, 16, 8, 4, 2, 1):
                e = estimate(cfg, strategy, devices, mb, seq, target, ac, mixed, **(settings or {}))
                if e.total <= headroom * memory:
                    fits.append(e)
                    break
    return fits


def plan_main(cfg, config: str, devices: int, device_memory: str) -> int:
    """Print the table and the recommendation for ``cfg``, the run config (a ``TrainConfig``,
    loaded by the CLI from the file ``config``: train/ is a layer above this one)."""
    model_cfg = cfg.model_config()
    memory = parse_bytes(device_memory)
    mixed = cfg.precision != "fp32"
    target = None
    if model_cfg.family == "encdec":
        from ..data import t5_lengths
        target = cfg.data.target_len or t5_lengths(cfg.data.seq_len)[1]
    gib = 2**30
    settings = training_memory(cfg)
    print(f"model: {model_cfg.family}, {config}; {devices} devices x {memory / gib:.1f} GiB; seq "
          f"{cfg.data.seq_len}; {'bf16 mixed' if mixed else 'fp32'}; loss.chunk_size={cfg.loss.chunk_size}; "
          f"activation_offload={'on' if settings['offload'] else 'off'}")
    print(f"{'strategy':<16}{'AC':<6}{'micro':>6}{'states GiB':>12}{'activ. GiB':>12}{'total GiB':>11}  fits")
    for strategy in STRATEGY_NAMES:
        for ac in ("none", "op", "full"):
            e = estimate(model_cfg, strategy, devices, cfg.micro_batch_size, cfg.data.seq_len, target, ac, mixed,
                         **settings)
            print(f"{strategy:<16}{ac:<6}{e.micro_batch:>6}{e.model_states / gib:>12.2f}"
                  f"{e.activations / gib:>12.2f}{e.total / gib:>11.2f}  {'yes' if e.total <= 0.9 * memory else 'no'}")
    print_savings(model_cfg, cfg.micro_batch_size, cfg.data.seq_len, target, mixed, settings)
    fits = recommend(model_cfg, devices, memory, cfg.data.seq_len, target, mixed, settings=settings)
    if not fits:
        print("recommendation: nothing fits; use more devices, a shorter sequence or a smaller model")
        return 1
    best = fits[0]
    flag = {"ddp": "parallel.strategy=ddp", "fsdp": "parallel.strategy=fsdp",
            "fsdp-no-reshard": "parallel.strategy=fsdp parallel.reshard_after_forward=false"}.get(
        best.strategy, f"parallel.strategy=deepspeed parallel.deepspeed_config=configs/deepspeed/{best.strategy}.json")
    ac = "" if best.ac == "none" else f" parallel.activation_checkpointing={best.ac}"
    print(f"recommendation: {best.strategy}, micro_batch_size={best.micro_batch}, AC {best.ac} "
          f"({best.total / gib:.2f} GiB per device)\n  overrides: {flag} micro_batch_size={best.micro_batch}{ac}")
    return 0
