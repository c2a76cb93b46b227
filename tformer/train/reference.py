"""The configuration reference (docs/reference/config.md), generated from the config dataclasses.

Every key of the run config with its type, default, allowed range and meaning. The meaning is the
comment on the field's line in its source (or the comment block right above the field), so the
reference says what the code says. ``python -m tformer.train.reference`` rewrites the page;
``tests/test_docs.py`` fails while the committed page differs from what this module renders.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import io
import re
import sys
import tokenize
import types
from dataclasses import fields
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

from ..config import config_key, field_hints, unwrap_optional
from .config import TrainConfig

PAGE = Path("docs/reference/config.md")
HEADER = """# Configuration reference

Every key a recipe (or a `key=value` override) takes. Sections are written dotted on the command
line (`optim.lr=1e-3`) and nested in YAML (`optim: {lr: 1e-3}`). A range is checked when the config
is read, before any work; `null`, where a key allows it, is never out of range. `model` starts from
a preset (`model.preset=gpt2-tiny` in the recipes); the model defaults below are those of a bare
`ModelConfig`, which a preset replaces.

This page is generated from the code (`python -m tformer.train.reference`); edit the fields'
declarations and comments, not this page.
"""


def field_comments(cls: type) -> dict[str, str]:
    """Field name -> its comment: the one on its line, else the comment lines right above it."""
    source = inspect.getsource(cls)
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    lines, found = source.splitlines(), {}
    for number, line in enumerate(lines, 1):
        m = re.match(r"    (\w+): ", line)
        if not m:
            continue
        text = comments.get(number) if not line.lstrip().startswith("#") else None
        if not text:
            above: list[str] = []
            n = number - 1
            while n >= 1 and lines[n - 1].strip().startswith("#"):
                above.insert(0, comments[n])
                n -= 1
            text = " ".join(above)
        found[m.group(1)] = text
    return found


def _type(hint: Any) -> str:
    base, optional = unwrap_optional(hint)
    if get_origin(base) is Literal:
        text = " \\| ".join(f"`{v}`" for v in get_args(base))
    else:
        parts = get_args(base) if get_origin(base) in (Union, types.UnionType) else (base,)
        text = " or ".join(getattr(p, "__name__", str(p)) for p in parts)
    return f"{text} or null" if optional else text


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return ""
    return f"`{json.dumps(value)}`"  # YAML's spelling of these values: null, true, [], "text", 0.0001


def _rows(cls: type, prefix: str) -> list[str]:
    hints, comments, rows, sections = field_hints(cls), field_comments(cls), [], []
    for f in fields(cls):
        hint, key = hints[f.name], prefix + config_key(f)
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            sections.append((hint, key + "."))
            continue
        spec = f"`{f.metadata['range']}`" if "range" in f.metadata else ""
        meaning = comments.get(f.name, "").replace("|", "\\|")
        rows.append(f"| `{key}` | {_type(hint)} | {_default(f)} | {spec} | {meaning} |")
    out = []
    if rows:
        title = prefix.rstrip(".") or "top level"
        head = ["| key | type | default | range | meaning |", "| --- | --- | --- | --- | --- |"]
        out += [f"## {title}", "", *head, *rows, ""]
    for section, section_prefix in sections:
        out += _rows(section, section_prefix)
    return out


def render() -> str:
    return HEADER + "\n" + "\n".join(_rows(TrainConfig, "")).rstrip() + "\n"


def main(argv: list[str]) -> int:
    root = Path(argv[0]) if argv else Path(".")
    (root / PAGE).write_text(render())
    print(f"wrote {root / PAGE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
