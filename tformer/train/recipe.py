"""A recipe file (YAML) and its dotted ``key=value`` overrides, as the plain mapping that
``config.py`` turns into a typed run config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from ..config import ConfigError


def parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not key=value (e.g. max_steps=100 or optim.lr=1e-3)")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw != "" else None
    except yaml.YAMLError:
        value = raw
    return key.strip().split("."), value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    data = dict(data)
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for part in path[:-1]:
            child = node.get(part)
            child = dict(child) if isinstance(child, dict) else {}
            node[part] = child
            node = child
        node[path[-1]] = value
    return data


def load_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist; pass a recipe such as configs/gpt2-tiny.yaml")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or "invalid YAML"
        raise ConfigError(f"{path}{where}: {problem}; fix the YAML syntax") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of config keys, not a {type(data).__name__}")
    return data
