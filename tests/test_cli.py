"""The ``tformer`` command's own surface: its command list, its version, where the keys are
documented, and the packaging metadata the version comes from."""

from __future__ import annotations

import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import tformer
from tformer.cli import COMMANDS, main

from train_helpers import ROOT


def test_help_lists_every_command_with_one_line(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    listed = dict(re.findall(r"^  ([a-z-]+) +(\S.*)$", out, re.MULTILINE))
    assert set(COMMANDS) <= set(listed), out
    assert all(len(listed[name]) > 10 for name in COMMANDS)
    assert "--version" in out
    assert main([]) == 2 and "commands:" in capsys.readouterr().err  # no command: the list, exit 2


def test_an_unknown_command_is_one_line_pointing_at_help(capsys):
    assert main(["trian"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: unknown command 'trian'") and "tformer --help" in err[0]


def test_version_is_the_installed_metadata_and_the_package_attribute():
    """``tformer --version`` through the installed entry point's interpreter: the distribution's
    metadata, which pyproject.toml takes from ``tformer.__version__``."""
    from importlib.metadata import version

    out = subprocess.run(
        [sys.executable, "-m", "tformer", "--version"], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    assert out == f"tformer {version('tformer')}\n"
    assert version("tformer") == tformer.__version__


@pytest.mark.parametrize(
    "command, says",
    [
        ("train", ["tformer/train/config.py", "README.md", "Training"]),
        ("export", ["BERT", "GPT-2", "Llama", "T5", "Marian"]),
    ],
)
def test_command_help_says_where_the_keys_are_and_what_it_exports(command, says, capsys):
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert [s for s in says if s not in out] == []


def test_train_help_names_a_readme_section_that_exists():
    assert re.search(r"^## Training$", (ROOT / "README.md").read_text(), re.MULTILINE)


def test_pyproject_metadata_applies_without_deprecation_warnings():
    """The license as an SPDX string (setuptools >= 77), not the deprecated table, and the version
    read from ``tformer.__version__``: what ``pip install -e .`` builds."""
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist = apply_configuration(Distribution(), ROOT / "pyproject.toml")
    assert [str(w.message).splitlines()[0] for w in caught] == []
    assert dist.metadata.license_expression == "Apache-2.0"
    assert dist.metadata.version == tformer.__version__


def _readme_commands(page: str = "README.md") -> list[tuple[int, str]]:
    """(line number, command) of a page's shell blocks, comments and continuation lines aside."""
    lines, inside, found = (ROOT / page).read_text().splitlines(), False, []
    for number, line in enumerate(lines, 1):
        if line.startswith("```"):
            inside = line.strip() == "```bash"
        elif inside and line.strip() and not line.lstrip().startswith("#"):
            found.append((number, line.split("  #")[0].strip()))
    return found


def _missing_inputs(page: str) -> list[str]:
    """Input files the page's commands name (not a CAPITALISED placeholder, not an output) that the
    repository does not ship, as ``page:line: file``."""
    missing = []
    for number, command in _readme_commands(page):
        words = command.split()
        for before, word in zip(["", *words], words):
            output = before in ("--out", "--json", ">") or "=" in word or word.startswith(("runs/", "hf/", "tok/"))
            placeholder = re.sub(r"[^A-Za-z]", "", Path(word).stem).isupper()
            if re.search(r"\.(ya?ml|txt|gz|jsonl?|sh|sbatch)$", word) and not (output or placeholder):
                if not (ROOT / word).exists():
                    missing.append(f"{page}:{number}: {word}")
    return missing


def test_readme_commands_run_as_written_on_a_fresh_clone():
    """Its first two commands call .venv/bin/ themselves; every later bare `tformer`, `torchrun`
    or `python` comes after the line that activates .venv; every input file a command names
    (not a CAPITALISED placeholder, not an output) ships with the repository."""
    text = (ROOT / "README.md").read_text()
    commands = _readme_commands()
    assert [c for _, c in commands[:2]] == [
        "bash scripts/setup.sh && .venv/bin/tformer train configs/gpt2-tiny.yaml",
        "bash scripts/setup.sh && .venv/bin/python -m pytest -q",
    ]
    activate = text.index("source .venv/bin/activate")
    bare = [n for n, c in commands[2:] if re.match(r"(\w+=\S+ )*(tformer|torchrun|python|pytest) ", c)]
    assert bare and len(text[:activate].splitlines()) < min(bare)
    assert _missing_inputs("README.md") == []


def test_docs_commands_name_files_that_ship():
    """The pages under docs/ (where most of the README's commands moved) hold to the same rule."""
    pages = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md"))
    assert "docs/launching.md" in pages
    assert [m for page in pages for m in _missing_inputs(page)] == []


def test_readme_is_one_page_whose_links_resolve():
    """README stays a newcomer's page (the rest lives in docs/); each relative link it makes names a
    file of the repository (mkdocs --strict checks the links inside docs/)."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    assert "docs/reference/config.md" in links
    assert [link for link in links if "://" not in link and not (ROOT / link).exists()] == []
