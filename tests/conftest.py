"""Shared fixtures: real models loaded once per test session (they take seconds to load)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from core.runners import ModelRunner, load_runner

# The statistical tests run many tiny tensor ops: one thread avoids the pool's overhead, and
# leaves the other core to the servers the integration tests start.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_runner_shared() -> ModelRunner:
    return load_runner("tiny-random", "transformers")


@pytest.fixture
def tiny_runner(tiny_runner_shared: ModelRunner) -> Iterator[ModelRunner]:
    """The tiny random-weight model, with no sessions left over from another test."""
    tiny_runner_shared.free_all()
    yield tiny_runner_shared
    tiny_runner_shared.free_all()


@pytest.fixture(scope="session")
def builtin_llama_shared() -> ModelRunner:
    return load_runner("builtin", "llama.cpp", memory_cap_mb=512)


@pytest.fixture
def builtin_llama(builtin_llama_shared: ModelRunner) -> Iterator[ModelRunner]:
    builtin_llama_shared.free_all()
    yield builtin_llama_shared
    builtin_llama_shared.free_all()
