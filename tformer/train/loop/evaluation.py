"""The evaluation loop: validation loss and perplexity (MLM accuracy, a mixture's loss per source),
through the pipeline schedule under ``parallel.pp``, and BLEU / chrF of decoded translations.

Plain functions of the trainer, which calls them from its ``evaluate`` and ``evaluate_bleu``
methods (those stay the trainer's public API, and tests replace ``Trainer.evaluate``). They see the
trainer through :class:`Evaluated`, the few fields and helpers they read, so this module never
imports ``trainer.py`` (which imports this)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sized
from typing import Any, Protocol, cast

import torch

from ...parallel.dist import DistInfo
from ...parallel.mesh import ParallelDims
from ...parallel.strategy import Pipeline, Strategy
from ..config import TrainConfig
from .data import RunData
from ..dist import all_reduce


class Evaluated(Protocol):
    """What evaluation reads of a run (``train.trainer.Trainer`` has it)."""

    @property
    def cfg(self) -> TrainConfig: ...
    @property
    def dist(self) -> DistInfo: ...
    @property
    def dims(self) -> ParallelDims: ...
    @property
    def data(self) -> RunData: ...
    @property
    def model(self) -> torch.nn.Module: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def strategy(self) -> Strategy: ...

    def evaluate_bleu(self, samples: int | None = None) -> Any: ...
    def _autocast(self) -> contextlib.AbstractContextManager: ...
    def _pipeline(self) -> Pipeline: ...
    def _pad_for_sp(self, inputs: dict) -> dict: ...


@torch.no_grad()
def evaluate(trainer: Evaluated) -> dict:
    """Validation loss (and perplexity, MLM accuracy); with a mixture also ``val_loss/NAME`` per
    source, the overall loss then being over the tokens of every source's evaluated samples."""
    t = trainer
    sources = t.data.validation_sources or {None: t.data.validation}
    was_training = t.model.training
    t.model.eval()
    totals = {name: eval_sums(t, ds) for name, ds in sources.items()}
    t.model.train(was_training)
    total = sum(totals.values(), torch.zeros(3, dtype=torch.float64, device=t.device))
    loss = (total[0] / total[1].clamp(min=1)).item()
    result = {"val_loss": loss, "val_ppl": math.exp(min(loss, 50.0))}
    if t.data.validation_sources:
        for name, s in totals.items():
            result[f"val_loss/{name}"] = (s[0] / s[1].clamp(min=1)).item()
    if t.data.objective == "mlm" and t.dims.pp == 1:
        result["val_mlm_acc"] = (total[2] / total[1].clamp(min=1)).item()
    if t.cfg.eval_bleu:
        result.update(t.evaluate_bleu(t.cfg.bleu_samples).record())
    t.strategy.release_gathered()
    return result


def eval_sums(trainer: Evaluated, ds) -> torch.Tensor:
    """(loss sum, label count, correct) over the first validation samples of ``ds``, all ranks."""
    t, cfg = trainer, trainer.cfg
    # Every rank evaluates the same number of samples: sharded forwards (FSDP2, ZeRO-3) are
    # collective, so a rank with one batch fewer would leave the others waiting.
    world = t.dist.group_dp_size  # the tp ranks of a group evaluate the same samples
    if t.dims.pp > 1:
        return eval_sums_pipelined(t, ds)
    n = min(len(ds), max(cfg.eval_batches * cfg.micro_batch_size, world))
    n -= n % world
    keys = list(range(t.dist.group_dp_rank, n, world))
    total = torch.zeros(3, dtype=torch.float64, device=t.device)  # loss sum, tokens, correct
    for i in range(0, len(keys), cfg.micro_batch_size):
        batch = t.data.collator([ds[k] for k in keys[i : i + cfg.micro_batch_size]])
        inputs = t._pad_for_sp({k: batch[k].to(t.device) for k in t.data.model_inputs if k in batch})
        with t._autocast():
            out = t.model(**inputs)
        mask = inputs["labels"] != -100
        count = mask.sum()
        total[0] += out.loss.double() * count
        total[1] += count
        total[2] += ((out.logits.argmax(-1) == inputs["labels"]) & mask).sum()
    all_reduce(total)
    return total


def eval_sums_pipelined(trainer: Evaluated, ds) -> torch.Tensor:
    """(loss sum, label count, 0) through the pipeline schedule (forward only), in whole steps of
    ``grad_accum`` micro-batches per data-parallel rank; each micro-batch's loss is weighted by
    its labelled tokens, as the unsplit evaluation weights its batches (no logits: no accuracy)."""
    t, cfg = trainer, trainer.cfg
    world, chunk = t.dist.group_dp_size, cfg.micro_batch_size * cfg.grad_accum
    n = min(len(ds), max(cfg.eval_batches * cfg.micro_batch_size, world * chunk))
    n -= n % (world * chunk)
    keys = list(range(t.dist.group_dp_rank, n, world))
    total = torch.zeros(3, dtype=torch.float64, device=t.device)
    for i in range(0, len(keys), chunk):
        batch = t.data.collator([ds[k] for k in keys[i : i + chunk]])
        inputs = t._pad_for_sp({k: batch[k].to(t.device) for k in t.data.model_inputs if k in batch})
        with t._autocast(), t.strategy.loss_context():
            losses = t._pipeline().run(inputs, train=False)
        if t._pipeline().is_last_stage:
            counts = (inputs["labels"] != -100).reshape(cfg.grad_accum, -1).sum(-1)
            total[0] += (torch.stack([x.double() for x in losses]) * counts).sum()
            total[1] += counts.sum()
    all_reduce(total)
    return total


def evaluate_bleu(trainer: Evaluated, samples: int | None = None):
    """BLEU / chrF of the first ``samples`` validation pairs, decoded with ``cfg.decode``. Every
    rank decodes the same pairs (sharded forwards are collective); the scores are identical."""
    from .decoding import decoded_bleu

    t = trainer
    ds = cast(Sized, t.data.validation)
    n = len(ds) if samples is None else min(samples, len(ds))
    was_training = t.model.training
    with t._autocast():
        result = decoded_bleu(t.cfg.decode, t.model, ds, t.data.tokenizer, n, device=t.device)
    t.model.train(was_training)
    return result
