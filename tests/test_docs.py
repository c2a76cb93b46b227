"""The docs stay true to the code: the configuration reference is what the code renders, and each
config key's allowed range is declared once, on its field (``tformer.config.ranged``), never again
in a check, a table or a page."""

from __future__ import annotations

import ast
import re

from tformer.config import ranges
from tformer.train.config import TrainConfig
from tformer.train.reference import PAGE, render

from train_helpers import ROOT

SPEC = re.compile(r"^[\[(]-?[\d.e]+, *(-?[\d.e]+|inf)[\])]$")


def test_reference_page_is_what_the_code_renders():
    """docs/reference/config.md is generated; regenerate it with `python -m tformer.train.reference`."""
    assert (ROOT / PAGE).read_text() == render(), "stale: run `python -m tformer.train.reference`"


def test_reference_lists_every_key_with_its_range():
    page = render()
    for key, spec in ranges(TrainConfig).items():
        assert re.search(rf"^\| `{re.escape(key)}` \|.*\| `{re.escape(spec)}` \|", page, re.MULTILINE), key
    assert "| `checkpoint.async` | bool | `false` |" in page  # a field under its config key


def _is_ranged_call(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "ranged"


def _raises_config_error(body: list[ast.stmt]) -> bool:
    return any(isinstance(s, ast.Raise) and "ConfigError" in ast.unparse(s) for s in body)


def _number(node: ast.AST) -> bool:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        node = node.operand
    return isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool)


def range_duplicates(source: str, keys: set[str], where: str = "<source>") -> list[str]:
    """Places in Python ``source`` that state a range of one of the config ``keys`` (their last
    dotted part) again: a range literal as the value of a table keyed by a key name (a ``RANGES``
    table), or an ``if`` whose whole test compares such a key's attribute with a number and raises
    ``ConfigError`` (a range re-checked by hand). A comparison with another field (``top_k >
    num_experts``) or inside a longer condition is a rule between keys, and ``== 0`` excludes one
    value (``parallel.dp_shard``): neither is a range."""
    tree, found = ast.parse(source), []
    declared = {id(a) for n in ast.walk(tree) if _is_ranged_call(n) for a in n.args}
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            for k, v in zip(node.keys, node.values):
                spec = isinstance(v, ast.Constant) and isinstance(v.value, str) and SPEC.match(v.value)
                name = isinstance(k, ast.Constant) and str(k.value).split(".")[-1] in keys
                if spec and name and id(v) not in declared:
                    found.append(f"{where}:{v.lineno}: table entry {ast.unparse(k)}: {ast.unparse(v)}")
        bound = isinstance(node, ast.If) and isinstance(node.test, ast.Compare) and len(node.test.ops) == 1
        if bound and isinstance(node.test.ops[0], (ast.Lt, ast.LtE, ast.Gt, ast.GtE)):  # not == (one value)
            left, right = node.test.left, node.test.comparators[0]
            attr = left if isinstance(left, ast.Attribute) else right if isinstance(right, ast.Attribute) else None
            number = _number(right) if attr is left else _number(left)
            if attr is not None and attr.attr in keys and number and _raises_config_error(node.body):
                found.append(f"{where}:{node.lineno}: {ast.unparse(node.test)}")
    return found


def _keys() -> set[str]:
    return {key.split(".")[-1] for key in ranges(TrainConfig)}


def test_each_range_is_declared_once_on_its_field():
    keys, found = _keys(), []
    for path in sorted((ROOT / "tformer").rglob("*.py")):
        found += range_duplicates(path.read_text(), keys, str(path.relative_to(ROOT)))
    assert found == []


def test_no_page_but_the_reference_tabulates_ranges():
    """A hand-written table of ranges (README's old "Allowed ranges") would drift from the code."""
    row = re.compile(r"^\|\s*`[\w.]+`\s*\|\s*`[\[(]-?[\d.]+, *(-?[\d.]+|inf)[\])]`\s*\|", re.MULTILINE)
    pages = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md"))]
    assert [str(p.relative_to(ROOT)) for p in pages if p != ROOT / PAGE and row.search(p.read_text())] == []


def test_the_duplicate_finder_finds_what_the_code_used_to_hold():
    """The two forms the ranges were repeated in before they moved onto the fields."""
    old = """
RANGES = {"parallel.ac_every": "[1, inf)", "seed": "[0, inf)", "name": "not a range"}
def validate(self):
    if self.parallel.ac_every < 1:
        raise ConfigError(f"parallel.ac_every={self.parallel.ac_every} must be >= 1")
    if self.optim.lr <= 0:
        raise ConfigError("optim.lr must be > 0")
    if self.parallel.tp > 1 and self.compile:  # a rule between keys
        raise ConfigError("...")
    if self.top_k > self.num_experts:  # a bound by another field
        raise ConfigError("...")
    x: int = ranged(1, "[1, inf)")  # the declaration itself
"""
    found = range_duplicates(old, _keys() | {"top_k"})
    assert [f.split(": ", 1)[1] for f in found] == [
        "table entry 'parallel.ac_every': '[1, inf)'",
        "table entry 'seed': '[0, inf)'",
        "self.parallel.ac_every < 1",
        "self.optim.lr <= 0",
    ]


def test_the_exporter_reads_and_writes_run_configs_through_the_checkpoint_package():
    """export/ takes the run config's file from checkpoint/runconfig.py, not the trainer's package."""
    from test_layering import imports

    root = ROOT / "tformer"
    used = {m for path in (root / "export").glob("*.py") for _, m in imports(path, root)}
    assert "tformer.checkpoint.runconfig" in used
    assert "tformer.train.config" not in used


def test_readme_speed_table_is_generated_from_the_newest_gpu_measurement():
    """README's "Speed on a GPU" table is what bench/speed_table.py renders from the newest
    bench/results/*.json: regenerate it with `python bench/speed_table.py --write`."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("speed_table", ROOT / "bench" / "speed_table.py")
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    rendered = table.render()
    assert "| llama-1b, seq 2048 | compiled |" in rendered and "tformer / HF" in rendered
    assert table.readme_table((ROOT / "README.md").read_text()) == rendered, (
        "stale: run `python bench/speed_table.py --write`"
    )
