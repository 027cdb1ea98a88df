"""Faults with real processes on 127.0.0.1: a worker killed by pid mid-stream with a replica beside it (the
seeded text does not change) and without one (an SSE error, then [DONE], and the gateway serves again when the
worker is back). The workers are processes; the gateway runs in this process under a real uvicorn
(tests/integration/gateways.py). SIGTERM under load: tests/integration/test_shared_workers_real.py."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import Any

import httpx
import orjson
import pytest

from clients.procs import ServerProcess, WorkerProcess
from core.config import parse_config
from tests.integration.gateways import SharedDraft, gateway_in_process

pytestmark = pytest.mark.integration

MODEL = "specgate-faults"
BODY = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Tell me about the moon."}],
    "max_tokens": 40,
    "seed": 11,
    "temperature": 0.8,
    "stream": True,
}


def _start(stack: ExitStack, server: ServerProcess) -> ServerProcess:
    stack.enter_context(server)
    return server


def _gateway(stack: ExitStack, draft: SharedDraft, workers: list[dict[str, Any]], **extra: Any) -> str:
    config = parse_config(
        {
            "model": MODEL,
            "draft": {"model": "builtin-draft", "threads": 1},
            "workers": workers,
            "speculative": {"mode": "exact", "num_draft_tokens": 4, "draft_top_k": 32},
            **extra,
        }
    )
    return gateway_in_process(stack, config, draft)


def _stream(
    url: str, on_chunk: Callable[[int], None] = lambda n: None, body: dict[str, Any] = BODY
) -> tuple[str, list[Any]]:
    """The streamed text and every event; ``on_chunk(n)`` after the n-th chunk with text."""
    text, events = "", []
    with (
        httpx.Client(timeout=120) as client,
        client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp,
    ):
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            event = line[len("data: ") :]
            events.append(event if event == "[DONE]" else orjson.loads(event))
            content = (
                events[-1]["choices"][0]["delta"].get("content")
                if event != "[DONE]" and events[-1].get("choices")
                else None
            )
            if content:
                text += content
                on_chunk(
                    sum(
                        1
                        for e in events
                        if e != "[DONE]" and e.get("choices") and e["choices"][0]["delta"].get("content")
                    )
                )
    return text, events


def _metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} not in {url}/metrics"
    return float(match.group(1))


def _proc(server: ServerProcess) -> subprocess.Popen[bytes]:
    assert server.proc is not None
    return server.proc


@pytest.fixture
def stack() -> Iterator[ExitStack]:
    with ExitStack() as s:
        yield s


def test_killing_the_replica_that_holds_a_stream_changes_nothing(
    stack: ExitStack, shared_draft: SharedDraft
) -> None:
    replicas = [_start(stack, WorkerProcess("builtin", "llama.cpp", threads=1)) for _ in range(2)]
    gateway = _gateway(stack, shared_draft, [{"urls": [r.url for r in replicas], "weight": 1.0}])
    undisturbed, _ = _stream(gateway)
    killed: list[ServerProcess] = []

    def kill_the_holder(chunks: int) -> None:
        if chunks == 2:
            holder = next(r for r in replicas if _metric(r.url, "specgate:sessions") == 1)
            _proc(holder).kill()  # SIGKILL: no goodbye, the socket just closes
            _proc(holder).wait(timeout=10)
            killed.append(holder)

    text, events = _stream(gateway, kill_the_holder)
    assert killed, "the stream ended before the worker could be killed"
    assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
    assert text == undisturbed
    assert _metric(gateway, 'specgate:worker_failovers_total{worker="w0"}') == 1
    survivor = next(r for r in replicas if r is not killed[0])
    assert _metric(survivor.url, "specgate:sessions") == 0  # freed at the end


def test_without_a_replica_the_stream_ends_with_an_error_and_the_gateway_recovers(
    stack: ExitStack, shared_draft: SharedDraft
) -> None:
    worker = _start(stack, WorkerProcess("builtin", "llama.cpp", threads=1))
    gateway = _gateway(stack, shared_draft, [{"url": worker.url}])

    def kill(chunks: int) -> None:
        if chunks == 2:
            _proc(worker).kill()
            _proc(worker).wait(timeout=10)

    text, events = _stream(gateway, kill)
    assert text and events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert error["code"] == "worker_error" and "worker w0" in error["message"]
    assert httpx.get(f"{gateway}/health", timeout=10).status_code == 200
    refused = httpx.post(f"{gateway}/v1/chat/completions", json={**BODY, "stream": False}, timeout=60)
    assert refused.status_code in (502, 503) and "w0" in refused.json()["error"]["message"]

    port = int(worker.url.rsplit(":", 1)[1])
    _start(stack, WorkerProcess("builtin", "llama.cpp", port=port, threads=1))  # back on the same address
    again = httpx.post(f"{gateway}/v1/chat/completions", json={**BODY, "stream": False}, timeout=120)
    assert again.status_code == 200 and again.json()["choices"][0]["message"]["content"]
