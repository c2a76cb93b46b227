"""Expert parallelism (``parallel.ep``): each MoE layer's experts split over ``ep`` ranks, tokens
sent to their experts' rank and back with all-to-all exchanges that autograd differentiates
(``torch.distributed._functional_collectives``: NCCL on GPU, gloo on CPU).

The ep ranks are data-parallel ranks (taken from ``dp_shard x cp``, ``mesh.py``): each routes its
own tokens, so routing, capacity groups and the auxiliary losses are those of the data-parallel
run. Applied from outside, like the other layouts: the stacked expert weights become DTensors
sharded on dim 0 over the ``ep`` mesh (a DCP checkpoint holds them by their full shape and loads at
any ep), and every ``Experts`` module gets the all-to-all ``exchange`` (``nn/moe.py``). FSDP2 then
shards the expert weights over what EP leaves (``dp_shard_mod_ep``) and everything else over the
data-parallel group as without EP (``shard_experts``), as torchtitan lays it out.

With a pipeline (``parallel.pp``) each stage's experts are split over the ep ranks of that stage
(the ep ranks share its pp index): every stage module gets its own layers' exchange, and the ranks
of one stage run the same schedule, so their exchanges pair up. With tensor parallelism the MoE
FFNs run whole on every TP rank (``tp.py``) and the ep ranks share a TP index: each TP rank of an ep
group exchanges the same rows with its peers of that TP index, and the experts' gradients are the
same on every TP rank.

Per layer and micro-batch a rank exchanges its routed rows twice (forward: to the experts and
back; backward: their gradients likewise), ``(ep - 1) / ep`` of them leaving the rank when the
routing is balanced: ``tformer plan`` counts these bytes (``tformer/plan/moe.py``).
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import ConfigError
from ..nn.moe import Experts, moe_layers

__all__ = ["check_moe_layout", "apply_expert_parallel", "shard_experts", "ExpertExchange"]


def check_moe_layout(cfg, dims) -> None:
    """What a mixture-of-experts model or ``parallel.ep`` cannot run with, refused in one line
    before any process group or model work. ``cfg``: the run config; ``dims``: its ParallelDims."""
    moe, pcfg = cfg.model.moe, cfg.parallel
    if moe.enabled and pcfg.strategy == "deepspeed":
        raise ConfigError(
            "model.moe does not run with parallel.strategy=deepspeed (its experts would be partitioned "
            "like dense weights, with no expert parallelism); use parallel.strategy=fsdp (or ddp)"
        )
    if dims.ep == 1:
        return
    if not moe.enabled:
        raise ConfigError(
            f"parallel.ep={dims.ep} needs a mixture-of-experts model (model.moe.num_experts > 0); set parallel.ep=1"
        )
    if moe.num_experts % dims.ep:
        raise ConfigError(
            f"model.moe.num_experts={moe.num_experts} is not divisible by parallel.ep={dims.ep}; choose an ep "
            "that divides the number of experts"
        )
    if pcfg.strategy != "fsdp":
        raise ConfigError(
            f"parallel.ep={dims.ep} does not run with parallel.strategy={pcfg.strategy}; set "
            "parallel.strategy=fsdp, or parallel.ep=1"
        )


def apply_expert_parallel(model: nn.Module, mesh) -> None:
    """Keep this rank's ``num_experts / ep`` experts of every MoE layer (as DTensor shards of the
    full stacks over the 1-D ``mesh``, the run mesh's ``ep``) and route tokens to them."""
    from torch.distributed.tensor import Shard, distribute_tensor

    exchange = ExpertExchange(mesh)
    for layer in moe_layers(model):
        experts = layer.experts
        for name in ("gate", "up", "down", "gate_bias", "up_bias", "down_bias"):  # biases (E, ...): gpt-oss
            w = getattr(experts, name)
            if w is not None:  # every rank holds the same full stack (one seed): cut it, no traffic
                shard = distribute_tensor(w.detach(), mesh, [Shard(0)], src_data_rank=None)
                setattr(experts, name, nn.Parameter(shard, requires_grad=w.requires_grad))
        experts.exchange = exchange


def shard_experts(model: nn.Module, mesh, dims, **fsdp_kwargs) -> None:
    """FSDP2 on every ``Experts`` module over what EP leaves of the shard group (``dp_shard_mod_ep``,
    with ``dp_replicate`` under HSDP), before the blocks are sharded over the whole group.

    An expert's gradient arrives summed over the ep ranks' tokens (the all-to-all's backward), and
    FSDP2 would divide it only by its own group's size: the divisor is set to the whole
    data-parallel degree, the same mean as every other weight's: as sum reductions and a separate
    division where there is a reduce-scatter (gloo has no pre-multiplied sum). Not on a group of
    one: there torch 2.13 divides its copy by the factor, then once more after (grads / ep**2)."""
    from torch.distributed.fsdp import fully_shard

    names = ("dp_replicate", "dp_shard_mod_ep") if dims.dp_replicate > 1 else ("dp_shard_mod_ep",)
    for module in model.modules():
        if isinstance(module, Experts):
            sharded = fully_shard(module, mesh=mesh[names], **fsdp_kwargs)
            sharded.set_gradient_divide_factor(float(dims.dp_replicate * dims.dp_shard * dims.cp))
            sharded.set_force_sum_reduction_for_comms(mesh["dp_shard_mod_ep"].size() > 1)


class ExpertExchange:
    """The all-to-all ``Experts.exchange`` of one ep group (shared by every MoE layer)."""

    def __init__(self, mesh) -> None:
        self.group = mesh.get_group()
        self.size = mesh.size()

    def __call__(self, x: torch.Tensor, counts: torch.Tensor, weights, ffn) -> torch.Tensor:
        """``x`` (N, d) sorted by global expert with ``counts`` (E,) -> the experts' outputs, same order."""
        import torch.distributed as dist
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        local = counts.numel() // self.size
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)  # rows per (source rank, my expert)
        received = received.view(self.size, local)
        send = counts.view(self.size, local).sum(1).tolist()
        recv = received.sum(1).tolist()
        rows = all_to_all_single_autograd(x, recv, send, self.group)
        # arrivals come in (source rank, local expert) blocks: regroup them expert by expert
        expert = torch.arange(local, device=x.device).repeat(self.size).repeat_interleave(received.reshape(-1))
        order = expert.argsort(stable=True)
        local_weights = [w.to_local() if hasattr(w, "to_local") else w for w in weights]
        y = ffn(rows[order], received.sum(0), *local_weights)
        y = y[order.argsort()]  # back to arrival order, then home
        return all_to_all_single_autograd(y, send, recv, self.group)
