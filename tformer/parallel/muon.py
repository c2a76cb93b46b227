"""Muon (Keller Jordan's "MomentUm Orthogonalized by Newton-schulz", as scaled by Moonlight and Kimi K2)
for the blocks' weight matrices, AdamW for every other parameter, in one ``torch.optim`` optimizer.

Which parameters: the 2-D weights of the ``nn.Linear`` layers inside a ``TransformerStack``
(attention's q/k/v/o, the FFN's, shared experts') and the 3-D expert stacks (each expert
orthogonalised on its own) take Muon; embeddings, the head (it sits outside the stacks), norms,
biases, the MoE router and the shared experts' gate take AdamW (``optim.*``), as Moonlight does.

The step composes torch's own pieces (``torch.optim._muon``): its Newton-Schulz iteration (its
coefficients, steps and eps), its learning-rate adjustment by shape, and AdamW's ``_init_group`` and
functional ``adam`` for the AdamW groups, so a one-process run is bitwise ``torch.optim.Muon`` +
``torch.optim.AdamW`` (``tests/test_muon.py``). What torch's Muon lacks is layout: a matrix must be
whole to be orthogonalised; ``newton_schulz.orthogonalise`` gathers sharded ones (FSDP2, TP) to one
owner rank each, balanced, and scatters the update back; EP's experts are whole on their rank.

The momentum buffer is the parameter's shape and layout (a DTensor shard under FSDP2 / TP / EP),
so DCP saves and reshards it like Adam's moments.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.optim._muon import _adjust_lr
from torch.optim.adam import adam

from ..config import ConfigError
from ..nn.block import TransformerStack
from ..nn.moe import Experts, MoEFeedForward
from .newton_schulz import orthogonalise
from .qk_clip import QKClip

# optim.muon.adjust -> torch's adjust_lr_fn (any other name is torch's factor 1.0)
TORCH_ADJUST = {"match_adamw": "match_rms_adamw", "spectral": "original", "none": "none"}


def muon_parameters(model: nn.Module) -> list[torch.Tensor]:
    """The parameters Muon updates: the 2-D weights of the linear layers inside the transformer
    stacks, except the MoE routers and shared-expert gates, and the experts' 3-D stacks."""
    skip: set[int] = set()
    for module in model.modules():
        if isinstance(module, MoEFeedForward):
            skip.update(id(m) for m in (module.router, module.shared_gate) if m is not None)
    chosen: dict[int, torch.Tensor] = {}
    for stack in model.modules():
        if not isinstance(stack, TransformerStack):
            continue
        for module in stack.modules():
            if isinstance(module, nn.Linear) and id(module) not in skip and module.weight.requires_grad:
                chosen[id(module.weight)] = module.weight
            elif isinstance(module, Experts):
                chosen.update({id(w): w for w in (module.gate, module.up, module.down) if w is not None})
    return list(chosen.values())


def param_groups(model: nn.Module, optim: Any) -> list[dict]:
    """AdamW's two groups (matrices decay, the rest not: ``train/optim.param_groups``' rule) over what
    Muon does not take, then Muon's group. ``optim`` is the run's ``optim`` section."""
    muon = muon_parameters(model)
    taken = {id(p) for p in muon}
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in taken]
    return [
        {"params": [p for p in rest if p.dim() >= 2], "weight_decay": optim.weight_decay, "muon": False},
        {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0, "muon": False},
        {"params": muon, "muon": True, **muon_group_settings(optim)},
    ]


def muon_group_settings(optim: Any) -> dict[str, Any]:
    """Muon's group's hyperparameters from the run's ``optim`` section (lr and decay default to AdamW's)."""
    m = optim.muon
    return {
        "lr": m.lr if m.lr is not None else optim.lr,
        "weight_decay": m.weight_decay if m.weight_decay is not None else optim.weight_decay,
        "momentum": m.momentum,
        "nesterov": m.nesterov,
        "ns_steps": m.ns_steps,
        "ns_dtype": m.ns_dtype,
        "adjust": m.adjust,
    }


def adjusted_lr(lr: float, adjust: str, shape: torch.Size) -> float:
    """``lr`` scaled by a matrix's shape (torch's ``_adjust_lr``); an expert stack by one expert's."""
    return _adjust_lr(lr, TORCH_ADJUST[adjust], shape[-2:])


def ns_dtype(name: str, device: torch.device) -> torch.dtype:
    """``optim.muon.ns_dtype`` on ``device``: auto = bf16 (torch's) on a GPU, fp32 on a CPU."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return torch.bfloat16 if name == "bf16" else torch.float32


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (an alias: in-place ops reach the DTensor), else ``t``."""
    return t.to_local() if hasattr(t, "to_local") else t


class MuonAdamW(torch.optim.AdamW):
    """Muon on the groups marked ``muon``, AdamW (torch's, unchanged) on the others.

    Muon's step per matrix ``W`` with gradient ``G`` and buffer ``B`` (torch's ``_single_tensor_muon``):
    ``B = lerp(B, G, 1 - momentum)``; ``U = lerp(G, B, momentum)`` (Nesterov) or ``B``; ``O =
    NS(U)``; ``W *= 1 - lr * weight_decay``; ``W -= adjusted_lr * O``. ``found_inf`` (set by the
    trainer's step that never reads the host) leaves weights and buffers as they were."""

    def __init__(self, groups: list[dict], lr: float, betas: tuple[float, float], eps: float, fused: bool | None):
        super().__init__(groups, lr=lr, betas=betas, eps=eps, fused=fused)
        self.qk_clip: QKClip | None = None  # optim.muon.qk_clip: run after every step
        for group in self.param_groups:
            if group["muon"]:
                group["fused"] = group["foreach"] = False  # no AdamW kernel runs on them
                bad = [tuple(p.shape) for p in group["params"] if p.dim() not in (2, 3)]
                if bad:
                    raise ValueError(f"Muon takes matrices and stacks of matrices, not shapes {bad}")

    def __setstate__(self, state: dict) -> None:
        """AdamW's (a loaded state's defaults, tensor step counts) for AdamW's groups only: Muon's
        parameters hold a momentum buffer and no step count."""
        muon = [g for g in state["param_groups"] if g.get("muon")]
        hidden = {p: state["state"].pop(p) for g in muon for p in g["params"] if p in state["state"]}
        super().__setstate__(state)
        self.state.update(hidden)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["muon"]:
                self._muon_step(group)
            else:
                self._adamw_step(group)
        if self.qk_clip is not None:
            self.qk_clip()
        return loss

    def _adamw_step(self, group: dict) -> None:
        """torch's ``Adam.step`` for one group (AdamW: ``decoupled_weight_decay``)."""
        params, grads, exp_avgs, exp_avg_sqs, max_sqs, steps = [], [], [], [], [], []  # type: ignore[var-annotated]
        has_complex = self._init_group(group, params, grads, exp_avgs, exp_avg_sqs, max_sqs, steps)
        beta1, beta2 = group["betas"]
        adam(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            max_sqs,
            steps,
            amsgrad=group["amsgrad"],
            has_complex=has_complex,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=group["maximize"],
            foreach=group["foreach"],
            capturable=group["capturable"],
            differentiable=group["differentiable"],
            fused=group["fused"],
            grad_scale=getattr(self, "grad_scale", None),
            found_inf=getattr(self, "found_inf", None),
            decoupled_weight_decay=group["decoupled_weight_decay"],
        )

    def _muon_step(self, group: dict) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        momentum, lr = group["momentum"], float(group["lr"])
        found = getattr(self, "found_inf", None)
        keep = None if found is None else found.to(params[0].device) == 0
        updates, olds = [], []
        for p in params:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
            buf, grad = local(state["momentum_buffer"]), local(p.grad)
            if keep is not None:
                olds.append((buf.clone(), local(p).clone()))
            buf.lerp_(grad, 1 - momentum)
            u = grad.lerp(buf, momentum) if group["nesterov"] else buf
            updates.append(u)
        dtype = ns_dtype(group["ns_dtype"], params[0].device)
        ortho = orthogonalise(params, updates, group["ns_steps"], dtype)
        for i, (p, o) in enumerate(zip(params, ortho)):
            w = local(p)
            w.mul_(1 - lr * group["weight_decay"])
            w.add_(o, alpha=-adjusted_lr(lr, group["adjust"], p.shape))
            if keep is not None:  # a non-finite step: weights and buffer as they were, on the device
                old_buf, old_w = olds[i]
                buf = local(self.state[p]["momentum_buffer"])
                buf.copy_(torch.where(keep, buf, old_buf))
                w.copy_(torch.where(keep, w, old_w))


def check_same_optimizer(saved: str, name: str, ckpt: Any) -> None:
    """A checkpoint's optimizer state belongs to its optimizer: AdamW's two moments per parameter
    are not Muon's momentum (nor the other way), so a switch at a resume is refused, even under
    ``resume_changes=allow``."""
    if saved != name:
        raise ConfigError(
            f"resuming {ckpt} would switch optim.name {saved} -> {name}: its optimizer state is {saved}'s; resume "
            f"with optim.name={saved}, or start a new run from its weights (tformer export, then import)"
        )


def build_muon(model: nn.Module, optim: Any, fused: bool | None) -> MuonAdamW:
    """The run's optimizer for ``optim.name=muon`` (``optim`` the run's ``optim`` section)."""
    opt = MuonAdamW(param_groups(model, optim), lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps, fused=fused)
    if optim.muon.qk_clip is not None:
        opt.qk_clip = QKClip(model, optim.muon.qk_clip)
    return opt
