"""Mixture-of-experts FFN: a router, experts stacked as ``(num_experts, ...)`` parameters, and the
steps between them as separate functions so an expert-parallel wrapper can replace the local
``dispatch`` / ``combine`` with all-to-all exchanges and keep the rest.

One forward: ``route`` (router logits -> top-k experts and weights, capacity mask) -> ``dispatch``
(assignments sorted by expert, tokens gathered into that order) -> ``Experts`` (grouped matmuls
over contiguous per-expert slices) -> ``combine`` (weighted scatter-add back to token order).
Routing math follows HF's Mixtral / Qwen2-MoE / Switch blocks so the exporters are name maps.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ..config import MoEConfig
from .ffn import FFN_KINDS, FeedForward

__all__ = [
    "MoEConfig",
    "MoEFeedForward",
    "Experts",
    "Routing",
    "Dispatch",
    "route",
    "capacity_mask",
    "dispatch",
    "combine",
    "load_balancing_loss",
    "router_z_loss",
    "routing_sums",
    "routing_losses",
    "RoutingPool",
    "grouped_mm_ok",
    "AttachAux",
    "sigmoid_route",
    "update_score_bias",
    "sequence_balance_loss",
]


@dataclass
class Routing:
    """The router's decision for T tokens: ``experts`` / ``weights`` (T, k) (a dropped assignment
    keeps its expert and gets ``keep`` False), ``logits`` / ``probs`` (T, E) in fp32."""

    logits: torch.Tensor
    probs: torch.Tensor
    experts: torch.Tensor
    weights: torch.Tensor
    keep: torch.Tensor | None


@dataclass
class Dispatch:
    """Kept assignments in expert order: ``token`` (N,) the token of each row, ``weight`` (N,) its
    routing weight, ``counts`` (E,) rows per expert (each expert's rows are contiguous)."""

    token: torch.Tensor
    weight: torch.Tensor
    counts: torch.Tensor


def route(logits: torch.Tensor, cfg: MoEConfig, group_size: int, score_bias: torch.Tensor | None = None) -> Routing:
    """Top-k experts and weights from fp32 router ``logits`` (T, E); tokens come in groups of
    ``group_size`` (one sequence) for capacity routing. ``score_bias`` (E,): sigmoid routing's
    loss-free balancing bias (``sigmoid_route``)."""
    if cfg.router_score == "sigmoid":
        probs, experts, weights = sigmoid_route(logits, cfg, score_bias)
    else:
        probs, experts, weights = softmax_route(logits, cfg)
    if cfg.routed_scaling_factor != 1.0:
        weights = weights * cfg.routed_scaling_factor
    keep = None
    capacity = expert_capacity(cfg, group_size)
    if capacity is not None:
        keep = capacity_mask(experts.view(-1, group_size, cfg.top_k), cfg.num_experts, capacity).reshape(experts.shape)
    return Routing(logits, probs, experts, weights, keep)


def sigmoid_route(
    logits: torch.Tensor, cfg: MoEConfig, score_bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's routing (its paper's eqs. 12-16): each expert's score is ``sigmoid(logit)``;
    the choice reads ``score + score_bias``, first keeping the ``topk_group`` of ``n_group``
    groups whose two best biased scores sum highest, then the ``top_k`` best experts in those;
    the weights are the chosen experts' unbiased scores (renormalised to sum 1 with
    ``renormalize``). The bias steers the choice only, never a weight, so it needs no gradient
    (``tformer/train/balance.py`` moves it). ``probs`` (for the balance losses): the scores
    normalised per token, the paper's ``s'``."""
    scores = logits.sigmoid()
    choice = scores.detach() if score_bias is None else scores.detach() + score_bias
    if cfg.n_group > 1:
        grouped = choice.view(choice.shape[0], cfg.n_group, -1)
        best = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)  # (T, n_group)
        groups = best.topk(cfg.topk_group, dim=-1).indices
        allowed = torch.zeros_like(best, dtype=torch.bool).scatter_(1, groups, True)
        choice = choice.masked_fill(~allowed.repeat_interleave(grouped.shape[-1], dim=1), float("-inf"))
    experts = choice.topk(cfg.top_k, dim=-1).indices
    weights = scores.gather(1, experts)
    if cfg.renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return scores / scores.sum(-1, keepdim=True), experts, weights


def softmax_route(logits: torch.Tensor, cfg: MoEConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Softmax routing: Mixtral's over the top-k logits, or Switch's / Qwen2-MoE's over all."""
    probs = logits.softmax(-1)
    if cfg.router_softmax == "topk":
        top_logits, experts = logits.topk(cfg.top_k, dim=-1)
        weights = top_logits.softmax(-1)
    else:
        weights, experts = probs.topk(cfg.top_k, dim=-1)
        if cfg.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
    return probs, experts, weights


def expert_capacity(cfg: MoEConfig, group_size: int) -> int | None:
    if cfg.expert_capacity is not None:
        return cfg.expert_capacity
    if cfg.capacity_factor is None:
        return None
    return math.ceil(cfg.capacity_factor * group_size * cfg.top_k / cfg.num_experts)


@torch.no_grad()
def capacity_mask(experts: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """``experts`` (G, S, k) -> keep (G, S, k): an expert takes the first ``capacity`` assignments
    of each group, all first choices before any second choice, each choice in token order (for
    k = 1 exactly Switch's cumulative-sum priority)."""
    g, s, k = experts.shape
    order = experts.transpose(1, 2).reshape(g, k * s)  # choice-major: rank 0 of every token first
    one_hot = F.one_hot(order, num_experts)
    position = (one_hot.cumsum(1) * one_hot).sum(-1)  # 1-based place in its expert's queue
    return (position <= capacity).view(g, k, s).transpose(1, 2)


def expert_counts(ids: torch.Tensor, num_experts: int, weight: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.bincount(ids, weight, minlength=num_experts)`` for ids below ``num_experts``, of a
    shape that does not depend on the data (``scatter_add_`` into ``num_experts`` slots), so that
    compile traces it without a graph break. Exact: integer counts, or sums of 0/1 weights."""
    if weight is None:
        return torch.zeros(num_experts, dtype=torch.long, device=ids.device).scatter_add_(0, ids, torch.ones_like(ids))
    return torch.zeros(num_experts, dtype=weight.dtype, device=ids.device).scatter_add_(0, ids, weight)


def dispatch(routing: Routing, num_experts: int) -> Dispatch:
    """Sort the kept (token, choice) assignments by expert (stable: token order inside each)."""
    k = routing.experts.shape[-1]
    ids = routing.experts.reshape(-1)
    if routing.keep is not None:
        ids = ids.masked_fill(~routing.keep.reshape(-1), num_experts)  # dropped rows sort last
    counts = expert_counts(ids, num_experts + 1)[:num_experts]
    order = ids.argsort(stable=True)
    if routing.keep is not None:
        order = order[: int(counts.sum())]
    return Dispatch(order // k, routing.weights.reshape(-1)[order], counts)


def combine(y: torch.Tensor, plan: Dispatch, num_tokens: int) -> torch.Tensor:
    """Expert outputs (N, d) in dispatch order -> (T, d): each row times its weight, summed per
    token; a token with no kept assignment gets zeros (the residual carries it on)."""
    out = y.new_zeros(num_tokens, y.shape[-1])
    return out.index_add_(0, plan.token, y * plan.weight.to(y.dtype)[:, None])


def grouped_mm_ok(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes these operands: fp32/bf16 (fp16 too on CUDA), every row
    stride a multiple of 16 bytes (torch 2.13's CPU kernel refuses others), all on one device."""
    if not hasattr(torch, "_grouped_mm") or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    if x.dtype == torch.float16 and x.device.type != "cuda":
        return False
    if x.dtype != torch.bfloat16 and torch.compiler.is_compiling():
        return False  # torch 2.13's meta kernel (what compile traces with) takes bf16 operands only
    align = 16 // x.element_size()
    return all(w.dtype == x.dtype and w.device == x.device and w.shape[-1] % align == 0 for w in weights) and (
        x.shape[-1] % align == 0
    )


class _DenseGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient dense: ``_grouped_mm``'s CPU backward
    refuses the stride-0 gradient that ``.sum()`` hands back ("Invalid strides/sizes")."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def expert_matmul(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, grouped: bool) -> torch.Tensor:
    """Rows of ``x`` (N, in) in expert order times their expert's ``w[e]`` (E, out, in) transposed.

    ``grouped``: one ``torch._grouped_mm`` call; else one matmul per expert on its contiguous slice
    (no padding). Both give the same numbers (tests/test_moe.py)."""
    if grouped:
        offs = counts.cumsum(0).to(torch.int32)
        return _DenseGrad.apply(torch._grouped_mm(x, w.transpose(-2, -1), offs=offs))
    pieces = x.split(counts.tolist())
    return torch.cat([p @ we.t() for p, we in zip(pieces, w.unbind(0))])


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """gpt-oss's gated activation: the gate clamped from above and the up projection both ways at
    ``limit``, then ``(up + 1) * gate * sigmoid(alpha * gate)``."""
    gate = gate.clamp(max=limit)
    return (up.clamp(-limit, limit) + 1) * gate * torch.sigmoid(alpha * gate)


class Experts(nn.Module):
    """``num_experts`` FFNs of one kind, weights stacked in HF's ``(E, out, in)`` layout: ``up``
    (and ``gate`` for gated kinds) ``(E, d_expert, d_model)``, ``down`` ``(E, d_model, d_expert)``;
    with ``bias`` (gpt-oss) ``up_bias`` / ``gate_bias`` ``(E, d_expert)``, ``down_bias``
    ``(E, d_model)``. ``swiglu_limit``: gpt-oss's clamped SwiGLU (``clamped_swiglu``)."""

    def __init__(
        self,
        num_experts: int,
        d_model: int,
        d_expert: int,
        activation,
        bias: bool = False,
        swiglu_limit: float | None = None,
        swiglu_alpha: float = 1.702,
    ) -> None:
        super().__init__()
        self.act, self.gated = FFN_KINDS[activation]
        if swiglu_limit is not None and activation != "swiglu":
            raise ValueError(f"swiglu_limit is gpt-oss's clamped SwiGLU; the experts' activation is {activation!r}")
        self.limit, self.alpha = swiglu_limit, swiglu_alpha
        shape = (num_experts, d_expert, d_model)
        self.gate = nn.Parameter(torch.empty(shape)) if self.gated else None
        self.up = nn.Parameter(torch.empty(shape))
        self.down = nn.Parameter(torch.empty(num_experts, d_model, d_expert))
        self.gate_bias = nn.Parameter(torch.zeros(num_experts, d_expert)) if bias and self.gated else None
        self.up_bias = nn.Parameter(torch.zeros(num_experts, d_expert)) if bias else None
        self.down_bias = nn.Parameter(torch.zeros(num_experts, d_model)) if bias else None
        # None: grouped matmuls where the operands allow them, else the per-expert loop; set False
        # to force the loop (tests compare the two; bench/bench_moe.py times them)
        self.grouped: bool | None = None
        # Set from outside (expert parallelism, tformer/parallel/ep.py): ``exchange(x, counts,
        # weights, ffn)`` takes the rows for every expert, sends each to the rank that holds its
        # expert, runs ``ffn(rows, counts, *weights)`` there on the local experts, and brings the
        # outputs back in ``x``'s order. Called inside this module's forward, so hooks that gather
        # the weights before it (FSDP2) have run.
        self.exchange: Callable | None = None

    def init_weights(self, std: float, down_std: float) -> None:
        for w in (self.gate, self.up):
            if w is not None:
                nn.init.normal_(w, 0.0, std)
        nn.init.normal_(self.down, 0.0, down_std)
        for b in (self.gate_bias, self.up_bias, self.down_bias):
            if b is not None:
                nn.init.zeros_(b)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``x`` (N, d) sorted by expert, ``counts`` (E,) rows per expert -> (N, d)."""
        weights: tuple[torch.Tensor | None, ...] = (self.gate, self.up, self.down)
        if self.up_bias is not None:
            weights += (self.gate_bias, self.up_bias, self.down_bias)
        if self.exchange is not None:
            return self.exchange(x, counts, weights, self.ffn)
        return self.ffn(x, counts, *weights)

    def ffn(self, x: torch.Tensor, counts: torch.Tensor, gate, up, down, *biases) -> torch.Tensor:
        """The experts' FFNs on rows sorted by expert, with the given (stacked) weights and biases:
        this module's own, or under expert parallelism the rank's slice of them."""
        gate_b, up_b, down_b = biases or (None, None, None)
        if torch.is_autocast_enabled(x.device.type):
            # autocast leaves ``_grouped_mm`` in fp32 (as the weights are); the per-expert matmuls
            # it casts: both paths in its dtype, biases too, as autocast runs a biased linear
            dtype = torch.get_autocast_dtype(x.device.type)
            x = x.to(dtype)
            gate, up, down, gate_b, up_b, down_b = (
                w if w is None else w.to(dtype) for w in (gate, up, down, gate_b, up_b, down_b)
            )
        present = [w for w in (gate, up, down) if w is not None]
        grouped = grouped_mm_ok(x, *present) if self.grouped is None else self.grouped

        def project(rows, w, b):
            out = expert_matmul(rows, w, counts, grouped)
            return out if b is None else out + b.repeat_interleave(counts, dim=0, output_size=rows.shape[0])

        h = project(x, up, up_b)
        if gate is None:
            h = self.act(h)
        elif self.limit is not None:
            h = clamped_swiglu(project(x, gate, gate_b), h, self.limit, self.alpha)
        else:
            h = self.act(project(x, gate, gate_b)) * h
        return project(h, down, down_b)


def load_balancing_loss(probs: torch.Tensor, experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Switch / Mixtral balance loss ``E * sum_e f_e * P_e`` over T tokens: ``f_e`` the fraction of
    tokens that chose expert e among their top k (before capacity), ``P_e`` its mean router
    probability. 1 when perfectly balanced at k = 1 (k at top-k, as HF's Mixtral writes it)."""
    tokens = probs.shape[0]
    f = expert_counts(experts.reshape(-1), num_experts).to(probs.dtype) / tokens
    return num_experts * (f * probs.mean(0)).sum()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's z-loss: the mean over tokens of ``logsumexp(logits)**2``."""
    return torch.logsumexp(logits, dim=-1).square().mean()


def routing_sums(
    probs: torch.Tensor, logits: torch.Tensor, experts: torch.Tensor, weight: torch.Tensor | None = None
) -> torch.Tensor:
    """What the balance and z-losses need of T tokens (``probs``, ``logits`` (T, E), ``experts``
    (T, k)), as sums (2E + 2,): assignments per expert (no gradient), router probability per expert,
    ``logsumexp(logits)**2``, tokens. ``weight`` (T,): 1 for a token that counts, 0 for one that
    does not (a layout's padding; None: all count). Sums of parts of a group held by different ranks
    add up to the group's (``routing_losses``)."""
    num_experts = probs.shape[-1]
    z = torch.logsumexp(logits, dim=-1).square()
    if weight is None:
        counts = expert_counts(experts.reshape(-1), num_experts).to(probs.dtype)
        tokens = torch.full((1,), probs.shape[0], dtype=probs.dtype, device=probs.device)
        return torch.cat((counts, probs.sum(0), z.sum()[None], tokens))
    weight = weight.to(probs.dtype)
    per_choice = weight[:, None].expand(experts.shape).reshape(-1)
    counts = expert_counts(experts.reshape(-1), num_experts, per_choice).to(probs.dtype)
    # weighted sums, not matmuls: autocast would run those in bf16
    return torch.cat((counts, (probs * weight[:, None]).sum(0), (z * weight).sum()[None], weight.sum()[None]))


def routing_losses(sums: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(balance loss, z-loss, assignments per expert) of a group of T tokens from its
    ``routing_sums``: ``E * sum_e (count_e / T) * (sum of p_e / T)`` (``load_balancing_loss``) and
    the mean of ``logsumexp**2`` (``router_z_loss``)."""
    e = (sums.shape[0] - 2) // 2
    counts, prob_sums, z_sum, tokens = sums[:e].detach(), sums[e : 2 * e], sums[2 * e], sums[2 * e + 1].detach()
    return e * (counts * prob_sums).sum() / tokens.square(), z_sum / tokens, counts


class RoutingPool(Protocol):
    """What a layout that splits or pads sequences sets as ``MoEFeedForward.pool_routing``
    (``tformer/parallel/routing.py``), so that the routing losses are those of whole sequences."""

    def real_tokens(self, length: int, device: torch.device) -> torch.Tensor | None:
        """(length,) 1 at the positions of this rank's part of a sequence that hold real tokens, 0 at
        the layout's padding; None where there is none."""
        ...

    def __call__(self, sums: torch.Tensor) -> torch.Tensor:
        """``routing_sums`` of this rank's part, added over every rank that holds part of the same
        sequences (with gradient: autograd adds their gradients back)."""
        ...


class MoEFeedForward(nn.Module):
    """Routed experts (+ shared experts, optionally sigmoid-gated) in place of the dense FFN.

    After each forward, ``aux_loss`` holds ``aux_loss_coef * balance + z_loss_coef * z`` (with
    gradient, for the family's training loss) and ``stats`` the detached figures to log:
    ``balance_loss``, ``z_loss``, ``tokens_max_over_mean`` (assignments per expert before capacity),
    ``dropped_fraction`` (assignments over capacity).

    Both losses are computed over the tokens of the forward's micro-batch, its whole sequences:
    where a layout splits those over ranks or pads them (context parallelism, sequence
    parallelism), ``pool_routing`` makes them the same figures as on one process."""

    def __init__(self, cfg: MoEConfig, d_model: int, d_ff: int, activation, dropout: float = 0.0) -> None:
        super().__init__()
        self.cfg = cfg
        kind = cfg.activation or activation
        d_expert = cfg.d_expert or d_ff
        self.router = nn.Linear(d_model, cfg.num_experts, bias=cfg.router_bias)
        self.experts = Experts(cfg.num_experts, d_model, d_expert, kind, cfg.expert_bias, cfg.swiglu_limit, cfg.swiglu_alpha)
        width = cfg.num_shared_experts * (cfg.d_shared or d_expert)
        self.shared = FeedForward(d_model, width, kind, bias=False) if width else None
        self.shared_gate = nn.Linear(d_model, 1, bias=False) if width and cfg.shared_gate else None
        self.dropout = nn.Dropout(dropout)
        # Sigmoid routing's loss-free balancing bias (HF's ``e_score_correction_bias``): state, not
        # a parameter, so no optimizer touches it; saved with the weights; moved after each
        # optimizer step from ``load`` (tformer/train/balance.py, ``update_score_bias``)
        self.register_buffer("score_bias", torch.zeros(cfg.num_experts) if cfg.score_bias else None)
        # Assignments per expert (E,) of this rank's training forwards since the last bias update,
        # a plain attribute, not a buffer: DDP would broadcast rank 0's over the others'
        self.load: torch.Tensor | None = None
        self.aux_loss: torch.Tensor | None = None
        self.stats: dict[str, torch.Tensor] = {}
        # Set from outside where a layout splits or pads the sequences (``RoutingPool``): while
        # training, the routing losses are then those of the whole micro-batch's real tokens
        self.pool_routing: RoutingPool | None = None

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 logits (T, E), outside autocast: routing decisions are precision-sensitive (Switch's
        "selective precision")."""
        if self.training and self.cfg.jitter > 0:
            x = x * torch.empty_like(x).uniform_(1.0 - self.cfg.jitter, 1.0 + self.cfg.jitter)
        with torch.autocast(x.device.type, enabled=False):
            bias = self.router.bias.float() if self.router.bias is not None else None
            return F.linear(x.float(), self.router.weight.float(), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        group = shape[-2] if x.dim() == 3 else flat.shape[0]  # capacity per sequence
        routing = route(self.router_logits(flat), self.cfg, group, self._buffers["score_bias"])
        plan = dispatch(routing, self.cfg.num_experts)
        out = combine(self.experts(flat[plan.token], plan.counts), plan, flat.shape[0])
        if self.shared is not None:
            shared = self.shared(flat)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(flat)) * shared
            out = out + shared
        self._record(routing, plan, shape)
        return self.dropout(out.view(shape))

    def _record(self, routing: Routing, plan: Dispatch, shape: torch.Size) -> None:
        cfg = self.cfg
        pool = self.pool_routing if self.training else None
        if pool is None:
            sums = routing_sums(routing.probs, routing.logits, routing.experts)
        else:
            real = pool.real_tokens(shape[-2] if len(shape) == 3 else shape[0], routing.probs.device)
            weight = real.repeat(routing.probs.shape[0] // real.shape[0]) if real is not None else None
            sums = pool(routing_sums(routing.probs, routing.logits, routing.experts, weight))
        balance, z, chosen = routing_losses(sums)
        self.aux_loss = cfg.aux_loss_coef * balance + cfg.z_loss_coef * z
        if self.training and cfg.seq_aux_loss_coef and len(shape) == 3:
            if pool is None:
                seq_loss = sequence_balance_loss(routing, shape[0], cfg.top_k)
            else:  # the sequences' sums over the layout's parts (and without its pad) first
                seq_loss = pooled_sequence_balance_loss(routing, shape[0], cfg.top_k, pool, real)
            self.aux_loss = self.aux_loss + cfg.seq_aux_loss_coef * seq_loss
        if self.score_bias is not None and self.training and torch.is_grad_enabled() and not in_backward():
            load = expert_counts(routing.experts.reshape(-1), cfg.num_experts).float()
            self.load = load if self.load is None else self.load + load
        assignments = routing.experts.numel()
        self.stats = {
            "balance_loss": balance.detach(),
            "z_loss": z.detach(),
            "tokens_max_over_mean": (chosen.max() / chosen.mean()).detach(),
            "dropped_fraction": 1.0 - plan.counts.sum().float() / assignments,
        }


def in_backward() -> bool:
    """Inside autograd's backward: activation checkpointing recomputing a forward, whose routing
    is already counted (autograd's running graph task). Never while compiling: dynamo cannot trace
    the task id (a break there cut every routed block in two), and a compiled block's recomputation
    runs its graph, not the Python that adds to ``load`` (full and op-level checkpointing of
    compiled blocks count each load once: tests/test_zoo_layouts.py)."""
    return not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1


def sequence_balance_loss(routing: Routing, batch: int, top_k: int) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss (its eqs. 17-20), averaged over the batch's
    sequences: ``sum_e f_e * P_e`` with ``f_e = E / (k S)`` times the assignments to expert e in
    the sequence and ``P_e`` the sequence's mean normalised score ``s'``."""
    probs = routing.probs.view(batch, -1, routing.probs.shape[-1])  # (B, S, E)
    num_experts, seq = probs.shape[-1], probs.shape[1]
    chosen = F.one_hot(routing.experts.view(batch, -1), num_experts).sum(1).to(probs.dtype)  # (B, E)
    f = chosen * (num_experts / (top_k * seq))
    return (f * probs.mean(1)).sum(-1).mean()


def pooled_sequence_balance_loss(
    routing: Routing, batch: int, top_k: int, pool: RoutingPool, real: torch.Tensor | None
) -> torch.Tensor:
    """``sequence_balance_loss`` of sequences a layout holds in parts (``pool``: the sum over the
    ranks holding the other parts; ``real`` (S,): 1 on this part's real tokens, None: all): each
    sequence's assignments, summed scores and tokens are summed over the parts before the
    product, which is not linear in them."""
    probs = routing.probs.view(batch, -1, routing.probs.shape[-1])  # (B, S, E)
    num_experts, seq = probs.shape[-1], probs.shape[1]
    weight = real.to(probs.dtype) if real is not None else probs.new_ones(seq)
    per_choice = weight.repeat_interleave(routing.experts.shape[-1])[None, :, None]  # (1, S k, 1)
    chosen = (F.one_hot(routing.experts.view(batch, -1), num_experts).to(probs.dtype) * per_choice).sum(1)
    tokens = weight.sum().expand(batch, 1)
    sums = pool(torch.cat((chosen, (probs * weight[None, :, None]).sum(1), tokens), -1))
    chosen, prob_sums, tokens = sums[:, :num_experts].detach(), sums[:, num_experts:-1], sums[:, -1:].detach()
    return ((chosen * (num_experts / top_k)) * prob_sums / tokens.square()).sum(-1).mean()


@torch.no_grad()
def update_score_bias(bias: torch.Tensor, load: torch.Tensor, rate: float) -> None:
    """The loss-free balancing step (DeepSeek-V3 section 2.1.2): an expert with more than the mean
    load gets its bias lowered by ``rate``, one with less raised by ``rate``. ``load`` (E,) must be
    the step's assignments summed over every rank that routed tokens (a sum over replicas is a
    common factor, which the sign ignores)."""
    bias.add_(torch.sign(load.mean() - load), alpha=rate)


def moe_layers(model: nn.Module) -> list[MoEFeedForward]:
    return [m for m in model.modules() if isinstance(m, MoEFeedForward)]


def moe_aux_loss(model: nn.Module, num_layers: int | None = None) -> torch.Tensor | None:
    """The MoE layers' ``aux_loss`` of the last forward summed and divided by ``num_layers``, the
    whole model's MoE layer count (default: those present), so a pipeline stage's part of the mean
    is the same share it is in the unsplit model (None without MoE layers here). A mean, not a sum,
    so the coefficients mean the same at any depth (HF's Mixtral pools the layers' routing likewise)."""
    losses = [m.aux_loss for m in moe_layers(model) if m.aux_loss is not None]
    if not losses:
        return None
    return torch.stack(losses).sum() / (num_layers or len(losses))


class AttachAux(torch.autograd.Function):
    """``x`` unchanged, with ``aux`` (a scalar loss term) joining the backward through it: the
    gradient that reaches ``x`` flows on, and ``aux`` gets gradient 1, as a term added to the final
    loss would. For a pipeline stage before the last, whose MoE layers' auxiliary losses cannot be
    added to the loss computed on another rank."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.aux_dtype = aux.dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.ones((), dtype=ctx.aux_dtype, device=grad.device)


def moe_table(model: nn.Module) -> tuple[list[str], torch.Tensor] | None:
    """The routing figures of the last forward, every MoE layer's, as one device tensor (layers x
    figures) and the figures' names: read with the step's other figures in one read of the device."""
    layers = [m.stats for m in moe_layers(model) if m.stats]
    if not layers:
        return None
    keys = list(layers[0])
    rows = [torch.stack([torch.as_tensor(s[k], dtype=torch.float32).reshape(()) for k in keys]) for s in layers]
    return keys, torch.stack(rows)


def moe_figures(keys: list[str], rows: list[list[float]]) -> dict[str, float]:
    """The table's figures averaged over the layers (``tokens_max_over_mean`` also as its worst
    layer), for the trainer's metrics."""
    out = {f"moe/{k}": sum(r[i] for r in rows) / len(rows) for i, k in enumerate(keys)}
    out["moe/tokens_max_over_mean_worst"] = max(r[keys.index("tokens_max_over_mean")] for r in rows)
    return out


def moe_stats(model: nn.Module) -> dict[str, float]:
    """``moe_figures`` of the last forward, read here (one read)."""
    table = moe_table(model)
    if table is None:
        return {}
    keys, values = table
    return moe_figures(keys, values.tolist())
