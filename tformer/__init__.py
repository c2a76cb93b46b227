"""tformer: one set of transformer blocks, three model families, one trainer."""

from .config import ConfigError, ModelConfig
from .models import PRESETS, build_config, build_model, preset


def load_checkpoint(path, device="cpu", trust=False):
    """The model of a checkpoint (or of a run directory's newest checkpoint), ready for inference.
    ``trust=True`` lets the checkpoint's pickles load freely (they could run code)."""
    from .checkpoint import load_checkpoint as _load

    return _load(path, device, trust)


__version__ = "0.1.0"
__all__ = ["ConfigError", "ModelConfig", "PRESETS", "build_config", "build_model", "preset", "load_checkpoint"]
