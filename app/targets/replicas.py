"""A target with replicas of one model (docs/design.md §4, docs/reliability.md): sessions, failover, breakers,
probes, and every retry of a verify call — on the same replica (a 409's resend, a full worker's wait) or on
another (failover)."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import Counter
from typing import Any

import httpx

from app.targets.base import Dialect, Target, resend
from app.targets.channel import Breaker, Channel, Expected, Replica, Traffic, health_body, stuck
from app.targets.checks import Checks
from app.targets.failures import AskAgain, ReplicaFailure, WorkerError
from core.protocol import InfoResponse, VerifyRequest, VerifyResponse

log = logging.getLogger(__name__)

_PROBE_TIMEOUT = httpx.Timeout(2.0)  # a probe of a hung replica must not hold up the others

_MAX_RESENDS = 2  # after a 409: from the prefix held, then from zero
_FULL_FIRST_PAUSE_S = 0.25  # a full worker (503 worker_full): the first wait, doubling to 2 s
_FULL_WAIT_S = 30.0  # at most this long in all when the channel has no read timeout
# a replica that refused a new session as draining gets none for this long (its Retry-After)
DRAINING_PAUSE_S = 5.0


class ReplicaSet(Target):
    """One target of the federation: its weight, its replicas, which replica holds which session."""

    def __init__(
        self,
        name: str,
        urls: list[str],
        weight: float,
        channel: Channel,
        dialect: Dialect,
        expected: Expected,
        threshold: int,
        discovered: bool = False,
    ) -> None:
        """``discovered``: ``urls[0]`` is a name whose addresses join as replicas
        (app/targets/discovery.py)."""
        self.name, self.weight, self.channel, self.dialect, self.expected, self.threshold = (
            name,
            weight,
            channel,
            dialect,
            expected,
            threshold,
        )
        self.replicas = [] if discovered else [Replica(url.rstrip("/"), Breaker(threshold)) for url in urls]
        self.url, self.is_openai_logprobs, self.discovered = (
            urls[0].rstrip("/"),
            dialect.is_openai_logprobs,
            discovered,
        )
        self.sessions: dict[str, Replica] = {}  # the replica that holds each session now
        self.held: dict[str, set[str]] = {}  # every replica a session was sent to (freed at the end)
        self.failures: Counter[str] = Counter()  # by kind
        self.failovers = 0  # sessions moved to another replica mid-request
        self.checks = Checks()

    def scorable(self, sequence: list[int], draft: list[int]) -> int:
        return self.dialect.scorable(sequence, draft)

    async def check(self, replica: Replica) -> InfoResponse:
        """What one replica serves, against Expected; success closes its breaker."""
        try:
            info = await self.dialect.info(replica)
        except ReplicaFailure as exc:
            self._failed(replica, exc)
            raise
        replica.info = info
        replica.breaker.record(ok=True)
        return info

    async def check_all(self, timeout: float | None = None) -> dict[str, Any]:
        """Every replica checked at once: the target's entry of ``/health/ready`` (leaving ones listed, not
        checked; draining ones not ready). ``timeout``: a replica that has not answered by then is not ready
        this time (``Checks``)."""
        serving = [r for r in self.replicas if not r.retired]
        answers = await self.checks.wait({r.url: functools.partial(self.check, r) for r in serving}, timeout)
        results = [answers[r.url] for r in serving]
        replicas, infos = [], []
        for replica, result in zip(serving, results):
            if isinstance(result, InfoResponse) and replica.draining:
                # it answers, but takes no new session now
                replicas.append({"url": replica.url, "ready": False, "draining": True})
            elif isinstance(result, InfoResponse):
                infos.append(result)
                replicas.append({"url": replica.url, "ready": True})
            else:
                replicas.append(
                    {
                        "url": replica.url,
                        "ready": False,
                        "error": str(result),
                        "failures_in_a_row": replica.breaker.failures,
                    }
                )
        replicas += [{"url": r.url, "ready": False, "leaving": True} for r in self.replicas if r.retired]
        entry: dict[str, Any] = {
            "name": self.name,
            "url": self.url,
            "weight": self.weight,
            "ready": bool(infos),
            "replicas": replicas,
        }
        if self.discovered:
            entry["discovered"] = True
        if infos:
            entry.update(model=infos[0].model_id, max_context=min(i.max_context for i in infos))
        else:
            why = (
                replicas[0].get("error", "draining" if replicas[0].get("draining") else "leaving")
                if replicas
                else f"no address of {self.url} has joined yet"
            )
            entry["error"] = f"worker {self.name}: no replica ready ({why})"
        return entry

    def present_urls(self) -> set[str]:
        """The replicas that take new sessions' URLs (discovery's view of the target)."""
        return {r.url for r in self.replicas if not r.retired}

    def join(self, replica: Replica) -> None:
        """A checked replica takes sessions (one that left and came back is the same replica again)."""
        known = next((r for r in self.replicas if r.url == replica.url), None)
        if known is None:
            self.replicas.append(replica)
        else:
            known.retired, known.info, known.breaker = False, replica.info, replica.breaker

    def retire(self, url: str) -> None:
        """No new sessions on ``url``; it leaves the list once no session holds it."""
        for replica in self.replicas:
            if replica.url == url:
                replica.retired = True
        self._drop_retired()

    def _drop_retired(self) -> None:
        holding = {r.url for r in self.sessions.values()}
        self.replicas = [r for r in self.replicas if not r.retired or r.url in holding]

    async def probe(self) -> None:
        """Open breakers only: the health path, then the check; a replica that passes takes calls again."""
        for replica in (r for r in self.replicas if r.breaker.is_open and not r.retired):
            try:
                if self.dialect.health_path is not None:
                    resp = await self.channel.client.get(
                        f"{replica.url}{self.dialect.health_path}", timeout=_PROBE_TIMEOUT
                    )
                    if (
                        resp.status_code != 200
                        or stuck(health_body(resp), self.channel.stall_timeout_s) is not None
                    ):
                        # not back: down, draining, or its model stuck (a new session would wait there)
                        continue
                await self.check(replica)
                log.info("worker %s: replica %s is back", self.name, replica.url)
            except (httpx.HTTPError, ReplicaFailure):
                continue

    async def verify(self, req: VerifyRequest, agreed: list[int]) -> tuple[VerifyResponse, Traffic]:
        """One verify call on the replica that holds the session, failing over to the others (``agreed``: for
        a resend)."""
        traffic, tried = Traffic(), set[str]()
        last: ReplicaFailure | None = None
        # on the replica ``asked``: resends after a 409, the pauses for a full worker
        resends, waits, asked = 0, [0.0], ""
        while True:
            replica = await self._replica_for(req.session_id, tried, last)
            if replica.url != asked:
                resends, waits, asked = 0, [0.0], replica.url
            if self.sessions.get(req.session_id) is not replica:
                if req.session_id in self.held:  # it lost the session's replica mid-request
                    self.failovers += 1
                    log.warning("worker %s: session %s moves to %s", self.name, req.session_id, replica.url)
                if req.prefix_len:
                    req = resend(req, agreed, 0)  # a fresh replica holds nothing of it
                self.sessions[req.session_id] = replica
                self.held.setdefault(req.session_id, set()).add(replica.url)
            try:
                try:
                    resp = await self.dialect.verify(replica, req, agreed, traffic)
                except AskAgain as again:
                    if again.held is None:
                        # a full worker is only busy: ask again until the read timeout (docs/reliability.md)
                        await self._wait_full(req.session_id, str(again), waits)
                        continue
                    if resends == _MAX_RESENDS:
                        raise ReplicaFailure(
                            "garbage", "kept answering session_short after a resend from zero"
                        ) from None
                    # held ≥ prefix_len: the hash differed
                    prefix = again.held if again.held < req.prefix_len else 0
                    log.info(
                        "worker %s lost session %s (holds %d): resending from %d",
                        self.name,
                        req.session_id,
                        again.held,
                        prefix,
                    )
                    req, resends = resend(req, agreed, prefix), resends + 1
                    continue
            except ReplicaFailure as exc:
                if exc.kind == "draining":
                    # not a failure: no new session there for a while, this one goes elsewhere
                    replica.draining_until = time.monotonic() + DRAINING_PAUSE_S
                    self._never_held(req.session_id, replica.url)
                    log.info(
                        "worker %s: replica %s is draining; session %s goes to another",
                        self.name,
                        replica.url,
                        req.session_id,
                    )
                else:
                    self._failed(replica, exc)
                tried.add(replica.url)
                del self.sessions[req.session_id]
                last = exc
                continue
            replica.breaker.record(ok=True)
            self.traffic.batch_sessions += resp.batch_sessions
            return resp, traffic

    async def _wait_full(self, session_id: str, message: str, waits: list[float]) -> None:
        limit, waited = self.channel.timeout.read or _FULL_WAIT_S, sum(waits)
        if waited >= limit:
            raise WorkerError(self.name, f"{message} (waited {waited:.1f} s)", 503)
        pause = min(_FULL_FIRST_PAUSE_S * 2 ** (len(waits) - 1), 2.0, limit - waited)
        log.info("worker %s is full, session %s waits %.2f s: %s", self.name, session_id, pause, message)
        await asyncio.sleep(pause)
        waits.append(pause)

    async def _replica_for(self, session_id: str, tried: set[str], last: ReplicaFailure | None) -> Replica:
        """The session's replica, else the least loaded healthy one not yet tried (checked first)."""
        current = self.sessions.get(session_id)
        if current is not None and not current.breaker.is_open:
            return current
        while True:
            candidates = [
                r for r in self.replicas if r.url not in tried and not r.breaker.is_open and r.takes_sessions
            ]
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

    def _never_held(self, session_id: str, url: str) -> None:
        """A replica that refused a new session holds nothing of it: no failover counted, no DELETE sent
        there."""
        held = self.held.get(session_id, set())
        held.discard(url)
        if not held:
            self.held.pop(session_id, None)

    def _exhausted(self, last: ReplicaFailure | None) -> WorkerError:
        if not self.present_urls():
            return WorkerError(self.name, f"no replica: no address of {self.url} has joined", 503)
        if (last is None or last.kind == "draining") and any(r.draining for r in self.replicas):
            return WorkerError(
                self.name,
                "every replica is draining (shutting down) or resting after a refusal; retry shortly",
                503,
            )
        if last is None:  # every breaker was open before this call
            return WorkerError(
                self.name,
                f"no healthy replica (circuit open after repeated failures: {self.replicas[0].last_error})",
                503,
            )
        status = 503 if last.kind in ("connect", "timeout", "draining") else 502
        which = "its replica" if len(self.replicas) == 1 else f"all {len(self.replicas)} replicas"
        return WorkerError(self.name, f"{which} failed: {last}", status)

    def _failed(self, replica: Replica, exc: ReplicaFailure) -> None:
        replica.failed(exc)
        self.failures[exc.kind] += 1
        if replica.breaker.failures == replica.breaker.threshold:
            replica.info = None  # checked again before its next call
            log.warning(
                "worker %s: circuit open for %s after %d failures: %s",
                self.name,
                replica.url,
                replica.breaker.failures,
                exc,
            )
        else:
            log.warning("worker %s: replica %s failed (%s): %s", self.name, replica.url, exc.kind, exc)

    async def delete_session(self, session_id: str) -> None:
        """Free the session on every replica it was sent to (best effort: they evict anyway)."""
        self.sessions.pop(session_id, None)
        for replica in self.replicas:
            if replica.url in self.held.get(session_id, ()) and not replica.breaker.is_open:
                await self.dialect.free(replica, session_id)
        self.held.pop(session_id, None)
        self._drop_retired()
