"""Many gateways on shared workers, and drains on rollout (issue 48), on 127.0.0.1: two worker processes that
are replicas of one target (two KV places each: ``--memory-cap-mb 128``) and two gateways on them — the first
in this process under a real uvicorn, the second a process, with small admission limits.

- Concurrent seeded streams through both gateways: each request gets its seed's text — the one it
  gets alone, so no session of one gateway touched another's — or a clean 429/503 in the envelope
  with Retry-After; the workers' ``503 worker_full`` was met and waited out; afterwards no session is
  left on either worker.
- SIGTERM to a worker under load: its sessions finish (the streams keep their texts), it refuses a new
  session with ``503 worker_draining`` + Retry-After (the gateways take the other replica: requests
  sent after the signal succeed), its ``/health`` answers 503, and it exits 0 once its sessions ended.
- SIGTERM to a gateway under load: ``/health/ready`` answers 503 at once, a new request gets
  ``503 shutting_down`` with Retry-After, its open streams finish whole, and it exits 0 once they have
  — long before its drain timeout.

The tests run in this order and each takes a process away (a worker, then a gateway)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
import pytest

from clients.procs import GatewayProcess, ServerProcess, WorkerProcess
from core.config import dump_config, parse_config
from core.protocol import JSON_CONTENT_TYPE, VerifyRequest, encode
from tests.integration.gateways import SharedDraft, gateway_in_process

pytestmark = pytest.mark.integration

MODEL = "specgate-shared"
MAX_TOKENS = 24
DRAIN_S = 60  # the gateways' and workers' drain timeout: a drain that ends on its own ends well before it
BODY = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Tell me about the sea."}],
    "max_tokens": MAX_TOKENS,
    "temperature": 1.0,
    "stream": True,
}


@dataclass
class Outcome:
    """One streamed request: its status, text, events and the headers of a refusal."""

    status: int
    text: str = ""
    events: list[Any] = field(default_factory=list)
    error: dict[str, Any] | None = None  # a refusal's envelope, or an error event's
    retry_after: str | None = None

    @property
    def whole(self) -> bool:
        return (
            self.status == 200
            and bool(self.events)
            and self.events[-1] == "[DONE]"
            and not any("error" in e for e in self.events[:-1])
        )


def _stream(url: str, seed: int, started: threading.Event | None = None) -> Outcome:
    with (
        httpx.Client(timeout=120) as client,
        client.stream("POST", f"{url}/v1/chat/completions", json={**BODY, "seed": seed}) as resp,
    ):
        if resp.status_code != 200:
            return Outcome(
                resp.status_code,
                error=orjson.loads(resp.read()).get("error"),
                retry_after=resp.headers.get("retry-after"),
            )
        outcome = Outcome(200)
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            event = data if data == "[DONE]" else orjson.loads(data)
            outcome.events.append(event)
            if isinstance(event, dict) and "error" in event:
                outcome.error = event["error"]
            content = (
                event["choices"][0]["delta"].get("content")
                if isinstance(event, dict) and event.get("choices")
                else None
            )
            if content:
                outcome.text += content
                if started is not None:
                    started.set()
        return outcome


def _metric(url: str, series: str) -> float:
    """A series' value on ``/metrics`` (0 when absent: a labelled counter not yet counted)."""
    match = re.search(
        rf"^{re.escape(series)} (\S+)$", httpx.get(f"{url}/metrics", timeout=10).text, re.MULTILINE
    )
    return float(match.group(1)) if match else 0.0


def _until(check: Any, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return bool(check())


def _proc(server: ServerProcess) -> subprocess.Popen[bytes]:
    assert server.proc is not None
    return server.proc


@dataclass
class Served:
    """The first gateway: in this process under a real uvicorn (tests/integration/gateways.py); the second, a
    process, is the one the last test stops."""

    url: str


@dataclass
class Stack:
    workers: list[ServerProcess]
    gateways: list[Any]  # a Served, then a ServerProcess
    texts: dict[int, str]  # seed -> the text it gets alone


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, shared_draft: SharedDraft) -> Iterator[Stack]:
    directory = tmp_path_factory.mktemp("shared")
    with ExitStack() as exits:
        workers = [
            WorkerProcess(
                "builtin",
                "llama.cpp",
                threads=1,
                extra=["--memory-cap-mb", "128", "--drain-timeout-s", str(DRAIN_S)],
            )
            for _ in range(2)
        ]
        urls = [exits.enter_context(w) for w in workers]
        gateways = []
        for name, limits in (
            ("g0", {}),
            ("g1", {"max_concurrent_requests": 2, "max_queued_requests": 1, "queue_timeout_s": 1.0}),
        ):
            config = parse_config(
                {
                    "model": MODEL,
                    "draft": {"model": "builtin-draft", "threads": 1},
                    "workers": [{"urls": urls}],
                    "speculative": {"mode": "exact", "num_draft_tokens": 4},
                    "limits": {"drain_timeout_s": DRAIN_S, **limits},
                }
            )
            if name == "g0":
                gateways.append(Served(gateway_in_process(exits, config, shared_draft)))
                continue
            path = directory / f"{name}.yaml"
            path.write_text(dump_config(config))
            gateways.append(GatewayProcess(str(path)))
            exits.enter_context(gateways[-1])
        # alone, one after another
        texts = {seed: _stream(gateways[seed % 2].url, seed).text for seed in range(10)}
        assert all(texts.values())
        yield Stack(workers, gateways, texts)


def test_two_gateways_share_the_workers_under_load(stack: Stack) -> None:
    seeds = list(range(8))
    with ThreadPoolExecutor(len(seeds)) as pool:
        outcomes = dict(zip(seeds, pool.map(lambda seed: _stream(stack.gateways[seed % 2].url, seed), seeds)))
    for seed, outcome in outcomes.items():
        if outcome.status == 200:
            assert outcome.whole and outcome.text == stack.texts[seed], (seed, outcome)
        else:  # the second gateway's admission: two running, one queued
            assert (
                outcome.status in (429, 503)
                and outcome.error is not None
                and outcome.error["code"]
                and outcome.retry_after
            ), (seed, outcome)
    served = [seed for seed, o in outcomes.items() if o.status == 200]
    assert {seed % 2 for seed in served} == {0, 1}, outcomes  # both gateways served
    # 8 streams, 4 KV places
    assert sum(_metric(w.url, 'specgate:verify_errors_total{code="worker_full"}') for w in stack.workers) >= 1
    assert _until(lambda: all(_metric(w.url, "specgate:sessions") == 0 for w in stack.workers))


def _new_session_call(url: str) -> httpx.Response:
    req = VerifyRequest.after("new-after-sigterm", [], [1, 2, 3], [])
    body, content_type = encode(req, 49152, as_json=True)
    return httpx.post(
        f"{url}/v1/verify",
        content=body,
        headers={"content-type": content_type, "accept": JSON_CONTENT_TYPE},
        timeout=30,
    )


def test_a_worker_drains_its_sessions_and_refuses_new_ones(stack: Stack) -> None:
    victim, other = stack.workers
    seeds = list(range(4))
    started = [threading.Event() for _ in seeds]
    with ThreadPoolExecutor(6) as pool:
        running = [pool.submit(_stream, stack.gateways[0].url, seed, started[seed]) for seed in seeds]
        assert all(e.wait(60) for e in started) and _metric(victim.url, "specgate:sessions") >= 1
        os.kill(_proc(victim).pid, signal.SIGTERM)
        health = httpx.get(f"{victim.url}/health", timeout=10)
        refused = _new_session_call(victim.url)
        # new sessions after the signal
        later = [pool.submit(_stream, stack.gateways[0].url, seed) for seed in (8, 9)]
        outcomes = [f.result() for f in running + later]
    assert health.status_code == 503 and health.json()["status"] == "draining"
    assert (
        refused.status_code == 503
        and refused.json()["error"]["code"] == "worker_draining"
        and refused.headers["retry-after"]
    )
    for seed, outcome in zip([*seeds, 8, 9], outcomes):
        assert outcome.whole and outcome.text == stack.texts[seed], (seed, outcome)
    assert _proc(victim).wait(timeout=30) == 0  # once its sessions ended: long before its drain timeout
    assert _until(lambda: _metric(other.url, "specgate:sessions") == 0)


def test_a_gateway_drains_its_streams_and_fails_readiness_at_once(stack: Stack) -> None:
    gateway, other = stack.gateways[1], stack.gateways[0]
    started = threading.Event()
    with ThreadPoolExecutor(2) as pool:
        running = [pool.submit(_stream, gateway.url, seed, started if seed == 1 else None) for seed in (0, 1)]
        assert started.wait(60)
        signalled = time.monotonic()
        os.kill(_proc(gateway).pid, signal.SIGTERM)
        ready = httpx.get(f"{gateway.url}/health/ready", timeout=10)
        late = httpx.post(
            f"{gateway.url}/v1/chat/completions", json={**BODY, "stream": False, "seed": 3}, timeout=30
        )
        outcomes = [f.result() for f in running]
    assert (
        ready.status_code == 503
        and ready.json()["status"] == "draining"
        and time.monotonic() - signalled < DRAIN_S
    )
    assert (
        late.status_code == 503
        and late.json()["error"]["code"] == "shutting_down"
        and late.headers["retry-after"]
    )
    for seed, outcome in zip((0, 1), outcomes):
        assert outcome.whole and outcome.text == stack.texts[seed], (seed, outcome)
    assert _proc(gateway).wait(timeout=30) == 0
    assert time.monotonic() - signalled < DRAIN_S / 2  # it left when its streams ended, not at the deadline
    assert _stream(other.url, 4).text == stack.texts[4]  # the other gateway serves on
