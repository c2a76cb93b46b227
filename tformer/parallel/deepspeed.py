"""DeepSpeed ZeRO 1/2/3 (+ optional CPU offload) behind the same trainer.

The engine owns the accumulation boundary, the gradient clipping and the optimizer step; the
client optimizer is torch AdamW (DeepSpeed's FusedAdam/CPUAdam would compile C++ on first use).
Checkpoints are DeepSpeed's own (``deepspeed/state/``); at a different world size they are
converted once to DeepSpeed's universal format and loaded from there.
"""

from __future__ import annotations

import importlib
import json
import logging
import subprocess
import sys
from pathlib import Path

import torch

from ..config import ConfigError
from ..files import torch_save_durable
from ..safeload import CheckpointError, torch_load_safe
from .strategy import StepResult, Strategy

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


class DeepSpeedStrategy(Strategy):
    """The engine clips, steps, skips non-finite steps and zeroes the gradients itself."""

    name = "deepspeed"
    async_save = False
    engine = None  # made with the optimizer (setup_optimizer)
    base_optimizer = None  # the torch AdamW whose state DeepSpeed fills on load
    _finite = None  # this rank's micro-batch losses so far this step were all finite

    @classmethod
    def check(cls, cfg, precision: str) -> None:
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

    def wrap(self, model):
        self.deepspeed = _import_deepspeed()
        import torch.distributed as dist

        if not dist.is_initialized():
            raise ConfigError(
                "parallel.strategy=deepspeed needs a process group: launch with torchrun, "
                "the deepspeed launcher, or accelerate launch"
            )
        self.ds_config = deepspeed_config(self.cfg, {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(self.dtype, "fp32"))
        self.engine = None
        return model  # the engine is made with the optimizer, in setup_optimizer

    def setup_optimizer(self, optimizer):
        self.base_optimizer = optimizer  # the torch AdamW whose state DeepSpeed fills on load
        self.engine, ds_optimizer, _, _ = self.deepspeed.initialize(
            model=self.model, optimizer=optimizer, config=self.ds_config
        )
        self.wrapped = self.engine
        return ds_optimizer

    def no_sync(self, last_micro: bool):
        import contextlib

        return contextlib.nullcontext()

    def backward(self, loss, last_micro: bool, scaler=None) -> None:
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

    def step(self, optimizer, scaler, max_norm: float, loss_finite: bool) -> StepResult:
        """The engine clips (``gradient_clipping``, from ``optim.grad_clip``) and updates, or skips
        a step whose global norm is not finite. Where it cannot skip (``can_skip``), a non-finite
        loss stops the run before the update; an update it applied on a non-finite loss stops it
        after."""
        if not loss_finite and not self.can_skip:
            return StepResult(float("nan"), applied=False, must_stop=True)
        skipped = self.engine.skipped_steps
        self.engine.step()
        applied = self.engine.skipped_steps == skipped
        norm = self.engine.get_global_grad_norm()
        return StepResult(float(norm) if norm is not None else float("nan"), applied, must_stop=applied and not loss_finite)

    def save(self, tmp: Path, optimizer, scheduler, scaler, background: bool = False) -> None:
        """Always synchronous: DeepSpeed's ``save_checkpoint`` has no background mode that hands
        back a completion to commit on (``checkpoint.async`` is ignored, with a warning)."""
        self.engine.save_checkpoint(str(tmp / "deepspeed"), tag=TAG)
        if self.dist.is_main:
            torch_save_durable(
                {"scheduler": scheduler.state_dict(), "scaler": None, "param_groups": _hyperparameters(optimizer)},
                tmp / "scheduler.pt",
            )

    def load(self, path: Path, optimizer, scheduler, scaler, saved_world_size: int | None = None) -> None:
        ds_dir = path / "deepspeed"
        if not (ds_dir / TAG).is_dir():
            raise CheckpointError(
                f"checkpoint {path} has no deepspeed/{TAG}; it was written by another "
                "strategy: resume it with parallel.strategy=ddp or fsdp"
            )
        # DeepSpeed (and its universal converter) unpickle these files freely: read them first
        from ..safeload import check_deepspeed_dir

        check_deepspeed_dir(ds_dir, self.cfg.checkpoint.trust)
        if saved_world_size is not None and saved_world_size != self.dist.world_size:
            universal = self._universal(ds_dir, saved_world_size)
            self.engine._config.load_universal_checkpoint = True
            load_dir, tag = universal.parent, universal.name
        else:
            load_dir, tag = ds_dir, TAG
        own_groups = _hyperparameters(optimizer)
        try:
            loaded, _ = self.engine.load_checkpoint(
                str(load_dir), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=False
            )
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(
                f"DeepSpeed checkpoint {load_dir / tag} cannot be loaded ({type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''}); use an earlier checkpoint"
            ) from None
        if loaded is None:
            raise CheckpointError(f"DeepSpeed found no checkpoint in {load_dir / tag}")
        extra = torch_load_safe(path / "scheduler.pt", self.cfg.checkpoint.trust)
        if tag != TAG:
            # ZeRO-3's universal load gives *every* param group the hyperparameters of group 0
            # (deepspeed 0.19 stage3.load_hp_checkpoint_state_from_checkpoint_dir_stage3), so the
            # no-decay group would suddenly decay. Put back each group's own values: the saved
            # ones (lr, weight_decay, betas, ...), else this run's.
            saved = extra.get("param_groups") or own_groups
            groups = optimizer.param_groups
            if len(saved) != len(groups):
                raise CheckpointError(
                    f"checkpoint {path} has {len(saved)} optimizer param groups but this "
                    f"run has {len(groups)}; resume with the same optimizer settings"
                )
            for group, values in zip(groups, saved):
                group.update(values)
            # ...and it hands every param group the *same* ``step`` tensor object: torch's AdamW
            # increments it in place once per group, so Adam's step count (and with it the bias
            # correction) would advance twice per step. Give each state its own copy.
            for state in self.base_optimizer.state.values():
                if torch.is_tensor(state.get("step")):
                    state["step"] = state["step"].clone()
        scheduler.load_state_dict(extra["scheduler"])
        if tag != TAG:  # the schedule's learning rates of the saved step (not this run's start)
            for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr()):
                group["lr"] = lr

    def _universal(self, ds_dir: Path, saved_world_size: int) -> Path:
        """Convert a ZeRO checkpoint of another world size to DeepSpeed's universal format (once)."""
        from .dist import barrier

        out = ds_dir / f"{TAG}_universal"
        if self.dist.is_main and not (out / "zero").is_dir():
            log.info(
                "converting the %d-rank DeepSpeed checkpoint for %d rank(s): %s -> %s",
                saved_world_size,
                self.dist.world_size,
                ds_dir / TAG,
                out,
            )
            cmd = [
                sys.executable,
                "-m",
                "deepspeed.checkpoint.ds_to_universal",
                "--input_folder",
                str(ds_dir / TAG),
                "--output_folder",
                str(out),
                "--inject_missing_state",
            ]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
                raise CheckpointError(
                    f"converting {ds_dir / TAG} to a universal checkpoint failed ({tail}); "
                    f"run `{' '.join(cmd[1:])}` by hand, or resume on "
                    f"{saved_world_size} ranks"
                )
        barrier()
        return out

    def clip_grad_norm(self, max_norm: float) -> float:  # the engine clips (gradient_clipping)
        raise RuntimeError("DeepSpeed clips inside engine.step()")


def _hyperparameters(optimizer) -> list[dict]:
    """Each param group's settings without its tensors (lr, weight_decay, betas, eps, ...)."""
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
