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
one device every rank runs every matrix itself. (Not a CPU profile's ``gemm_table``: its operands
come from memory, each Newton-Schulz product's from the cache: ``_ns_seconds``.)

Beside the products, what the step adds to AdamW's (the time model prices AdamW for every
parameter: its ``optimizer`` term and the fused kernel's host ops): Muon's elementwise traffic per
matrix element beyond AdamW's 28 bytes (``MUON_BYTES``: the momentum and Nesterov lerps, the
normalisation, the decay and the update), and its host ops, one Python loop over the matrices
(``muon_ops_per_matrix``: the ops outside the iterations, counted on a real step as plan/host.py
counts AdamW's) at the profile's ``op_overhead`` each. ``bench/bench_muon.py --predict`` holds the
sum against a measured step.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import SimpleNamespace

from ..config import ModelConfig
from ..models import build_model
from ..parallel.muon import muon_parameters
from ..parallel.newton_schulz import newton_schulz_flops
from .comm import link_of
from .compute import gemm_efficiency
from .hardware import Hardware
from .layout import Layout, rank_stages
from .states import _fields, config_of
from .time import ADAMW_BYTES, adamw_step_seconds


@functools.lru_cache(maxsize=16)
def _shapes(fields: tuple) -> tuple[tuple[int, ...], ...]:
    import torch

    with torch.device("meta"):
        model = build_model(config_of(fields))
    return tuple(tuple(p.shape) for p in muon_parameters(model))


def muon_shapes(cfg: ModelConfig) -> tuple[tuple[int, ...], ...]:
    """The shapes of the parameters Muon updates (2-D matrices, 3-D expert stacks)."""
    return _shapes(_fields(cfg))


# fp32 bytes per matrix element of Muon's elementwise step (parallel/muon.py): the momentum lerp_
# (read g, read and write the buffer: 12), Nesterov's lerp (read g and the buffer, write u: 12), the
# normalisation (a norm and a division: 12), the decay (read and write p: 8), the update (read p and
# the result, write p: 12); AdamW's (time.py's ADAMW_BYTES, in its OPTIMIZER_BYTES) are priced already
MUON_BYTES = 56


def _count_step_ops(ns_steps: int, matrices: int) -> int:
    """aten ops of one ``MuonAdamW`` step over ``matrices`` small matrices (past the first step,
    which creates the buffers)."""
    import torch

    from ..parallel.config import MuonConfig
    from ..parallel.muon import MuonAdamW, muon_group_settings
    from .host import _counting_mode

    params = [torch.nn.Parameter(torch.ones(4, 8)) for _ in range(matrices)]
    for p in params:
        p.grad = torch.ones_like(p)
    optim = SimpleNamespace(lr=1e-3, weight_decay=0.1, muon=MuonConfig(ns_steps=ns_steps, ns_dtype="fp32"))
    opt = MuonAdamW([{"params": params, "muon": True, **muon_group_settings(optim)}], 1e-3, (0.9, 0.95), 1e-8, None)
    opt.step()
    mode = _counting_mode()
    with mode:
        opt.step()
    return mode.total


@functools.lru_cache(maxsize=1)
def muon_ops_per_matrix() -> float:
    """aten ops Muon's step runs per matrix outside Newton-Schulz's iterations (momentum, Nesterov,
    the normalisation, decay, update): the iterations' own products are priced with their
    dispatch by ``_ns_seconds`` (the GEMM curve is measured per call). Counted on real steps: the
    difference of 8 and 4 matrices (no fixed cost leaks in), at 1 and 2 iterations (one
    iteration's ops, taken out)."""
    per = {s: (_count_step_ops(s, 8) - _count_step_ops(s, 4)) / 4 for s in (1, 2)}
    return per[1] - (per[2] - per[1])


@dataclass
class MuonCost:
    params: int  # parameters Muon updates (the rest: AdamW)
    flops: float  # Newton-Schulz FLOPs of one step, all matrices
    seconds: float  # Newton-Schulz seconds on the busiest rank
    comm_seconds: float  # gathers to the owners and scatters back, per rank
    state_saving: float  # bytes per rank Muon's one buffer saves against AdamW's two moments
    host_seconds: float = 0.0  # Muon's loop over its matrices: ops x the profile's op_overhead
    memory_seconds: float = 0.0  # its elementwise traffic beyond AdamW's, at the memory bandwidth

    @property
    def extra(self) -> float:
        """Seconds Muon's step adds to the AdamW-priced step."""
        return self.seconds + self.comm_seconds + self.host_seconds + self.memory_seconds


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
    local = params / layout.tp / max(shard, 1)
    host = len(shapes) * muon_ops_per_matrix() * hw.op_overhead / (layout.tp if sharded else 1)
    memory = (MUON_BYTES - ADAMW_BYTES) * local / (hw.hbm_bandwidth * hw.hbm_efficiency)
    return MuonCost(params, flops, seconds / owners, comm, 4 * local, host, memory)


def _ns_seconds(shape: tuple[int, ...], steps: int, rate: float, hw: Hardware) -> float:
    """One matrix (or stack): per step the Gram matrix (s x l)(l x s), its square (s x s)(s x s) and
    the product with X (s x s)(s x l), each at the share of the peak its shape reaches
    (``compute.gemm_efficiency``: small matrices run far below it). Not a CPU profile's
    ``gemm_table``: it is measured with operands out of the caches (as a training step's GEMMs
    find them), while each Newton-Schulz product reads the one before it, in cache; on gpt2-tiny the
    table's rates put the iteration at 3x its measured time (bench/bench_muon.py --predict)."""
    *stack, m, n = shape
    s, big = min(m, n), max(m, n)

    def seconds(a: int, b: int, c: int) -> float:  # (a x c) @ (c x b)
        return 2 * a * b * c / (rate * gemm_efficiency(a, b, c, hw))

    per = seconds(s, s, big) + seconds(s, s, s) + seconds(s, big, s)
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


def adamw_seconds(cfg: ModelConfig, layout: Layout, hw: Hardware) -> float:
    """The time model's AdamW optimizer step (``time.adamw_step_seconds``) on the rank with the
    most parameters: its traffic and its host ops."""
    return sum(adamw_step_seconds(cfg, layout, hw, max(rank_stages(cfg, layout), key=lambda st: st.params)))


def optimizer_seconds(cfg: ModelConfig, layout: Layout, hw: Hardware, name: str, ns_steps: int = 5) -> float:
    """Predicted seconds of one optimizer step (clip, step, zeroing) of ``optim.name`` ``name``."""
    adamw = adamw_seconds(cfg, layout, hw)
    if name == "adamw":
        return adamw
    return adamw + muon_cost(cfg, layout, hw, ns_steps, "fp32" if hw.device == "cpu" else "auto").extra


def time_line(cfg: ModelConfig, layout: Layout, hw: Hardware, step: float, ns_steps: int, ns_dtype: str) -> str:
    """``tformer plan``'s line for optim.name=muon: Newton-Schulz and its traffic, Muon's host and
    elementwise work, and the optimizer's share of the step (``step``: the AdamW-priced step's
    seconds, whose optimizer part is ``adamw_seconds``)."""
    c = muon_cost(cfg, layout, hw, ns_steps, ns_dtype)
    total = step + c.extra
    optimizer = adamw_seconds(cfg, layout, hw) + c.extra
    return (
        f"  optim.name=muon: Newton-Schulz {c.flops / 1e9:.2f} GFLOP per step ({c.seconds:.4f} s on the busiest "
        f"rank), gathers + scatters {c.comm_seconds:.4f} s, its loop and elementwise work "
        f"{c.host_seconds + c.memory_seconds:.4f} s: +{c.extra:.4f} s, a {total:.3f} s step; the optimizer "
        f"{optimizer:.4f} s, {optimizer / total:.1%} of the step (Newton-Schulz {c.seconds / total:.1%})"
    )
