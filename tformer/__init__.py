"""tformer: one set of transformer blocks, three model families, one trainer."""
from .config import ConfigError, ModelConfig
from .models import PRESETS, build_config, build_model, preset

__version__ = "0.1.0"
__all__ = ["ConfigError", "ModelConfig", "PRESETS", "build_config", "build_model", "preset"]
