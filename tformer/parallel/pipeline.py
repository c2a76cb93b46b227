"""Pipeline parallelism with ``torch.distributed.pipelining``, split from outside the model.

``parallel.pp`` stages, the outermost dimension of the mesh. Each stage is a copy of the model with
what the stage does not run removed; the blocks it keeps stay at their places in their stack's
``layers`` (the others become parameter-free placeholders), so every parameter name (FQN) equals
the unsplit model's: DCP checkpoints reshard between pp degrees, and consolidate / export see the
usual names.

- decoder and encoder: blocks divided as evenly as possible (or ``parallel.pp_layers``), embeddings
  on the first stage, final norm + head + loss on the last;
- encoder-decoder: split at the encoder/decoder boundary only (``pp=2``, Megatron's split): stage 0
  embeds and encodes, stage 1 receives the encoder output and runs the decoder, the head and the
  loss. A finer split would send the encoder output through every decoder stage, which the
  pipelining API's one-tensor-stream stages do not express well; it is refused in one line.

Weights used on two stages (the token embedding tied to the head of GPT-2/BERT/T5 v1.0, the
embedding T5 shares between encoder and decoder) live on both, start equal, get their gradients
summed over the pipeline group before the update (Megatron's embedding group), count once in the
gradient norm, and so stay equal.

Schedules: ``gpipe``, ``1f1b`` (one stage per rank) and ``interleaved_1f1b`` (``pp_stages_per_rank``
stages per rank, stage ``s`` on rank ``s % pp``). The pipeline's micro-batches are the step's
``grad_accum`` micro-batches of ``micro_batch_size`` samples (the same ones the unsplit run
accumulates over), and every stage receives the batch's masks and labels as keyword arguments (under
context parallelism also the shard's positions, decoder input and loss divisor: ``MODEL_KWARGS``).
The last stage computes the loss inside its forward (the head stays in the stage module, under its
FSDP2/TP hooks); the schedule's loss function passes it through.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from ..config import PP_SCHEDULES, ConfigError, ModelConfig
from ..models import spec_of
from ..models.base import ModelOutput
from ..models.base import stage_layers as stage_layers  # the models' own split, re-exported for the planner


def num_stages(pcfg) -> int:
    return pcfg.pp * (pcfg.pp_stages_per_rank if pcfg.pp_schedule == "interleaved_1f1b" else 1)


def check_pipeline(cfg: ModelConfig, pcfg, strategy: str) -> None:
    """One line for each pipeline layout that cannot be built, before any process group."""
    if pcfg.pp_schedule not in PP_SCHEDULES:
        raise ConfigError(f"parallel.pp_schedule={pcfg.pp_schedule!r} is not known; use one of: {', '.join(PP_SCHEDULES)}")
    if pcfg.pp == 1:
        return
    if strategy == "deepspeed":
        raise ConfigError(
            "parallel.pp does not compose with parallel.strategy=deepspeed (DeepSpeed has its own "
            "pipeline engine); use parallel.strategy=fsdp or ddp"
        )
    interleaved = pcfg.pp_schedule == "interleaved_1f1b"
    if interleaved and pcfg.pp_stages_per_rank < 2:
        raise ConfigError(
            f"parallel.pp_schedule=interleaved_1f1b needs parallel.pp_stages_per_rank >= 2 (got "
            f"{pcfg.pp_stages_per_rank}); set it, or use parallel.pp_schedule=1f1b"
        )
    if not interleaved and pcfg.pp_stages_per_rank != 1:
        raise ConfigError(
            f"parallel.pp_stages_per_rank={pcfg.pp_stages_per_rank} needs "
            "parallel.pp_schedule=interleaved_1f1b; set it, or parallel.pp_stages_per_rank=1"
        )
    stages = num_stages(pcfg)
    if len(spec_of(cfg).model.STACKS) > 1:
        if stages != 2 or pcfg.pp_layers:
            raise ConfigError(
                f"encoder-decoder models split only at the encoder/decoder boundary: "
                f"parallel.pp=2 with one stage per rank and no parallel.pp_layers (got {stages} "
                "stages); the decoder's every block needs the encoder output"
            )
        return
    blocks = cfg.num_layers
    if pcfg.pp_layers:
        layers = pcfg.pp_layers
        if (
            len(layers) != stages
            or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in layers)
            or sum(layers) != blocks
        ):
            raise ConfigError(
                f"parallel.pp_layers={layers} must list {stages} positive block counts (one per "
                f"stage) that add up to the model's {blocks} blocks"
            )
    elif stages > blocks:
        raise ConfigError(
            f"{stages} pipeline stages (parallel.pp={pcfg.pp}"
            f"{f' x pp_stages_per_rank={pcfg.pp_stages_per_rank}' if interleaved else ''}) exceed the "
            f"model's {blocks} blocks; lower parallel.pp or use a deeper model"
        )
    elif interleaved and blocks % stages:
        raise ConfigError(
            f"parallel.pp_schedule=interleaved_1f1b with {stages} stages does not divide the "
            f"model's {blocks} blocks evenly; change parallel.pp_stages_per_rank or give "
            "parallel.pp_layers"
        )


def build_stage(model, stage: int, stages: int, pp_layers: list | None, label_smoothing: float) -> nn.Module:
    """Stage ``stage`` of ``stages``: a copy of ``model`` cut by its own ``cut_stage``; its one
    forward runs what is left. The last stage is called as the schedule needs it, through torch's
    module hooks (its parameter names must stay the model's, so it is not wrapped): the trainer's
    loss-only path (``return_logits=False``, the run's label smoothing in training) in, the loss tensor out."""
    part = copy.deepcopy(model)
    part.cut_stage(stage, stages, pp_layers)
    part.pp_aux = []  # a stage before the last: its auxiliary losses of the step (_attach_aux)
    if stage == stages - 1:
        part.register_forward_pre_hook(_loss_call(label_smoothing), with_kwargs=True)
        part.register_forward_hook(_loss_only)
    elif model.config.moe.enabled:
        part.register_forward_hook(_attach_aux)
    return part


def _loss_call(label_smoothing: float):
    # evaluation scores the plain cross-entropy, as the unsplit model's evaluation does
    def hook(module, args, kwargs):
        return args, {**kwargs, "return_logits": False, "label_smoothing": label_smoothing if module.training else 0.0}

    return hook


def _loss_only(_module, _args, output: ModelOutput) -> torch.Tensor | None:
    return output.loss


def _attach_aux(module, _args, h: torch.Tensor) -> torch.Tensor:
    """A stage before the last: its MoE layers' share of the auxiliary loss joins the backward
    through its output (``AttachAux``), and its value waits in ``pp_aux`` for the logged loss."""
    from ..nn.moe import AttachAux, moe_aux_loss

    if not module.training:
        return h
    aux = moe_aux_loss(module, module.moe_layer_count(module.config))
    if aux is None:
        return h
    module.pp_aux.append(aux.detach().float())
    return AttachAux.apply(h, aux)


def stage_aux(parts, n_micro: int) -> torch.Tensor | None:
    """The sum of this rank's earlier stages' auxiliary losses over the step's ``n_micro``
    micro-batches (their part of the training loss the last stage reports), emptied for the next
    step. The last ``n_micro`` of each stage: torch's first schedule step also runs a stage forward
    of its own to learn the output shapes, whose output no backward reaches."""
    values = [v for part in parts.parts for v in part.pp_aux[-n_micro:]]
    for part in parts.parts:
        part.pp_aux.clear()
    return torch.stack(values).sum() if values else None


def stages_of_rank(pp_rank: int, pp: int, stages: int) -> list[int]:
    """Stage indices a pipeline rank runs (interleaved: ``pp_rank``, ``pp_rank + pp``, ...)."""
    return list(range(pp_rank, stages, pp))


class Parts(nn.Module):
    """This rank's stage modules, as children ``"0"``, ``"1"``...; parameter names without that
    prefix (``strip``) are the unsplit model's."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.config = parts[0].config

    @staticmethod
    def strip(name: str) -> str:
        return name.split(".", 2)[2] if name.startswith("parts.") else name


def make_schedule(stage_modules: list[nn.Module], stage_ids: list[int], stages: int, pcfg, n_micro: int, device, group):
    """torch's ``PipelineStage`` per module and the configured schedule over them."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    pipe_stages: list[Any] = [PipelineStage(m, s, stages, device, group=group) for m, s in zip(stage_modules, stage_ids)]
    for stage in pipe_stages:
        _leave_no_record(stage)

    def passthrough(loss, _target):  # the last stage's forward already returns the loss
        return loss

    if pcfg.pp_schedule == "interleaved_1f1b":
        return ScheduleInterleaved1F1B(pipe_stages, n_micro, loss_fn=passthrough)
    cls = ScheduleGPipe if pcfg.pp_schedule == "gpipe" else Schedule1F1B
    return cls(pipe_stages[0], n_micro, loss_fn=passthrough)


# What a training forward records for its step beside its output: each attention head's largest
# logit (QK-clip, ``nn.attention``) and each routed layer's expert loads (the loss-free bias,
# ``nn.moe``). Each is replaced, never changed in place, when a forward adds to it.
STEP_RECORDS = ("max_logit", "load")


def _leave_no_record(stage) -> None:
    """torch's first schedule step runs each stage's forward once more to learn its shapes (a
    later stage's on uninitialised ``torch.empty`` inputs): what that forward records (``STEP_
    RECORDS``) is put back as it was, or QK-clip's maxima and the expert loads of the step would
    count garbage. (``_forward_metadata_inference`` in torch 2.13, ``_shape_inference`` before.)"""
    for name in ("_forward_metadata_inference", "_shape_inference"):
        infer = getattr(stage, name, None)
        if infer is None:
            continue

        def wrapped(*args, _infer=infer, **kwargs):
            kept = [(m, a, getattr(m, a)) for m in stage.submod.modules() for a in STEP_RECORDS if hasattr(m, a)]
            try:
                return _infer(*args, **kwargs)
            finally:
                for m, a, value in kept:
                    setattr(m, a, value)

        setattr(stage, name, wrapped)
        return


# A context-parallel shard (``context.context_shard``) adds its positions (rotary blocks need them
# in every stage), an encoder-decoder's shifted decoder input and its positions (the decoder's
# stage), and the loss divisor (the last stage): all (B, ...) per sample.
MODEL_KWARGS = (
    "attention_mask",
    "token_type_ids",
    "labels",
    "position_ids",
    "decoder_input_ids",
    "decoder_position_ids",
    "loss_tokens",
    "doc_ids",
    "decoder_doc_ids",
)


def stage_kwargs(inputs: dict) -> dict:
    """What every stage receives besides the first stage's input ids (chunked like them along the
    batch dimension, one chunk per micro-batch)."""
    return {k: inputs[k] for k in MODEL_KWARGS if k in inputs}


class Shared:
    """Parameters that more than one pipeline rank holds (by unsplit name), with their local shapes."""

    def __init__(self, shapes: dict[str, tuple], counted_elsewhere: frozenset):
        self.shapes = shapes  # name -> local gradient shape, in a fixed order
        self.counted_elsewhere = counted_elsewhere  # this rank's names (prefixed) another rank counts


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def shared_parameters(parts: Parts, group) -> Shared:
    from .dist import all_gather_object

    mine = {Parts.strip(n): tuple(_local(p).shape) for n, p in parts.named_parameters()}
    everyone, me = all_gather_object(mine, group)
    owners: dict[str, list[int]] = {}
    for rank, names in enumerate(everyone):
        for name in names:
            owners.setdefault(name, []).append(rank)
    shapes = {name: everyone[ranks[0]][name] for name, ranks in sorted(owners.items()) if len(ranks) > 1}
    elsewhere = frozenset(
        n for n, _ in parts.named_parameters() if Parts.strip(n) in shapes and owners[Parts.strip(n)][0] != me
    )
    return Shared(shapes, elsewhere)


def sync_shared_grads(parts: Parts, shared: Shared, group) -> None:
    """Sum the gradients of weights several stages hold (each computed its share of the use)."""
    from .dist import all_reduce

    if not shared.shapes:
        return
    params = {Parts.strip(n): p for n, p in parts.named_parameters()}
    device = next(parts.parameters()).device
    for name, shape in shared.shapes.items():
        p: Any = params.get(name)
        if p is not None and p.grad is not None and hasattr(p.grad, "placements") and p.grad.placements != p.placements:
            # e.g. a vocabulary-parallel embedding's gradient may arrive replicated: shard it like the weight
            p.grad = p.grad.redistribute(p.device_mesh, p.placements)
        grad = _local(p.grad) if p is not None and p.grad is not None else None
        buf = grad if grad is not None else torch.zeros(shape, device=device)
        all_reduce(buf, group=group)
