"""schemathesis against the gateway's own OpenAPI schema, in-process over ASGI: hundreds of generated requests
(well over a thousand with SPECGATE_FULL_STATISTICS=1), valid and invalid, across every route. No answer is a
5xx, and every 4xx carries the OpenAI error envelope."""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from app.server import create_app
from core.config import parse_config
from core.runners import ModelRunner
from tests.app.fakes import FakeWorkerTransport

FULL = bool(os.environ.get("SPECGATE_FULL_STATISTICS"))
# the sizes below by default; twice them (and the floors the test asserts) with SPECGATE_FULL_STATISTICS=1
SCALE = 2 if FULL else 1
# per POST route and mode: the generation routes
EXAMPLES = {GenerationMode.POSITIVE: 150 * SCALE, GenerationMode.NEGATIVE: 125 * SCALE}
# the routes beside them (/v1/responses, which runs as a chat request and has its own generated surface in
# tests/integration/test_request_surface.py; /tokenize, /detokenize) take fewer by default, as many with
# SPECGATE_FULL_STATISTICS
FEWER = EXAMPLES if FULL else {GenerationMode.POSITIVE: 60, GenerationMode.NEGATIVE: 50}
GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions")
# The parameters issue 46 hardened: the generated bodies must carry each of them, many times
# (schemathesis draws them from the OpenAPI schema, which the request models generate).
HARDENED = (
    "logit_bias",
    "tools",
    "tool_choice",
    "response_format",
    "structured_outputs",
    "min_tokens",
    "stop",
    "n",
    "min_p",
    "speculative",
    "stream_options",
)


def _app(tiny_runner: ModelRunner) -> Any:
    config = parse_config(
        {
            "model": "test-model",
            "workers": [{"url": "http://w0:1", "weight": 0.6}, {"url": "http://w1:1", "weight": 0.4}],
            "speculative": {"mode": "aggregate", "num_draft_tokens": 2, "k": 8},
            "limits": {"max_tokens": 3, "max_prompt_tokens": 64, "max_concurrent_requests": 64},
        }
    )
    return create_app(
        config, draft_runner=tiny_runner, transport=FakeWorkerTransport(tiny_runner.fingerprint).transport()
    )


def _check(response: Any, what: str) -> None:
    assert response.status_code < 500, f"{what}: {response.status_code} {response.text[:500]}"
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and isinstance(error["message"], str), (
            f"{what}: {response.text[:500]}"
        )


def _fuzz(
    operation: Any,
    mode: Any,
    examples: int,
    calls: dict[str, int],
    statuses: Counter[int],
    keys: Counter[str],
) -> None:
    """``examples`` requests to one operation, generated in ``mode``; each answer checked and counted."""
    what = f"{operation.method.upper()} {operation.path}"
    is_post = operation.method.lower() == "post"

    @settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case: Any) -> None:
        calls[what] = calls.get(what, 0) + 1
        if is_post and isinstance(case.body, dict) and calls[what] % 2:
            case.body["model"] = "test-model"  # half get past the model check to the engine
        if is_post and isinstance(case.body, dict):
            keys.update(list(case.body))
        response = case.call()
        statuses[response.status_code] += 1
        _check(response, what)

    run()


def test_generated_requests_never_get_a_5xx(tiny_runner: ModelRunner) -> None:
    schema = schemathesis.openapi.from_asgi("/openapi.json", _app(tiny_runner))
    calls: dict[str, int] = {}
    statuses: Counter[int] = Counter()
    keys: Counter[str] = Counter()
    for result in schema.get_all_operations():
        operation = result.ok()
        is_post = operation.method.lower() == "post"
        sizes = (
            (EXAMPLES if operation.path in GENERATION_ROUTES else FEWER)
            if is_post
            else {GenerationMode.POSITIVE: 5}
        )
        for mode, examples in sizes.items():
            _fuzz(operation, mode, examples, calls, statuses, keys)
    print(
        "requests per route:",
        calls,
        "statuses:",
        dict(statuses),
        "parameters:",
        {name: keys[name] for name in HARDENED},
    )
    assert all(keys[name] >= 25 * SCALE for name in HARDENED), {name: keys[name] for name in HARDENED}
    assert sum(calls.values()) >= 500 * SCALE
    assert statuses[200] >= 25 * SCALE  # a good share reached the engine and the fake workers
    assert {
        "POST /v1/completions",
        "POST /v1/chat/completions",
        "GET /v1/models",
        "GET /health/ready",
    } <= set(calls)


@pytest.fixture(autouse=True)
def _no_constants_from_other_modules(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Hypothesis draws, now and then, a constant found in the local modules imported so far (all of them,
    test modules too): the same seed then generates other requests in a process that ran other tests first
    (``tools`` came 46, 103 or 121 times; 72 without it, in any process). Without that pool the requests
    depend on the seed alone."""
    from hypothesis.internal.conjecture import providers

    monkeypatch.setattr(providers, "_get_local_constants", lambda: providers.Constants(), raising=False)
    providers.CONSTANTS_CACHE.cache.clear()
    yield
    providers.CONSTANTS_CACHE.cache.clear()


@pytest.fixture(autouse=True)
def _end_lifespans() -> Any:
    yield
    from schemathesis.python import asgi

    asgi.shutdown_lifespans()  # the app's lifespan ran in schemathesis' own loop
