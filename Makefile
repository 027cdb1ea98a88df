# The two commands of the README. Both set up .venv once (idempotent: a second call reuses it).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.specgate-installed

.PHONY: run test setup test-tools image-check format clean

# Both let Python write the bytecode of what they import, once, as it does by default (set-up installs without it): a
# machine that sets PYTHONDONTWRITEBYTECODE would compile every module again in every process they start.
run: setup
	PYTHONDONTWRITEBYTECODE= $(BIN)/specgate serve

test: setup test-tools
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest

# The image built and run as the default overlay's pods would run it (needs a Docker engine; not part of
# `make test`): tests/image_check.py. IMAGE_CHECK_ARGS=--debian-base builds its base from Debian's packages.
image-check: setup
	$(BIN)/python -m tests.image_check $(IMAGE_CHECK_ARGS)

# the one format and the lint rules (pyproject.toml), applied; make test checks them
format: setup
	$(BIN)/ruff format . && $(BIN)/ruff check --fix .

# Debian's chromium for the chat page's test (Playwright drives it: no browser download), and
# docker-compose where docker has no compose plugin (the compose.yaml test)
test-tools:
	command -v chromium >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }
	! command -v docker >/dev/null || docker compose version >/dev/null 2>&1 || command -v docker-compose >/dev/null \
	  || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker-compose >/dev/null; }

setup: $(STAMP)

# the same script as the Dockerfile's: torch 2.13.0 (CPU) first, the project, the built-in model
$(STAMP): pyproject.toml scripts/setup.sh
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	bash scripts/setup.sh $(BIN)/python --dev
	touch $(STAMP)

clean:
	rm -rf $(VENV)
