"""The planner's mixture-of-experts terms (``tformer plan``), apart from the dense counts in
``states.py`` and ``activations.py``: total against active parameters, the expert states a rank
holds under expert parallelism x FSDP2, the dispatch buffers of one MoE layer, and the all-to-all
bytes of a step.

The exchange volume (``parallel/ep.py``): per MoE layer and micro-batch a rank sends its routed
rows (tokens x top_k, d_model wide) to the experts' ranks and gets the outputs back, and backward
sends both gradients the other way: four exchanges, each ``(ep - 1) / ep`` of the rows leaving
the rank when routing is balanced (the rest stay on the rank). ``bench/bench_moe.py`` measures it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ModelConfig
from ..models import spec_of
from ..nn.ffn import FFN_KINDS
from .states import model_state_bytes


def moe_layers(cfg: ModelConfig) -> int:
    """MoE layers of the whole model: the stacks' and each multi-token prediction depth's whose
    block is MoE (DeepSeek-V3's is: an index past the trunk's last)."""
    mtp = sum(cfg.moe.is_moe_layer(cfg.num_layers + k) for k in range(cfg.mtp_depth))
    return spec_of(cfg).model.moe_layer_count(cfg) + mtp


def expert_parameters(cfg: ModelConfig) -> int:
    """Routed experts' parameters of the whole model (the part expert parallelism splits)."""
    moe = cfg.moe
    if not moe.enabled:
        return 0
    matrices = 3 if FFN_KINDS[moe.activation or cfg.activation][1] else 2
    d_expert = moe.d_expert or cfg.d_ff
    per_expert = matrices * cfg.d_model * d_expert + ((matrices - 1) * d_expert + cfg.d_model if moe.expert_bias else 0)
    return moe_layers(cfg) * moe.num_experts * per_expert


def active_parameters(cfg: ModelConfig, total: int) -> int:
    """Parameters one token passes through: all but the experts it is not routed to (the input
    embedding and the output head included, each multi-token prediction depth's block too).
    Publishers differ on the embedding (docs/planning.md, "Published parameter counts"):
    ``tformer plan`` prints the count without it as well."""
    if not cfg.moe.enabled:
        return total
    return total - expert_parameters(cfg) * (cfg.moe.num_experts - cfg.moe.top_k) // cfg.moe.num_experts


@dataclass(frozen=True)
class MoELayout:
    ep: int
    dp_shard: int  # the FSDP2 shard group of the dense weights (dp_shard x cp)
    tokens: int  # tokens per rank per micro-batch
    micro_batches: int = 1  # per step (grad_accum)
    elt: int = 4  # bytes per exchanged element (the activations' dtype)


def expert_states_per_rank(cfg: ModelConfig, layout: MoELayout, bytes_per_param: float) -> float:
    """Bytes of expert states one rank holds: 1/ep of the experts, FSDP2-sharded over the
    dp_shard / ep ranks EP leaves (``bytes_per_param``: parameters + gradients + optimizer)."""
    return expert_parameters(cfg) * bytes_per_param / layout.dp_shard


def dispatch_buffer_bytes(cfg: ModelConfig, layout: MoELayout) -> float:
    """One MoE layer's routed-token buffers on a rank, kept for backward: the rows gathered in
    expert order (sent, and received under EP), the experts' hidden activations and outputs."""
    moe = cfg.moe
    if not moe.enabled:
        return 0.0
    rows = layout.tokens * moe.top_k
    gated = FFN_KINDS[moe.activation or cfg.activation][1]
    hidden = (3 if gated else 2) * (moe.d_expert or cfg.d_ff)
    copies = 2 if layout.ep > 1 else 1  # under EP: the rows sent and the rows received
    return rows * (copies * cfg.d_model + hidden + cfg.d_model) * layout.elt


def ep_activation_bytes(cfg: ModelConfig, tokens: int, ep: int, elt: int, ac: str) -> float:
    """Bytes expert parallelism adds to a rank's activations for ``tokens`` tokens of one
    micro-batch: each MoE layer keeps the rows it received for its experts' backward besides the
    rows it sent (``dispatch_buffer_bytes``' second copy), in every MoE layer under AC none, in the
    one block being recomputed otherwise (no checkpointing policy saves an all-to-all's output)."""
    if not cfg.moe.enabled or ep == 1:
        return 0.0
    extra = dispatch_buffer_bytes(cfg, MoELayout(ep, ep, tokens, 1, elt)) - dispatch_buffer_bytes(
        cfg, MoELayout(1, ep, tokens, 1, elt)
    )
    return extra * (moe_layers(cfg) if ac == "none" else 1)


def all_to_all_bytes_per_step(cfg: ModelConfig, layout: MoELayout) -> float:
    """Bytes leaving one rank in the expert all-to-alls of a training step, balanced routing."""
    if not cfg.moe.enabled or layout.ep == 1:
        return 0.0
    rows = layout.tokens * cfg.moe.top_k
    per_exchange = rows * cfg.d_model * layout.elt * (layout.ep - 1) / layout.ep
    return 4 * per_exchange * moe_layers(cfg) * layout.micro_batches


def moe_lines(cfg: ModelConfig, total: int, devices: int, tokens: int, mixed: bool) -> list[str]:
    """What ``tformer plan`` prints for an MoE model: its parameter split and, for each ep the
    devices allow (FSDP2 over all of them), the per-rank expert states and exchange volume."""
    if not cfg.moe.enabled:
        return []
    experts, active = expert_parameters(cfg), active_parameters(cfg, total)
    lookup = cfg.padded_vocab_size * cfg.d_model  # the input embedding: read, not multiplied
    lines = [
        f"mixture of experts: {total / 1e9:.2f}B parameters, {active / 1e9:.2f}B active per token "
        f"({(active - lookup) / 1e9:.2f}B without the input embedding); routed experts {experts / 1e9:.2f}B "
        f"in {moe_layers(cfg)} MoE layers"
    ]
    per_param = model_state_bytes("fsdp", 1, 1, mixed)
    elt = 2 if mixed else 4
    for ep in (e for e in range(1, devices + 1) if devices % e == 0 and cfg.moe.num_experts % e == 0):
        layout = MoELayout(ep, devices, tokens, 1, elt)
        lines.append(
            f"  ep={ep:<3} expert states {expert_states_per_rank(cfg, layout, per_param) / 2**30:8.2f} GiB/rank, "
            f"dispatch buffers {dispatch_buffer_bytes(cfg, layout) / 2**20:8.1f} MiB/layer, all-to-all "
            f"{all_to_all_bytes_per_step(cfg, layout) / 2**20:8.1f} MiB/rank per micro-batch"
        )
    return lines
