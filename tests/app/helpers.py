"""What the gateway's tests share: a config over fake workers, SSE parsing, error checks, and
the pool a statistical test deals its seeds out to."""

from __future__ import annotations

import atexit
import multiprocessing
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from contextlib import contextmanager
from typing import Any

import httpx
import orjson
import pytest
import torch
import uvicorn

from clients.procs import free_port
from core.config import SpecgateConfig, parse_config
from core.cores import usable_cores

# Statistical sweeps whose property a cheaper test proves in the default run — the exact law of
# every cell through the same engine, tests/app/test_lossless_matrix.py — run with the real
# random streams when SPECGATE_FULL_STATISTICS=1 is set.
FULL_STATISTICS = pytest.mark.skipif(
    not os.environ.get("SPECGATE_FULL_STATISTICS"),
    reason="proven exactly by tests/app/test_lossless_matrix.py; set SPECGATE_FULL_STATISTICS=1",
)


# The rest of a parametrized test whose first cells run by default and prove its property there
# (each names why where it is used).
FULL_RUN = pytest.mark.skipif(
    not os.environ.get("SPECGATE_FULL_STATISTICS"),
    reason="more cells of a test that runs by default; set SPECGATE_FULL_STATISTICS=1",
)


def seed_pool(fresh: bool = False) -> Executor:
    """Where a statistical test deals out its seeds (every draw is keyed by its seed: the counts are the same
    wherever they run): two spawned processes, one torch thread each, where this process may use two cores or
    more — the same two for every test of this process, started once (a start imports torch and the project:
    seconds of CPU) —; this process itself where it may use one (a test process pinned to its core: spawning
    would only add the processes' start-up). ``fresh``: new processes, two (one where this process may use one
    core: a second would only add its start-up) — a negative control's task breaks the code it runs, and the
    break must end with them."""
    if fresh:
        return _processes(2 if usable_cores() >= 2 else 1)
    if usable_cores() < 2:
        return _InThisProcess()
    global _SHARED_POOL
    if _SHARED_POOL is None:
        _SHARED_POOL = _processes(2)
        atexit.register(_SHARED_POOL.shutdown)
    return _Lent(_SHARED_POOL)


_SHARED_POOL: ProcessPoolExecutor | None = None


def _processes(count: int) -> ProcessPoolExecutor:
    return ProcessPoolExecutor(
        count,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=torch.set_num_threads,
        initargs=(1,),
    )


class _Lent(Executor):
    """The shared pool for a ``with`` block: its end does not shut the pool down."""

    def __init__(self, pool: ProcessPoolExecutor) -> None:
        self.pool = pool

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        return self.pool.submit(fn, *args, **kwargs)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        pass


class _InThisProcess(Executor):
    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, as a pool would
            future.set_exception(exc)
        return future


def gateway_config(**overrides: Any) -> SpecgateConfig:
    """Two fake workers w0 / w1 (0.6 / 0.4), aggregate with full distributions, small limits."""
    data: dict[str, Any] = {
        "model": "test-model",
        "workers": [{"url": "http://w0:1", "weight": 0.6}, {"url": "http://w1:1", "weight": 0.4}],
        "speculative": {"mode": "aggregate", "num_draft_tokens": 3, "k": "full"},
        "limits": {"max_tokens": 64, "max_prompt_tokens": 100},
        "health": {"probe_interval_s": 0.1},
    }
    data.update(overrides)
    return parse_config(data)


def sse_events(text: str) -> list[Any]:
    """The ``data:`` payloads of an SSE body: parsed JSON, or the string ``[DONE]``."""
    events = []
    for block in text.strip().split("\n\n"):
        data = "".join(line[len("data: ") :] for line in block.splitlines() if line.startswith("data: "))
        if data:
            events.append(data if data == "[DONE]" else orjson.loads(data))
    return events


def assert_error(
    resp: httpx.Response, status: int, param: str | None = None, contains: str = "", code: str | None = None
) -> dict[str, Any]:
    """``resp`` is ``status`` with the OpenAI error envelope; returns its ``error`` object."""
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] is None or isinstance(error["code"], str)
    if param is not None:
        assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    assert contains in error["message"], error["message"]
    return error


@contextmanager
def served(app: Any) -> Iterator[str]:
    """``app`` under a real uvicorn on 127.0.0.1, in a thread, stopped at the end."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        for _ in range(200):
            if server.started:
                break
            time.sleep(0.05)
        assert server.started, "uvicorn did not start"
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=15)
