"""What the integration modules share: one pair of built-in workers for the whole run, and the built-in draft.

Six modules talk to the same two workers (``builtin``, ``builtin-alt``; llama.cpp, one thread
each), each through gateways of its own: a worker holds only its sessions' KV caches, which a
request frees, so modules cannot see each other there — and the pair starts once, not six times.
Tests that kill or restart workers start their own (test_faults_real, test_worker_real).

The gateways of the modules that test what a gateway answers run in this process under a real uvicorn
(``gateway_in_process``), drafting with one built-in draft runner on one model thread: each gateway holds its
own sessions, and seeded text does not depend on what else runs — a gateway process start (4 s of CPU) and a
draft load saved each (test_faults_real and test_discovery_real too: their workers are the processes).
``specgate serve`` / ``gateway`` as processes: tests/clients/test_cli.py, test_shared_workers_real (SIGTERM to
a gateway)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack

import pytest

from clients.procs import WorkerProcess
from tests.integration.gateways import SharedDraft


@pytest.fixture(scope="session")
def builtin_workers() -> Iterator[list[str]]:
    """The URLs of a ``builtin`` and a ``builtin-alt`` worker on 127.0.0.1."""
    with ExitStack() as stack:
        yield [
            stack.enter_context(WorkerProcess(model, "llama.cpp", threads=1))
            for model in ("builtin", "builtin-alt")
        ]


@pytest.fixture(scope="session")
def shared_draft() -> Iterator[SharedDraft]:
    draft = SharedDraft()
    yield draft
    draft.close()
