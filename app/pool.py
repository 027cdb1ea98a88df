"""The gateway's side of protocol v1 (DESIGN §4): a WorkerClient per configured target, each
with one or more replicas of the same model; resend on ``409 session_short``; failover between
replicas; a circuit breaker per replica. Transport and protocol failures are mapped here, once:

    ReplicaFailure   one replica failed one call (kind: connect | timeout | transport | http_5xx
                     | garbage | fingerprint | unauthorized); the session moves to another replica
    WorkerError      what the engine sees: no replica of a target is left, or the target refused
                     the request itself (a 4xx every replica would give)

The gateway owns the token sequence, so any replica can take a session over: the new one gets
the agreed prefix resent from zero and answers exactly as the old one would have (the worker's
random draws are keyed by the request's seed, position and the target's index, not by replica).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import httpx
import numpy as np

from core.config import LinkConfig, SpecgateConfig
from core.errors import ProtocolError, SpecgateError
from core.protocol import (
    BINARY_CONTENT_TYPE,
    ErrorBody,
    InfoResponse,
    VerifyRequest,
    VerifyResponse,
    check_verify_response,
    decode,
    encode,
    prefix_hash,
)

log = logging.getLogger(__name__)

_MAX_RESENDS = 2  # held prefix, then from zero
_PROBE_TIMEOUT = httpx.Timeout(2.0)  # a probe of a hung replica must not hold up the others
FAILURE_KINDS = ("connect", "timeout", "transport", "http_5xx", "garbage", "fingerprint", "unauthorized", "rejected")


class WorkerError(SpecgateError):
    """A target that is down, timed out, or answered something unusable."""

    def __init__(self, worker: str, message: str, status: int = 502) -> None:
        super().__init__(f"worker {worker}: {message}")
        self.worker = worker
        self.status = status


class ReplicaFailure(Exception):
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
    """Bytes on the wire with one worker, both directions (DESIGN §4)."""

    sent: int = 0
    received: int = 0
    calls: int = 0

    def add(self, other: Traffic) -> None:
        self.sent += other.sent
        self.received += other.received
        self.calls += other.calls


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


class WorkerClient:
    """One target of the federation: its weight, its replicas, which replica holds which session."""

    def __init__(
        self,
        name: str,
        urls: list[str],
        weight: float,
        client: httpx.AsyncClient,
        timeout: httpx.Timeout,
        threshold: int,
        expected: Expected,
        link: LinkConfig | None = None,  # emulated network: delays each direction, never blocks the loop
    ) -> None:
        self.name, self.weight, self.client, self.timeout, self.expected, self.link = name, weight, client, timeout, expected, link
        self.replicas = [Replica(url.rstrip("/"), Breaker(threshold)) for url in urls]
        self.sessions: dict[str, Replica] = {}  # the replica that holds each session now
        self.held: dict[str, set[str]] = {}  # every replica a session was sent to (freed at the end)
        self.failures: Counter[str] = Counter()  # by kind
        self.failovers = 0  # sessions moved to another replica mid-request
        self.traffic = Traffic()
        self.on_call: Callable[[str, float], None] = lambda worker, seconds: None  # metrics hook

    @property
    def url(self) -> str:
        return self.replicas[0].url

    @property
    def vocab_size(self) -> int:
        return self.expected.vocab_size

    @property
    def is_up(self) -> bool:
        return any(not r.breaker.is_open for r in self.replicas)

    # ----------------------------------------------------------------- info and health

    async def check(self, replica: Replica) -> InfoResponse:
        """/v1/info of one replica against Expected; success closes its breaker."""
        try:
            info = await self._fetch_info(replica)
        except ReplicaFailure as exc:
            self._failed(replica, exc)
            raise
        replica.info = info
        replica.breaker.record(ok=True)
        return info

    async def check_all(self) -> dict[str, Any]:
        """Every replica checked at once: the target's entry of ``/health/ready``."""
        results = await asyncio.gather(*(self.check(r) for r in self.replicas), return_exceptions=True)
        replicas, infos = [], []
        for replica, result in zip(self.replicas, results):
            if isinstance(result, InfoResponse):
                infos.append(result)
                replicas.append({"url": replica.url, "ready": True})
            else:
                replicas.append({"url": replica.url, "ready": False, "error": str(result), "failures_in_a_row": replica.breaker.failures})
        entry: dict[str, Any] = {"name": self.name, "url": self.url, "weight": self.weight, "ready": bool(infos), "replicas": replicas}
        if infos:
            entry.update(model=infos[0].model_id, max_context=min(i.max_context for i in infos))
        else:
            entry["error"] = f"worker {self.name}: no replica ready ({replicas[0]['error']})"
        return entry

    health_path: str | None = "/health"  # probed before /v1/info; None: straight to the check
    is_engine = False  # an openai-logprobs engine (app.openai_target), not our worker

    async def probe(self) -> None:
        """Open breakers only: ``/health``, then ``/v1/info``; a replica that passes takes calls again."""
        for replica in (r for r in self.replicas if r.breaker.is_open):
            try:
                if self.health_path is not None:
                    resp = await self.client.get(f"{replica.url}{self.health_path}", timeout=_PROBE_TIMEOUT)
                    if resp.status_code != 200:
                        continue
                await self.check(replica)
                log.info("worker %s: replica %s is back", self.name, replica.url)
            except (httpx.HTTPError, ReplicaFailure):
                continue

    async def _fetch_info(self, replica: Replica) -> InfoResponse:
        resp = await self._request("GET", replica, "/v1/info")
        if resp.status_code != 200:
            raise status_failure(resp.status_code, resp.content, "/v1/info")
        try:
            info = decode(InfoResponse, resp.content, resp.headers.get("content-type"))
        except ProtocolError as exc:
            raise ReplicaFailure("garbage", f"/v1/info answered garbage: {exc}") from exc
        if info.tokenizer_fingerprint != self.expected.fingerprint or info.vocab_size != self.expected.vocab_size:
            raise ReplicaFailure("fingerprint", f"serves another tokenizer/vocabulary ({info.model_id}, V={info.vocab_size})")
        return info

    # ----------------------------------------------------------------- verify

    async def verify(self, req: VerifyRequest, agreed: list[int]) -> tuple[VerifyResponse, Traffic]:
        """One verify call on the replica that holds the session, failing over to the others.

        ``agreed`` is the whole token sequence the request's prefix is a part of: a resend moves
        tokens from the prefix into ``tokens``.
        """
        traffic, tried = Traffic(), set[str]()
        last: ReplicaFailure | None = None
        while True:
            replica = await self._replica_for(req.session_id, tried, last)
            if self.sessions.get(req.session_id) is not replica:
                if req.session_id in self.held:  # it lost the session's replica mid-request
                    self.failovers += 1
                    log.warning("worker %s: session %s moves to %s", self.name, req.session_id, replica.url)
                if req.prefix_len:
                    req = _resend(req, agreed, 0)  # a fresh replica holds nothing of it
                self.sessions[req.session_id] = replica
                self.held.setdefault(req.session_id, set()).add(replica.url)
            try:
                resp = await self._verify_on(replica, req, agreed, traffic)
            except ReplicaFailure as exc:
                self._failed(replica, exc)
                tried.add(replica.url)
                del self.sessions[req.session_id]
                last = exc
                continue
            replica.breaker.record(ok=True)
            return resp, traffic

    async def _replica_for(self, session_id: str, tried: set[str], last: ReplicaFailure | None) -> Replica:
        """The session's replica, else the least loaded healthy one not yet tried (checked first)."""
        current = self.sessions.get(session_id)
        if current is not None and not current.breaker.is_open:
            return current
        while True:
            candidates = [r for r in self.replicas if r.url not in tried and not r.breaker.is_open]
            if not candidates:
                raise self._exhausted(last)
            load = Counter(r.url for r in self.sessions.values())
            replica = min(candidates, key=lambda r: (r.breaker.failures, load[r.url]))
            if replica.info is not None:
                return replica
            try:
                await self.check(replica)
                return replica
            except ReplicaFailure as exc:
                tried.add(replica.url)
                last = exc

    def _exhausted(self, last: ReplicaFailure | None) -> WorkerError:
        if last is None:  # every breaker was open before this call
            return WorkerError(self.name, f"no healthy replica (circuit open after repeated failures: {self.replicas[0].last_error})", 503)
        status = 503 if last.kind in ("connect", "timeout") else 502
        which = "its replica" if len(self.replicas) == 1 else f"all {len(self.replicas)} replicas"
        return WorkerError(self.name, f"{which} failed: {last}", status)

    def _failed(self, replica: Replica, exc: ReplicaFailure) -> None:
        replica.breaker.record(ok=False)
        replica.last_error = str(exc)
        self.failures[exc.kind] += 1
        if replica.breaker.failures == replica.breaker.threshold:
            replica.info = None  # checked again before its next call
            log.warning("worker %s: circuit open for %s after %d failures: %s", self.name, replica.url, replica.breaker.failures, exc)
        else:
            log.warning("worker %s: replica %s failed (%s): %s", self.name, replica.url, exc.kind, exc)

    async def _verify_on(self, replica: Replica, req: VerifyRequest, agreed: list[int], traffic: Traffic) -> VerifyResponse:
        for _ in range(_MAX_RESENDS + 1):
            status, body = await self._post(replica, req, traffic)
            if status == 200:
                return self._parse(body, req)
            if status != 409:
                failure = status_failure(status, body, "verify")
                if failure.kind == "rejected":  # the request itself: every replica would refuse it
                    raise WorkerError(self.name, str(failure))
                raise failure
            held = _held(body)
            prefix = held if held < req.prefix_len else 0  # held ≥ prefix_len: the hash differed
            log.info("worker %s lost session %s (holds %d): resending from %d", self.name, req.session_id, held, prefix)
            req = _resend(req, agreed, prefix)
        raise ReplicaFailure("garbage", "kept answering session_short after a resend from zero")

    async def _post(self, replica: Replica, req: VerifyRequest, traffic: Traffic) -> tuple[int, bytes]:
        body, content_type = encode(req, self.vocab_size)
        return await self._exchange(replica, "/v1/verify", body, {"content-type": content_type, "accept": BINARY_CONTENT_TYPE}, traffic)

    async def _exchange(self, replica: Replica, path: str, body: bytes, headers: dict[str, str], traffic: Traffic) -> tuple[int, bytes]:
        """One POST of a round: the emulated link, the round-latency hook, bytes both ways."""
        if self.link is not None:
            await asyncio.sleep(self.link.delay_s(len(body), upstream=True))
        started = time.perf_counter()
        resp = await self._request("POST", replica, path, content=body, headers=headers)
        if self.link is not None:
            await asyncio.sleep(self.link.delay_s(len(resp.content), upstream=False))
        self.on_call(self.name, time.perf_counter() - started)
        call = Traffic(len(body), len(resp.content), 1)
        for t in (traffic, self.traffic, replica.traffic):
            t.add(call)
        return resp.status_code, resp.content

    async def _request(self, method: str, replica: Replica, path: str, **kwargs: Any) -> httpx.Response:
        try:
            return await self.client.request(method, f"{replica.url}{path}", timeout=self.timeout, **kwargs)
        except httpx.TimeoutException as exc:
            raise ReplicaFailure("timeout", f"{path} at {replica.url}: {_describe(exc)}") from exc
        except httpx.ConnectError as exc:
            raise ReplicaFailure("connect", f"{path} at {replica.url}: {_describe(exc)}") from exc
        except httpx.HTTPError as exc:  # reset, closed mid-body, …
            raise ReplicaFailure("transport", f"{path} at {replica.url}: {_describe(exc)}") from exc

    def scorable(self, sequence: list[int], draft: list[int]) -> int:
        """How many leading draft tokens this target can score after ``sequence``: all of them."""
        return len(draft)

    def _parse(self, body: bytes, req: VerifyRequest) -> VerifyResponse:
        try:
            resp = decode(VerifyResponse, body, BINARY_CONTENT_TYPE)
            check_verify_response(resp, req, self.vocab_size)
        except ProtocolError as exc:
            raise ReplicaFailure("garbage", f"answered garbage: {exc}") from exc
        return resp

    async def delete_session(self, session_id: str) -> None:
        """Free the session on every replica it was sent to (best effort: they evict anyway)."""
        self.sessions.pop(session_id, None)
        for replica in self.replicas:
            if replica.url in self.held.get(session_id, ()) and not replica.breaker.is_open:
                try:
                    await self.client.delete(f"{replica.url}/v1/sessions/{session_id}", timeout=5.0)
                except httpx.HTTPError as exc:
                    log.warning("could not free session %s on worker %s (%s): %s", session_id, self.name, replica.url, _describe(exc))
        self.held.pop(session_id, None)


def _resend(req: VerifyRequest, agreed: list[int], prefix: int) -> VerifyRequest:
    """``req`` from a shorter prefix: every other field as it was (replace, not field by field)."""
    held_until = req.prefix_len + len(req.tokens)
    tokens = np.asarray(agreed[prefix:held_until], dtype=np.int64)
    return replace(req, prefix_len=prefix, prefix_hash=prefix_hash(agreed[:prefix]), tokens=tokens)


def _held(body: bytes) -> int:
    try:
        held = ErrorBody.from_json(body).held
    except ProtocolError:
        return 0
    return held if isinstance(held, int) and held >= 0 else 0


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


def _describe(exc: httpx.HTTPError) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class WorkerPool:
    """The federation: every target, its weight, and one HTTP client shared by them all
    (transport retries off: the failover loop above is the only retry)."""

    def __init__(self, workers: list[WorkerClient], client: httpx.AsyncClient, probe_interval_s: float) -> None:
        self.workers, self.client, self.probe_interval_s = workers, client, probe_interval_s
        self._prober: asyncio.Task[None] | None = None

    @classmethod
    def from_config(cls, config: SpecgateConfig, expected: Expected, transport: httpx.AsyncBaseTransport | None = None) -> WorkerPool:
        headers = {"authorization": f"Bearer {config.worker_token}"} if config.worker_token else None
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=4 * config.limits.max_concurrent_requests)
        client = httpx.AsyncClient(transport=transport or httpx.AsyncHTTPTransport(retries=0, limits=limits), headers=headers)
        from app.openai_target import OpenAITarget  # it builds on WorkerClient

        workers = []
        for w in config.workers:
            timeout = httpx.Timeout(w.read_timeout_s, connect=w.connect_timeout_s)
            args = (w.name or "", config.worker_urls(w), w.weight, client, timeout, config.health.failure_threshold, expected, w.link)
            workers.append(OpenAITarget(*args, entry=w) if w.is_engine else WorkerClient(*args))
        return cls(workers, client, config.health.probe_interval_s)

    def scorable(self, sequence: list[int], draft: list[int]) -> int:
        """How many leading draft tokens every target can score (engines cannot score every token)."""
        return min(w.scorable(sequence, draft) for w in self.workers)

    @property
    def weights(self) -> list[float]:
        return [w.weight for w in self.workers]

    @property
    def on_call(self) -> Callable[[str, float], None]:
        return self.workers[0].on_call

    @on_call.setter
    def on_call(self, hook: Callable[[str, float], None]) -> None:
        """``hook(worker, seconds)`` after every verify call (the round-latency histogram)."""
        for worker in self.workers:
            worker.on_call = hook

    def start(self) -> None:
        """Probe open breakers in the background until ``close``."""
        self._prober = asyncio.create_task(self._probe_forever())

    async def _probe_forever(self) -> None:
        while True:
            await asyncio.sleep(self.probe_interval_s)
            await asyncio.gather(*(w.probe() for w in self.workers))

    async def check_all(self) -> list[dict[str, Any]]:
        return list(await asyncio.gather(*(w.check_all() for w in self.workers)))

    async def delete_sessions(self, session_id: str) -> None:
        await asyncio.gather(*(w.delete_session(session_id) for w in self.workers))

    async def close(self) -> None:
        if self._prober is not None:
            self._prober.cancel()
            await asyncio.gather(self._prober, return_exceptions=True)
        await self.client.aclose()
