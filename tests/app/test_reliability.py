"""Faults, in-process: garbage from workers, failover between replicas, circuit breakers, a real
slow socket tripping the read timeout, backpressure, access, body caps, client disconnects.
Fake workers (httpx.MockTransport) stand in for the worker layer below the gateway."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import numpy as np
import openai
import orjson
import pytest

from app.server import create_app
from core.protocol import InfoResponse, VerifyResponse, encode, encode_json
from core.runners import ModelRunner
from tests.app.conftest import Gateway
from tests.app.fakes import FakeWorkerTransport, Mutation, V
from tests.app.helpers import assert_error, gateway_config, served, sse_events

CHAT = {"model": "test-model", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6}
COMPLETION = {"model": "test-model", "prompt": "Once upon a time", "max_tokens": 6}
TWO_WORKERS = [{"url": "http://w0:1", "weight": 0.6}, {"url": "http://w1:1", "weight": 0.4}]


def _refused(
    resp: httpx.Response, status: int, code: str | None = None, contains: str = ""
) -> dict[str, Any]:
    return assert_error(resp, status, code=code, contains=contains)


async def _metric(client: httpx.AsyncClient, name: str) -> float:
    text = (await client.get("/metrics")).text
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} not in /metrics:\n{text}"
    return float(match.group(1))


# ----------------------------------------------------------------------------- garbage


def _encoded(resp: VerifyResponse) -> bytes:
    return encode(resp, V)[0]


def _with(**arrays: Callable[[np.ndarray], np.ndarray]) -> Mutation:
    """A worker whose answer has some arrays changed by the given functions."""

    def mutate(resp: VerifyResponse) -> bytes:
        changed = {name: fn(np.array(getattr(resp, name), copy=True)) for name, fn in arrays.items()}
        return _encoded(dataclasses.replace(resp, **changed))

    return mutate


def _set(index: tuple[int, int], value: float) -> Callable[[np.ndarray], np.ndarray]:
    def change(arr: np.ndarray) -> np.ndarray:
        arr[index] = value
        return arr

    return change


GARBAGE: dict[str, tuple[Mutation, dict[str, Any]]] = {
    "truncated body": (lambda r: _encoded(r)[: len(_encoded(r)) // 2], {}),
    "corrupt frame": (lambda r: b"XXv1" + _encoded(r)[4:], {}),
    "random bytes": (lambda r: bytes(np.random.default_rng(0).integers(0, 256, 300, dtype=np.uint8)), {}),
    "a position missing": (_with(probs=lambda a: a[:-1], tail_mass=lambda a: a[:-1]), {}),
    "ids outside the vocabulary": (_with(ids=lambda a: np.full_like(a, V + 7)), {"k": 8}),
    "NaN probabilities": (_with(probs=_set((0, 5), float("nan"))), {}),
    "negative probabilities": (_with(probs=_set((0, 5), -0.25)), {}),
    "probabilities summing over 1": (_with(probs=lambda a: a * 3), {}),
}


@pytest.mark.parametrize("kind", list(GARBAGE))
async def test_garbage_from_a_worker_is_that_worker_failing(
    gateway: Gateway, fakes: FakeWorkerTransport, kind: str
) -> None:
    mutation, spec = GARBAGE[kind]
    async with gateway(
        speculative={"mode": "aggregate", "num_draft_tokens": 3, "k": spec.get("k", "full")}
    ) as client:
        fakes.behaviour["w1"] = mutation
        error = _refused(
            await client.post("/v1/completions", json={**COMPLETION, "stream": False}),
            502,
            "worker_error",
            "worker w1",
        )
        assert "garbage" in error["message"]
        events = sse_events((await client.post("/v1/completions", json={**COMPLETION, "stream": True})).text)
        assert events[-1] == "[DONE]" and "w1" in events[-2]["error"]["message"]
        assert await _metric(client, 'specgate:worker_failures_total{kind="garbage",worker="w1"}') == 2
        fakes.behaviour["w1"] = ""
        assert (await client.post("/v1/completions", json=COMPLETION)).status_code == 200  # serving again


async def test_a_worker_with_another_tokenizer_is_refused_before_any_call(
    gateway: Gateway, fakes: FakeWorkerTransport
) -> None:
    fakes.behaviour["w1"] = "other-tokenizer"
    async with gateway() as client:
        _refused(
            await client.post("/v1/completions", json=COMPLETION), 503, "worker_error", "another tokenizer"
        )
        assert await _metric(client, 'specgate:worker_failures_total{kind="fingerprint",worker="w1"}') >= 1
        assert fakes.requests == []  # no verify reached either worker


# ----------------------------------------------------------------------------- replicas


async def test_failover_to_a_replica_gives_the_same_seeded_text(
    gateway: Gateway, fakes: FakeWorkerTransport
) -> None:
    body = {**COMPLETION, "max_tokens": 16, "seed": 7, "temperature": 1.0}
    workers = [{"urls": ["http://a:1", "http://b:1"], "weight": 1.0}]
    async with gateway(
        workers=workers, speculative={"mode": "aggregate", "num_draft_tokens": 2, "k": "full"}
    ) as client:
        undisturbed = (await client.post("/v1/completions", json=body)).json()["choices"][0]["text"]
        fakes.requests.clear()
        fakes.behaviour["a"] = "die-after:2"
        stream = sse_events((await client.post("/v1/completions", json={**body, "stream": True})).text)
        assert stream[-1] == "[DONE]" and "error" not in stream[-2]
        assert "".join(e["choices"][0]["text"] for e in stream[:-1] if e["choices"]) == undisturbed
        hosts = [host for host, _ in fakes.requests]
        assert hosts[:2] == ["a", "a"] and set(hosts[2:]) == {"b"}
        first_on_b = fakes.requests[2][1]
        # the prefix, resent
        assert first_on_b.prefix_len == 0 and len(first_on_b.tokens) > len(fakes.requests[0][1].tokens)
        assert await _metric(client, 'specgate:worker_failovers_total{worker="w0"}') == 1
        assert await _metric(client, 'specgate:worker_failures_total{kind="connect",worker="w0"}') == 1


async def test_a_draining_replica_keeps_its_sessions_and_new_ones_go_to_another(
    gateway: Gateway, fakes: FakeWorkerTransport
) -> None:
    """A worker that got SIGTERM (503 worker_draining to a new session): the session goes to the other
    replica, no breaker counts it, and for a while no new session is sent there; a session it holds goes on
    there; /health/ready and /metrics name it draining; with no other replica a new request gets a clean
    503."""
    body = {**COMPLETION, "max_tokens": 8, "seed": 3, "temperature": 1.0, "stream": True}
    async with gateway(workers=[{"urls": ["http://a:1", "http://b:1"], "weight": 1.0}]) as client:
        text = lambda events: "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])  # noqa: E731
        undisturbed = text(sse_events((await client.post("/v1/completions", json=body)).text))
        first = fakes.requests[0][0]  # the replica the first session went to (both were idle)
        other = "b" if first == "a" else "a"
        fakes.requests.clear()
        fakes.behaviour[first] = "draining"
        moved = sse_events((await client.post("/v1/completions", json=body)).text)
        # the same seeded text, from the other replica
        assert moved[-1] == "[DONE]" and "error" not in moved[-2] and text(moved) == undisturbed
        assert [host for host, _ in fakes.requests] == [first] + [other] * (len(fakes.requests) - 1)
        metrics = (await client.get("/metrics")).text
        assert not re.search(r'worker_failures_total\{kind="\w+",worker="w0"\} [1-9]', metrics)
        assert 'specgate:worker_replicas{state="draining",worker="w0"} 1.0' in metrics
        # a refused new session is no failover
        assert 'specgate:worker_failovers_total{worker="w0"} 0.0' in metrics
        fakes.requests.clear()
        assert (await client.post("/v1/completions", json=body)).status_code == 200
        assert {host for host, _ in fakes.requests} == {other}  # resting: not even asked
        ready = (await client.get("/health/ready")).json()
        assert ready["status"] == "ready" and {
            r["url"]: r.get("draining", False) for r in ready["workers"][0]["replicas"]
        } == {f"http://{first}:1": True, f"http://{other}:1": False}
        fakes.behaviour[other] = "draining"
        fakes.requests.clear()
        _refused(
            await client.post("/v1/completions", json={**body, "stream": False}),
            503,
            "worker_error",
            "draining",
        )


async def test_readiness_answers_within_its_bound_while_a_replica_hangs(
    gateway: Gateway, fakes: FakeWorkerTransport
) -> None:
    """Issue 59: /health/ready asked every replica with the worker's own timeout (30-120 s) inside a 5 s
    probe, so one hung replica made every gateway unready. It waits at most health.ready_timeout_s: the hung
    replica is not ready this time (its one check goes on, never started twice), the target is ready through
    the other; all hung: 503, as fast."""
    async with gateway(
        workers=[{"urls": ["http://a:1", "http://b:1"]}], health={"ready_timeout_s": 0.2}
    ) as client:
        fakes.behaviour["b"] = "sleep:30"
        asked = fakes.arrived["b", "/v1/info"]
        for _ in range(2):
            start = time.monotonic()
            resp = await asyncio.wait_for(client.get("/health/ready"), 5)
            assert time.monotonic() - start < 2 and resp.status_code == 200
            replicas = {r["url"]: r for r in resp.json()["workers"][0]["replicas"]}
            assert replicas["http://a:1"]["ready"] and not replicas["http://b:1"]["ready"]
            assert "no answer to /v1/info within 0.2 s" in replicas["http://b:1"]["error"]
        assert fakes.arrived["b", "/v1/info"] - asked == 1  # the same check, still pending
        fakes.behaviour["a"] = "sleep:30"
        start = time.monotonic()
        resp = await asyncio.wait_for(client.get("/health/ready"), 5)
        assert (
            time.monotonic() - start < 2 and resp.status_code == 503 and resp.json()["status"] == "not_ready"
        )


async def test_a_replica_with_another_tokenizer_is_not_failed_over_to(
    gateway: Gateway, fakes: FakeWorkerTransport
) -> None:
    fakes.behaviour["b"] = "other-tokenizer"
    async with gateway(workers=[{"urls": ["http://a:1", "http://b:1"]}]) as client:
        ready = (await client.get("/health/ready")).json()
        assert ready["status"] == "ready" and [r["ready"] for r in ready["workers"][0]["replicas"]] == [
            True,
            False,
        ]
        fakes.behaviour["a"] = "500"
        _refused(
            await client.post("/v1/completions", json=COMPLETION),
            502,
            "worker_error",
            "all 2 replicas failed",
        )
        assert not any(host == "b" for host, _ in fakes.requests)


async def test_the_circuit_opens_and_a_probe_closes_it(gateway: Gateway, fakes: FakeWorkerTransport) -> None:
    async with gateway(
        workers=[{"url": "http://w0:1"}], health={"failure_threshold": 3, "probe_interval_s": 0.1}
    ) as client:
        fakes.behaviour["w0"] = "down"
        for _ in range(3):
            _refused(
                await client.post("/v1/completions", json=COMPLETION),
                503,
                "worker_error",
                "connection refused",
            )
        calls = len(fakes.authorization)
        error = _refused(
            await client.post("/v1/completions", json=COMPLETION), 503, "worker_error", "circuit open"
        )
        assert len(fakes.authorization) - calls <= 1  # at most a probe of /health came in between
        assert (await client.get("/health/ready")).status_code == 503
        assert await _metric(client, 'specgate:worker_replica_up{url="http://w0:1",worker="w0"}') == 0
        fakes.behaviour["w0"] = ""
        for _ in range(50):
            if await _metric(client, 'specgate:worker_replica_up{url="http://w0:1",worker="w0"}') == 1:
                break
            await asyncio.sleep(0.05)
        assert (await client.post("/v1/completions", json=COMPLETION)).status_code == 200, error


# ----------------------------------------------------------------------------- timeouts


@asynccontextmanager
async def _silent_worker(info: InfoResponse, health: dict[str, Any] | None = None) -> AsyncIterator[str]:
    """A real socket on 127.0.0.1 that answers /health (``health``, as it is when the call comes) and /v1/info
    but never a verify."""
    handlers: list[asyncio.Task[None]] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        handlers.append(asyncio.current_task())  # type: ignore[arg-type]
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = re.search(rb"content-length: *(\d+)", head, re.IGNORECASE)
                await reader.readexactly(int(length.group(1)) if length else 0)
                path = head.split(b" ")[1]
                if path == b"/v1/verify":
                    await asyncio.sleep(3600)
                body = (
                    encode_json(info)
                    if path == b"/v1/info"
                    else json.dumps(health or {"status": "ok"}).encode()
                )
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                    % (len(body), body)
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        for task in handlers:
            task.cancel()


async def test_a_silent_worker_trips_the_read_timeout(gateway: Gateway, tiny_runner: ModelRunner) -> None:
    info = InfoResponse(1, ["aggregate"], "silent", V, tiny_runner.fingerprint, [2], 2048, "fake")
    async with _silent_worker(info) as url:
        workers = [{"url": url, "read_timeout_s": 0.3}]
        async with gateway(transport=httpx.AsyncHTTPTransport(), workers=workers) as client:
            started = time.monotonic()
            _refused(
                await client.post("/v1/completions", json=COMPLETION),
                503,
                "worker_error",
                "no answer within 0.3 s",
            )
            assert time.monotonic() - started < 5
            assert await _metric(client, 'specgate:worker_failures_total{kind="timeout",worker="w0"}') == 1
            assert (await client.get("/health")).status_code == 200


async def test_a_busy_worker_is_waited_for_and_a_stuck_one_failed(
    gateway: Gateway, tiny_runner: ModelRunner
) -> None:
    """Issue 76: a worker slow past the read timeout was failed like a dead one, and three such calls opened
    its breaker (503s for every request until it half-opened). Past the read timeout the gateway now asks its
    /health: while it answers and its model finished a step within the read timeout (``stalled_s``), the call
    waits on and nothing is counted against it; once its model has finished no step for that long, the call
    fails (a timeout, as before)."""
    info = InfoResponse(1, ["aggregate"], "silent", V, tiny_runner.fingerprint, [2], 2048, "fake")
    health: dict[str, Any] = {"status": "ok", "calls": 1, "stalled_s": 0.05}
    async with _silent_worker(info, health) as url:
        async with gateway(
            transport=httpx.AsyncHTTPTransport(), workers=[{"url": url, "read_timeout_s": 0.3}]
        ) as client:
            call = asyncio.create_task(client.post("/v1/completions", json=COMPLETION))
            await asyncio.sleep(1.0)  # a read timeout, then a check every quarter of one: busy, each time
            assert not call.done()
            assert await _metric(client, 'specgate:worker_failures_total{kind="timeout",worker="w0"}') == 0
            health["stalled_s"] = 0.4  # stuck now: no step for longer than the read timeout
            _refused(await call, 503, "worker_error", "its model has finished no step for 0.40 s")
            # idle while the call waits: a restarted process, or one that lost it
            health.update(stalled_s=0.0, calls=0)
            _refused(
                await client.post("/v1/completions", json=COMPLETION),
                503,
                "worker_error",
                "it is answering no call",
            )
            assert await _metric(client, 'specgate:worker_failures_total{kind="timeout",worker="w0"}') == 2


# ----------------------------------------------------------------------------- load, access, bodies


async def test_a_full_worker_is_waited_for_not_failed(gateway: Gateway, fakes: FakeWorkerTransport) -> None:
    """A worker whose KV slots are all in use answers 503 worker_full: the gateway waits and
    asks again (no breaker, no failover) until the read timeout, then fails with a 503."""
    async with gateway() as client:
        fakes.behaviour["w1"] = "full:3"
        assert (await client.post("/v1/completions", json=COMPLETION)).status_code == 200
        assert [host for host, _ in fakes.requests].count("w1") >= 4
        assert not re.search(
            r'worker_failures_total\{kind="\w+",worker="w1"\} [1-9]', (await client.get("/metrics")).text
        )
    async with gateway(workers=[{"url": "http://w0:1", "read_timeout_s": 0.6}]) as client:
        fakes.behaviour["w0"] = "full"
        started = time.monotonic()
        _refused(await client.post("/v1/completions", json=COMPLETION), 503, "worker_error", "worker full")
        assert 0.5 < time.monotonic() - started < 5
        fakes.behaviour["w0"] = ""
        assert (await client.post("/v1/completions", json=COMPLETION)).status_code == 200


async def test_beyond_the_queue_a_429_with_retry_after(gateway: Gateway, fakes: FakeWorkerTransport) -> None:
    fakes.behaviour.update(w0="sleep:0.1", w1="sleep:0.1")
    limits = {
        "max_tokens": 64,
        "max_prompt_tokens": 100,
        "max_concurrent_requests": 1,
        "max_queued_requests": 1,
        "queue_timeout_s": 10,
    }
    async with gateway(limits=limits) as client:
        running = asyncio.create_task(client.post("/v1/completions", json=COMPLETION))
        await asyncio.sleep(0.05)
        queued = asyncio.create_task(client.post("/v1/completions", json=COMPLETION))
        await asyncio.sleep(0.05)
        refused = await client.post("/v1/completions", json={**COMPLETION, "stream": True})
        _refused(refused, 429, "rate_limit_exceeded")
        assert int(refused.headers["retry-after"]) >= 1
        assert (await running).status_code == 200 and (await queued).status_code == 200
        assert await _metric(client, "specgate:num_requests_rejected") == 1
        assert await _metric(client, "specgate:num_requests_running") == 0


async def test_a_request_queued_too_long_gets_a_429(gateway: Gateway, fakes: FakeWorkerTransport) -> None:
    fakes.behaviour.update(w0="sleep:0.2", w1="sleep:0.2")
    limits = {
        "max_tokens": 64,
        "max_prompt_tokens": 100,
        "max_concurrent_requests": 1,
        "max_queued_requests": 4,
        "queue_timeout_s": 0.1,
    }
    async with gateway(limits=limits) as client:
        running = asyncio.create_task(client.post("/v1/completions", json=COMPLETION))
        await asyncio.sleep(0.05)
        _refused(
            await client.post("/v1/completions", json=COMPLETION),
            429,
            "rate_limit_exceeded",
            "no slot within",
        )
        assert (await running).status_code == 200


async def test_api_key_with_the_openai_client(gateway: Gateway, fakes: FakeWorkerTransport) -> None:
    async with gateway(api_key="sk-right", worker_token="wt-1") as client:
        _refused(await client.post("/v1/completions", json=COMPLETION), 401, "invalid_api_key")
        _refused(
            await client.get("/v1/models", headers={"authorization": "Bearer sk-wrong"}),
            401,
            "invalid_api_key",
        )
        assert (await client.get("/health")).status_code == 200 and (
            await client.get("/metrics")
        ).status_code == 200
        transport = client._transport  # the gateway app, in-process
        async with httpx.AsyncClient(transport=transport) as http:
            wrong = openai.AsyncOpenAI(
                base_url="http://gateway/v1", api_key="sk-wrong", http_client=http, max_retries=0
            )
            with pytest.raises(openai.AuthenticationError):
                await wrong.completions.create(model="test-model", prompt="Hi", max_tokens=4)
            right = openai.AsyncOpenAI(
                base_url="http://gateway/v1", api_key="sk-right", http_client=http, max_retries=0
            )
            answer = await right.completions.create(model="test-model", prompt="Hi", max_tokens=4)
            assert answer.usage is not None and answer.usage.completion_tokens == 4
    assert fakes.authorization and set(fakes.authorization) == {"Bearer wt-1"}  # every call to every worker


BAD_BODIES: dict[str, tuple[bytes, int, str | None]] = {
    "malformed JSON": (b'{"model": "test-model", ', 400, "invalid_json"),
    "invalid UTF-8": (b'{"model": "test-model", "prompt": "\xff\xfe bad", "max_tokens": 4}', 400, None),
    "wrong type of max_tokens": (orjson.dumps({**COMPLETION, "max_tokens": "ten"}), 400, "invalid_value"),
    "wrong type of prompt": (orjson.dumps({**COMPLETION, "prompt": {"text": "hi"}}), 400, "invalid_value"),
    "negative max_tokens": (orjson.dumps({**COMPLETION, "max_tokens": -5}), 400, "invalid_value"),
    "huge max_tokens": (orjson.dumps({**COMPLETION, "max_tokens": 10**12}), 400, "context_length_exceeded"),
    "n = 0": (orjson.dumps({**COMPLETION, "n": 0}), 400, "invalid_value"),
    "unknown model": (orjson.dumps({**COMPLETION, "model": "gpt-9"}), 404, "model_not_found"),
    "a prompt over the limit": (
        orjson.dumps({**COMPLETION, "prompt": "word " * 400}),
        400,
        "context_length_exceeded",
    ),
    "a 10 MB body": (orjson.dumps({**COMPLETION, "prompt": "x" * 10_000_000}), 413, "payload_too_large"),
    "not an object": (b"[1, 2, 3]", 400, None),
    "empty body": (b"", 400, None),
}


@pytest.mark.parametrize("kind", list(BAD_BODIES))
async def test_bad_requests_get_the_envelope_and_lose_nothing(client: httpx.AsyncClient, kind: str) -> None:
    body, status, code = BAD_BODIES[kind]
    _refused(
        await client.post("/v1/completions", content=body, headers={"content-type": "application/json"}),
        status,
        code,
    )
    assert (await client.post("/v1/completions", json=COMPLETION)).status_code == 200


@pytest.mark.parametrize(
    "extreme",
    [
        {"top_p": 5e-324},
        {"temperature": 5e-324},
        {"temperature": 1e-6, "top_p": 1e-300},
        {"temperature": 2.0, "top_k": 1},
    ],
)
async def test_extreme_sampling_values_areserved(
    client: httpx.AsyncClient, extreme: dict[str, float]
) -> None:
    resp = await client.post("/v1/completions", json={**COMPLETION, **extreme})  # fuzzing found NaN here once
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 6


async def test_bad_chat_requests(client: httpx.AsyncClient) -> None:
    _refused(await client.post("/v1/chat/completions", json={**CHAT, "messages": []}), 400, "invalid_value")
    _refused(
        await client.post(
            "/v1/chat/completions", json={**CHAT, "messages": [{"role": "wizard", "content": "x"}]}
        ),
        400,
        "invalid_value",
    )
    _refused(await client.post("/v1/chat/completions", json={**CHAT, "messages": "hi"}), 400, "invalid_value")


# ----------------------------------------------------------------------------- disconnects


def test_a_client_that_leaves_frees_the_worker_sessions(
    tiny_runner: ModelRunner, fakes: FakeWorkerTransport
) -> None:
    fakes.behaviour.update(w0="sleep:0.05", w1="sleep:0.05")
    app = create_app(gateway_config(), draft_runner=tiny_runner, transport=fakes.transport())
    with served(app) as url, httpx.Client(base_url=url, timeout=30) as client:
        with client.stream(
            "POST", "/v1/completions", json={**COMPLETION, "max_tokens": 60, "stream": True}
        ) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: ") and '"text"' in line:
                    break  # one chunk, then the client hangs up
        _assert_stopped_and_freed(fakes)
        assert client.get("/metrics").text.count("specgate:num_requests_running 0.0") == 1


def test_a_client_that_gives_up_on_a_whole_response_frees_the_sessions_too(
    tiny_runner: ModelRunner, fakes: FakeWorkerTransport
) -> None:
    fakes.behaviour.update(w0="sleep:0.05", w1="sleep:0.05")
    app = create_app(gateway_config(), draft_runner=tiny_runner, transport=fakes.transport())
    with served(app) as url:
        with pytest.raises(httpx.ReadTimeout):  # the client hangs up after 0.5 s
            httpx.post(f"{url}/v1/completions", json={**COMPLETION, "max_tokens": 60}, timeout=0.5)
        _assert_stopped_and_freed(fakes)


def _assert_stopped_and_freed(fakes: FakeWorkerTransport) -> None:
    """Both workers' sessions deleted within 5 s, long before 60 tokens, and no call after."""
    deadline = time.monotonic() + 5
    while len(fakes.deleted) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(fakes.deleted) == 2 and all(p.startswith("/v1/sessions/") for p in fakes.deleted)
    calls = len(fakes.requests)
    assert calls < 2 * 20  # a round is 2 calls and emits ≥ 1 token: far from 60 tokens
    time.sleep(0.5)
    assert len(fakes.requests) == calls  # no round kept going
