"""DeepSpeed ZeRO 1/2/3 (+ optional CPU offload) behind the same trainer.

The engine owns the accumulation boundary, the gradient clipping and the optimizer step; the
client optimizer is torch AdamW (DeepSpeed's FusedAdam/CPUAdam would compile C++ on first use).
The engine's checkpoints are saved and loaded by ``checkpoint/deepspeed.py``.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
from pathlib import Path
from typing import Any

import torch

from ..config import ConfigError
from .strategy import MODEL_STEPS, Layout, StepResult, memory_report, parallelize

log = logging.getLogger("tformer.parallel")
TAG = "state"


def _import_deepspeed():
    try:
        import deepspeed
    except ImportError:
        raise ConfigError(
            "parallel.strategy=deepspeed needs the deepspeed package: DS_BUILD_OPS=0 pip install deepspeed"
        ) from None
    if not torch.cuda.is_available():
        # The CPU accelerator compiles a shared-memory collective on first init (80-100 s) that
        # gloo training never uses: skip it.
        comm = importlib.import_module("deepspeed.comm.torch")
        comm.build_shm_op = lambda: None
    return deepspeed


def deepspeed_config(cfg, precision: str) -> dict:
    pcfg = cfg.parallel
    if pcfg.deepspeed_config:
        path = Path(pcfg.deepspeed_config)
        if not path.is_file():
            raise ConfigError(
                f"parallel.deepspeed_config={path} does not exist; use one of configs/deepspeed/zero{{1,2,3}}.json"
            )
        try:
            ds = json.loads(path.read_text())
        except ValueError as e:
            raise ConfigError(f"parallel.deepspeed_config={path} is not valid JSON ({e})") from None
    else:
        ds = {"zero_optimization": {"stage": pcfg.zero_stage}, "steps_per_print": 10**9}
    auto = {
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": cfg.grad_accum,
        "gradient_clipping": cfg.optim.grad_clip,
    }
    for key, value in auto.items():
        if ds.get(key, "auto") == "auto":
            ds[key] = value
    bf16 = ds.setdefault("bf16", {})
    if bf16.get("enabled", "auto") == "auto":
        bf16["enabled"] = precision == "bf16"
    if precision == "fp16":
        ds["fp16"] = {"enabled": True}
    zero = ds.setdefault("zero_optimization", {})
    # Bucket sizes scaled to the model (DeepSpeed's fixed 5e8-element default allocates 1-2 GB per
    # rank for its ZeRO-3 reduce bucket even for a small model): d^2 elements, as HF does for "auto".
    d = cfg.model.d_model
    for key, value in (
        ("reduce_bucket_size", d * d),
        ("stage3_prefetch_bucket_size", int(0.9 * d * d)),
        ("stage3_param_persistence_threshold", 10 * d),
    ):
        if zero.get(key) == "auto":
            zero[key] = value
    where = f"parallel.deepspeed_config={pcfg.deepspeed_config}" if pcfg.deepspeed_config else "DeepSpeed config"
    if zero.get("stage") not in (0, 1, 2, 3):
        raise ConfigError(f"DeepSpeed zero_optimization.stage={zero.get('stage')!r}; use 0, 1, 2 or 3")
    for section in ("optimizer", "scheduler"):
        if section in ds:
            raise ConfigError(
                f'{where} has an "{section}" section, but tformer makes the optimizer and LR '
                f"schedule itself (torch AdamW, optim.*): remove the section"
            )
    if zero.get("offload_optimizer") or zero.get("offload_param"):
        # torch AdamW steps the offloaded states; DeepSpeed's CPUAdam (a C++ op) is never used
        if ds.setdefault("zero_force_ds_cpu_optimizer", False):
            raise ConfigError(
                f'{where} sets "zero_force_ds_cpu_optimizer": true, which demands DeepSpeed\'s '
                "CPUAdam op; tformer steps offloaded states with torch AdamW: set it to false"
            )
    ds.pop("train_batch_size", None)  # derived by DeepSpeed from micro batch x accumulation x ranks
    return ds


def _op_available(builder: str) -> bool:
    """A DeepSpeed C++ op is prebuilt in this install, or can be compiled here on first use."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import installed_ops

    op = get_accelerator().create_op_builder(builder)
    return op is not None and bool(installed_ops.get(op.NAME) or op.is_compatible(verbose=False))


def check_offload_ops(ds: dict, where: str) -> None:
    """ZeRO-Infinity (offload to NVMe) needs the async_io op: refuse it before any work if absent."""
    zero = ds.get("zero_optimization", {})
    nvme = [
        key
        for key in ("offload_optimizer", "offload_param")
        if isinstance(zero.get(key), dict) and zero[key].get("device") == "nvme"
    ]
    if nvme and not _op_available("AsyncIOBuilder"):
        raise ConfigError(
            f"{where}: zero_optimization.{nvme[0]} to nvme needs DeepSpeed's async_io op, which "
            'this install cannot load or build (libaio-dev missing?); use "device": "cpu", or '
            "install libaio-dev and reinstall with DS_BUILD_AIO=1 pip install deepspeed"
        )


class DeepSpeedStrategy:
    """DeepSpeed's engine behind the :class:`~tformer.parallel.strategy.Strategy` contract: the
    model steps of the mesh strategy (activation checkpointing, compile) run first, then the engine
    takes the data-parallel step's place. The engine clips (``gradient_clipping``, from
    ``optim.grad_clip``), steps, skips non-finite steps and zeroes the gradients itself."""

    name = "deepspeed"
    pipeline = None  # parallel.pp is refused with DeepSpeed (mesh.check_strategy)
    engine: Any = None  # made with the optimizer (setup_optimizer)
    base_optimizer: Any = None  # the torch AdamW whose state DeepSpeed fills on load
    _finite: torch.Tensor | None = None  # this rank's micro-batch losses so far this step were all finite

    def __init__(self, model: torch.nn.Module, cfg: Any, dist_info: Any, dtype: torch.dtype):
        self.deepspeed = _import_deepspeed()
        import torch.distributed as dist

        if not dist.is_initialized():
            raise ConfigError(
                "parallel.strategy=deepspeed needs a process group: launch with torchrun, "
                "the deepspeed launcher, or accelerate launch"
            )
        self.dist = dist_info
        self.ds_config = deepspeed_config(cfg, {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32"))
        self.model = self.wrapped = parallelize(model, Layout.of(cfg, dist_info, dtype), MODEL_STEPS)

    @classmethod
    def check(cls, cfg: Any, precision: str) -> None:
        """Everything that can be refused before the process group, data and model exist.

        Mistakes in the config itself come first, so they are reported whether or not deepspeed is
        installed here; then the package, then the C++ ops the config asks for."""
        ds = deepspeed_config(cfg, precision)
        if cfg.parallel.activation_checkpointing == "op" and ds["zero_optimization"].get("stage") == 3:
            # ZeRO-3 gathers a layer's partitioned weight in module hooks and its own linear
            # autograd function; the op-level recomputation replays the block's ops outside them
            raise ConfigError(
                "parallel.activation_checkpointing=op does not compose with DeepSpeed ZeRO-3 "
                "(its partitioned weights are not gathered for the op-level recomputation); use "
                "parallel.strategy=fsdp, ZeRO stage 0-2, or activation_checkpointing=full"
            )
        _import_deepspeed()
        check_offload_ops(ds, f"parallel.deepspeed_config={cfg.parallel.deepspeed_config}")

    def setup_optimizer(self, optimizer: Any) -> Any:
        self.base_optimizer = optimizer  # the torch AdamW whose state DeepSpeed fills on load
        self.engine, ds_optimizer, _, _ = self.deepspeed.initialize(
            model=self.model, optimizer=optimizer, config=self.ds_config
        )
        self.wrapped = self.engine
        return ds_optimizer

    def fused_optimizer_ok(self) -> bool:
        return True  # plain parameters: ZeRO partitions them itself

    def no_sync(self, last_micro: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # the engine owns the accumulation boundary

    def loss_context(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # no tensor parallelism

    def backward(self, loss: torch.Tensor, last_micro: bool, scaler: Any = None) -> None:
        # The trainer already divided the loss by the accumulation steps. A non-finite loss in any
        # micro-batch of this rank makes the last one's gradients NaN (no host sync): the gradient
        # reduction spreads them, the engine's global norm is then non-finite on every rank, and
        # every rank skips the update together (see ``step``).
        finite = torch.isfinite(loss.detach())
        self._finite = finite if self._finite is None else self._finite & finite
        if last_micro:
            loss = loss * torch.where(self._finite, 1.0, float("nan"))
            self._finite = None
        self.engine.backward(loss, scale_wrt_gas=False)
        if not last_micro:
            self.engine.step()  # advances DeepSpeed's micro-step count; no update off the boundary

    @property
    def can_skip(self) -> bool:
        """ZeRO 1/2/3 and DeepSpeed's bf16 optimizer discard a step whose global gradient norm is
        not finite (and clear its gradients); a plain torch optimizer under stage 0 fp32 does not."""
        return hasattr(self.engine.optimizer, "overflow")

    def step(self, optimizer: Any, scaler: Any, max_norm: float, loss_finite: bool) -> StepResult:
        """The engine clips to ``gradient_clipping`` (``max_norm`` came from the same
        ``optim.grad_clip``) and updates, or skips a step whose global norm is not finite. Where it
        cannot skip (``can_skip``), a non-finite loss stops the run before the update; an update it
        applied on a non-finite loss stops it after."""
        if not loss_finite and not self.can_skip:
            return StepResult(float("nan"), applied=False, must_stop=True)
        skipped = self.engine.skipped_steps
        self.engine.step()
        applied = self.engine.skipped_steps == skipped
        norm = self.engine.get_global_grad_norm()
        return StepResult(float(norm) if norm is not None else float("nan"), applied, must_stop=applied and not loss_finite)

    def release_gathered(self) -> None:
        """Nothing: ZeRO-3 releases the parameters it gathered for a forward itself."""

    def memory_report(self, optimizer: Any) -> dict[str, float]:
        return memory_report(self.model, optimizer, self.dist.device)
