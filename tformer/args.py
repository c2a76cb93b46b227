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


class DefaultsHelp(argparse.HelpFormatter):
    """Every option's help ends in its default, unless the help already says it (or there is none
    to say: a flag, an option that is off unless given)."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if (
            "default" in text
            or default in (None, False, argparse.SUPPRESS)
            or (not action.option_strings and action.nargs not in ("?", "*"))
        ):
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


class Parser(argparse.ArgumentParser):
    """argparse that reports a bad argument as one ``error:`` line (no usage block), exit 2, and
    shows each option's default in ``--help``."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", DefaultsHelp)
        super().__init__(*args, **kwargs)

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


SIZE_HELP = "a bare number is GiB (80 = 80 GiB); or with a unit: 80GiB, 80GB, 512MiB, 8.6e10B (K/M/G/T are binary)"
# a bare number at least this large was meant as bytes (80e9 GiB is no device): refused, not guessed
BARE_GIB_LIMIT = 2**20


def byte_size(text: str) -> str:
    """A size such as 80 (GiB), 80GB or 24GiB."""
    from .config import ConfigError

    try:
        if parse_bytes(text) <= 0:
            raise ConfigError("not positive")
    except ConfigError as e:
        reason = str(e) if "bare number" in str(e) else f"{text!r} is not a size"
        raise argparse.ArgumentTypeError(f"{reason}; use e.g. 80 (GiB), 80GiB or 8.6e10B") from None
    return text


def parse_bytes(text: str) -> float:
    """Bytes in a size: a bare number is GiB (``80``), else a number with a unit (``80GB``,
    ``24GiB``, ``512M``, ``8.6e10B``; K/M/G/T binary either way, as device memory is quoted). A bare
    number of ``BARE_GIB_LIMIT`` or more is refused: it was meant as bytes."""
    from .config import ConfigError

    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([KMGT]i?B?|B)?\s*", text, re.IGNORECASE)
    if not m:
        raise ConfigError(f"{text!r} is not a size; write e.g. 80 (GiB), 80GiB or 8.6e10B")
    value = float(m.group(1))
    if m.group(2) is None:
        if value >= BARE_GIB_LIMIT:
            raise ConfigError(f"{text!r}: a bare number is GiB; for bytes write {text.strip()}B")
        return value * 2**30
    unit = m.group(2).upper().rstrip("B").rstrip("I")
    return value * {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[unit]


def shard_size(text: str) -> str:
    """A safetensors shard size as HF's writer reads it (5GB, 500MB: decimal units)."""
    from huggingface_hub.serialization._base import parse_size_to_int

    try:
        if parse_size_to_int(text) <= 0:
            raise ValueError
    except (ValueError, TypeError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a shard size; use e.g. 5GB or 500MB") from None
    return text
