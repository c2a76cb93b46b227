"""How the model is wrapped, synchronised, stepped and checkpointed, per ``parallel.strategy``.

The order of application is fixed: tensor parallelism (+ sequence parallelism, ``parallel.tp``,
see ``tp.py``) -> activation checkpointing -> per-block ``torch.compile`` -> sharding (FSDP2 per
block, then the root, on the mesh's data-parallel dimensions: HSDP when ``dp_replicate > 1``) or
DDP. Model code knows none of this. The run's ``DeviceMesh`` (``mesh.py``) arrives on ``dist_info``.

Checkpoints are not a strategy's business: ``checkpoint/`` saves and loads the model and
optimizer (DCP, or DeepSpeed's engine) with everything else a resume restores.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..config import StrategyName
from ..nn import TransformerBlock, TransformerStack
from .ac import apply_activation_checkpointing
from .compile import compile_blocks


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step did. ``grad_norm``: the global gradient norm before clipping (nan
    when it was not computed: a non-finite loss). ``applied``: the parameters changed. ``must_stop``:
    the run cannot go on safely (a non-finite step that could not be skipped, or that an engine
    applied anyway)."""

    grad_norm: float
    applied: bool
    must_stop: bool = False


class Strategy:
    """The contract every strategy implements, and the DDP / TP / PP behaviour (``FSDPStrategy``
    and ``DeepSpeedStrategy`` override what differs): ``check`` (before any process group),
    ``wrap`` and ``setup_optimizer`` (at construction), ``no_sync`` / ``loss_context`` /
    ``backward`` (per micro-batch), ``step`` (per optimizer step: clip, update, clear the
    gradients, one ``StepResult``), ``save`` / ``load`` / ``load_weights`` (checkpoints) and
    ``memory_report``. The trainer has one update path whatever the strategy."""

    name = "ddp"
    engine = None  # DeepSpeed's: it checkpoints model and optimizer itself (checkpoint/deepspeed.py)
    base_optimizer = None
    # pipeline only (pp > 1): this rank's stage indices, whether it holds the last stage (the
    # loss), torch's schedule and the parameters shared between stages (tied embeddings)
    stage_ids: list[int] = []
    is_last_stage = True
    schedule = None
    shared = None

    def __init__(self, model: torch.nn.Module, cfg, dist_info, dtype: torch.dtype):
        self.model = model  # the unwrapped module (for state dicts and evaluation)
        self.cfg = cfg
        self.dist = dist_info
        self.dtype = dtype
        pcfg = cfg.parallel
        self.mesh = getattr(dist_info, "mesh", None)
        self.tp = self.mesh["tp"].size() if self.mesh is not None else 1
        self.pp = self.mesh["pp"].size() if self.mesh is not None else 1
        self.loss_parallel = self.tp > 1 and pcfg.loss_parallel
        if self.pp == 1:
            self.wrapped = self.wrap(self._prepare(model))
            return
        # pipeline: this rank's stages, each prepared and wrapped like a whole model
        from . import pipeline

        stages = pipeline.num_stages(pcfg)
        self.stage_ids = pipeline.stages_of_rank(self.mesh["pp"].get_local_rank(), self.pp, stages)
        parts = [
            self.wrap(self._prepare(pipeline.build_stage(model, s, stages, pcfg.pp_layers, cfg.optim.label_smoothing)))
            for s in self.stage_ids
        ]
        self.model = self.wrapped = pipeline.Parts(parts)
        self.is_last_stage = stages - 1 in self.stage_ids
        self.schedule = pipeline.make_schedule(
            parts, self.stage_ids, stages, pcfg, cfg.grad_accum, dist_info.device, self.mesh["pp"].get_group()
        )
        self.shared = pipeline.shared_parameters(self.model, self.mesh["pp"].get_group())

    def _prepare(self, model):
        """TP (+SP) -> activation checkpointing -> per-block compile, in place."""
        pcfg = self.cfg.parallel
        if self.tp > 1:
            from .tp import apply_tensor_parallel

            apply_tensor_parallel(model, self.mesh["tp"], pcfg.sp, pcfg.loss_parallel)
        if self.mesh is not None and self.mesh["cp"].size() > 1:
            from .context import apply_context_parallel

            apply_context_parallel(model, self.mesh["cp"].get_group(), pcfg.cp_kernel, self.mesh["cp"])
        if pcfg.activation_checkpointing != "none":
            apply_activation_checkpointing(model, pcfg.activation_checkpointing, pcfg.ac_every)
        if self.cfg.compile:
            compile_blocks(model)
        return model

    @classmethod
    def check(cls, cfg, precision: str) -> None:
        """Refuse what the installed packages cannot run, before any distributed work."""

    # -- wrapping and stepping -------------------------------------------------------------
    def wrap(self, model):
        if not self.dist.distributed or self.tp > 1 or self.pp > 1:  # TP / PP alone: no data-parallel peer
            return model
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [self.dist.device.index] if self.dist.device.type == "cuda" else None
        return DDP(model, device_ids=ids)

    def setup_optimizer(self, optimizer):
        return optimizer

    def backward(self, loss, last_micro: bool, scaler=None) -> None:
        (scaler.scale(loss) if scaler is not None else loss).backward()

    def no_sync(self, last_micro: bool):
        """Skip the gradient all-reduce on all but the last micro-batch of an accumulation."""
        if last_micro or self.wrapped is self.model:
            return contextlib.nullcontext()
        return self.wrapped.no_sync()

    def loss_context(self):
        """Where the forward and backward of a micro-batch run: torch's ``loss_parallel`` under
        tensor parallelism (the cross-entropy over vocabulary-sharded logits), else nothing."""
        from .tp import loss_context

        return loss_context(self.loss_parallel)

    def step(self, optimizer, scaler, max_norm: float, loss_finite: bool) -> StepResult:
        """Clip to ``max_norm`` (inf: measure only), update and clear the gradients. A non-finite
        loss or gradient norm skips the update; under fp16 the scaler skips overflowing steps itself
        (counted as applied: it lowers its scale and the run goes on)."""
        grad_norm, applied = float("nan"), False
        if loss_finite:
            if scaler is not None:
                scaler.unscale_(optimizer)
            grad_norm = self.clip_grad_norm(max_norm)
            if math.isfinite(grad_norm) or scaler is not None:
                if scaler is not None:
                    scaler.step(optimizer)
                    scaler.update()
                else:
                    optimizer.step()
                applied = True
        optimizer.zero_grad(set_to_none=True)
        return StepResult(grad_norm, applied)

    def memory_report(self, optimizer) -> dict[str, float]:
        """This rank's memory in MB: the model states it holds (parameters, gradients still held,
        optimizer states: its shards under FSDP2 / TP / PP / ZeRO) and the process's peak on its
        device (``parallel.memory.peak_memory_mb``)."""
        from .memory import model_state_bytes, peak_memory_mb

        return {
            "model_states_mb": model_state_bytes(self.model, optimizer) / 2**20,
            "memory_mb": peak_memory_mb(self.dist.device),
        }

    def clip_grad_norm(self, max_norm: float) -> float:
        if self.pp > 1:  # shared weights' gradients summed over the stages; the norm over all stages
            from .pipeline import sync_shared_grads
            from .tp import grad_norm_and_clip

            sync_shared_grads(self.model, self.shared, self.mesh["pp"].get_group())
            return grad_norm_and_clip(
                self.model.named_parameters(),
                max_norm,
                group=self.mesh["pp"].get_group(),
                skip=self.shared.counted_elsewhere,
            )
        if self.tp > 1:  # parameters on several meshes (TP, TP x FSDP, replicated)
            from .tp import grad_norm_and_clip

            return grad_norm_and_clip(self.model.named_parameters(), max_norm)
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    def fused_optimizer_ok(self) -> bool:
        return self.tp == 1 and self.pp == 1  # DTensor parameters: the foreach implementation

    # -- pipeline --------------------------------------------------------------------------------
    def pipeline_step(self, inputs: dict, train: bool = True) -> torch.Tensor | None:
        """One pass of the schedule over the step's micro-batches (forward and, when training,
        backward). Returns the mean of the micro-batch losses on the last stage, else None."""
        from .pipeline import stage_kwargs

        losses: list = []
        kwargs = stage_kwargs(inputs)
        run = self.schedule.step if train else self.schedule.eval
        run(inputs["input_ids"], target=inputs["labels"], losses=losses, return_outputs=False, **kwargs)
        if not self.is_last_stage:
            return None
        return torch.stack([loss.detach().float() for loss in losses]).mean()


class FSDPStrategy(Strategy):
    """FSDP2: ``fully_shard`` on every transformer block, then on the root module."""

    name = "fsdp"

    def wrap(self, model):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if not dist.is_initialized():
            from ..config import ConfigError

            raise ConfigError(
                "parallel.strategy=fsdp needs a process group: launch with torchrun "
                "(torchrun --nproc_per_node N -m tformer train ...)"
            )
        mp = None
        if self.dtype != torch.float32:
            mp = MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=torch.float32)
        kwargs = {"reshard_after_forward": self.cfg.parallel.reshard_after_forward}
        if self.mesh is not None:  # 1-D: shard over dp_shard; 2-D (HSDP): replicate x shard
            shard = "dp_shard_cp" if self.mesh["cp"].size() > 1 else "dp_shard"  # cp ranks: same parameters
            dims = ("dp_replicate", shard) if self.mesh["dp_replicate"].size() > 1 else (shard,)
            kwargs["mesh"] = self.mesh[dims]
        if mp is not None:
            kwargs["mp_policy"] = mp
        for stack in model.modules():
            if isinstance(stack, TransformerStack):
                for block in stack.layers:
                    if isinstance(block, TransformerBlock):  # not another pipeline stage's placeholder
                        fully_shard(block, **kwargs)
        # The root (embeddings, final norm, head) keeps its gathered parameters from forward into
        # backward, which needs them first thing: torch's own default for the root. Resharding it
        # saves no peak memory and costs an all-gather per micro-batch; and torch < 2.13 hooks the
        # backward re-gather only on outputs tree_flatten sees, not on our ModelOutput dataclass
        # (backward then finds the root's parameters freed).
        fully_shard(model, **{**kwargs, "reshard_after_forward": False})
        return model

    def no_sync(self, last_micro: bool):
        self.model.set_requires_gradient_sync(last_micro)
        return contextlib.nullcontext()

    def fused_optimizer_ok(self) -> bool:
        return False  # DTensor parameters: use the foreach implementation


def strategy_class(name: StrategyName):
    if name == "deepspeed":
        from .deepspeed import DeepSpeedStrategy

        return DeepSpeedStrategy
    return {"ddp": Strategy, "fsdp": FSDPStrategy}[name]


def param_counts(model: torch.nn.Module) -> tuple[int, int]:
    """(parameter elements this rank holds, elements of the whole model) under any strategy:
    FSDP2 DTensors hold a local shard; ZeRO-3 parameters hold ``ds_tensor`` (their partition)."""
    local = total = 0
    for p in model.parameters():
        if hasattr(p, "ds_tensor"):
            local, total = local + p.ds_tensor.numel(), total + p.ds_numel
        elif hasattr(p, "to_local"):
            local, total = local + p.to_local().numel(), total + p.numel()
        else:
            local, total = local + p.numel(), total + p.numel()
    return local, total
