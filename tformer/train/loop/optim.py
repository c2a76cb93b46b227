"""AdamW with decay on matrices only (or Muon for the blocks' matrices: parallel/muon.py), and the
LR schedules (warmup + cosine / linear / constant / WSD, and the paper's inverse square root)."""

from __future__ import annotations

import math

import torch

from ...parallel.muon import build_muon, muon_group_settings
from ..config import OptimConfig


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Matrices (weights of linears and embeddings) decay; biases, norm gains, 1-D params don't."""
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(
    model: torch.nn.Module, cfg: OptimConfig, device: torch.device, allow_fused: bool = True
) -> torch.optim.Optimizer:
    fused = cfg.fused
    if fused is None:
        fused = allow_fused and device.type in ("cuda", "cpu")  # torch >= 2.4: fused AdamW on both
    if cfg.name == "muon":
        return build_muon(model, cfg, fused)
    return torch.optim.AdamW(
        param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=fused
    )


def optimizer_figures(optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """A logging step's figures of the optimizer: under ``optim.muon.qk_clip`` the step's largest
    attention logit over every head, layer and rank (before the clip; kept on the device, read here)."""
    clip = getattr(optimizer, "qk_clip", None)
    if clip is None or clip.last_max is None:
        return {}
    return {"max_logit": float(clip.last_max)}


def lr_factor(step: int, total: int, cfg: OptimConfig) -> float:
    """Multiplier of the peak LR at optimizer step ``step`` (0-based) of ``total``.

    ``inverse_sqrt`` is the paper's schedule: with ``t = step + 1``, ``min(t / warmup, sqrt(warmup / t))``
    (linear warmup, then decay as 1/sqrt(t)). The paper's ``d_model**-0.5 * min(t**-0.5, t *
    warmup**-1.5)`` is this with peak ``lr = (d_model * warmup)**-0.5`` (7.0e-4 for 512 and 4000)."""
    warm = cfg.warmup_steps
    if cfg.schedule == "inverse_sqrt":
        t = step + 1
        return min(t / warm, math.sqrt(warm / t))
    if warm and step < warm:
        return (step + 1) / warm
    floor = cfg.min_lr_ratio
    if cfg.schedule == "constant":
        return 1.0
    if cfg.schedule == "wsd":  # warmup - stable - decay (linear) over the last decay_steps
        decay = cfg.decay_steps if cfg.decay_steps is not None else max(1, total // 5)
        start = total - decay
        if step < start:
            return 1.0
        return 1.0 - (1.0 - floor) * min(1.0, (step - start + 1) / decay)
    progress = min(1.0, (step - warm) / max(1, total - warm))
    if cfg.schedule == "linear":
        return 1.0 - (1.0 - floor) * progress
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, total_steps, cfg))


def apply_optim_config(optimizer: torch.optim.Optimizer, scheduler, o: OptimConfig) -> None:
    """A loaded optimizer and schedule carry the hyperparameters they were saved with; under
    ``resume_changes=allow`` this run's ``optim`` section replaces them (the moments stay): AdamW's
    groups (matrices, then the rest) and Muon's group (its own lr and decay)."""
    decays = [o.weight_decay, 0.0]  # the groups of param_groups: matrices, then the rest
    for group, decay in zip(optimizer.param_groups, decays):
        group.update(betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=decay, initial_lr=o.lr)
    peaks = [o.lr] * len(optimizer.param_groups)
    for i, group in enumerate(optimizer.param_groups):
        if group.get("muon"):
            fresh = muon_group_settings(o)
            group.update(fresh, initial_lr=fresh["lr"])
            peaks[i] = fresh["lr"]
    scheduler.base_lrs = peaks
    for group, factor in zip(optimizer.param_groups, scheduler.lr_lambdas):
        group["lr"] = group["initial_lr"] * factor(scheduler.last_epoch)
