"""The checks every config dataclass gets from its annotations (the model's config, the run
config's sections): ranges declared beside each field (``ranged``), choices from ``Literal`` types,
types, unknown keys with a suggestion. Each error names the field and the fix in one line
(``ConfigError``). ``tformer.config`` re-exports every name here."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import types
from dataclasses import fields
from typing import Any, Iterator, Literal, Mapping, Union, get_args, get_origin, get_type_hints


class ConfigError(ValueError):
    """A configuration problem, stated in one line that names the field and the fix."""


def check_table(table: Mapping[Any, Any], choice: Any, what: str) -> None:
    """Fail at import when ``table`` (keyed by the values of the ``Literal`` ``choice``) misses a
    value or has one too many, so a value added to the type cannot leave a table behind."""
    missing = [v for v in get_args(choice) if v not in table]
    extra = [k for k in table if k not in get_args(choice)]
    if missing or extra:
        raise TypeError(f"{what} does not match its choices: missing {missing}, extra {extra}")


def parse_range(spec: str) -> tuple[float, bool, float, bool]:
    """``"[0, 1)"`` -> (0.0, True, 1.0, False): bounds and whether each is included."""
    lo, hi = (float(x) for x in spec[1:-1].split(","))
    return lo, spec[0] == "[", hi, spec[-1] == "]"


def in_range(value: float, spec: str) -> bool:
    lo, lo_in, hi, hi_in = parse_range(spec)
    return (value > lo or (lo_in and value == lo)) and (value < hi or (hi_in and value == hi))


def ranged(default: Any, spec: str, *, says: str | None = None, note: str | None = None) -> Any:
    """A numeric config field with its allowed range declared beside it, the one place a range is
    written: ``"[1, inf)"``, ``"(0, 1)"`` (inf for no bound; null, where the type allows it, is never
    out of range). ``check_ranges`` checks every such field and words the error from the range
    (``must be >= 1``, ``must be > 0``, ``must be in [0, 1)``); ``says`` replaces that wording,
    ``note`` adds a word on the value in brackets. The configuration reference lists the same."""
    parse_range(spec)  # a malformed range fails at import
    extra = {k: v for k, v in (("says", says), ("note", note)) if v is not None}
    return dataclasses.field(default=default, metadata={"range": spec, **extra})


def positive(default: int | None) -> Any:
    """A model size or count: an integer >= 1 (null, where the type allows it, for its default)."""
    return ranged(default, "[1, inf)", says="a positive integer", note=None if default else "or null for the default")


def _range_words(spec: str) -> str:
    lo, lo_in, hi, hi_in = parse_range(spec)
    if hi == math.inf:
        return f"{'>=' if lo_in else '>'} {lo:g}"
    return f"in {spec}"


def range_error(obj: Any, name: str, prefix: str = "") -> str:
    """The one line for field ``name`` of ``obj`` outside its declared range."""
    f = next(f for f in fields(obj) if f.name == name)
    says = f.metadata.get("says", "").format(**vars(obj)) or _range_words(f.metadata["range"])
    note = f" ({f.metadata['note']})" if "note" in f.metadata else ""
    return f"{prefix}{config_key(f)}={getattr(obj, name)} must be {says}{note}"


def check_ranges(obj: Any, prefix: str = "") -> None:
    """One ConfigError for the first field of dataclass ``obj`` outside the range its declaration
    (``ranged``) gives; nested sections are checked by their own ``validate``."""
    for f in fields(obj):
        spec, value = f.metadata.get("range"), getattr(obj, f.name)
        if spec is None or value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue  # null where allowed; wrong types are reported by the type check
        if math.isnan(value) or not in_range(value, spec):  # NaN is in no range
            raise ConfigError(range_error(obj, f.name, prefix))


def ranges(cls: type, prefix: str = "", nested: bool = True) -> dict[str, str]:
    """Dotted key -> allowed range of every ranged field of dataclass ``cls`` (and, with ``nested``,
    of its sections): a table derived from the declarations, never written by hand."""
    hints, out = field_hints(cls), {}
    for f in fields(cls):
        hint = hints[f.name]
        if isinstance(hint, type) and dataclasses.is_dataclass(hint) and nested:
            out.update(ranges(hint, f"{prefix}{config_key(f)}."))
        elif "range" in f.metadata:
            out[prefix + config_key(f)] = f.metadata["range"]
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def config_key(f: dataclasses.Field) -> str:
    """A field's key in YAML and overrides: its name, or ``metadata["key"]`` where the key is a
    Python keyword (``checkpoint.async`` is the field ``async_``)."""
    return f.metadata.get("key", f.name)


def check_keys(data: dict[str, Any], cls: type, section: str) -> None:
    """Reject unknown keys with a did-you-mean suggestion."""
    known = [config_key(f) for f in fields(cls)]
    prefix = f"{section}." if section else ""
    moved = getattr(cls, "MOVED_KEYS", {})
    for key in data:
        if key in moved:
            raise ConfigError(f"config key {prefix}{key} has moved: write it as {prefix}{moved[key]}")
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f"; did you mean {prefix}{close[0]}?" if close else f"; known keys: {', '.join(known)}"
            raise ConfigError(f"unknown config key {prefix}{key}{hint}")


@functools.cache
def field_hints(cls: type) -> dict[str, Any]:
    """The resolved annotations of a dataclass (cached: every ``replace`` validates again)."""
    return get_type_hints(cls)


def unwrap_optional(hint: Any) -> tuple[Any, bool]:
    """``X | None`` -> ``(X, True)``; any other hint -> ``(hint, False)``."""
    if get_origin(hint) in (Union, types.UnionType):
        args = get_args(hint)
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1 and len(rest) < len(args):
            return rest[0], True
        if len(rest) < len(args):  # e.g. int | str | None: optional, of several kinds
            return Union[tuple(rest)], True
    return hint, False


def choices(hint: Any) -> tuple | None:
    """The allowed values of a ``Literal`` hint (optional or not), else None."""
    base, _ = unwrap_optional(hint)
    return get_args(base) if get_origin(base) is Literal else None


# What a value of each checked type must be, and how an error says so. bool comes before int
# (True is an int to isinstance); a float field also takes an integer.
_EXPECTED: dict[type, tuple[Any, str]] = {
    bool: (bool, "true or false"),
    int: (int, "an integer"),
    float: ((int, float), "a number"),
    str: (str, "a string"),
    list: (list, "a list"),
}


def _check_type(name: str, value: Any, hint: Any) -> None:
    """One ConfigError when ``value`` does not fit the resolved annotation ``hint``: null where the
    hint is not optional, or a value of the wrong type. A ``Literal``'s values are checked by
    ``_check_choice``; hints of other kinds (a nested section) are not checked here."""
    base, optional = unwrap_optional(hint)
    if value is None:
        if not optional:
            raise ConfigError(f"{name} must not be null")
        return
    allowed = choices(base)
    if allowed is not None:  # a Literal: its values' type (every choice is a string)
        kinds = {type(v) for v in allowed}
        base = kinds.pop() if len(kinds) == 1 else None
    if base not in _EXPECTED:
        return
    want, text = _EXPECTED[base]
    ok = isinstance(value, want) and (base is bool or not isinstance(value, bool))
    if not ok:
        raise ConfigError(f"{name}={value!r} has the wrong type; expected {text}")


def _check_choice(name: str, value: Any, hint: Any, null: str | None = None) -> None:
    """One ConfigError when a ``Literal`` field's value is not one of its values. ``null``: what
    null means where the field is optional (said in the message)."""
    allowed = choices(hint)
    if allowed is None or value is None or value in allowed:
        return
    tail = f" (or null: {null})" if null else ""
    raise ConfigError(f"{name}={value!r} is not allowed; use one of: {', '.join(map(str, allowed))}{tail}")


def _walk(obj: Any, prefix: str) -> Iterator[tuple[str, Any, Any, dataclasses.Field]]:
    """(dotted key, value, hint, field) of every field of dataclass ``obj``, nested sections
    (fields holding a dataclass) included after their own entry."""
    hints = field_hints(obj.__class__)
    for f in fields(obj):
        value = getattr(obj, f.name)
        yield prefix + config_key(f), value, hints[f.name], f
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            yield from _walk(value, f"{prefix}{config_key(f)}.")


def check_fields(obj: Any, prefix: str = "") -> None:
    """The checks every field gets from its annotation alone: first the type of every field (in
    nested sections too), then each ``Literal`` field's value against its allowed values."""
    entries = list(_walk(obj, prefix))
    for name, value, hint, _ in entries:
        _check_type(name, value, hint)
    for name, value, hint, f in entries:
        _check_choice(name, value, hint, f.metadata.get("null"))


# Tables derived from the declarations, for callers that want them whole (the tests, the reference)
