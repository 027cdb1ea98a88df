"""``FastPost``, the rounds' POST without httpx's layers, against a real uvicorn: answers with a
length or chunked, kept-alive connections reused, one the server closed retried once, and
failures of the same httpx kinds (so ``Channel`` names them as before: connect, timeout,
transport)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from app.targets.channel import Breaker, Channel, Replica, Traffic
from app.targets.failures import ReplicaFailure
from app.targets.fastpost import FastPost
from clients.procs import free_port
from tests.app.helpers import served

TIMEOUT = httpx.Timeout(5.0, connect=2.0)


async def _app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Echoes the body; the path picks the answer's shape."""
    if scope["type"] != "http":
        return
    body, more = b"", True
    while more:
        message = await receive()
        body += message.get("body", b"")
        more = message.get("more_body", False)
    path, headers = scope["path"], dict(scope["headers"])
    if path == "/slow":
        await asyncio.sleep(1.0)
    if path == "/chunked":  # no length: uvicorn sends it chunked
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"x-seen", headers.get(b"authorization", b"-"))],
            }
        )
        for i in range(0, len(body), 3):
            await send({"type": "http.response.body", "body": body[i : i + 3], "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        return
    extra = [(b"connection", b"close")] if path == "/close" else []
    out = [
        (b"content-length", str(len(body)).encode()),
        (b"server-timing", b"model;dur=1.5, total;dur=2"),
        *extra,
    ]
    await send({"type": "http.response.start", "status": 418 if path == "/teapot" else 200, "headers": out})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture(scope="module")
def url() -> Any:
    with served(_app) as base:
        yield base


async def test_answers_with_a_length_or_chunked_and_reuses_its_connection(url: str) -> None:
    fast = FastPost({"Authorization": "Bearer k"})
    try:
        first = await fast.post(
            f"{url}/echo", b"hello", {"content-type": "application/octet-stream"}, TIMEOUT
        )
        assert (first.status_code, first.content, first.headers["server-timing"]) == (
            200,
            b"hello",
            "model;dur=1.5, total;dur=2",
        )
        second = await fast.post(f"{url}/echo", b"x" * 100_000, {}, TIMEOUT)
        assert second.content == b"x" * 100_000
        assert sum(len(c) for c in fast._idle.values()) == 1  # one connection, kept and reused
        chunked = await fast.post(f"{url}/chunked", b"0123456789", {}, TIMEOUT)
        assert (chunked.content, chunked.headers["x-seen"]) == (b"0123456789", "Bearer k")
        assert (await fast.post(f"{url}/teapot", b"", {}, TIMEOUT)).status_code == 418
    finally:
        await fast.aclose()


async def test_a_connection_the_server_closed_is_not_reused(url: str) -> None:
    fast = FastPost()
    try:
        assert (await fast.post(f"{url}/close", b"a", {}, TIMEOUT)).content == b"a"
        assert not any(fast._idle.values())  # `connection: close`: dropped
        await fast.post(f"{url}/echo", b"b", {}, TIMEOUT)
        conn = next(c for conns in fast._idle.values() for c in conns)
        conn.writer.transport.abort()  # as if the server had closed it while idle
        await asyncio.sleep(0.05)
        assert (await fast.post(f"{url}/echo", b"c", {}, TIMEOUT)).content == b"c"  # retried on a fresh one
    finally:
        await fast.aclose()


async def test_failures_keep_their_kinds_through_the_channel(url: str) -> None:
    fast = FastPost()
    channel = Channel("w0", httpx.AsyncClient(), httpx.Timeout(0.3, connect=1.0), fast=fast)
    traffic = Traffic()
    try:
        status, body = await channel.exchange(Replica(url, Breaker(3)), "/echo", b"abc", {}, traffic)
        assert (status, body, traffic.sent, traffic.received) == (200, b"abc", 3, 3)
        assert traffic.seconds["worker_model"] == pytest.approx(1.5e-3)
        with pytest.raises(ReplicaFailure) as timeout:
            await channel.exchange(Replica(url, Breaker(3)), "/slow", b"", {}, traffic)
        assert timeout.value.kind == "timeout"
        with pytest.raises(ReplicaFailure) as refused:
            await channel.exchange(
                Replica(f"http://127.0.0.1:{free_port()}", Breaker(3)), "/echo", b"", {}, traffic
            )
        assert refused.value.kind == "connect"
    finally:
        await fast.aclose()
        await channel.client.aclose()


class _ClosedByServer:
    """A kept-alive connection whose server closed it just as it was reused: the request goes
    out, the answer is an EOF before any byte."""

    def __init__(self) -> None:
        self.reader = asyncio.StreamReader()
        self.writer = self

    def write(self, data: bytes) -> None:
        self.reader.feed_eof()

    async def drain(self) -> None:
        pass

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        pass


async def test_a_reused_connection_closed_under_it_is_retried_once_on_a_fresh_one(url: str) -> None:
    fast = FastPost()
    fresh = fast._connection
    handed: list[str] = []

    async def connection(host: str, port: int, timeout: httpx.Timeout) -> Any:
        handed.append("stale" if not handed else "fresh")
        return fast._idle[(host, port)].pop() if len(handed) == 1 else await fresh(host, port, timeout)

    fast._idle[("127.0.0.1", int(url.rsplit(":", 1)[1]))] = [_ClosedByServer()]  # type: ignore[list-item]  # one idle: a reuse
    fast._connection = connection  # type: ignore[method-assign]
    try:
        assert (await fast.post(f"{url}/echo", b"again", {}, TIMEOUT)).content == b"again"
        assert handed == ["stale", "fresh"]
        with pytest.raises(httpx.RemoteProtocolError):
            # a fresh connection that closes is a failure, not a retry
            await fast._exchange(_ClosedByServer(), b"x", TIMEOUT, may_be_stale=False)  # type: ignore[arg-type]
    finally:
        await fast.aclose()
