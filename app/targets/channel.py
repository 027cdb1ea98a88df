"""The wire to a target's replicas (docs/design.md §4): a ``Replica`` and its ``Breaker``, the ``Channel``
every call of one target goes through (its link emulation, its ``Traffic``), what the gateway ``Expected`` of
a worker, and the parts of a worker's ``Server-Timing``."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from app.targets.failures import ReplicaFailure, describe, status_failure
from app.targets.fastpost import Answer, FastPost
from core.config import LinkConfig
from core.errors import ProtocolError
from core.protocol import InfoResponse, decode

log = logging.getLogger(__name__)

_HEALTH_TIMEOUT = httpx.Timeout(5.0)  # asking a slow replica's health (a kubelet's probe gives it as long)


@dataclass(frozen=True)
class Expected:
    """What every replica must serve: the draft's tokenizer and vocabulary."""

    fingerprint: str
    vocab_size: int
    tokenizer: Any = None  # the draft's (HF) tokenizer: engine targets speak text and token strings


@dataclass
class Traffic:
    """Bytes on the wire with one worker, both ways (docs/design.md §4), and seconds by part
    (``ROUND_PARTS``); ``add`` sums the bytes only."""

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
    retired: bool = False  # its address left the target's DNS name: no new sessions, its own finish
    draining_until: float = 0.0  # time.monotonic() until which it refuses new sessions (503 worker_draining)
    traffic: Traffic = field(default_factory=Traffic)

    def failed(self, exc: BaseException) -> None:
        self.breaker.record(ok=False)
        self.last_error = str(exc)

    @property
    def draining(self) -> bool:
        return time.monotonic() < self.draining_until

    @property
    def takes_sessions(self) -> bool:
        """New sessions may go here: its address is listed and it is not draining (an open breaker aside)."""
        return not self.retired and not self.draining


class Channel:
    """One target's way to its replicas: the shared HTTP client, its timeout, the emulated link, the latency
    hook, the bytes."""

    def __init__(
        self,
        name: str,
        client: httpx.AsyncClient,
        timeout: httpx.Timeout,
        link: LinkConfig | None = None,
        fast: FastPost | None = None,
        health_path: str | None = None,
        stall_timeout_s: float | None = None,
    ) -> None:
        self.name, self.client, self.timeout, self.link = name, client, timeout, link
        self.fast = fast  # the rounds' POSTs without httpx's layers (real sockets only)
        # a round's answer slower than the read timeout: the replica's health (and its progress) decides
        # whether to wait on (a busy worker) or to fail the call (one silent or stuck); None: the read timeout
        # is a deadline (engines)
        self.health_path = health_path
        # how long a model may finish no step before it is stuck
        self.stall_timeout_s = stall_timeout_s or timeout.read
        self._patient = httpx.Timeout(None, connect=timeout.connect, write=timeout.write, pool=timeout.pool)
        self.traffic = Traffic()
        self.on_call: Callable[[str, float], None] = lambda worker, seconds: None  # metrics hook

    async def request(self, method: str, replica: Replica, path: str, **kwargs: Any) -> httpx.Response:
        """One HTTP request; transport failures as ReplicaFailure (not a round: no link, no bytes)."""
        try:
            return await self.client.request(method, f"{replica.url}{path}", timeout=self.timeout, **kwargs)
        except httpx.HTTPError as exc:
            raise _failure(exc, path, replica) from exc

    async def info(self, replica: Replica) -> InfoResponse:
        """``/v1/info`` as it answered it (ReplicaFailure when it did not)."""
        resp = await self.request("GET", replica, "/v1/info")
        if resp.status_code != 200:
            raise status_failure(resp.status_code, resp.content, "/v1/info")
        try:
            return decode(InfoResponse, resp.content, resp.headers.get("content-type"))
        except ProtocolError as exc:
            raise ReplicaFailure("garbage", f"/v1/info answered garbage: {exc}") from exc

    async def free(self, replica: Replica, session_id: str) -> None:
        """Free a session on a replica (best effort: workers evict anyway)."""
        try:
            await self.client.delete(f"{replica.url}/v1/sessions/{session_id}", timeout=5.0)
        except httpx.HTTPError as exc:
            log.warning(
                "could not free session %s on %s (%s): %s", session_id, self.name, replica.url, describe(exc)
            )

    async def _post(
        self, replica: Replica, path: str, body: bytes, headers: dict[str, str]
    ) -> httpx.Response | Answer:
        """One POST of a round. Slow is not dead: once ``read_timeout_s`` passes with no answer, and every
        quarter of it after, the replica's health is asked; while it answers, holds calls and its model keeps
        finishing steps (a busy worker: a long prompt, a queue), the call waits on; a replica silent, idle or
        stuck fails it (kind ``timeout``, which counts towards its breaker)."""
        if self.health_path is None or self.timeout.read is None:
            return await self._post_once(replica, path, body, headers, self.timeout)
        call = asyncio.ensure_future(self._post_once(replica, path, body, headers, self._patient))
        started, wait = time.monotonic(), self.timeout.read
        try:
            while True:
                done, _ = await asyncio.wait((call,), timeout=wait)
                if done:
                    return call.result()
                why = await self._not_progressing(replica)
                if call.done():  # the answer (or the call's own failure) came during the check: it stands
                    return call.result()
                waited = time.monotonic() - started
                if why is not None:
                    raise ReplicaFailure(
                        "timeout", f"{path} at {replica.url}: no answer within {waited:.1f} s, and {why}"
                    )
                log.info(
                    "worker %s: %s at %s has not answered in %.1f s, but it is busy and "
                    "progressing: waiting on",
                    self.name,
                    path,
                    replica.url,
                    waited,
                )
                # a worker that stops now is found within a quarter more
                wait = max(self.timeout.read / 4, 0.05)
        finally:
            if not call.done():
                call.cancel()
            elif not call.cancelled():
                # retrieved: a failure that lost the race to a verdict is not "never retrieved"
                call.exception()

    async def _not_progressing(self, replica: Replica) -> str | None:
        """Why a replica that has not answered within the read timeout is taken for dead, or None: its health
        answers (draining counts: its sessions go on), it is answering calls (a restarted process, or one that
        lost the call, holds none), and its model finished a step within ``stall_timeout_s``."""
        limit = self.stall_timeout_s
        try:
            resp = await self.client.get(f"{replica.url}{self.health_path}", timeout=_HEALTH_TIMEOUT)
        except httpx.HTTPError as exc:
            return f"its {self.health_path} did not answer ({describe(exc)})"
        body = health_body(resp)
        if resp.status_code != 200 and body.get("status") != "draining":
            return f"its {self.health_path} answered {resp.status_code}"
        stalled, calls = body.get("stalled_s"), body.get("calls")
        if not isinstance(stalled, (int, float)) or not isinstance(calls, int):
            return f"its {self.health_path} reports no progress"
        if calls < 1:
            return "it is answering no call (it restarted, or lost this one)"
        return stuck(body, limit)

    async def _post_once(
        self, replica: Replica, path: str, body: bytes, headers: dict[str, str], timeout: httpx.Timeout
    ) -> httpx.Response | Answer:
        url = f"{replica.url}{path}"
        try:
            if self.fast is not None and self.fast.handles(url):
                return await self.fast.post(url, body, headers, timeout)
            return await self.client.request("POST", url, timeout=timeout, content=body, headers=headers)
        except httpx.HTTPError as exc:
            raise _failure(exc, path, replica) from exc

    async def exchange(
        self, replica: Replica, path: str, body: bytes, headers: dict[str, str], traffic: Traffic
    ) -> tuple[int, bytes]:
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
    """A transport failure as its kind: timeout, connect, or transport (reset, closed mid-body, …)."""
    kind = (
        "timeout"
        if isinstance(exc, httpx.TimeoutException)
        else "connect"
        if isinstance(exc, httpx.ConnectError)
        else "transport"
    )
    return ReplicaFailure(kind, f"{path} at {replica.url}: {describe(exc)}")


_WORKER_PARTS = {"codec": "codec", "queue": "queue", "model": "model", "score": "scoring", "total": "total"}


def server_timing(header: str) -> dict[str, float]:
    """A worker's ``Server-Timing`` (``name;dur=ms, …``) as seconds by part; unknown names are left out."""
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


def stuck(health: Any, limit: float | None) -> str | None:
    """Why a worker whose ``/health`` answered ``health`` is stuck (its model has finished no step for
    ``limit`` s while work waits), or None. A probe does not close the breaker of a stuck replica."""
    stalled = health.get("stalled_s") if isinstance(health, dict) else None
    if limit is not None and isinstance(stalled, (int, float)) and stalled >= limit:
        return f"its model has finished no step for {stalled:.2f} s"
    return None


def health_body(resp: httpx.Response) -> dict[str, Any]:
    """A ``/health`` answer's JSON object; empty when it is not one."""
    try:
        body = resp.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}
