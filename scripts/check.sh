#!/usr/bin/env bash
# The habits CI keeps before the tests (.ci/run): ruff lint and format, mypy, shellcheck, the docs site. The tools
# come from the "lint" and "docs" extras that scripts/setup.sh installs into .venv (PYTHON= picks another interpreter).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
BIN=$(dirname "$PY")

echo "ruff check"
"$PY" -m ruff check .
# The tree is formatted with `ruff format .` (see CONTRIBUTING.md):
echo "ruff format --check"
"$PY" -m ruff format --check .
echo "mypy"
"$PY" -m mypy
echo "shellcheck"
mapfile -t scripts < <(find launch slurm scripts tests/cluster -type f \( -name '*.sh' -o -name '*.sbatch' \) | sort)
"$BIN/shellcheck" "${scripts[@]}" .ci/run
# --strict: a broken link, a missing anchor or a page left out of mkdocs.yml's nav fails the build
# (not --quiet: it hides the warnings that --strict counts)
echo "mkdocs build --strict"
site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
NO_MKDOCS_2_WARNING=1 "$BIN/mkdocs" build --strict --site-dir "$site"
