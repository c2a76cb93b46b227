"""One full-precision state dict from any checkpoint: safetensors (ddp), DCP shards (ddp/fsdp, any
world size) or DeepSpeed ZeRO partitions. Everything happens on CPU in one process, so a sharded
model is never gathered onto an accelerator; :func:`load_checkpoint` builds the model from it for
inference."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..config import ModelConfig
from ..files import atomic_write, save_safetensors, unique_tensors
from ..models import build_model
from .io import (
    DCP_DIR,
    DEEPSPEED_DIR,
    DEEPSPEED_TAG,
    WEIGHTS,
    CheckpointError,
    is_tied_alias,
    load_model_from_dcp,
    load_model_weights,
    read_trainer_state,
    resolve_checkpoint,
)
from .state import TrainerState


def read_model_state(ckpt: str | Path, trust: bool = False) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(model config, full fp32 state dict with tied tensors once) of a tformer checkpoint (a run
    directory means its newest one); its pickles are read through an allow-list unless ``trust``."""
    return read_resolved_model_state(resolve_checkpoint(ckpt, trust), trust)


def read_resolved_model_state(ckpt: Path, trust: bool = False) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """:func:`read_model_state` of a checkpoint already resolved by ``resolve_checkpoint`` (sizes,
    CRC-32 and every pickle checked once there, not again here)."""
    saved = TrainerState.read(ckpt).model_config
    if saved is None:
        raise CheckpointError(f"checkpoint {ckpt} records no model_config; it is not a tformer checkpoint")
    cfg = ModelConfig.from_dict(dict(saved))
    if (ckpt / WEIGHTS).is_file():
        from safetensors.torch import load_file

        return cfg, load_file(ckpt / WEIGHTS)
    if (ckpt / DCP_DIR).is_dir():
        with torch.device("meta"):
            model = build_model(cfg)
        model.to_empty(device="cpu")
        if cfg.tie_embeddings:  # to_empty unties: tie again so both names read one tensor
            model.lm_head.weight = model.embed.tok.weight
        load_model_from_dcp(model, ckpt, trust)
        return cfg, unique_tensors(dict(model.state_dict()))
    if (ckpt / DEEPSPEED_DIR).is_dir():
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        # its pickles were read through the allow-list by resolve_checkpoint (check_checkpoint)
        state = get_fp32_state_dict_from_zero_checkpoint(str(ckpt / DEEPSPEED_DIR), tag=DEEPSPEED_TAG)
        return cfg, unique_tensors({k: v.float() for k, v in state.items()})
    raise CheckpointError(f"checkpoint {ckpt} holds no model weights ({WEIGHTS}, {DCP_DIR}/ or {DEEPSPEED_DIR}/)")


def consolidate(ckpt: str | Path, out: str | Path | None = None, trust: bool = False) -> Path:
    """Write ``model.safetensors`` (one file, fp32) for any checkpoint; the model config goes in
    the file's metadata. Written to a temporary name and renamed: never a partial file."""
    ckpt = resolve_checkpoint(ckpt, trust)
    cfg, state = read_resolved_model_state(ckpt, trust)
    out = Path(out) if out else ckpt / "consolidated.safetensors"
    with atomic_write(out) as tmp:
        save_safetensors(
            {k: v.contiguous() for k, v in state.items()}, tmp, {"tformer_model_config": json.dumps(cfg.to_dict())}
        )
    return out


def load_checkpoint(path: str | Path, device: str | torch.device = "cpu", trust: bool = False):
    """The model of a checkpoint (or of a run directory's newest checkpoint), ready for inference.
    Its pickles are read through an allow-list unless ``trust`` (see ``tformer/safeload.py``)."""
    path = resolve_checkpoint(path, trust)
    state = read_trainer_state(path)
    model_cfg = state.get("model_config")
    if model_cfg is None:
        raise CheckpointError(f"checkpoint {path} records no model_config")
    model = build_model(dict(model_cfg))
    if (path / WEIGHTS).is_file():
        load_model_weights(model, path)
    else:  # DCP shards or DeepSpeed partitions, consolidated on CPU
        _, state = read_resolved_model_state(path, trust)
        missing, unexpected = model.load_state_dict(state, strict=False)
        missing = [n for n in missing if not is_tied_alias(model, n, state)]
        if missing or unexpected:
            raise CheckpointError(
                f"checkpoint {path} does not fit its recorded model config (missing: "
                f"{', '.join(missing[:3]) or '-'}; unexpected: {', '.join(unexpected[:3]) or '-'})"
            )
    return model.to(device).eval()
