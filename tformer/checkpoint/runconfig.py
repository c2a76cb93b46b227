"""The run config a checkpoint carries: ``config.yaml`` in the checkpoint and in its run directory.

Readers of checkpoints (the exporter, ``tformer generate``, decoding defaults) find and read it
here, and the importer writes one here, without reaching into the trainer's package. The file is a
mapping of sections (``model``, ``data``, ``parallel``, ``decode``, ...), each the ``to_dict`` of its
owner's dataclass; a key it leaves out takes its default when the trainer reads the file.

One source of decoding defaults: the run's ``decode`` section (num_beams, length_penalty,
length_norm, max_new_tokens) is how the run translates: ``eval_bleu`` during training and ``tformer
evaluate --bleu`` decode with it, and ``tformer generate`` and the HF export's
``generation_config.json`` take it (``saved_decode``) as their defaults too (command-line flags
override it). Runs that do not translate (``data.objective`` other than ``seq2seq``: language
models, span corruption) have no decoding recipe: greedy, as HF's default.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from ..config import ModelConfig
from ..decode_config import DecodeConfig, decode_config
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


def saved_decode(path: str | Path) -> DecodeConfig | None:
    """The ``decode`` settings of the translation run that wrote ``path``, with ``max_new_tokens``
    resolved to the run's target length when the recipe leaves it to the data (as BLEU does); None
    for a run that does not translate, or one without a config.yaml."""
    raw = find_run_config(path)
    if raw is None or (raw.get("data") or {}).get("objective") != "seq2seq":
        return None
    decode = decode_config(raw.get("decode") or {})  # validated like the recipe
    if decode.max_new_tokens is None:
        decode.max_new_tokens = (raw.get("data") or {}).get("target_len") or (raw.get("data") or {}).get("seq_len")
    return decode
