"""The gateway's /metrics (prometheus_client, vLLM's names under ``specgate:``): after a
request, every counter moved by exactly what the response's usage block reports."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.app.conftest import Gateway
from tests.app.helpers import sse_events

Samples = dict[str, dict[frozenset[tuple[str, str]], float]]


async def _scrape(client: httpx.AsyncClient) -> Samples:
    resp = await client.get("/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    samples: Samples = defaultdict(dict)
    for family in text_string_to_metric_families(resp.text):
        for sample in family.samples:
            samples[sample.name][frozenset(sample.labels.items())] = sample.value
    return samples


def _value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get(name, {}).get(frozenset(labels.items()), 0.0)


def _delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return _value(after, name, **labels) - _value(before, name, **labels)


def _sum(samples: Samples, name: str) -> float:
    return sum(samples.get(name, {}).values())


@pytest.mark.parametrize("stream", [False, True])
async def test_counters_move_by_what_the_usage_reports(gateway: Gateway, stream: bool) -> None:
    async with gateway() as client:
        before = await _scrape(client)
        body: dict[str, Any] = {
            "model": "test-model",
            "prompt": "Once upon a time",
            "max_tokens": 12,
            "seed": 3,
        }
        if stream:
            body.update(stream=True, stream_options={"include_usage": True})
            events = sse_events((await client.post("/v1/completions", json=body)).text)
            usage = next(e["usage"] for e in reversed(events) if e != "[DONE]" and e.get("usage"))
        else:
            usage = (await client.post("/v1/completions", json=body)).json()["usage"]
        after = await _scrape(client)
    spec, mode = usage["speculative"], "aggregate"
    assert (
        _delta(before, after, "specgate:spec_decode_num_draft_tokens_total", mode=mode)
        == spec["draft_tokens"]
        > 0
    )
    assert (
        _delta(before, after, "specgate:spec_decode_num_accepted_tokens_total", mode=mode)
        == spec["accepted_tokens"]
    )
    assert 1 <= _delta(before, after, "specgate:spec_decode_num_drafts_total", mode=mode) <= spec["rounds"]
    per_pos = [
        _delta(
            before,
            after,
            "specgate:spec_decode_num_accepted_tokens_per_pos_total",
            mode=mode,
            position=str(i),
        )
        for i in range(3)
    ]
    assert sum(per_pos) == spec["accepted_tokens"] and per_pos == sorted(per_pos, reverse=True)
    assert (
        _delta(before, after, "specgate:generation_tokens_total", mode=mode)
        == usage["completion_tokens"]
        == 12
    )
    assert _delta(before, after, "specgate:prompt_tokens_total") == usage["prompt_tokens"]
    assert _delta(before, after, "specgate:request_success_total", finished_reason="length") == 1
    assert _delta(before, after, "specgate:time_to_first_token_seconds_count", mode=mode) == 1
    assert _delta(before, after, "specgate:e2e_request_latency_seconds_count", mode=mode) == 1
    assert _delta(before, after, "specgate:inter_token_latency_seconds_count", mode=mode) == 12 - 1
    assert (
        _sum(after, "specgate:worker_bytes_sent_total") - _sum(before, "specgate:worker_bytes_sent_total")
        == spec["bytes_to_workers"]
    )
    assert (
        _sum(after, "specgate:worker_bytes_received_total")
        - _sum(before, "specgate:worker_bytes_received_total")
        == spec["bytes_from_workers"]
    )
    calls = _delta(before, after, "specgate:worker_calls_total", worker="w0")
    assert (
        calls == spec["rounds"]
        and _delta(before, after, "specgate:worker_round_latency_seconds_count", worker="w0") == calls
    )
    assert _value(after, "specgate:num_requests_running") == 0
    assert (
        _value(after, "specgate:requests_running_ratio") == 0
        and _value(after, "specgate:requests_waiting_ratio") == 0
    )
    assert (
        _value(after, "specgate:worker_replicas", worker="w1", state="up") == 1
        and _value(after, "specgate:worker_replicas", worker="w1", state="leaving") == 0
    )
    assert _value(after, "specgate:worker_replica_up", worker="w1", url="http://w1:1") == 1


async def test_spec_decode_series_exist_at_zero_from_start(gateway: Gateway) -> None:
    """As vLLM: the configured mode's counters are listed (at 0) before the first request."""
    async with gateway() as client:
        text = (await client.get("/metrics")).text
        samples = await _scrape(client)
    assert 'specgate:spec_decode_num_draft_tokens_total{mode="aggregate"} 0.0' in text
    for name in ("drafts", "draft_tokens", "accepted_tokens"):
        assert frozenset({("mode", "aggregate")}) in samples[f"specgate:spec_decode_num_{name}_total"]
    per_pos = samples["specgate:spec_decode_num_accepted_tokens_per_pos_total"]
    assert sorted(dict(k)["position"] for k in per_pos) == ["0", "1", "2"]  # γ = 3 configured
    assert _value(samples, "specgate:time_to_first_token_seconds_count", mode="aggregate") == 0
