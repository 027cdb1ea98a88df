"""Mode ``pipeline`` end to end (docs/design.md §3.7): three stage workers of the built-in model
(transformers; stage 2 a process, stages 1 and 3 real uvicorns in this process) behind a real uvicorn gateway,
spoken to by the official ``openai`` client. Greedy text equals ``autoregressive`` through one whole-model
worker; bad pipelines stop the gateway at start-up naming the stage; a stage killed mid-stream ends the stream
with an error event and ``[DONE]``, and the other stages free the session."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from clients.procs import StageProcess
from core.config import parse_config
from core.errors import ConfigError
from core.names import Backend
from core.runners import load_runner
from tests.app.helpers import served, sse_events
from tests.integration.gateways import SharedDraft, gateway_app
from workers.server import create_app as create_worker
from workers.settings import WorkerSettings

pytestmark = pytest.mark.integration

MODEL = "specgate-pipeline"
PROMPT = "The three primary colours are"
SPLIT = ["0:9", "9:21", "21:30"]


class _Served:
    """A stage served in this process under a real uvicorn: its ``url``; no ``proc`` (the tests kill stage 2
    alone)."""

    def __init__(self, url: str) -> None:
        self.url, self.proc = url, None


@pytest.fixture(scope="module")
def stage_procs() -> Iterator[list[Any]]:
    """The three stages (one thread each), first layers first: stage 2 a process (the tests kill it), stages 1
    and 3 served in this process (a process start and its imports saved each)."""
    with ExitStack() as stack:
        middle = StageProcess(SPLIT[1])
        stack.enter_context(middle)
        first, last = (
            _Served(
                stack.enter_context(
                    served(
                        create_worker(
                            WorkerSettings(
                                model="builtin", backend=Backend.TRANSFORMERS, layers=layers, threads=1
                            )
                        )
                    )
                )
            )
            for layers in (SPLIT[0], SPLIT[2])
        )
        yield [first, middle, last]


def _config(workers: list[dict[str, Any]], mode: str = "pipeline", **speculative: Any) -> Any:
    return parse_config(
        {
            "model": MODEL,
            "draft": {"model": "builtin-draft", "threads": 1},
            "workers": workers,
            "speculative": {"mode": mode, **speculative},
            "limits": {"max_tokens": 64},
        }
    )


@pytest.fixture(scope="module")
def gateway(stage_procs: list[Any], shared_draft: SharedDraft) -> Iterator[str]:
    config = _config([{"name": "pipe", "pipeline": [p.url for p in stage_procs], "read_timeout_s": 120}])
    with served(gateway_app(config, shared_draft)) as url:
        yield url


@pytest.fixture(scope="module")
def whole_worker() -> Iterator[str]:
    runner = load_runner("builtin", "transformers", memory_cap_mb=64)
    with served(
        create_worker(WorkerSettings(model="builtin", backend=Backend.TRANSFORMERS), runner=runner)
    ) as url:
        yield url
    runner.close()


def _text(base: str, mode: str, max_tokens: int = 24, **spec: Any) -> tuple[str, dict[str, Any]]:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)
    completion = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"speculative": {"mode": mode, **spec}},
    )
    assert completion.usage is not None
    return completion.choices[0].text, completion.usage.model_extra["speculative"]  # type: ignore[index]


def test_greedy_pipeline_text_equals_autoregressive_through_a_whole_model_worker(
    gateway: str, whole_worker: str, shared_draft: SharedDraft
) -> None:
    text, spec = _text(gateway, "pipeline")
    config = _config([{"url": whole_worker}], mode="autoregressive")
    with served(gateway_app(config, shared_draft)) as single:
        reference, _ = _text(single, "autoregressive")
    assert text == reference and text
    block = spec["pipeline"]
    assert spec["mode"] == "pipeline" and spec["lossless"] and block["turns"] >= 1 and block["trees"] >= 1
    assert (
        block["alt"] > 0
        and block["alr"] >= 1
        and len(block["hop_bytes"]) == 2
        and min(block["hop_bytes"]) > 0
    )
    # the same stages as one target of autoregressive: pipelined autoregressive decoding (the baseline)
    assert _text(gateway, "autoregressive")[0] == reference
    # the lookup's branch joins its trees (docs/design.md §3.10)
    merged, block = _text(gateway, "pipeline", drafter="model+lookup")
    assert merged == reference and block["drafter"] == "model+lookup"


def test_sampled_pipeline_is_reproducible_by_seed(gateway: str) -> None:
    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key="unused", max_retries=0, timeout=300)
    texts = [
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=5)
        .choices[0]
        .text
        for _ in range(2)
    ]
    assert texts[0] == texts[1] and texts[0]


COLOURS = {
    "type": "object",
    "properties": {
        "colour": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["colour", "count"],
    "additionalProperties": False,
}
CONSTRAINED = {  # docs/design.md §3.9: the last stage transforms each scored row by its ancestors
    "response_format": {
        "type": "json_schema",
        "json_schema": {"name": "colours", "schema": COLOURS, "strict": True},
    },
    "frequency_penalty": 0.5,
    "presence_penalty": 0.3,
    "logit_bias": {"45": 2.0},
}


def _constrained(base: str, mode: str, **params: Any) -> openai.types.Completion:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)
    return client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=40,
        extra_body={"speculative": {"mode": mode}, **CONSTRAINED},
        **params,
    )


def test_a_schema_with_penalties_and_bias_through_the_pipeline_equals_autoregressive(
    gateway: str, whole_worker: str, shared_draft: SharedDraft
) -> None:
    """Greedy: the pipeline's answer is the whole model's, constrained alike; sampled and seeded,
    it follows the schema."""
    answer = _constrained(gateway, "pipeline", temperature=0)
    config = _config([{"url": whole_worker}], mode="autoregressive")
    with served(gateway_app(config, shared_draft)) as single:
        reference = _constrained(single, "autoregressive", temperature=0).choices[0].text
    assert answer.choices[0].text == reference and answer.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reference), COLOURS)
    # the stages as a target of another mode
    assert _constrained(gateway, "autoregressive", temperature=0).choices[0].text == reference
    speculative = answer.usage.model_extra["speculative"]  # type: ignore[union-attr, index]
    assert speculative["lossless"] is True
    for seed in range(3):
        sampled = _constrained(gateway, "pipeline", temperature=1.0, seed=seed).choices[0]
        assert sampled.finish_reason == "stop", sampled
        jsonschema.validate(json.loads(sampled.text), COLOURS)


def _start_up_error(stages: list[Any], draft: SharedDraft) -> str:
    config = _config([{"name": "pipe", "pipeline": stages}])
    app = gateway_app(config, draft)

    async def start() -> None:
        async with app.router.lifespan_context(app):
            pass

    with pytest.raises(ConfigError) as failure:
        asyncio.run(start())
    return str(failure.value)


def test_bad_pipelines_stop_start_up_naming_the_stage(
    stage_procs: list[Any], whole_worker: str, shared_draft: SharedDraft
) -> None:
    one, two, three = (p.url for p in stage_procs)
    assert re.search(
        r"layers 9:21 are on no stage \(gap before stage 2", _start_up_error([one, three], shared_draft)
    )
    assert "layers 21:30 are on no stage" in _start_up_error([one, two], shared_draft)
    assert "on two stages (overlap" in _start_up_error([one, two, two, three], shared_draft)
    assert f"stage 2 ({whole_worker}) is not a pipeline stage" in _start_up_error(
        [one, whole_worker, three], shared_draft
    )
    with ExitStack() as stack:
        llama = stack.enter_context(
            served(
                create_worker(
                    WorkerSettings(model="builtin"), runner=load_runner("builtin", "llama.cpp", threads=1)
                )
            )
        )
        assert "runs llama.cpp: a pipeline stage needs --backend transformers" in _start_up_error(
            [one, llama, three], shared_draft
        )
    assert f"stage 2's replica {three} cannot stand in for {two}" in _start_up_error(
        [one, {"url": two, "replicas": [three]}, three], shared_draft
    )  # type: ignore[list-item]


def _sessions(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return float(re.search(r"^specgate:sessions (\S+)$", text, re.M).group(1))  # type: ignore[union-attr]


def _ready(gateway: str) -> dict[str, Any]:
    return httpx.get(f"{gateway}/health/ready", timeout=30).json()  # type: ignore[no-any-return]


def test_a_stage_with_a_replica_fails_over_mid_stream_and_the_answer_is_the_same(
    stage_procs: list[Any], gateway: str, shared_draft: SharedDraft
) -> None:
    """Stage 2 is a process of its own, with the module's stage 2 as its replica: killed after
    the first event, the stream goes on through the replica (every row resent from zero) and
    gives the text of a run without the failure; no stage holds the session afterwards."""
    reference, _ = _text(gateway, "pipeline", max_tokens=32)
    one, spare, three = (p.url for p in stage_procs)
    primary = StageProcess(SPLIT[1])
    with primary:
        assert primary.proc is not None
        config = _config(
            [
                {
                    "name": "pipe",
                    "pipeline": [one, {"url": primary.url, "replicas": [spare]}, three],
                    "read_timeout_s": 120,
                }
            ]
        )
        with served(gateway_app(config, shared_draft)) as failing:
            body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 32, "temperature": 0, "stream": True}
            events: list[str] = []
            with httpx.stream("POST", f"{failing}/v1/completions", json=body, timeout=120) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data:"):
                        events.append(line)
                        if len(events) == 1:
                            primary.proc.kill()  # stage 2 dies mid-answer; its replica takes over
            parsed = sse_events("\n\n".join(events) + "\n\n")
            assert parsed[-1] == "[DONE]" and not [
                e for e in parsed if isinstance(e, dict) and "error" in e
            ], parsed[-3:]
            text = "".join(c["text"] for e in parsed if isinstance(e, dict) for c in e.get("choices", []))
            assert text == reference
            stage_two = [r for r in _ready(failing)["workers"][0]["replicas"] if r["stage"] == 2]
            assert [r["url"] for r in stage_two if r["active"]] == [spare] and not any(
                r["ready"] for r in stage_two if r["url"] == primary.url
            )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_sessions(p.url) for p in stage_procs):
        time.sleep(0.2)
    assert [_sessions(p.url) for p in stage_procs] == [0, 0, 0]


def test_a_stage_killed_mid_stream_ends_it_with_an_error_and_the_others_free_the_session(
    stage_procs: list[Any], gateway: str
) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 64, "temperature": 0, "stream": True}
    events: list[Any] = []
    with httpx.stream("POST", f"{gateway}/v1/completions", json=body, timeout=120) as resp:
        lines = resp.iter_lines()
        for line in lines:
            if line.startswith("data:"):
                events.append(line)
                if len(events) == 1:
                    assert stage_procs[1].proc is not None
                    stage_procs[1].proc.kill()  # stage 2 dies mid-answer
        text = "\n\n".join(events) + "\n\n"
    parsed = sse_events(text)
    assert parsed[-1] == "[DONE]"
    errors = [e for e in parsed if isinstance(e, dict) and "error" in e]
    assert errors and "stage" in errors[0]["error"]["message"], parsed[-3:]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (_sessions(stage_procs[0].url) or _sessions(stage_procs[2].url)):
        time.sleep(0.2)
    assert _sessions(stage_procs[0].url) == 0 and _sessions(stage_procs[2].url) == 0
