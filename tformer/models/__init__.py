"""The model zoo: three families assembled from the shared blocks in ``tformer.nn``."""

from __future__ import annotations

from typing import Any

from ..config import ConfigError, ModelConfig
from .base import ModelOutput, TformerModel
from .decoder import DecoderModel
from .encdec import EncoderDecoderModel
from .encoder import EncoderModel
from .presets import PRESETS, preset
from .spec import FAMILY_CLASSES, SPECS, ModelSpec, register, spec_of


def build_config(preset_or_config: str | ModelConfig | dict[str, Any], **overrides: Any) -> ModelConfig:
    if isinstance(preset_or_config, str):
        return preset(preset_or_config, **overrides)
    if isinstance(preset_or_config, ModelConfig):
        return preset_or_config.replace(**overrides) if overrides else preset_or_config
    if isinstance(preset_or_config, dict):
        data = dict(preset_or_config)
        base = data.pop("preset", None)
        if base is not None:
            return preset(base, **{**data, **overrides})
        return ModelConfig.from_dict({**data, **overrides})
    raise ConfigError(f"build_model takes a preset name, a ModelConfig or a dict, not {type(preset_or_config).__name__}")


def build_model(preset_or_config: str | ModelConfig | dict[str, Any], **overrides: Any) -> TformerModel:
    """Build a model from a preset name (``"gpt2-small"``), a ``ModelConfig`` or a dict, with field
    overrides: ``build_model("gpt2-tiny", num_layers=4)``."""
    cfg = build_config(preset_or_config, **overrides)
    return spec_of(cfg).build(cfg)


__all__ = [
    "build_model",
    "build_config",
    "preset",
    "PRESETS",
    "ModelConfig",
    "ModelOutput",
    "TformerModel",
    "EncoderModel",
    "DecoderModel",
    "EncoderDecoderModel",
    "FAMILY_CLASSES",
    "ModelSpec",
    "SPECS",
    "register",
    "spec_of",
]
