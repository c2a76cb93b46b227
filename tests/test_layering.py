"""Layers only look down: no module imports a layer above its own (CONTRIBUTING.md, "Layering").

Every import is read from the source with ``ast``, including those inside functions, so a lazy
import is no way around the rule. The checker is also run on a small synthetic package holding a
violation, to show the test can fail.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "tformer"

# Lowest first. A module may import its own layer and any layer below it, never one above. A module
# belongs to the longest entry that is its name or a package above it ("tformer", the package's
# own __init__, holds only itself).
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("tformer.config", "tformer.args", "tformer.logs", "tformer.files", "tformer.safeload")),
    ("nn", ("tformer.nn",)),
    ("models", ("tformer.models", "tformer.generate", "tformer.evaluate")),
    ("data", ("tformer.data",)),
    ("parallel", ("tformer.parallel",)),
    ("plan", ("tformer.plan",)),  # the planner reads parallel/'s layouts and memory model
    ("checkpoint", ("tformer.checkpoint",)),
    ("train", ("tformer.train",)),
    ("export/cli", ("tformer.export", "tformer.cli", "tformer.__main__", "tformer")),
]
# rooms that must stay free of torch.distributed (parallelism is applied from outside)
NO_DISTRIBUTED = ("tformer.nn", "tformer.models")


def layer_of(module: str, layers=LAYERS) -> int | None:
    best, found = -1, None
    for index, (_, prefixes) in enumerate(layers):
        for prefix in prefixes:
            inside = "." in prefix and module.startswith(prefix + ".")
            if (module == prefix or inside) and len(prefix) > best:
                best, found = len(prefix), index
    return found


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path, root: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in ``path``, relative ones resolved, at any depth."""
    name = module_name(path, root)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            if node.module:
                found.append((node.lineno, ".".join([*base, node.module])))
            else:  # ``from . import bert``: each name is a module of the package
                found += [(node.lineno, ".".join([*base, alias.name])) for alias in node.names]
    return found


def violations(root: Path, layers=LAYERS) -> list[str]:
    """One line per import of a higher layer (or of a module no layer holds) under ``root``."""
    problems = []
    for path in sorted(root.rglob("*.py")):
        name = module_name(path, root)
        own = layer_of(name, layers)
        if own is None:
            problems.append(f"{path.relative_to(root.parent)}: {name} is in no layer; add it to LAYERS")
            continue
        for line, target in imports(path, root):
            if target.split(".")[0] != root.name:
                continue
            other = layer_of(target, layers)
            if other is not None and other > own:
                problems.append(
                    f"{path.relative_to(root.parent)}:{line}: {name} ({layers[own][0]}) imports "
                    f"{target} ({layers[other][0]}), a layer above it"
                )
    return problems


def test_no_module_imports_a_layer_above_its_own():
    assert violations(ROOT) == []


def test_model_code_never_imports_torch_distributed():
    found = [
        f"{path.relative_to(ROOT.parent)}:{line}: {target}"
        for path in sorted(ROOT.rglob("*.py"))
        if module_name(path, ROOT).startswith(NO_DISTRIBUTED)
        for line, target in imports(path, ROOT)
        if target.startswith("torch.distributed")
    ]
    assert found == []


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.mark.parametrize(
    "line, target",
    [
        ("from ..train.config import load_config", "tformer.train.config"),
        ("from ..data import t5_lengths", None),  # a layer below: allowed
        ("import torch.distributed", None),  # not ours
        ("import tformer.train.trainer", "tformer.train.trainer"),
        ("from ..train import trainer", "tformer.train"),
        ("from .. import train", "tformer.train"),
    ],
)
def test_the_check_finds_an_import_of_a_higher_layer(tmp_path, line, target):
    root = tmp_path / "tformer"
    _write(
        root,
        {
            "__init__.py": "",
            "config.py": "",
            "train/__init__.py": "",
            "train/config.py": "",
            "train/trainer.py": "from ..parallel import mesh\nfrom ..config import X\n",
            "parallel/__init__.py": "",
            # lazily, inside a function: still found
            "parallel/mesh.py": f"import os\n\n\ndef main():\n    {line}\n",
        },
    )
    found = violations(root)
    if target is None:
        assert found == []
    else:
        assert found == [
            f"tformer/parallel/mesh.py:5: tformer.parallel.mesh (parallel) imports {target} (train), a layer above it"
        ]


def test_a_module_in_no_layer_is_reported(tmp_path):
    _write(tmp_path / "tformer", {"__init__.py": "", "config.py": "", "stray.py": "from . import config\n"})
    assert violations(tmp_path / "tformer") == ["tformer/stray.py: tformer.stray is in no layer; add it to LAYERS"]


def test_the_real_tree_fails_once_a_lower_layer_imports_a_higher_one(tmp_path):
    """A copy of tformer/ with one extra import in nn/: the check names exactly that import."""
    import shutil

    copy = tmp_path / "tformer"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns("__pycache__", "corpus"))
    norm = copy / "nn" / "norm.py"
    norm.write_text(norm.read_text() + "\n\ndef _late():\n    from ..checkpoint import io  # a door in the wrong wall\n")
    found = violations(copy)
    assert len(found) == 1 and found[0].startswith("tformer/nn/norm.py:") and "(checkpoint)" in found[0]
