"""The optimizer's share of memory and time under ``optim.name: muon`` (tformer/parallel/muon.py).

Memory: Muon keeps one fp32 momentum buffer per parameter it updates (4 bytes) where AdamW keeps two
moments (8); the rest stay AdamW's. The planner's model-state tables count AdamW's 8 bytes for every
parameter (states.py), so Muon's states are those less ``4 x Muon's parameters / shard``.

Time: Newton-Schulz per matrix (m, n) of ``steps`` iterations is ``steps x (4 s^2 l + 2 s^3)``
FLOPs (s = min(m, n), l = max(m, n): the Gram matrix, its square, the product with X; about
``5 x 3 x 2 x m x n x min(m, n)`` at 5 steps on a square matrix), run at the GEMM peak of its dtype
(bf16 on a GPU, fp32 on a CPU: ``optim.muon.ns_dtype``) at the share of it the planner's GEMM curve
gives each product's shape. A data-parallel (FSDP2) or TP group of n
ranks spreads the matrices over n owners (``newton_schulz.orthogonalise``), each rank sending and
receiving ``(n - 1) / n`` of its shards twice (gather to the owners, scatter back); under DDP or on
one device every rank runs every matrix itself. The elementwise work (momentum, the update) is
AdamW's traffic or less, already in the step's ``optimizer`` term.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ..config import ModelConfig
from ..models import build_model
from ..parallel.muon import muon_parameters
from ..parallel.newton_schulz import newton_schulz_flops
from .comm import link_of
from .compute import gemm_efficiency
from .hardware import Hardware
from .layout import Layout
from .states import _fields, config_of


@functools.lru_cache(maxsize=16)
def _shapes(fields: tuple) -> tuple[tuple[int, ...], ...]:
    import torch

    with torch.device("meta"):
        model = build_model(config_of(fields))
    return tuple(tuple(p.shape) for p in muon_parameters(model))


def muon_shapes(cfg: ModelConfig) -> tuple[tuple[int, ...], ...]:
    """The shapes of the parameters Muon updates (2-D matrices, 3-D expert stacks)."""
    return _shapes(_fields(cfg))


@dataclass
class MuonCost:
    params: int  # parameters Muon updates (the rest: AdamW)
    flops: float  # Newton-Schulz FLOPs of one step, all matrices
    seconds: float  # Newton-Schulz seconds on the busiest rank
    comm_seconds: float  # gathers to the owners and scatters back, per rank
    state_saving: float  # bytes per rank Muon's one buffer saves against AdamW's two moments


def muon_cost(cfg: ModelConfig, layout: Layout, hw: Hardware, ns_steps: int = 5, ns_dtype: str = "auto") -> MuonCost:
    shapes = muon_shapes(cfg)
    params = sum(_numel(s) for s in shapes)
    flops = sum(newton_schulz_flops(s, ns_steps) for s in shapes)
    dtype = ns_dtype if ns_dtype != "auto" else ("bf16" if hw.device == "cuda" else "fp32")
    rate = hw.peak["bf16" if dtype == "bf16" else "fp32"]
    seconds = sum(_ns_seconds(s, ns_steps, rate, hw) for s in shapes)
    sharded = layout.strategy != "ddp"
    owners = layout.dp_shard * layout.tp if sharded else 1
    shard = layout.dp_shard * layout.cp if sharded else 1
    comm = 0.0
    if owners > 1:
        link = link_of(hw, 1, owners)
        moved = 2 * 4 * params / (layout.tp * max(shard, 1)) * (owners - 1) / owners
        comm = moved / link.bandwidth + 2 * len(shapes) / owners * link.latency
    return MuonCost(params, flops, seconds / owners, comm, 4 * params / layout.tp / max(shard, 1))


def _ns_seconds(shape: tuple[int, ...], steps: int, rate: float, hw: Hardware) -> float:
    """One matrix (or stack): per step the Gram matrix (s x l)(l x s), its square (s x s)(s x s) and
    the product with X (s x s)(s x l), each at the share of the peak its shape reaches
    (``compute.gemm_efficiency``: small matrices run far below it)."""
    *stack, m, n = shape
    s, big = min(m, n), max(m, n)
    per = sum(2 * a * b * c / (rate * gemm_efficiency(a, b, c, hw)) for a, b, c in ((s, s, big), (s, s, s), (s, big, s)))
    return _numel(tuple(stack)) * steps * per


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def memory_line(cfg: ModelConfig, total_params: int, devices: int, strategy: str) -> str:
    """``tformer plan``'s line for optim.name=muon: the optimizer states against AdamW's."""
    shapes = muon_shapes(cfg)
    params = sum(_numel(s) for s in shapes)
    shard = 1 if strategy == "ddp" else devices
    gib = 2**30
    return (
        f"optim.name=muon: {len(shapes)} matrices / expert stacks ({params / total_params:.0%} of the parameters) "
        f"keep one momentum buffer (4 B) instead of AdamW's two moments (8 B): optimizer states "
        f"{(8 * total_params - 4 * params) / gib:.2f} GiB instead of {8 * total_params / gib:.2f} GiB unsharded"
        + (f" ({(8 * total_params - 4 * params) / shard / gib:.2f} per device sharded over {shard})" if shard > 1 else "")
        + "; the tables below count AdamW's"
    )


def time_line(cfg: ModelConfig, layout: Layout, hw: Hardware, step: float, ns_steps: int, ns_dtype: str) -> str:
    """``tformer plan``'s line for optim.name=muon: Newton-Schulz and its traffic, and their share
    of the step (``step``: the AdamW-priced step's seconds)."""
    c = muon_cost(cfg, layout, hw, ns_steps, ns_dtype)
    extra = c.seconds + c.comm_seconds
    return (
        f"  optim.name=muon: Newton-Schulz {c.flops / 1e9:.2f} GFLOP per step ({c.seconds:.4f} s on the busiest "
        f"rank), gathers + scatters {c.comm_seconds:.4f} s: +{extra:.4f} s, {extra / (step + extra):.1%} of a "
        f"{step + extra:.3f} s step"
    )
