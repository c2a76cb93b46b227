#!/usr/bin/env bash
# Create .venv and install tformer with its test, lint (ruff, mypy, shellcheck), docs (mkdocs), float8
# (torchao: precision=fp8, emulated on the CPU), tensorboard (2.21, the tested version) and ft (torchft:
# fault_tolerance) dependencies, CPU-only.
# torch is pinned to the local CPU wheel (2.13.0) *before* the project so that the project's
# torch range is already satisfied and pip never pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
# DeepSpeed ships as a source package: build it against the torch above (no isolated build env,
# which could fetch another torch), with its C++ ops left to compile lazily if a run needs them.
DS_BUILD_OPS=0 .venv/bin/python -m pip install -q --no-build-isolation "deepspeed>=0.15"
.venv/bin/python -m pip install -q -e ".[test,lint,docs,float8,tensorboard,ft]"
