"""What a run is refused for before any work (process group, data, model): a precision or backend
this device cannot run, layouts the strategy and model shapes do not allow, combinations not built
yet, a resume path that is not there, a run directory that cannot be written.

Plain functions of the run config, the resolved precision and the device: they read no trainer
state, so the trainer calls them first and keeps the mesh's arithmetic (``ParallelDims``) they
return."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ...config import ConfigError
from ...parallel.build import strategy_class
from ...parallel.context import check_context_parallel
from ...parallel.ep import check_moe_layout
from ...parallel.float8 import check_float8
from ...parallel.mesh import ParallelDims, check_strategy
from ...parallel.pipeline import check_pipeline
from ...parallel.tp import check_tp
from ..config import TrainConfig


def check_support(cfg: TrainConfig, precision: str, device: torch.device) -> ParallelDims:
    """Refuse what this device, this torch and the chosen layout cannot run; the run's mesh sizes."""
    if precision == "fp16" and device.type != "cuda":
        raise ConfigError(
            "precision=fp16 needs a CUDA GPU (loss-scaled fp16 is not supported on "
            f"{device.type}); use precision=bf16 or precision=fp32"
        )
    if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError("precision=bf16 is not supported by this GPU; use precision=fp16")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "device=cuda but no CUDA GPU is visible (or this torch is a CPU build); use device=cpu or device=auto"
        )
    backend = cfg.parallel.backend
    if backend is not None:
        import torch.distributed as dist

        available = {
            "gloo": dist.is_gloo_available,
            "nccl": dist.is_nccl_available,
            "mpi": dist.is_mpi_available,
            "ucc": dist.is_ucc_available,
        }[backend]()
        if not available or (backend == "nccl" and device.type != "cuda"):
            why = "needs a CUDA GPU" if backend == "nccl" else "not built into this torch"
            raise ConfigError(
                f"parallel.backend={backend} is not available here ({why}); leave "
                "parallel.backend unset (nccl on CUDA, gloo on CPU)"
            )
    check_pipeline(cfg.model, cfg.parallel, cfg.parallel.strategy)
    if cfg.model.mtp_depth and (cfg.parallel.pp > 1 or cfg.parallel.cp > 1):
        dim = "pp" if cfg.parallel.pp > 1 else "cp"
        raise ConfigError(
            f"model.mtp_depth={cfg.model.mtp_depth} is not supported with parallel.{dim} > 1 "
            "(its modules read the whole sequence after the last block); set model.mtp_depth=0"
        )
    if cfg.parallel.pp > 1 and cfg.data.tokens_per_batch is not None:
        raise ConfigError(
            "parallel.pp needs micro-batches of micro_batch_size samples (the schedule splits "
            "the step's batch evenly); set data.tokens_per_batch=null"
        )
    if cfg.parallel.pp > 1 and (precision == "fp16" or cfg.eval_bleu):
        raise ConfigError(
            "parallel.pp does not compose with "
            + (
                "precision=fp16 (its loss scaler); use bf16"
                if precision == "fp16"
                else "eval_bleu=true (decoding needs the whole model); "
                "set eval_bleu=false and decode a consolidated checkpoint with tformer evaluate"
            )
        )
    if cfg.tensorboard.enabled:
        check_tensorboard()
    # the mesh's arithmetic and what the strategy and model shapes allow, before any process group
    dims = ParallelDims.from_config(cfg.parallel, int(os.environ.get("WORLD_SIZE", "1")))
    check_strategy(dims, cfg.parallel.strategy)
    check_context_parallel(cfg, dims)
    check_moe_layout(cfg, dims)
    check_tp(cfg.model, dims.tp)
    if cfg.compile and dims.tp > 1 and cfg.model.position == "rotary":
        # measured on torch 2.13: the compiled block's backward hands DTensor's redistribute a plain
        # tensor ("'Tensor' object has no attribute '_local_tensor'") for rotary models only
        raise ConfigError(
            "compile=true with parallel.tp > 1 fails in torch's DTensor backward for rotary-position "
            "models (Llama flavour); set compile=false (or parallel.tp=1) for this model"
        )
    if cfg.compile and dims.tp > 1 and torch.torch_version.TorchVersion(torch.__version__) < "2.13":
        # measured on torch 2.11: dynamo fails building the compiled block's guards over the TP
        # hooks ("'function' object has no attribute '__func__'"); 2.13 compiles them
        raise ConfigError(
            f"compile=true with parallel.tp > 1 needs torch >= 2.13 (this is {torch.__version__}, whose "
            "compiler fails on the tensor-parallel blocks); set compile=false or upgrade torch"
        )
    # after the config's own mistakes, so those are reported whether or not the package is here
    check_float8(cfg, precision, device)  # fp8: torchao, FP8 tensor cores, no DeepSpeed
    strategy_class(cfg.parallel.strategy).check(cfg, precision)  # e.g. DeepSpeed missing
    check_paths(cfg)
    return dims


def check_paths(cfg: TrainConfig) -> None:
    """The run directory can be made and written; an explicit resume path exists."""
    if cfg.resume not in ("auto", "none") and not Path(cfg.resume).exists():
        raise ConfigError(
            f"resume={cfg.resume} does not exist; pass a run directory, one of its "
            "checkpoints (RUN/checkpoints/step_XXXXXXXX), auto or none"
        )
    out = Path(cfg.output_dir)
    for p in (out, *out.parents):
        if p.exists():
            if not p.is_dir():
                raise ConfigError(f"output_dir={cfg.output_dir} cannot be created: {p} is a file; pass a directory path")
            if not os.access(p, os.W_OK | os.X_OK) and p == out:
                raise ConfigError(f"output_dir={cfg.output_dir} is not writable; pass a directory you can write to")
            break


def check_tensorboard() -> None:
    import importlib.util

    if importlib.util.find_spec("tensorboard") is None:
        raise ConfigError(
            "tensorboard.enabled=true but the tensorboard package is not installed; "
            "pip install 'tformer[tensorboard]' (or pip install tensorboard), or set tensorboard.enabled=false"
        )
