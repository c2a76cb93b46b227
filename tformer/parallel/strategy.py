"""How the model is parallelised, synchronised and stepped, per ``parallel.*`` and the run's mesh.

The run is built from the ``DeviceMesh`` (``mesh.py``, on ``dist_info``) by a flat sequence of
``apply_*`` steps, each a function of (module, :class:`Layout`) that does nothing when its
dimension or option is off, in the order torchtitan's parallelize functions use:

    apply_float8 -> apply_tp (+SP) -> apply_cp -> apply_ep -> apply_ac -> apply_compile
        -> apply_data_parallel (FSDP2 / HSDP, experts first under EP; or DDP)

and, when ``pp > 1``, ``apply_pipeline`` first cuts this rank's stages, each then taken through the
same steps. A new dimension is one more ``apply_*`` function and one more entry in ``STEPS``.
Model code knows none of this.

:class:`MeshStrategy` is the result: the one backward / clip / step path, which reads the mesh
(the norm of TP, FSDP and plain parameters alike, summed over pipeline stages). DeepSpeed is a
separate engine behind the same :class:`Strategy` contract (``deepspeed.py``). Checkpoints are
not a strategy's business: ``checkpoint/`` saves and loads the model and optimizer (DCP, or
DeepSpeed's engine) with everything else a resume restores.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ..config import ConfigError
from ..nn import TransformerBlock, TransformerStack
from .ac import apply_activation_checkpointing
from .compile import compile_blocks, compile_head, compile_model
from .float8 import apply_float8, precompute_scales_after_step


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step did. ``grad_norm``: the global gradient norm before clipping (nan
    when it was not computed: a non-finite loss). ``applied``: the parameters changed. ``must_stop``:
    the run cannot go on safely (a non-finite step that could not be skipped, or that an engine
    applied anyway)."""

    grad_norm: float
    applied: bool
    must_stop: bool = False


class Strategy(Protocol):
    """What the trainer uses, whatever runs the model: ``model`` (this rank's unwrapped module:
    state dicts, evaluation), ``wrapped`` (what the forward calls), ``setup_optimizer`` (at
    construction), ``no_sync`` / ``loss_context`` / ``backward`` (per micro-batch), ``step`` (per
    optimizer step: clip, update, clear the gradients, one :class:`StepResult`),
    ``release_gathered`` (after a forward without backward: evaluation, decoding), ``memory_report``;
    ``pipeline`` (pp > 1: the schedule) and ``engine`` (DeepSpeed's) are None elsewhere."""

    name: str
    model: Any
    wrapped: Any
    engine: Any
    base_optimizer: Any
    pipeline: Pipeline | None

    def setup_optimizer(self, optimizer: Any) -> Any: ...

    def fused_optimizer_ok(self) -> bool: ...

    def no_sync(self, last_micro: bool) -> contextlib.AbstractContextManager: ...

    def loss_context(self) -> contextlib.AbstractContextManager: ...

    def backward(self, loss: torch.Tensor, last_micro: bool, scaler: Any = None) -> None: ...

    def step(self, optimizer: Any, scaler: Any, max_norm: float, loss_finite: bool) -> StepResult: ...

    def release_gathered(self) -> None: ...

    def memory_report(self, optimizer: Any) -> dict[str, float]: ...


@dataclass(frozen=True)
class Layout:
    """What the ``apply_*`` steps read: the run config, its mesh and the degrees it was built from
    (``ParallelDims``; both None: one process) and the parameters' compute dtype."""

    cfg: Any
    mesh: Any
    dims: Any
    dtype: torch.dtype
    device: torch.device
    distributed: bool

    @classmethod
    def of(cls, cfg: Any, dist_info: Any, dtype: torch.dtype) -> Layout:
        mesh = getattr(dist_info, "mesh", None)
        dims = getattr(dist_info, "dims", None) if mesh is not None else None
        return cls(cfg, mesh, dims, dtype, dist_info.device, dist_info.distributed)

    def size(self, dim: str) -> int:
        return self.mesh[dim].size() if self.mesh is not None else 1

    @property
    def tp(self) -> int:
        return self.size("tp")

    @property
    def pp(self) -> int:
        return self.size("pp")

    @property
    def cp(self) -> int:
        return self.size("cp")

    @property
    def ep(self) -> int:  # borrowed from dp_shard x cp: the mesh has an ``ep`` dimension only when > 1
        return self.dims.ep if self.dims is not None else 1


# -- the apply steps -------------------------------------------------------------------------------


def apply_tp(model: torch.nn.Module, layout: Layout) -> torch.nn.Module:
    """Tensor parallelism (+ sequence parallelism) over ``mesh["tp"]`` (``tp.py``)."""
    if layout.tp > 1:
        from .tp import apply_tensor_parallel

        pcfg = layout.cfg.parallel
        apply_tensor_parallel(model, layout.mesh["tp"], pcfg.sp, pcfg.loss_parallel)
    return model


def apply_cp(model: torch.nn.Module, layout: Layout) -> torch.nn.Module:
    """Context parallelism: attention over the sequence shards of ``mesh["cp"]`` (``context.py``)."""
    if layout.cp > 1:
        from .context import apply_context_parallel

        cp = layout.mesh["cp"]
        apply_context_parallel(model, cp.get_group(), layout.cfg.parallel.cp_kernel, cp)
    return model


def apply_ep(model: torch.nn.Module, layout: Layout) -> torch.nn.Module:
    """Expert parallelism: every MoE layer keeps its share of the experts on ``mesh["ep"]`` and
    routes tokens to them (``ep.py``)."""
    if layout.ep > 1:
        from .ep import apply_expert_parallel

        apply_expert_parallel(model, layout.mesh["ep"])
    return model


def apply_routing(model: torch.nn.Module, layout: Layout) -> torch.nn.Module:
    """MoE routing losses of whole sequences where the layout splits them over ``mesh["cp"]`` or
    pads them (context and sequence parallelism; ``routing.py``)."""
    if layout.cp > 1 or (layout.tp > 1 and layout.cfg.parallel.sp):
        from .routing import apply_routing_pools

        apply_routing_pools(model, layout.mesh["cp"] if layout.cp > 1 else None)
    return model


def apply_ac(model: torch.nn.Module, layout: Layout) -> torch.nn.Module:
    pcfg = layout.cfg.parallel
    if pcfg.activation_checkpointing != "none":
        apply_activation_checkpointing(model, pcfg.activation_checkpointing, pcfg.ac_every)
    return model


def apply_compile(model: torch.nn.Module, layout: Layout) -> torch.nn.Module:
    """Per block (and the whole head with its loss), before sharding; ``compile=model``: the whole
    model, on one device or under DDP (whole-model compile graph-breaks in FSDP2's hooks)."""
    if layout.cfg.compile == "model":
        compile_model(model)
    elif layout.cfg.compile:
        compile_blocks(model)
        if layout.tp == 1 and layout.pp == 1:
            compile_head(model)
    return model


def apply_fsdp(model: torch.nn.Module, layout: Layout) -> torch.nn.Module:
    """FSDP2: ``fully_shard`` on every transformer block, then on the root module, over the mesh's
    data-parallel dimensions (HSDP when ``dp_replicate > 1``; cp ranks hold the same parameters).
    Under EP the expert weights are sharded first, over what EP leaves (``ep.shard_experts``)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if not dist.is_initialized():
        raise ConfigError(
            "parallel.strategy=fsdp needs a process group: launch with torchrun "
            "(torchrun --nproc_per_node N -m tformer train ...)"
        )
    kwargs: dict[str, Any] = {"reshard_after_forward": layout.cfg.parallel.reshard_after_forward}
    if layout.mesh is not None:
        shard = "dp_shard_cp" if layout.cp > 1 else "dp_shard"
        dims = ("dp_replicate", shard) if layout.size("dp_replicate") > 1 else (shard,)
        kwargs["mesh"] = layout.mesh[dims]
    if layout.dtype != torch.float32:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=layout.dtype, reduce_dtype=torch.float32)
    if layout.ep > 1:
        from .ep import shard_experts

        shard_experts(model, layout.mesh, layout.dims, **{k: v for k, v in kwargs.items() if k != "mesh"})
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


def apply_ddp(model: torch.nn.Module, layout: Layout) -> torch.nn.Module:
    """DDP over every rank: only with no tp / pp peers (the mesh refuses DDP beside them otherwise,
    ``mesh.check_strategy``); TP or PP alone have no data-parallel peer to wrap for."""
    if not layout.distributed or layout.tp > 1 or layout.pp > 1:
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    ids = [layout.device.index] if layout.device.type == "cuda" else None
    return DDP(model, device_ids=ids)


def apply_data_parallel(model: torch.nn.Module, layout: Layout) -> torch.nn.Module:
    return (apply_fsdp if layout.cfg.parallel.strategy == "fsdp" else apply_ddp)(model, layout)


Step = Callable[[torch.nn.Module, Layout], torch.nn.Module]
# The order is fixed: float8 swaps the blocks' linear layers first (precision=fp8); TP shards their
# weights next; AC and compile wrap what TP made;
# sharding comes last, over the finished blocks (torchtitan's parallelize_llama does the same).
# MODEL_STEPS change the module in place; DeepSpeed's engine takes the place of the last step.
MODEL_STEPS: tuple[Step, ...] = (apply_float8, apply_tp, apply_cp, apply_ep, apply_routing, apply_ac, apply_compile)
STEPS: tuple[Step, ...] = (*MODEL_STEPS, apply_data_parallel)


def parallelize(model: torch.nn.Module, layout: Layout, steps: tuple[Step, ...] = STEPS) -> torch.nn.Module:
    """``model`` taken through ``steps``; returns what the forward calls (DDP's wrapper, or the
    module itself, changed in place)."""
    for step in steps:
        model = step(model, layout)
    return model


# -- the pipeline ----------------------------------------------------------------------------------


class Pipeline:
    """This rank's stages (``pipeline.py``), torch's schedule over them and the parameters shared
    between stages (tied embeddings)."""

    def __init__(self, model: torch.nn.Module, layout: Layout, label_smoothing: float, grad_accum: int):
        from . import pipeline

        self.grad_accum = grad_accum
        pcfg, pp = layout.cfg.parallel, layout.mesh["pp"]
        stages = pipeline.num_stages(pcfg)
        self.stage_ids = pipeline.stages_of_rank(pp.get_local_rank(), pp.size(), stages)
        modules = [pipeline.build_stage(model, s, stages, pcfg.pp_layers, label_smoothing) for s in self.stage_ids]
        parts = [parallelize(m, layout) for m in modules]
        self.parts = pipeline.Parts(parts)
        self.is_last_stage = stages - 1 in self.stage_ids
        self.group = pp.get_group()
        self.schedule: Any = pipeline.make_schedule(
            parts, self.stage_ids, stages, pcfg, grad_accum, layout.device, self.group
        )
        self.shared = pipeline.shared_parameters(self.parts, self.group)

    def step(self, inputs: dict, train: bool = True) -> torch.Tensor | None:
        """One pass of the schedule over the step's micro-batches (forward and, when training,
        backward). Returns the mean of the micro-batch losses on the last stage, plus (MoE) the
        mean auxiliary loss of this rank's earlier stages; None on a rank with neither."""
        from .pipeline import stage_aux

        losses = self.run(inputs, train)
        aux = stage_aux(self.parts, self.grad_accum)
        aux = aux / self.grad_accum if aux is not None else None
        if not self.is_last_stage:
            return aux
        loss = torch.stack([loss.detach().float() for loss in losses]).mean()
        return loss + aux if aux is not None else loss

    def run(self, inputs: dict, train: bool) -> list:
        """The schedule over ``inputs``; the micro-batch losses (last stage only, else empty)."""
        from .pipeline import stage_kwargs

        losses: list = []
        run = self.schedule.step if train else self.schedule.eval
        run(inputs["input_ids"], target=inputs["labels"], losses=losses, return_outputs=False, **stage_kwargs(inputs))
        return losses


def apply_pipeline(model: torch.nn.Module, layout: Layout) -> Pipeline | None:
    if layout.pp == 1:
        return None
    cfg = layout.cfg
    return Pipeline(model, layout, cfg.optim.label_smoothing, cfg.grad_accum)


# -- clip and step ---------------------------------------------------------------------------------


def clip_grad_norm(
    model: torch.nn.Module, max_norm: float, layout: Layout, pipeline: Pipeline | None = None
) -> torch.Tensor:
    """The global gradient norm (before clipping), clipped to ``max_norm`` (inf: measure only), over
    whatever the mesh made of the parameters: pipeline stages (shared weights' gradients summed
    first, counted once), DTensors on several meshes (TP, TP x FSDP, EP experts beside FSDP), or
    one kind (plain / FSDP)."""
    from .tp import grad_norm_and_clip

    if pipeline is not None:
        from .pipeline import sync_shared_grads

        sync_shared_grads(pipeline.parts, pipeline.shared, pipeline.group)
        return grad_norm_and_clip(
            model.named_parameters(), max_norm, group=pipeline.group, skip=pipeline.shared.counted_elsewhere
        )
    if layout.tp > 1 or layout.ep > 1:
        return grad_norm_and_clip(model.named_parameters(), max_norm)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def clip_for_step(optimizer: Any, scaler: Any, clip: Callable[[], torch.Tensor]) -> torch.Tensor:
    """The first half of a step: unscale (fp16), clip; the global gradient norm stays on the device,
    for the trainer to read once with the step's other figures (``finish_step`` then decides)."""
    if scaler is not None:
        scaler.unscale_(optimizer)
    return clip()


def finish_step(optimizer: Any, scaler: Any, ok: bool) -> StepResult:
    """The second half: update (unless the loss or the norm was non-finite: ``ok`` false) and clear
    the gradients. Under fp16 the scaler skips overflowing steps itself (counted as applied: it
    lowers its scale and the run goes on; it reads its own found-inf flag)."""
    applied = False
    if ok or scaler is not None:
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        applied = True
    optimizer.zero_grad(set_to_none=True)
    return StepResult(float("nan"), applied)


def skips_on_device(optimizer: Any, scaler: Any) -> bool:
    """Whether ``finish_step_on_device`` can skip a non-finite step without the host: torch's fused
    AdamW takes a ``found_inf`` flag (its kernel leaves the weights, moments and step count as they
    were when it is set). fp16's GradScaler drives that flag itself."""
    return scaler is None and bool(getattr(optimizer, "defaults", {}).get("fused"))


def finish_step_on_device(optimizer: Any, ok: torch.Tensor) -> None:
    """The second half of a step with the decision left on the device: update where ``ok`` (a
    device bool: the loss and the norm finite), leave everything as it was where not, and clear
    the gradients. Nothing is read on the host."""
    optimizer.found_inf = (~ok).to(torch.float32)
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf  # an optimizer step outside the trainer's (a test's) is unconditional
    optimizer.zero_grad(set_to_none=True)


def optimizer_step(optimizer: Any, scaler: Any, loss_finite: bool, clip: Callable[[], torch.Tensor]) -> StepResult:
    """Clip, update and clear the gradients in one call (the two halves above, reading the norm
    here). A non-finite loss or gradient norm skips the update."""
    if not loss_finite:
        optimizer.zero_grad(set_to_none=True)
        return StepResult(float("nan"), False)
    grad_norm = float(clip_for_step(optimizer, scaler, clip))
    result = finish_step(optimizer, scaler, math.isfinite(grad_norm))
    return StepResult(grad_norm, result.applied)


def release_gathered(model: torch.nn.Module) -> None:
    """Free the parameters a forward without backward (evaluation, decoding) left gathered: FSDP2's
    root keeps its own from forward into backward, so after an evaluation every rank would hold the
    whole embedding and head until the next training step. Nothing to do without FSDP2."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def memory_report(model: torch.nn.Module, optimizer: Any, device: torch.device) -> dict[str, float]:
    """This rank's memory in MB: the model states it holds (parameters, gradients still held,
    optimizer states: its shards under FSDP2 / TP / PP / ZeRO) and the process's peak on its
    device (``parallel.memory.peak_memory_mb``)."""
    from .memory import model_state_bytes, peak_memory_mb

    return {"model_states_mb": model_state_bytes(model, optimizer) / 2**20, "memory_mb": peak_memory_mb(device)}


class MeshStrategy:
    """ddp / fsdp with any tp, cp, ep and pp: the model taken through the ``apply_*`` steps."""

    engine = None
    base_optimizer = None

    def __init__(self, model: torch.nn.Module, cfg: Any, dist_info: Any, dtype: torch.dtype):
        self.name: str = cfg.parallel.strategy
        self.dist = dist_info
        self.layout = Layout.of(cfg, dist_info, dtype)
        self.loss_parallel = self.layout.tp > 1 and cfg.parallel.loss_parallel
        self.pipeline = apply_pipeline(model, self.layout)
        if self.pipeline is not None:
            self.model: torch.nn.Module = self.pipeline.parts
            self.wrapped: torch.nn.Module = self.model
        else:
            self.model = model  # the unwrapped module (state dicts and evaluation)
            self.wrapped = parallelize(model, self.layout)

    @classmethod
    def check(cls, cfg: Any, precision: str) -> None:
        """Refuse what the installed packages cannot run, before any distributed work."""

    def setup_optimizer(self, optimizer: Any) -> Any:
        precompute_scales_after_step(optimizer, self.model)  # fsdp + fp8: one scale all-reduce per step
        return optimizer

    def fused_optimizer_ok(self) -> bool:
        # DTensor parameters (FSDP2, TP, EP) run torch's fused AdamW too: DTensor dispatches its
        # kernel shard by shard; fused, a non-finite step is skipped on the device (no read). One
        # kernel takes a parameter group's tensors together, so they must be of one kind: TP under
        # DDP (replicated plain tensors beside DTensors) takes the foreach implementation.
        from torch.distributed.tensor import DTensor

        return len({isinstance(p, DTensor) for p in self.model.parameters() if p.requires_grad}) <= 1

    def no_sync(self, last_micro: bool) -> contextlib.AbstractContextManager:
        """Skip the gradient reduction on all but the last micro-batch of an accumulation."""
        if self.name == "fsdp" and self.pipeline is None:
            self.model.set_requires_gradient_sync(last_micro)  # type: ignore[operator]
            return contextlib.nullcontext()
        if last_micro or self.wrapped is self.model:
            return contextlib.nullcontext()
        return self.wrapped.no_sync()  # type: ignore[operator]

    def loss_context(self) -> contextlib.AbstractContextManager:
        """torch's ``loss_parallel`` under tensor parallelism (the cross-entropy over
        vocabulary-sharded logits), else nothing."""
        from .tp import loss_context

        return loss_context(self.loss_parallel)

    def backward(self, loss: torch.Tensor, last_micro: bool, scaler: Any = None) -> None:
        (scaler.scale(loss) if scaler is not None else loss).backward()

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        return clip_grad_norm(self.model, max_norm, self.layout, self.pipeline)

    def step(self, optimizer: Any, scaler: Any, max_norm: float, loss_finite: bool) -> StepResult:
        return optimizer_step(optimizer, scaler, loss_finite, lambda: self.clip_grad_norm(max_norm))

    def clip_for_step(self, optimizer: Any, scaler: Any, max_norm: float) -> torch.Tensor:
        return clip_for_step(optimizer, scaler, lambda: self.clip_grad_norm(max_norm))

    def finish_step(self, optimizer: Any, scaler: Any, ok: bool) -> StepResult:
        return finish_step(optimizer, scaler, ok)

    def finish_step_on_device(self, optimizer: Any, ok: torch.Tensor) -> None:
        finish_step_on_device(optimizer, ok)

    def release_gathered(self) -> None:
        release_gathered(self.model)

    def memory_report(self, optimizer: Any) -> dict[str, float]:
        return memory_report(self.model, optimizer, self.dist.device)


def param_counts(model: torch.nn.Module) -> tuple[int, int]:
    """(parameter elements this rank holds, elements of the whole model) under any strategy:
    FSDP2 DTensors hold a local shard; ZeRO-3 parameters hold ``ds_tensor`` (their partition)."""
    local = total = 0
    for p in model.parameters():
        if hasattr(p, "ds_tensor"):
            local, total = local + p.ds_tensor.numel(), total + p.ds_numel  # type: ignore[attr-defined]
        elif hasattr(p, "to_local"):
            local, total = local + p.to_local().numel(), total + p.numel()
        else:
            local, total = local + p.numel(), total + p.numel()
    return local, total
