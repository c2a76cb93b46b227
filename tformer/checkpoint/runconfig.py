"""The run config a checkpoint carries: ``config.yaml`` in the checkpoint and in its run directory.

Readers of checkpoints (the exporter, ``tformer generate``, decoding defaults) find and read it
here, and the importer writes one here, without reaching into the trainer's package. The file is a
mapping of sections (``model``, ``data``, ``parallel``, ``decode``, ...), each the ``to_dict`` of its
owner's dataclass; a key it leaves out takes its default when the trainer reads the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from ..config import ModelConfig
from .io import RUN_CONFIG


def find_run_config(path: str | Path) -> dict | None:
    """The run config (as a dict) nearest to ``path``: the config.yaml of the checkpoint or run
    directory ``path``, else of its parents; None when there is none (an imported model)."""
    start = Path(path)
    for d in (start, *start.parents):
        file = d / RUN_CONFIG
        if file.is_file():
            loaded = yaml.safe_load(file.read_text())
            return loaded if isinstance(loaded, dict) else None
    return None


def run_config_yaml(model: ModelConfig, **sections: Any) -> str:
    """``config.yaml`` text for a run that starts from ``model`` (an import): the model section
    whole, then the given sections and top-level keys as they are."""
    return yaml.safe_dump({"model": model.to_dict(), **sections}, sort_keys=False)
