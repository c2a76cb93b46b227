"""The run config's ``decode`` section: how a run decodes when it translates (beams, length penalty
and norm, length limit).

It lives here, in the base layer, because the layers below ``train/`` read it from a saved run
config too (``checkpoint.runconfig.saved_decode``: ``tformer generate`` and the HF export take it
as their defaults); ``tformer/train/config.py`` composes it into the run config and re-exports it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from .config import (
    ConfigError,
    LengthNorm,
    _check_type,
    check_fields,
    check_keys,
    check_ranges,
    config_key,
    field_hints,
    ranged,
    unwrap_optional,
)


@dataclass
class DecodeConfig:
    """How the run translates when BLEU is measured (``eval_bleu``, ``tformer evaluate --bleu``)."""

    num_beams: int = ranged(4, "[1, inf)", note="1 = greedy")  # the paper: 4
    length_penalty: float = ranged(0.6, "[0, inf)")  # the paper: alpha 0.6
    length_norm: LengthNorm = "gnmt"  # gnmt: ((5 + len) / 6) ** alpha; power: len ** alpha (HF's)
    max_new_tokens: int | None = ranged(None, "[1, inf)")  # default: the run's target length
    batch_size: int = ranged(32, "[1, inf)")  # pairs decoded at once


def decode_config(data: Any) -> DecodeConfig:
    """The ``decode`` section of a saved run config, checked as the whole run config checks it
    (``train/config.py``): unknown keys, types, choices, ranges, each error in the same words."""
    if not isinstance(data, dict):
        raise ConfigError(f"section decode must be a mapping, got {type(data).__name__}")
    check_keys(data, DecodeConfig, "decode")
    hints, kwargs = field_hints(DecodeConfig), {}
    for f in fields(DecodeConfig):
        key = config_key(f)
        if key in data:
            value = data[key]
            if unwrap_optional(hints[f.name])[0] is float and not isinstance(value, bool):
                value = as_number(value)
            _check_type(f"decode.{key}", value, hints[f.name])
            kwargs[f.name] = value
    decode = DecodeConfig(**kwargs)
    check_fields(decode, "decode.")
    check_ranges(decode, "decode.")
    return decode


def as_number(value: Any) -> Any:
    """YAML 1.1 reads ``1e-3`` as a string; accept it (and ints) where a number is expected."""
    if isinstance(value, (int, str)):
        try:
            return float(value)
        except ValueError:
            return value
    return value
