"""Layers only look down and imports run one way (CONTRIBUTING.md, "Layering").

No module imports a layer above its own, and no modules import each other in a circle, not even
inside one folder. Every import is read from the source with ``ast``, including those inside
functions and under ``if TYPE_CHECKING:``, so a lazy import is no way around either rule. Each
checker is also run on a small synthetic package holding a violation, to show the test can fail.
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
    (
        "base",
        (
            "tformer.config",
            "tformer.config_checks",
            "tformer.decode_config",
            "tformer.args",
            "tformer.logs",
            "tformer.files",
            "tformer.safeload",
        ),
    ),
    ("nn", ("tformer.nn",)),
    ("models", ("tformer.models", "tformer.generate", "tformer.evaluate")),
    ("data", ("tformer.data",)),
    ("parallel", ("tformer.parallel",)),
    ("plan", ("tformer.plan",)),  # the planner reads parallel/'s layouts and memory model
    ("checkpoint", ("tformer.checkpoint",)),
    # train/ by concern, lowest first: the run config and process group every part reads; what a run
    # reports (observe/); what keeps it going through faults (resilience/); the loop that runs the
    # steps (loop/); and the trainer that puts them together (train/trainer.py, the package's
    # __init__ and any module directly in train/ not named here)
    (
        "train: base",
        (
            "tformer.train.config",
            "tformer.train.config_data",
            "tformer.train.recipe",
            "tformer.train.dist",
            "tformer.train.reference",
        ),
    ),
    ("train: observe", ("tformer.train.observe",)),
    ("train: resilience", ("tformer.train.resilience",)),
    ("train: loop", ("tformer.train.loop",)),
    ("train: trainer", ("tformer.train",)),
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


def module_graph(root: Path) -> dict[str, dict[str, int]]:
    """module -> {module of ours it imports: first line}, at any depth in the file.

    ``from pkg import name`` points at the module ``pkg.name`` where there is one, else at ``pkg``
    (its ``__init__``); any other target at the longest name of ours above it. Importing
    ``pkg.mod`` also runs ``pkg/__init__``, but that edge is left out: a package's ``__init__``
    re-exporting its own modules is the usual shape, not a circle.
    """
    paths = {module_name(path, root): path for path in sorted(root.rglob("*.py"))}

    def ours(target: str) -> str | None:
        parts = target.split(".")
        while parts and ".".join(parts) not in paths:
            parts.pop()
        return ".".join(parts) if parts else None

    graph: dict[str, dict[str, int]] = {}
    for name, path in paths.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(
                    [
                        *(package[: len(package) - node.level + 1] if node.level else []),
                        *([node.module] if node.module else []),
                    ]
                )
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in paths else base for alias in node.names]
            for target in targets:
                found = ours(target)
                if found is not None and found != name:
                    edges[found] = min(edges.get(found, node.lineno), node.lineno)
        graph[name] = edges
    return graph


def circles(root: Path) -> list[str]:
    """One line per import circle under ``root`` (a strongly connected set of modules), naming one
    closed path through it with the line of each import."""
    graph = module_graph(root)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(module: str) -> None:  # Tarjan's strongly connected components
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for other in graph[module]:
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in on_stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in graph:
        if module not in index:
            visit(module)

    lines = []
    for component in sorted(found):
        members, start = set(component), component[0]
        # the shortest closed path from the first member back to itself, inside the component
        paths = {start: [start]}
        queue = [start]
        cycle: list[str] = []
        while queue and not cycle:
            here = queue.pop(0)
            for other in sorted(graph[here]):
                if other == start:
                    cycle = [*paths[here], start]
                    break
                if other in members and other not in paths:
                    paths[other] = [*paths[here], other]
                    queue.append(other)
        hops = " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:])) + f" -> {start}"
        lines.append(f"{len(component)} modules import each other in a circle: {', '.join(component)}; e.g. {hops}")
    return lines


def test_no_module_imports_a_layer_above_its_own():
    assert violations(ROOT) == []


def test_no_import_circles():
    """Not even inside one folder, and not through a function-level import: a shared name goes to a
    module below both of its users."""
    assert circles(ROOT) == []


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
            f"tformer/parallel/mesh.py:5: tformer.parallel.mesh (parallel) imports {target} "
            f"({LAYERS[layer_of(target)][0]}), a layer above it"
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


@pytest.mark.parametrize(
    "where, line, above",
    [
        # observe/ reports: it never reaches into what keeps the run going, nor into the loop
        ("observe/console.py", "from ..resilience.spike import SpikeDetector", "train: resilience"),
        ("observe/console.py", "from ..loop.figures import StepFigures", "train: loop"),
        # resilience/ is called by the loop and the trainer, never the other way round
        ("resilience/rollback.py", "from ..loop.state import RunState", "train: loop"),
        ("resilience/ft.py", "from .. import trainer", "train: trainer"),
        ("loop/step.py", "from ..trainer import Trainer", "train: trainer"),
        # the run config is the base of train/: it imports none of the folders
        ("config.py", "from .observe import console", "train: observe"),
    ],
)
def test_the_train_folders_import_one_way(tmp_path, where, line, above):
    """A copy of tformer/ with one import that runs up inside train/: the check names exactly it."""
    import shutil

    copy = tmp_path / "tformer"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns("__pycache__", "corpus"))
    path = copy / "train" / where
    path.write_text(path.read_text() + f"\n\ndef _late():\n    {line}  # a door in the wrong wall\n")
    found = violations(copy)
    assert len(found) == 1 and found[0].startswith(f"tformer/train/{where}:") and f"({above})" in found[0], found


def test_every_train_module_sits_in_a_folder_by_concern():
    """Only the run config's base modules and the trainer that composes the folders sit directly in
    train/; everything else lives in loop/, observe/ or resilience/."""
    top = sorted(p.name for p in (ROOT / "train").glob("*.py"))
    assert top == ["__init__.py", "config.py", "config_data.py", "dist.py", "recipe.py", "reference.py", "trainer.py"]
    assert {p.name for p in (ROOT / "train").iterdir() if p.is_dir() and p.name != "__pycache__"} == {
        "loop",
        "observe",
        "resilience",
    }


@pytest.mark.parametrize(
    "mesh",
    [
        "from .strategy import Layout\n",  # top-level
        "import os\n\n\ndef main():\n    from .strategy import Layout\n",  # lazily, inside a function
        "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from . import strategy\n",  # types only
        "from tformer.parallel import strategy\n",  # absolute, a module named as a package's attribute
    ],
)
def test_the_check_finds_a_circle(tmp_path, mesh):
    root = tmp_path / "tformer"
    _write(
        root,
        {
            "__init__.py": "",
            "parallel/__init__.py": "from .strategy import Layout\n",  # a package re-exporting: no circle
            "parallel/strategy.py": "from .deepspeed import X\nfrom .mesh import Y\n",
            "parallel/deepspeed.py": "from ..parallel.config import Z\n",  # importing pkg.mod runs pkg/__init__: not counted
            "parallel/config.py": "",
            "parallel/mesh.py": mesh,
        },
    )
    found = circles(root)
    assert len(found) == 1, found
    assert found[0].startswith("2 modules import each other in a circle: tformer.parallel.mesh, tformer.parallel.strategy;")
    assert "tformer.parallel.mesh (line" in found[0] and "tformer.parallel.strategy (line 2)" in found[0]


def test_a_tree_without_circles_passes(tmp_path):
    _write(
        tmp_path / "tformer",
        {"__init__.py": "from . import a\n", "a.py": "from .b import X\n", "b.py": "import os\nimport tformer\n"},
    )
    # b imports the package, whose __init__ imports a, which imports b: a real circle
    assert len(circles(tmp_path / "tformer")) == 1
    _write(tmp_path / "tformer", {"b.py": "import os\n"})
    assert circles(tmp_path / "tformer") == []


def test_the_real_tree_fails_once_two_of_its_modules_import_each_other(tmp_path):
    """A copy of tformer/ where checkpoint/state.py lazily imports the manager that imports it: the
    check names that circle."""
    import shutil

    copy = tmp_path / "tformer"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns("__pycache__", "corpus"))
    state = copy / "checkpoint" / "state.py"
    state.write_text(state.read_text() + "\n\ndef _late():\n    from .manager import CheckpointManager  # back up\n")
    found = [line for line in circles(copy) if "tformer.checkpoint.state" in line]
    assert len(found) == 1 and "tformer.checkpoint.manager" in found[0], circles(copy)


def test_no_family_name_is_asked_outside_the_config_and_the_spec_registry():
    """A flavour's facts come from its spec or its switches (a ModernBERT is an encoder with local
    windows, a T5Gemma an encoder-decoder with soft-caps): code that compares family names would
    mis-serve them. Only the config (validation) and the registry (``spec_of``) may."""
    import re

    allowed = {ROOT / "config.py", ROOT / "models" / "spec.py"}
    asked = re.compile(r"""\bfamily\s*(==|!=|in\b)|(==|!=)\s*\w*\.family\b""")
    found = [
        f"{path.relative_to(ROOT.parent)}:{n}: {line.strip()}"
        for path in sorted(ROOT.rglob("*.py"))
        if path not in allowed
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if asked.search(line)
    ]
    assert not found, "\n".join(found)
    assert asked.search('if cfg.family == "encoder":')  # the pattern catches what it is for
