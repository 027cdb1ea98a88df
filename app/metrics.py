"""The gateway's Prometheus metrics (docs/design.md §5): vLLM's names under ``specgate:`` (dashboards carry
over); one registry per app, read at scrape."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from app.drafting import DraftModel
from app.engine import RoundResult
from app.targets.failures import FAILURE_KINDS
from app.targets.pool import TargetSet

if TYPE_CHECKING:  # admission → service → metrics: only the type is needed here
    from app.admission import Admission

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class GatewayMetrics:
    """Everything ``/metrics`` of one gateway app shows."""

    def __init__(self, admission: Admission) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.drafts = Counter(
            "specgate:spec_decode_num_drafts", "Rounds that verified a draft.", ["mode"], registry=r
        )
        self.draft_tokens = Counter(
            "specgate:spec_decode_num_draft_tokens", "Draft tokens proposed.", ["mode"], registry=r
        )
        self.accepted_tokens = Counter(
            "specgate:spec_decode_num_accepted_tokens", "Draft tokens accepted.", ["mode"], registry=r
        )
        self.accepted_per_pos = Counter(
            "specgate:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by draft position (0 = first).",
            ["mode", "position"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "specgate:prompt_tokens", "Prompt tokens of finished requests.", registry=r
        )
        self.generation_tokens = Counter(
            "specgate:generation_tokens", "Tokens generated.", ["mode"], registry=r
        )
        self.requests = Counter(
            "specgate:request_success", "Choices finished, by finish reason.", ["finished_reason"], registry=r
        )
        self.ttft = Histogram(
            "specgate:time_to_first_token_seconds",
            "From arrival to the first token of a choice.",
            ["mode"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "specgate:inter_token_latency_seconds",
            "Time per output token after the first.",
            ["mode"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "specgate:e2e_request_latency_seconds",
            "From arrival to the last token of a choice.",
            ["mode"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.round_latency = Histogram(
            "specgate:worker_round_latency_seconds",
            "One verify call to a worker, network included.",
            ["worker"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        for name, help_text, read in (
            ("num_requests_running", "Requests generating now.", lambda: admission.active),
            ("num_requests_waiting", "Requests queued for a slot.", lambda: admission.queued),
            ("num_requests_rejected", "429s given since start.", lambda: admission.rejected),
            (
                "requests_running_ratio",
                "Requests generating over limits.max_concurrent_requests (what an autoscaler reads).",
                lambda: admission.active / admission.max_active,
            ),
            (
                "requests_waiting_ratio",
                "Requests queued over limits.max_queued_requests (1 when any waits and none may).",
                lambda: (
                    admission.queued / admission.max_queued
                    if admission.max_queued
                    else float(admission.queued > 0)
                ),
            ),
        ):
            Gauge(f"specgate:{name}", help_text, registry=r).set_function(read)

    def open_series(self, mode: str, num_positions: int) -> None:
        """The series of ``mode`` at 0 from start-up (as vLLM), so ``rate()`` sees them before the first
        request."""
        for counter in (self.drafts, self.draft_tokens, self.accepted_tokens, self.generation_tokens):
            counter.labels(mode)
        for position in range(num_positions):
            self.accepted_per_pos.labels(mode, str(position))
        for histogram in (self.ttft, self.itl, self.e2e):
            histogram.labels(mode)

    def watch(self, pool: TargetSet) -> None:
        """Read the pool's own counters at scrape time, and time its calls."""
        self.registry.register(_PoolCollector(pool))
        pool.on_call = lambda worker, seconds: self.round_latency.labels(worker).observe(seconds)

    def watch_draft(self, draft: DraftModel) -> None:
        """Read the draft's step counters at scrape time."""
        self.registry.register(_DraftCollector(draft))

    def observe_round(self, mode: str, result: RoundResult) -> None:
        if result.drafted:
            self.drafts.labels(mode).inc()
            self.draft_tokens.labels(mode).inc(result.drafted)
            self.accepted_tokens.labels(mode).inc(result.accepted)
            for position in range(result.accepted):
                self.accepted_per_pos.labels(mode, str(position)).inc()
        self.generation_tokens.labels(mode).inc(len(result.tokens))

    def observe_tokens(self, mode: str, since_last_s: float, num_tokens: int, is_first: bool) -> None:
        """A round's tokens reached the client ``since_last_s`` after the previous ones."""
        if is_first:
            self.ttft.labels(mode).observe(since_last_s)
            num_tokens -= 1
            since_last_s = 0.0
        for _ in range(num_tokens):  # a round's tokens share the round's time
            self.itl.labels(mode).observe(since_last_s / max(num_tokens, 1))

    def observe_finish(self, mode: str, reason: str, latency_s: float) -> None:
        self.requests.labels(reason).inc()
        self.e2e.labels(mode).observe(latency_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _PoolCollector(Collector):
    def __init__(self, pool: TargetSet) -> None:
        self.pool = pool

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        sent = CounterMetricFamily("specgate:worker_bytes_sent", "Bytes sent to a worker.", labels=["worker"])
        received = CounterMetricFamily(
            "specgate:worker_bytes_received", "Bytes received from a worker.", labels=["worker"]
        )
        calls = CounterMetricFamily("specgate:worker_calls", "Verify calls to a worker.", labels=["worker"])
        batched = CounterMetricFamily(
            "specgate:worker_batch_sessions",
            "Sessions that shared the worker's forward, summed over the calls answered.",
            labels=["worker"],
        )
        failovers = CounterMetricFamily(
            "specgate:worker_failovers", "Sessions moved to another replica mid-request.", labels=["worker"]
        )
        failures = CounterMetricFamily(
            "specgate:worker_failures", "Failed calls, by kind.", labels=["worker", "kind"]
        )
        up = GaugeMetricFamily(
            "specgate:worker_replica_up", "1 while a replica's circuit is closed.", labels=["worker", "url"]
        )
        states = GaugeMetricFamily(
            "specgate:worker_replicas",
            "A target's replicas: up, open (circuit open), draining (refused a new session: "
            "shutting down) or leaving (gone from its DNS name).",
            labels=["worker", "state"],
        )
        for w in self.pool.workers:
            sent.add_metric([w.name], w.traffic.sent)
            received.add_metric([w.name], w.traffic.received)
            calls.add_metric([w.name], w.traffic.calls)
            batched.add_metric([w.name], w.traffic.batch_sessions)
            failovers.add_metric([w.name], w.failovers)
            for kind in FAILURE_KINDS:
                failures.add_metric([w.name, kind], w.failures[kind])
            count = dict.fromkeys(("up", "open", "draining", "leaving"), 0)
            for replica in w.replicas:
                up.add_metric([w.name, replica.url], 0 if replica.breaker.is_open else 1)
                count[
                    "leaving"
                    if replica.retired
                    else "open"
                    if replica.breaker.is_open
                    else "draining"
                    if replica.draining
                    else "up"
                ] += 1
            for state, n in count.items():
                states.add_metric([w.name, state], n)
        yield from (sent, received, calls, batched, failovers, failures, up, states)


class _DraftCollector(Collector):
    def __init__(self, draft: DraftModel) -> None:
        self.draft = draft

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(
            "specgate:draft_steps",
            "Draft model steps (one forward over every draft in progress).",
            value=self.draft.batcher.num_steps,
        )
        yield CounterMetricFamily(
            "specgate:draft_step_drafts",
            "Drafts carried by the draft's steps, summed over steps.",
            value=self.draft.batcher.num_step_drafts,
        )
        yield CounterMetricFamily(
            "specgate:lookups",
            "Lookups for a draft (drafter lookup or model+lookup).",
            value=self.draft.lookup.num_lookups,
        )
        yield CounterMetricFamily(
            "specgate:lookup_hits",
            "Lookups that proposed at least one token.",
            value=self.draft.lookup.num_lookup_hits,
        )
        yield CounterMetricFamily(
            "specgate:lookup_tokens",
            "Tokens lookups proposed (model+lookup: before the model's check).",
            value=self.draft.lookup.num_lookup_tokens,
        )
