"""Tools in a template's own format end to end: gateways under real uvicorn (the draft the built-in model, a
family's chat template from tests/data/chat_templates in place of its own) on the two real workers, the
official ``openai`` SDK. A required call follows its tool's parameters in each family's format; in the Hermes
format, every lossless mode gives autoregressive's answer at T = 0 (calls and text alike: the lazy grammar is
a transform like any other), streamed as whole; the Responses API calls through the native format too."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from app.server import create_app
from core.config import parse_config
from core.runners import ModelRunner
from tests.app.helpers import served
from tests.integration.test_structured_real import LOSSLESS, SOME_MODES

pytestmark = pytest.mark.integration

TEMPLATES = Path(__file__).resolve().parents[1] / "data" / "chat_templates"
MODEL = "specgate-native-tools"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a zone.",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
ASK = [
    {"role": "system", "content": "You answer questions about the weather."},
    {"role": "user", "content": "What is the weather in Paris?"},
]
CALL = [
    {"role": "system", "content": "You call tools."},
    {"role": "user", "content": "<tool_call> get_weather for Paris, please."},
]


@pytest.fixture(scope="module")
def clients(
    builtin_workers: list[str], builtin_llama_shared: ModelRunner
) -> Iterator[dict[str, openai.OpenAI]]:
    """A client per family (and a thinking template), each of its own gateway with that template in place of
    the built-in model's."""
    with ExitStack() as stack:
        out = {}
        for family in ("hermes", "llama3_json", "mistral", "thinking"):
            config = parse_config(
                {
                    "model": MODEL,
                    "draft": {"chat_template": str(TEMPLATES / f"{family}.jinja")},
                    "workers": [{"url": url, "weight": w} for url, w in zip(builtin_workers, (0.6, 0.4))],
                    "speculative": {"mode": "exact", "num_draft_tokens": 4},
                    "responses": {"store": "memory"},
                }
            )
            url = stack.enter_context(served(create_app(config, draft_runner=builtin_llama_shared)))
            out[family] = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
        yield out


def _calls(message: Any) -> list[tuple[str, Any]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


@pytest.mark.parametrize("family", ["hermes", "llama3_json", "mistral"])
def test_a_required_call_follows_its_parameters_in_each_familys_format(
    clients: dict[str, openai.OpenAI], family: str
) -> None:
    answer = clients[family].chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=48,
        temperature=0,  # type: ignore[list-item]
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    [(name, arguments)] = _calls(choice.message)
    jsonschema.validate(arguments, {"get_weather": WEATHER, "get_time": TIME}[name]["function"]["parameters"])
    with_result = [
        *ASK,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": choice.message.tool_calls[0].id, "content": "18 C, sunny."},
    ]  # type: ignore[index]
    again = clients[family].chat.completions.create(
        model=MODEL, messages=with_result, tools=[WEATHER, TIME], max_tokens=4, temperature=0
    )  # type: ignore[arg-type, list-item]
    # the template rendered the call and its result (a few tokens show it)
    assert again.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize("prompt", [ASK, CALL], ids=["text", "call"])
def test_every_lossless_mode_gives_autoregressives_answer_in_the_hermes_format(
    clients: dict[str, openai.OpenAI], prompt: list[dict[str, str]]
) -> None:
    """tool_choice auto: the model writes text (the first prompt) or a call (the second), the same in every
    mode (``SOME_MODES``: two by default, every lossless mode with SPECGATE_FULL_STATISTICS)."""
    client = clients["hermes"]
    answers = {}
    for mode, spec in SOME_MODES.items():
        answer = client.chat.completions.create(
            model=MODEL,
            messages=prompt,
            tools=[WEATHER, TIME],
            max_tokens=40,
            temperature=0,
            extra_body={"speculative": spec},  # type: ignore[arg-type, list-item]
        )
        choice = answer.choices[0]
        answers[mode] = (choice.message.content, _calls(choice.message), choice.finish_reason)
    assert len(set(map(repr, answers.values()))) == 1, answers
    # the figure (-rP shows it)
    print("hermes, tool_choice auto, T = 0, every mode:", answers["autoregressive"])
    assert (answers["autoregressive"][2] == "tool_calls") == (prompt is CALL)
    stream = client.chat.completions.create(
        model=MODEL, messages=prompt, tools=[WEATHER, TIME], max_tokens=40, temperature=0, stream=True
    )  # type: ignore[arg-type, list-item]
    content, names, arguments, finish = "", {}, {}, None
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            names[call.index] = names.get(call.index, "") + (
                call.function.name or "" if call.function else ""
            )
            arguments[call.index] = arguments.get(call.index, "") + (
                call.function.arguments or "" if call.function else ""
            )
        finish = chunk.choices[0].finish_reason or finish
    assert "<tool_call" not in content  # never streamed as text
    streamed = (
        (content or None) if names else content,
        [(names[i], json.loads(arguments[i])) for i in sorted(names)],
        finish,
    )
    assert streamed == answers["autoregressive"]


def test_the_responses_api_calls_through_the_native_format(clients: dict[str, openai.OpenAI]) -> None:
    tool = {"type": "function", **WEATHER["function"], "strict": True}
    response = clients["hermes"].responses.create(
        model=MODEL,
        input="What is the weather in Paris?",
        instructions="You answer questions about the weather.",
        tools=[tool],  # type: ignore[list-item]
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=48,
        temperature=0,
    )
    [call] = [item for item in response.output if item.type == "function_call"]
    assert response.status == "completed" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER["function"]["parameters"])


def test_a_thinking_templates_reasoning_comes_apart_the_same_in_every_mode(
    clients: dict[str, openai.OpenAI],
) -> None:
    """The thinking template opens the reasoning in its prompt: the answer's reasoning is
    ``reasoning_content`` (the built-in model rarely closes it), the same at T = 0 in every mode, with a
    schema held for after it."""
    schema = {
        "type": "json_schema",
        "json_schema": {
            "name": "answer",
            "schema": {"type": "object", "properties": {"sum": {"type": "integer"}}, "required": ["sum"]},
        },
    }
    answers = {}
    for mode in ("autoregressive", "exact", "tree exact"):
        answer = clients["thinking"].chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "What is 2 + 2?"}],
            max_tokens=24,
            temperature=0,
            response_format=schema,  # type: ignore[arg-type]
            extra_body={"speculative": LOSSLESS[mode]},
        )
        message = answer.choices[0].message
        answers[mode] = (
            (message.model_extra or {}).get("reasoning_content"),
            message.content,
            answer.choices[0].finish_reason,
        )
        assert answer.usage is not None and (answer.usage.completion_tokens_details is not None)
    assert len(set(answers.values())) == 1, answers
    reasoning, content, finish = answers["autoregressive"]
    assert reasoning and "<think>" not in reasoning and "</think>" not in reasoning
    if finish == "stop":  # the reasoning closed: the reply follows the schema
        assert isinstance(json.loads(content or "")["sum"], int)
    print("thinking, T = 0, every mode:", answers["autoregressive"])
