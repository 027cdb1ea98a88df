"""A mode is one plug-in (core.modes.register), as a tool format is (app.tool_formats): one file,
tests/app/toy_plugin.py, loaded as ``SPECGATE_PLUGINS`` loads it, holds a mode (its row and its strategy) and
a tool format, and nothing else is needed to serve them end to end. A request names the mode in
``speculative.mode``, its strategy verifies each round on a real worker's ``/v1/verify`` (which takes it from
the same registry), usage reports it, and at T = 0 its text is autoregressive's. Every kind of answer a row
names is scored on the host and on the device and checked by the protocol; a name taken or not registered, a
row that contradicts itself, a strategy missing and a plug-in that does not import are refused by name."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import httpx
import pytest

from app.engine.strategies import STRATEGIES, check_strategies
from app.tool_formats import FORMATS
from core.errors import ConfigError
from core.modes import MODES, ROWS, SAMPLE, VERDICT, ModeSpec, Payload, problems, register
from core.plugins import load_plugins
from core.protocol.checks import ANSWER_CHECKS
from core.runners import ModelRunner, load_runner
from tests.app.conftest import Gateway
from tests.app.helpers import assert_error
from workers.device_scoring import DEVICE_SCORINGS
from workers.scoring import SCORINGS
from workers.server import create_app as create_worker
from workers.settings import WorkerSettings

PLUGIN, TOY = "tests.app.toy_plugin", "first-choice"
CHAT = {"model": "test-model", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 12}


@pytest.fixture
def toy() -> Iterator[ModeSpec]:
    """The plug-in, loaded as a process loads it at start-up (``SPECGATE_PLUGINS``), and taken out after."""
    assert load_plugins({"SPECGATE_PLUGINS": f" {PLUGIN} ,"}) == [PLUGIN]
    try:
        yield MODES[TOY]
    finally:
        MODES.pop(TOY), STRATEGIES.pop(TOY), FORMATS.pop("bracketed"), sys.modules.pop(PLUGIN)


@pytest.fixture(scope="module")
def worker_runner() -> ModelRunner:
    return load_runner("tiny-random", "transformers")  # its own: the draft's sessions stay apart


async def test_a_mode_registered_by_a_plug_in_is_served_end_to_end_and_keeps_greedy_text(
    gateway: Gateway, worker_runner: ModelRunner, toy: ModeSpec
) -> None:
    worker = create_worker(WorkerSettings(model="tiny-random", backend="transformers"), runner=worker_runner)
    one = {"workers": [{"url": "http://w0:1"}]}
    async with gateway(transport=httpx.ASGITransport(app=worker), **one) as client:
        info = (await client.get("/health/ready")).json()
        answers = {}
        for mode in ("autoregressive", TOY):
            body = {**CHAT, "temperature": 0, "speculative": {"mode": mode}}
            resp = await client.post("/v1/chat/completions", json=body)
            assert resp.status_code == 200, resp.text
            answers[mode] = resp.json()
    speculative = answers[TOY]["usage"]["speculative"]
    assert speculative["mode"] == TOY and speculative["draft_tokens"] > 0, speculative
    assert speculative["lossless"] is False  # its row's one payload: a top-k
    text = {mode: answer["choices"][0]["message"]["content"] for mode, answer in answers.items()}
    assert text[TOY] == text["autoregressive"] and text[TOY], (text, info)


async def test_a_mode_not_registered_or_a_name_taken_is_refused_by_name(
    client: httpx.AsyncClient, toy: ModeSpec
) -> None:
    resp = await client.post("/v1/chat/completions", json={**CHAT, "speculative": {"mode": "telepathy"}})
    assert_error(resp, 400, "speculative.mode", "'telepathy' is not available")
    assert TOY in resp.json()["error"]["message"]
    with pytest.raises(ValueError, match="a name of its own"):
        register(toy)
    resp = await client.post("/v1/chat/completions", json={**CHAT, "speculative": {"mode": TOY, "k": 2}})
    assert_error(resp, 400, "speculative.k", "does not take ['k']")


def test_every_kind_of_answer_a_row_names_is_scored_on_both_sides_and_checked() -> None:
    """Host and device scoring of each kind are held equal bit for bit by
    tests/workers/test_device_scoring.py; here, that each kind has all three."""
    named = {kind for spec in MODES.values() if spec.scoring for kind in spec.scoring}
    assert named <= set(SCORINGS) == set(DEVICE_SCORINGS) == set(ANSWER_CHECKS)


async def test_a_tool_format_registered_by_a_plug_in_is_served_end_to_end(
    gateway: Gateway, worker_runner: ModelRunner, toy: ModeSpec
) -> None:
    """A format is one file too (app.tool_formats, one registered class): named by ``draft.tool_format``,
    its grammar holds a required call and its reader reads it back."""
    worker = create_worker(WorkerSettings(model="tiny-random", backend="transformers"), runner=worker_runner)
    config = {"workers": [{"url": "http://w0:1"}], "draft": {"tool_format": "bracketed"}}
    tool = {"type": "function", "function": {"name": "ping", "parameters": {"type": "object"}}}
    body = {**CHAT, "max_tokens": 40, "temperature": 0, "tools": [tool], "tool_choice": "required"}
    async with gateway(transport=httpx.ASGITransport(app=worker), **config) as client:
        resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    assert [call["function"]["name"] for call in choice["message"]["tool_calls"]] == ["ping"]


def test_a_row_that_contradicts_itself_a_missing_strategy_or_plug_in_is_refused_at_start() -> None:
    fields, rows = frozenset({"mode", "k"}), frozenset({Payload.FULL})
    assert problems(ModeSpec("m", fields, rows, "m", (ROWS, ROWS))) == ["a 'k' field needs top_k payloads"]
    with pytest.raises(ValueError, match="its calls carry no draft"):
        register(ModeSpec("m", frozenset({"mode"}), rows, "m", (ROWS, SAMPLE)))
    with pytest.raises(ValueError, match="no trees"):
        register(ModeSpec("m", frozenset({"mode"}), rows, "m", (VERDICT, VERDICT), trees=True))
    assert "m" not in MODES and not any(problems(spec) for spec in MODES.values())
    register(ModeSpec("m", frozenset({"mode"}), rows, "nowhere", (ROWS, ROWS)))
    try:
        with pytest.raises(ConfigError, match="'nowhere', which app.engine.strategies.STRATEGIES lacks"):
            check_strategies()
    finally:
        MODES.pop("m")
    with pytest.raises(ConfigError, match="SPECGATE_PLUGINS: 'tests.app.nowhere' does not import"):
        load_plugins({"SPECGATE_PLUGINS": "tests.app.nowhere"})
