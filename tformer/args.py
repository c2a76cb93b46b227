"""Command-line argument helpers: every bad flag is one ``error:`` line, never argparse's usage
block or a traceback."""

from __future__ import annotations

import argparse
import math
import re


class UsageError(SystemExit):
    """A bad command-line argument (one line). A ``SystemExit`` with code 2, like argparse's own,
    so callers of a parser see the same exception type; ``tformer``'s main prints it as one line."""

    def __init__(self, message: str):
        super().__init__(message)
        self.code = 2


class Parser(argparse.ArgumentParser):
    """argparse that reports a bad argument as one ``error:`` line (no usage block), exit 2."""

    def error(self, message: str):
        raise UsageError(f"{self.prog}: {message}; see {self.prog} --help")


def number(kind, spec: str):
    """An argparse type: ``kind`` (int/float) within ``spec`` (e.g. "[1, inf)")."""
    from .config import in_range

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if (isinstance(value, float) and math.isnan(value)) or not in_range(value, spec):
            raise argparse.ArgumentTypeError(f"{text} is out of range; use a value in {spec}")
        return value

    parse.__name__ = kind.__name__
    return parse


def byte_size(text: str) -> str:
    """A size such as 80GB or 24GiB."""
    from .config import ConfigError

    try:
        if parse_bytes(text) <= 0:
            raise ConfigError("not positive")
    except (ConfigError, KeyError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; use e.g. 80GB or 24GiB") from None
    return text


def parse_bytes(text: str) -> float:
    """Bytes in a size such as 80GB, 24GiB or 512M (binary units either way)."""
    from .config import ConfigError

    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]i?B?|B)?\s*", text, re.IGNORECASE)
    if not m:
        raise ConfigError(f"--device-memory {text!r} is not a size; write e.g. 80GB or 24GiB")
    unit = (m.group(2) or "B").upper().rstrip("B").rstrip("I")
    return float(m.group(1)) * {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[unit]


def shard_size(text: str) -> str:
    """A safetensors shard size as HF's writer reads it (5GB, 500MB: decimal units)."""
    from huggingface_hub.serialization._base import parse_size_to_int

    try:
        if parse_size_to_int(text) <= 0:
            raise ValueError
    except (ValueError, TypeError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a shard size; use e.g. 5GB or 500MB") from None
    return text
