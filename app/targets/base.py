"""What every target of the federation shares (DESIGN §1, §4, §8): the ``Target`` protocol the
engine speaks to, the ``Dialect`` a kind of target is spoken in (a specgate worker, an
OpenAI-compatible engine), the ``Channel`` a dialect's calls go through (one HTTP client, the
emulated link, bytes counted), and the failures:

    ReplicaFailure   one replica failed one call (kind: connect | timeout | transport | http_5xx
                     | garbage | fingerprint | unauthorized | rejected); the session moves on
    WorkerError      what the engine sees: no replica of a target is left, or the target refused
                     the request itself (a 4xx every replica would give)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import httpx
import numpy as np

from app.targets.fastpost import Answer, FastPost
from core.config import LinkConfig
from core.errors import ProtocolError, SpecgateError
from core.protocol import (
    ErrorBody,
    InfoResponse,
    VerifyRequest,
    VerifyResponse,
    prefix_hash,
)

FAILURE_KINDS = ("connect", "timeout", "transport", "http_5xx", "garbage", "fingerprint", "unauthorized", "rejected")


class WorkerError(SpecgateError):
    """A target that is down, timed out, or answered something unusable."""

    def __init__(self, worker: str, message: str, status: int = 502) -> None:
        super().__init__(f"worker {worker}: {message}")
        self.worker = worker
        self.status = status


class ReplicaFailure(SpecgateError):
    """One replica failed one call; ``kind`` is one of FAILURE_KINDS."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class Expected:
    """What every replica must serve: the draft's tokenizer and vocabulary."""

    fingerprint: str
    vocab_size: int
    tokenizer: Any = None  # the draft's (HF) tokenizer: engine targets speak text and token strings


@dataclass
class Traffic:
    """Bytes on the wire with one worker, both directions (DESIGN §4), and — for one call —
    where its seconds went (``seconds``: gateway_codec, link, http, and the worker's own parts
    from its ``Server-Timing``: worker_codec, worker_queue, worker_model, worker_scoring,
    worker_other). ``add`` sums the bytes only: calls made in parallel overlap in time, so
    which call's seconds count is the caller's choice (``app.engine.round``)."""

    sent: int = 0
    received: int = 0
    calls: int = 0
    seconds: dict[str, float] = field(default_factory=dict)
    batch_sessions: int = 0  # over the calls answered: the sessions that shared each one's worker forward

    def add(self, other: Traffic) -> None:
        self.sent += other.sent
        self.received += other.received
        self.calls += other.calls

    def time(self, **parts: float) -> None:
        for name, seconds in parts.items():
            self.seconds[name] = self.seconds.get(name, 0.0) + seconds


@dataclass
class Breaker:
    """Closed until ``threshold`` failures in a row; then open (no calls) until a probe passes."""

    threshold: int
    failures: int = 0  # in a row

    @property
    def is_open(self) -> bool:
        return self.failures >= self.threshold

    def record(self, ok: bool) -> None:
        self.failures = 0 if ok else self.failures + 1


@dataclass
class Replica:
    url: str
    breaker: Breaker
    info: InfoResponse | None = None  # its /v1/info, once checked against Expected
    last_error: str = ""
    traffic: Traffic = field(default_factory=Traffic)


class Channel:
    """One target's way to its replicas: the shared HTTP client, its timeout, the emulated link
    (delays each direction, never blocks the loop), the round-latency hook and the bytes."""

    def __init__(self, name: str, client: httpx.AsyncClient, timeout: httpx.Timeout, link: LinkConfig | None = None, fast: FastPost | None = None) -> None:
        self.name, self.client, self.timeout, self.link = name, client, timeout, link
        self.fast = fast  # the rounds' POSTs without httpx's layers (real sockets only)
        self.traffic = Traffic()
        self.on_call: Callable[[str, float], None] = lambda worker, seconds: None  # metrics hook

    async def request(self, method: str, replica: Replica, path: str, **kwargs: Any) -> httpx.Response:
        """One HTTP request; transport failures as ReplicaFailure (not a round: no link, no bytes)."""
        try:
            return await self.client.request(method, f"{replica.url}{path}", timeout=self.timeout, **kwargs)
        except httpx.HTTPError as exc:
            raise _failure(exc, path, replica) from exc

    async def _post(self, replica: Replica, path: str, body: bytes, headers: dict[str, str]) -> httpx.Response | Answer:
        url = f"{replica.url}{path}"
        if self.fast is None or not self.fast.handles(url):
            return await self.request("POST", replica, path, content=body, headers=headers)
        try:
            return await self.fast.post(url, body, headers, self.timeout)
        except httpx.HTTPError as exc:
            raise _failure(exc, path, replica) from exc

    async def exchange(self, replica: Replica, path: str, body: bytes, headers: dict[str, str], traffic: Traffic) -> tuple[int, bytes]:
        """One POST of a round: the emulated link, the round-latency hook, bytes both ways."""
        linked = time.perf_counter()
        if self.link is not None:
            await asyncio.sleep(self.link.delay_s(len(body), upstream=True))
        started = time.perf_counter()
        resp = await self._post(replica, path, body, headers)
        answered = time.perf_counter()
        if self.link is not None:
            await asyncio.sleep(self.link.delay_s(len(resp.content), upstream=False))
        ended = time.perf_counter()
        self.on_call(self.name, ended - started)
        call = Traffic(len(body), len(resp.content), 1)
        for t in (traffic, self.traffic, replica.traffic):
            t.add(call)
        worker = server_timing(resp.headers.get("server-timing", ""))
        handler = worker.pop("total", 0.0)
        parts = {f"worker_{name}": seconds for name, seconds in worker.items()}
        parts["worker_other"] = max(handler - sum(worker.values()), 0.0) if worker else 0.0
        traffic.time(link=ended - answered + started - linked, http=answered - started - handler, **parts)
        return resp.status_code, resp.content


def _failure(exc: httpx.HTTPError, path: str, replica: Replica) -> ReplicaFailure:
    """A transport failure as the replica set's kind: timeout, connect, or transport (reset,
    closed mid-body, …)."""
    kind = "timeout" if isinstance(exc, httpx.TimeoutException) else "connect" if isinstance(exc, httpx.ConnectError) else "transport"
    return ReplicaFailure(kind, f"{path} at {replica.url}: {describe(exc)}")


class Dialect(Protocol):
    """How one kind of target is spoken to, replica by replica (the replica set does the rest:
    which replica, failover, breakers)."""

    health_path: str | None  # probed before ``info`` when a breaker is open; None: straight to ``info``
    is_engine: bool  # an OpenAI-compatible engine (DESIGN §8), not a specgate worker

    async def info(self, replica: Replica) -> InfoResponse:
        """What the replica serves, checked against Expected (ReplicaFailure otherwise)."""
        ...

    async def verify(self, replica: Replica, req: VerifyRequest, agreed: list[int], traffic: Traffic) -> VerifyResponse:
        """One verify call on one replica; ``agreed``: the whole sequence the prefix is part of."""
        ...

    async def free(self, replica: Replica, session_id: str) -> None:
        """Free a session on a replica (best effort)."""
        ...

    def scorable(self, sequence: list[int], draft: list[int]) -> int:
        """How many leading draft tokens this target can score after ``sequence``."""
        ...


class Target(Protocol):
    """One weighted member of the federation, as the engine sees it."""

    name: str
    weight: float
    is_engine: bool

    async def verify(self, req: VerifyRequest, agreed: list[int]) -> tuple[VerifyResponse, Traffic]: ...

    async def delete_session(self, session_id: str) -> None: ...

    def scorable(self, sequence: list[int], draft: list[int]) -> int: ...


_WORKER_PARTS = {"codec": "codec", "queue": "queue", "model": "model", "score": "scoring", "total": "total"}


def server_timing(header: str) -> dict[str, float]:
    """A worker's ``Server-Timing`` (``name;dur=ms, …``) as seconds by part (scoring, not
    score); names it does not know, and a header that is not one, are left out."""
    out: dict[str, float] = {}
    for entry in header.split(","):
        name, _, rest = entry.strip().partition(";")
        part = _WORKER_PARTS.get(name)
        if part is None or not rest.startswith("dur="):
            continue
        try:
            out[part] = max(float(rest[4:]), 0.0) / 1e3
        except ValueError:
            continue
    return out


def status_failure(status: int, body: bytes, what: str) -> ReplicaFailure:
    """A non-200 answer: 5xx and 401/403 are the replica's fault; other 4xx are the request's."""
    try:
        message = f"{what}: HTTP {status}: {ErrorBody.from_json(body).message}"
    except ProtocolError:
        message = f"{what}: HTTP {status}: {body[:200]!r}"
    if status >= 500:
        return ReplicaFailure("http_5xx", message)
    if status in (401, 403):
        return ReplicaFailure("unauthorized", f"{message} (is SPECGATE_WORKER_TOKEN the same on both sides?)")
    return ReplicaFailure("rejected", message)


def error_message(body: bytes) -> str:
    """The message of an error body in the OpenAI envelope, else the body's first bytes."""
    try:
        return ErrorBody.from_json(body).message
    except ProtocolError:
        return repr(body[:200])


def describe(exc: httpx.HTTPError) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def resend(req: VerifyRequest, agreed: list[int], prefix: int) -> VerifyRequest:
    """``req`` from a shorter prefix: every other field as it was (replace, not field by field),
    but no ``path``: the accepted path of the previous tree is then among the tokens resent."""
    held_until = req.prefix_len + len(req.tokens)
    tokens = np.asarray(agreed[prefix:held_until], dtype=np.int64)
    return replace(req, prefix_len=prefix, prefix_hash=prefix_hash(agreed[:prefix]), tokens=tokens, path=None)
