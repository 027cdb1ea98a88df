"""A mode is one plug-in (core.modes.register), as a tool format is (app.tool_formats): a mode a test defines,
its row and its strategy and nothing else, is served end to end. A request names it in ``speculative.mode``,
its strategy verifies each round on a real worker's ``/v1/verify`` (which takes it from the same registry),
usage reports it, and at T = 0 its text is autoregressive's. Every kind of answer a row names is scored on the
host and on the device and checked by the protocol; a name taken, or not registered, is refused by name."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from app.engine.round import Round, array
from app.engine.spec import RoundResult
from app.engine.strategies import STRATEGIES, RoundStrategy
from app.tool_formats import FORMATS, CallStyle
from app.tool_formats.base import register as register_format
from app.tool_formats.json_calls import JsonCallFormat
from core.modes import MODES, ROWS, ModeSpec, Payload, register
from core.protocol.checks import ANSWERS
from core.runners import ModelRunner, load_runner
from tests.app.conftest import Gateway
from tests.app.helpers import assert_error
from workers.device_scoring import DEVICE_SCORINGS
from workers.scoring import SCORINGS
from workers.server import create_app as create_worker
from workers.settings import WorkerSettings

TOY = "first-choice"
CHAT = {"model": "test-model", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 12}


class FirstChoice(RoundStrategy):
    """The toy mode: the draft kept while it is the worker's top-1 at each position, then the worker's top-1
    (one worker, T = 0: greedy decoding's tokens, on a one-id row a position)."""

    async def verify(self, rnd: Round) -> RoundResult:
        (resp,) = await rnd.call(mode=TOY, k=1)
        top = array(resp.ids)[:, 0].tolist()
        draft = rnd.draft.ids()
        accepted = next((j for j, token in enumerate(draft) if token != top[j]), len(draft))
        return RoundResult(
            [*draft[:accepted], top[accepted]], drafted=len(draft), accepted=accepted, traffic=rnd.traffic
        )


@pytest.fixture
def toy() -> Iterator[ModeSpec]:
    fields = frozenset({"mode", "profile", "num_draft_tokens", "drafter"})
    spec = register(ModeSpec(TOY, fields, frozenset({Payload.FULL}), strategy=TOY, scoring=(ROWS, ROWS)))
    STRATEGIES[TOY] = FirstChoice()
    try:
        yield spec
    finally:
        MODES.pop(TOY), STRATEGIES.pop(TOY)


@pytest.fixture(scope="module")
def worker_runner() -> ModelRunner:
    return load_runner("tiny-random", "transformers")  # its own: the draft's sessions stay apart


async def test_a_mode_registered_by_a_test_is_served_end_to_end_and_keeps_greedy_text(
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
    assert named <= set(SCORINGS) == set(DEVICE_SCORINGS) == set(ANSWERS)


class Bracketed(JsonCallFormat):
    """The toy tool format: ``[[call]]{"name": …, "args": …}[[/call]]``, one call an answer."""

    name = "bracketed"
    style = CallStyle("[[call]]", ("",), "args", None, "[[/call]]")

    def detects(self, template: str) -> bool:
        return False


@pytest.fixture
def bracketed() -> Iterator[None]:
    register_format(Bracketed)
    try:
        yield
    finally:
        FORMATS.pop(Bracketed.name)


async def test_a_tool_format_registered_by_a_test_is_served_end_to_end(
    gateway: Gateway, worker_runner: ModelRunner, bracketed: None
) -> None:
    """A format is one file too (app.tool_formats, one registered class): named by ``draft.tool_format``,
    its grammar holds a required call and its reader reads it back."""
    worker = create_worker(WorkerSettings(model="tiny-random", backend="transformers"), runner=worker_runner)
    config = {"workers": [{"url": "http://w0:1"}], "draft": {"tool_format": Bracketed.name}}
    tool = {"type": "function", "function": {"name": "ping", "parameters": {"type": "object"}}}
    body = {**CHAT, "max_tokens": 40, "temperature": 0, "tools": [tool], "tool_choice": "required"}
    async with gateway(transport=httpx.ASGITransport(app=worker), **config) as client:
        resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    assert [call["function"]["name"] for call in choice["message"]["tool_calls"]] == ["ping"]
