"""Where a round's time goes (usage ``timing_ms``, ``speculative.profile``, ``specgate bench
overhead``): the bookkeeping, on the fakes. A draft and a worker whose models sleep a known
time and a link that sleeps a known time: each sleep lands in its own part, and the parts add
up to the measured round within 10 % — the rest (``other``) stays small. Not a test of speed."""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from app.server import create_app
from app.targets.channel import server_timing
from clients.bench.overhead import PARTS, projection, round_figures
from core.runners import ModelRunner, load_runner
from tests.app.fake_engine import Router
from tests.app.helpers import gateway_config
from workers.server import create_app as create_worker
from workers.settings import WorkerSettings

DRAFT_S, MODEL_S, LINK_S = 0.004, 0.015, 0.005


def _slowed(runner: ModelRunner, seconds: float) -> ModelRunner:
    """``runner`` whose every forward sleeps ``seconds`` first (a model of known cost)."""
    compute: Callable[..., Any] = runner._compute_each  # type: ignore[attr-defined]

    def slow(*args: Any) -> Any:
        time.sleep(seconds)
        return compute(*args)

    runner._compute_each = slow  # type: ignore[attr-defined]
    return runner


class _Link(httpx.AsyncBaseTransport):
    """Every request waits ``seconds`` before it reaches ``inner`` (an HTTP hop of known cost)."""

    def __init__(self, inner: httpx.AsyncBaseTransport, seconds: float) -> None:
        self.inner, self.seconds = inner, seconds

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(self.seconds)
        return await self.inner.handle_async_request(request)


@pytest.fixture(scope="module")
def runners() -> tuple[ModelRunner, ModelRunner]:
    return _slowed(load_runner("tiny-random", "transformers"), DRAFT_S), _slowed(
        load_runner("tiny-random", "transformers"), MODEL_S
    )


@pytest.mark.parametrize(
    ("spec", "ahead"),
    [
        ({"mode": "aggregate", "k": 8}, False),
        ({"mode": "exact"}, False),
        ({"mode": "autoregressive"}, False),
        ({"mode": "tree"}, False),
        ({"mode": "autoregressive"}, True),
    ],
    ids=["aggregate", "exact", "autoregressive", "tree", "autoregressive, decoding ahead"],
)
async def test_the_parts_add_up_to_the_round(
    runners: tuple[ModelRunner, ModelRunner], spec: dict[str, Any], ahead: bool
) -> None:
    """Each round's parts add up to it, the models' at their known costs. Decoding ahead, the worker's model
    part of a call is only the part of its decode done ahead that it waited for: here none or little, the link
    being longer."""
    draft, target = runners
    draft.free_all()
    target.free_all()
    worker = create_worker(
        WorkerSettings(model="tiny-random", backend="transformers", decode_ahead=ahead), runner=target
    )
    transport = _Link(Router({"w0": httpx.ASGITransport(app=worker)}), LINK_S)
    config = gateway_config(
        workers=[{"url": "http://w0:1", "weight": 1.0}],
        speculative={"mode": "aggregate", "num_draft_tokens": 3},
    )
    app = create_app(config, draft_runner=draft, transport=transport)
    body = {
        "model": "test-model",
        "prompt": "Once upon a time",
        "max_tokens": 12,
        "temperature": 1.0,
        "seed": 3,
        "speculative": {**spec, "profile": True},
    }
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://gateway", timeout=60
        ) as client:
            resp = await client.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    block = resp.json()["usage"]["speculative"]
    rounds = block["profile"]
    assert len(rounds) == block["rounds"] >= 2
    # what no part names is small (the median round: a busy machine may stall one)
    assert statistics.median(r["parts_ms"]["other"] / r["round_ms"] for r in rounds) <= 0.1, rounds
    for r in rounds:
        parts = r["parts_ms"]
        assert set(parts) == set(PARTS)
        assert abs(sum(parts.values()) - r["round_ms"]) <= 0.01 + 1e-3 * r["round_ms"]
        if ahead and r is not rounds[0]:  # the first call decodes its prompt itself
            assert 0.0 <= parts["worker_model"] <= 1e3 * MODEL_S * r["calls"] * 1.5, r
        else:
            assert parts["worker_model"] >= 1e3 * MODEL_S * r["calls"] * 0.95, r
        assert parts["http"] >= 1e3 * LINK_S * r["calls"] * 0.95, r
        if spec["mode"] != "autoregressive":
            assert parts["draft_model"] >= 1e3 * DRAFT_S * 0.95, r
        else:
            assert parts["draft_model"] == parts["draft_sampling"] == 0.0
    # the bench's per-round figures are its median round's, and its parts add up to it (medians per part need
    # not: a clean run once missed by 13 %)
    kept = rounds[1:] or rounds
    figures = round_figures(kept)
    assert figures["round_ms"] == pytest.approx(statistics.median(r["round_ms"] for r in kept))
    assert sum(figures["parts_ms"].values()) == pytest.approx(figures["round_ms"], abs=0.01)
    assert figures["outside_models_ms"] == pytest.approx(
        figures["round_ms"] - figures["parts_ms"]["draft_model"] - figures["parts_ms"]["worker_model"]
    )
    if ahead:
        # every call after the first, but one may come early
        assert worker.state.worker.counters["taken_ahead"] >= len(rounds) - 2
    # the usage block's sums are the profile's
    timing = block["timing_ms"]
    assert timing["rounds"] == pytest.approx(sum(r["round_ms"] for r in rounds), abs=0.01 * len(rounds))
    assert timing["worker_model"] == pytest.approx(
        sum(r["parts_ms"]["worker_model"] for r in rounds), abs=0.01 * len(rounds)
    )


def test_a_workers_server_timing_is_read_by_part() -> None:
    parts = server_timing("codec;dur=0.250, queue;dur=1, model;dur=7.5, score;dur=0.8, total;dur=9.9")
    assert parts == pytest.approx(
        {"codec": 25e-5, "queue": 1e-3, "model": 7.5e-3, "scoring": 8e-4, "total": 9.9e-3}
    )
    assert server_timing("") == {}
    # what it cannot read, it leaves out
    assert server_timing("model;desc=x, junk, score;dur=abc, cpu;dur=3") == {}


async def test_busy_time_counts_every_worker(runners: tuple[ModelRunner, ModelRunner]) -> None:
    """``worker_model_ms`` is the slowest worker's per call (latency); ``worker_busy_ms`` every
    worker's (the targets' cost, `specgate bench`'s target-cost column): two workers whose
    models sleep the same time cost about twice the latency."""
    draft, target = runners
    draft.free_all()
    target.free_all()
    second = _slowed(load_runner("tiny-random", "transformers"), MODEL_S)
    workers = {
        f"w{n}": httpx.ASGITransport(
            app=create_worker(WorkerSettings(model="tiny-random", backend="transformers"), runner=r)
        )
        for n, r in enumerate((target, second))
    }
    config = gateway_config(
        workers=[{"url": "http://w0:1", "weight": 0.6}, {"url": "http://w1:1", "weight": 0.4}],
        speculative={"mode": "exact", "num_draft_tokens": 3},
    )
    app = create_app(config, draft_runner=draft, transport=Router(workers))
    body = {
        "model": "test-model",
        "prompt": "Once upon a time",
        "max_tokens": 8,
        "temperature": 1.0,
        "seed": 3,
    }
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://gateway", timeout=60
        ) as client:
            resp = await client.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    block = resp.json()["usage"]["speculative"]
    assert block["worker_model_ms"] >= 1e3 * MODEL_S * block["rounds"] * 0.95
    assert 1.6 * block["worker_model_ms"] <= block["worker_busy_ms"] <= 2.0 * block["worker_model_ms"] + 0.01


def test_the_budget_puts_a_gpus_verify_step_in_a_measured_round() -> None:
    """``bench overhead --verify-ms X``: the worker's model and scoring become X ms, a link adds its round
    trip and its bytes' time, the rest stays as measured — a 100 ms round with 60 ms of worker and 20 of draft
    model, 3 tokens a round."""
    parts = dict.fromkeys(PARTS, 0.0) | {"worker_model": 50.0, "worker_scoring": 10.0, "draft_model": 20.0}
    row = {
        "round_ms": 100.0,
        "parts_ms": parts,
        "bytes_up_per_round": 500.0,
        "bytes_down_per_round": 1500.0,
        "tokens_per_round": 3.0,
    }
    fast = projection(row, verify_ms=4.0)
    assert (
        fast["round_ms"] == 44.0
        and abs(fast["tokens_per_s"] - 3 / 0.044) < 1e-9
        and abs(fast["outside_share"] - 20 / 44) < 1e-12
    )
    wan = projection(row, verify_ms=4.0, rtt_ms=50.0, mbps=10.0)  # 2,000 bytes at 10 Mbit/s: 1.6 ms
    assert abs(wan["round_ms"] - 95.6) < 1e-9 and abs(wan["outside_share"] - 71.6 / 95.6) < 1e-12
