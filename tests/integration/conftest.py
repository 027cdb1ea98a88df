"""What the integration modules share: one pair of built-in workers for the whole run.

Six modules talk to the same two workers (``builtin``, ``builtin-alt``; llama.cpp, one thread
each), each through gateways of its own: a worker holds only its sessions' KV caches, which a
request frees, so modules cannot see each other there — and the pair starts once, not six times.
Tests that kill or restart workers start their own (test_faults_real, test_worker_real)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack

import pytest

from clients.procs import WorkerProcess


@pytest.fixture(scope="session")
def builtin_workers() -> Iterator[list[str]]:
    """The URLs of a ``builtin`` and a ``builtin-alt`` worker on 127.0.0.1."""
    with ExitStack() as stack:
        yield [stack.enter_context(WorkerProcess(model, "llama.cpp", threads=1)) for model in ("builtin", "builtin-alt")]
