"""The federation (docs/design.md §3.3): every weighted target, one HTTP client for all (retries off: failover
is the only retry)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import httpx

from app.targets.base import Dialect
from app.targets.channel import Channel, Expected
from app.targets.discovery import Discovery, Resolver
from app.targets.fastpost import FastPost
from app.targets.openai_logprobs import EngineDialect
from app.targets.pipeline import PipelineTarget
from app.targets.replicas import ReplicaSet
from app.targets.specgate import SpecgateDialect
from core.config import SpecgateConfig


class TargetSet:
    def __init__(
        self,
        workers: list[ReplicaSet | PipelineTarget],
        client: httpx.AsyncClient,
        probe_interval_s: float,
        fast: FastPost | None = None,
        discoveries: list[Discovery] | None = None,
    ) -> None:
        self.workers, self.client, self.probe_interval_s, self.fast = workers, client, probe_interval_s, fast
        self.discoveries = discoveries or []  # the targets whose replicas are a name's addresses
        self._tasks: list[asyncio.Task[None]] = []

    @classmethod
    def from_config(
        cls, config: SpecgateConfig, expected: Expected, transport: httpx.AsyncBaseTransport | None = None
    ) -> TargetSet:
        headers = {"authorization": f"Bearer {config.worker_token}"} if config.worker_token else None
        limits = httpx.Limits(
            max_connections=None, max_keepalive_connections=4 * config.limits.max_concurrent_requests
        )
        client = httpx.AsyncClient(
            transport=transport or httpx.AsyncHTTPTransport(retries=0, limits=limits), headers=headers
        )
        fast = FastPost(headers) if transport is None else None  # the rounds' POSTs on real sockets
        workers: list[ReplicaSet | PipelineTarget] = []
        discoveries: list[Discovery] = []
        resolver = Resolver(config.discovery.dns_servers, config.discovery.timeout_s)
        for w in config.workers:
            name = w.name or ""
            # an engine's /health says nothing of its progress: its read timeout is a deadline
            health = None if w.is_openai_logprobs else "/health"
            channel = Channel(
                name,
                client,
                httpx.Timeout(w.read_timeout_s, connect=w.connect_timeout_s),
                w.link,
                fast,
                health,
                w.stall_timeout_s,
            )
            if w.pipeline is not None:
                workers.append(
                    PipelineTarget(
                        name,
                        config.stage_replicas(w),
                        w.weight,
                        channel,
                        expected,
                        config.health.failure_threshold,
                    )
                )
                continue
            dialect: Dialect = (
                EngineDialect(name, channel, expected, w)
                if w.is_openai_logprobs
                else SpecgateDialect(name, channel, expected)
            )
            target = ReplicaSet(
                name,
                config.worker_urls(w),
                w.weight,
                channel,
                dialect,
                expected,
                config.health.failure_threshold,
                w.discovery_interval_s is not None,
            )
            workers.append(target)
            if w.discovery_interval_s is not None:
                discoveries.append(Discovery(target, target.url, w.discovery_interval_s, resolver, client))
        return cls(workers, client, config.health.probe_interval_s, fast, discoveries)

    def scorable(self, sequence: list[int], draft: list[int]) -> int:
        """How many leading draft tokens every target can score (engines cannot score every token)."""
        return min(w.scorable(sequence, draft) for w in self.workers)

    @property
    def weights(self) -> list[float]:
        return [w.weight for w in self.workers]

    @property
    def on_call(self) -> Callable[[str, float], None]:
        return self.workers[0].channel.on_call

    @on_call.setter
    def on_call(self, hook: Callable[[str, float], None]) -> None:
        """``hook(worker, seconds)`` after every verify call (the round-latency histogram)."""
        for worker in self.workers:
            worker.channel.on_call = hook

    async def discover(self) -> None:
        """Resolve every discovered target's name once (start-up: before the first readiness check)."""
        await asyncio.gather(*(d.refresh() for d in self.discoveries))

    def start(self) -> None:
        """Probe open breakers, and resolve discovered targets' names, in the background until ``close``."""
        self._tasks = [
            asyncio.create_task(self._probe_forever()),
            *(asyncio.create_task(d.run()) for d in self.discoveries),
        ]

    async def _probe_forever(self) -> None:
        while True:
            await asyncio.sleep(self.probe_interval_s)
            await asyncio.gather(*(w.probe() for w in self.workers))

    async def check_all(self, timeout: float | None = None) -> list[dict[str, Any]]:
        """Every target's entry of ``/health/ready``; ``timeout``: a replica silent that long is not ready
        this time."""
        return list(await asyncio.gather(*(w.check_all(timeout) for w in self.workers)))

    async def delete_sessions(self, session_id: str) -> None:
        await asyncio.gather(*(w.delete_session(session_id) for w in self.workers))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for worker in self.workers:
            worker.checks.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.client.aclose()
        if self.fast is not None:
            await self.fast.aclose()
