#!/usr/bin/env bash
# Download the Python wheels that the lent GPU machine lacks for tformer into .whl/ (about 4 MB).
#
# Run it HERE, on the CPU machine, before a GPU session: the GPU machine reaches no package
# registry, so whatever tformer needs beyond its image must travel with the working tree.
# That image (Python 3.12, torch 2.11.0+cu130, transformers 5.17, tokenizers 0.23, safetensors 0.8,
# accelerate, numpy, pandas, pyarrow, fsspec, huggingface-hub, xxhash, sacrebleu, matplotlib,
# pytest, pytest-timeout, ...) lacks only these for `tformer train` (data loading goes through
# `datasets`) and for `pytest`:
#   datasets      the corpus loader
#   dill          datasets' pickler (datasets 5.2 wants >=0.3.0,<0.4.2; multiprocess 0.70.19 wants >=0.4.1)
#   multiprocess  datasets' worker pool (<0.70.20); a per-Python wheel: py312 here
#   torchao       precision=fp8's float8 layers (bench_gpu.py --precision fp8, gpu_session.sh more):
#                 0.18.0, the version tested here (with torch 2.13), built against torch 2.11 -- the
#                 GPU image's -- and loading its C++ extensions only on torch >= 2.11. Not a
#                 pure-Python wheel (cp310-abi3, manylinux_2_24/2_28 x86_64: any CPython >= 3.10),
#                 but float8 training is pure Python over torch's _scaled_mm; its extensions
#                 (MXFP8, CUTLASS kernels) are for other recipes
# Not carried on purpose: wandb (tracking imports it only when wandb.enabled=true; its two tests
# skip without it) and deepspeed (parallel.strategy=deepspeed only; its tests skip without it).
# datasets 5.2.0 also needs pyarrow>=24 and fsspec<=2026.9.0 from the image; check with
# `python3 -m pip show pyarrow fsspec` there if a datasets call fails.
#
# Then, in the device command (with .whl named in `carry`; .gitignore keeps /.whl/ out of commits):
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
#     && export PYTHONPATH=/tmp/site:$PWD || exit
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELS=(
    datasets==5.2.0
    dill==0.4.1
    multiprocess==0.70.19
    torchao==0.18.0
)

rm -rf .whl
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "${WHEELS[@]}"

count=$(find .whl -type f -name '*.whl' | wc -l)
if [ "$count" -ne "${#WHEELS[@]}" ]; then
    echo "expected ${#WHEELS[@]} wheels in .whl/, found $count" >&2
    exit 1
fi
du -sh .whl
