"""``/v1/responses`` end to end: a real uvicorn gateway (draft builtin-draft, a SQLite store on disk) and a
real worker (builtin: the translation, not the federation, is what is checked), the official ``openai`` SDK
and the OpenAI Agents SDK. At T = 0 a response is the chat answer to the same conversation in every lossless
mode; at T = 1 every mode's stream is well formed and adds up to its response; ``responses.parse`` fills a
pydantic model; a function tool is called with arguments that follow its parameters and its result, chained by
``previous_response_id``, is answered; an agent runs a tool to the end of its run."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import jsonschema
import openai
import pydantic
import pytest

from core.config import parse_config
from tests.integration.gateways import SharedDraft, gateway_in_process
from tests.integration.test_structured_real import SOME_MODES

pytestmark = pytest.mark.integration

MODEL = "specgate-responses"
INSTRUCTIONS = "Answer briefly."
QUESTION = "Name three colours."
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "strict": True,
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 16}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def base_url(
    builtin_workers: list[str], shared_draft: SharedDraft, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    where = tmp_path_factory.mktemp("responses")
    config = parse_config(
        {
            "model": MODEL,
            "draft": {"model": "builtin-draft", "threads": 1},
            "workers": [{"url": url, "weight": w} for url, w in zip(builtin_workers[:1], (0.6, 0.4))],
            "speculative": {"mode": "exact", "num_draft_tokens": 4},
            "responses": {"store": str(where / "responses.sqlite3")},
        }
    )
    with ExitStack() as stack:
        yield gateway_in_process(stack, config, shared_draft)
    assert (where / "responses.sqlite3").stat().st_size > 0  # kept on disk


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=300)


def test_every_mode_answers_as_chat_does_at_t0_and_streams_well_formed_at_t1(client: openai.OpenAI) -> None:
    """``SOME_MODES``: two by default, every lossless mode with SPECGATE_FULL_STATISTICS."""
    for mode, spec in SOME_MODES.items():
        extra = {"speculative": spec}
        chat = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}],
            max_tokens=12,
            temperature=0,
            extra_body=extra,
        )
        response = client.responses.create(
            model=MODEL,
            instructions=INSTRUCTIONS,
            input=QUESTION,
            max_output_tokens=12,
            temperature=0,
            extra_body=extra,
        )
        assert response.output_text == chat.choices[0].message.content, mode
        assert response.usage is not None and chat.usage is not None
        assert (response.usage.input_tokens, response.usage.output_tokens) == (
            chat.usage.prompt_tokens,
            chat.usage.completion_tokens,
        ), mode
        events = list(
            client.responses.create(
                model=MODEL,
                input=QUESTION,
                max_output_tokens=12,
                temperature=1,
                stream=True,
                extra_body={**extra, "seed": 7},
            )
        )
        kinds = [event.type for event in events]
        final = events[-1].response  # type: ignore[union-attr]
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == final.output_text  # type: ignore[union-attr]
        assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] in (
            "response.completed",
            "response.incomplete",
        ), (mode, kinds)
        assert (
            final.status in ("completed", "incomplete")
            and final.usage is not None
            and final.usage.output_tokens <= 12
        )
        assert (final.usage.model_extra or {})["speculative"]["lossless"] is True
        again = client.responses.create(
            model=MODEL, input=QUESTION, max_output_tokens=12, temperature=1, extra_body={**extra, "seed": 7}
        )
        # seeded: the stream and the whole answer are one text
        assert again.output_text == final.output_text, mode


def test_parse_fills_a_pydantic_model(client: openai.OpenAI) -> None:
    class Colour(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=20)
        warm: bool

    parsed = client.responses.parse(
        model=MODEL,
        input="Describe the colour red as JSON.",
        text_format=Colour,
        max_output_tokens=40,
        temperature=0,
    )
    assert parsed.status == "completed" and isinstance(parsed.output_parsed, Colour)


def test_a_function_tool_is_called_and_its_result_answered_by_id(client: openai.OpenAI) -> None:
    first = client.responses.create(
        model=MODEL,
        instructions="You answer questions about the weather.",
        input="What is the weather in Paris?",
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=48,
        temperature=0,
    )
    calls = [item for item in first.output if item.type == "function_call"]
    assert first.status == "completed" and len(calls) == 1, first.output
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    result = {"type": "function_call_output", "call_id": calls[0].call_id, "output": "18 C and sunny."}
    second = client.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input=[result],
        tools=[WEATHER],
        max_output_tokens=48,
        temperature=0,
    )  # type: ignore[list-item]
    assert second.previous_response_id == first.id and second.status in ("completed", "incomplete")
    # the conversation, with the result
    assert (
        second.usage is not None
        and first.usage is not None
        and second.usage.input_tokens > first.usage.input_tokens
    )
    assert client.responses.retrieve(second.id).output_text == second.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)


def test_a_call_cut_by_the_token_limit_is_never_text(client: openai.OpenAI) -> None:
    """Issue 75: with tool_choice required and the limit reached inside a call, the call's partial JSON came
    back as message text, on chat completions and as a Responses message. Now the answer ends length /
    incomplete with no text."""
    chat_tool: Any = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
    question = "What is the weather in Paris, Rome and Oslo?"
    for limit in (5, 9):
        chat = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": question}],
            tools=[chat_tool],
            tool_choice="required",
            max_tokens=limit,
            temperature=0,
        )
        assert chat.choices[0].finish_reason == "length" and not chat.choices[0].message.content, chat
        response = client.responses.create(
            model=MODEL,
            input=question,
            tools=[WEATHER],
            tool_choice="required",
            max_output_tokens=limit,
            temperature=0,
        )
        assert response.status == "incomplete" and response.output_text == "", response


def test_a_coding_agents_own_tools_are_served(client: openai.OpenAI) -> None:
    """Issue 75, the CLI's request shapes: a freeform tool with a grammar is called with an input the grammar
    makes (the CLI's apply_patch grammar, held the same way, is tests/app/test_responses_api.py's and
    tests/core/test_grammar.py's); the next turn carries a freeform call and its output, a local_shell call
    and its output, and two namespaces whose tools share a name, and is answered."""
    from tests.app.test_responses_api import A_PATCH

    touch: Any = {
        "type": "custom",
        "name": "touch",
        "description": "Creates an empty file.",
        "format": {"type": "grammar", "syntax": "regex", "definition": "[a-z]{1,8}\\.(txt|md)"},
    }
    ask = "Create the file hello.txt."
    first = client.responses.create(
        model=MODEL,
        input=ask,
        tools=[touch],
        tool_choice={"type": "custom", "name": "touch"},
        max_output_tokens=40,
        temperature=0,
    )
    [call] = [item for item in first.output if item.type == "custom_tool_call"]
    assert (
        call.name == "touch"
        and call.status == "completed"
        and re.fullmatch(r"[a-z]{1,8}\.(txt|md)", call.input)
    ), call
    history: Any = [
        {"role": "user", "content": ask},
        {"type": "custom_tool_call", "call_id": call.call_id, "name": "apply_patch", "input": A_PATCH},
        {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "Done."},
        {
            "type": "local_shell_call",
            "id": "lsh_1",
            "call_id": "c1",
            "status": "completed",
            "action": {"type": "exec", "command": ["cat", "hello.txt"], "env": {}},
        },
        {"type": "local_shell_call_output", "id": "lsh_1", "call_id": "c1", "output": "hi"},
        {
            "type": "function_call",
            "call_id": "c2",
            "name": "search",
            "namespace": "docs",
            "arguments": '{"q":"hello"}',
        },
        {
            "type": "function_call",
            "call_id": "c3",
            "name": "search",
            "namespace": "code",
            "arguments": '{"q":"hello"}',
        },
        {"type": "function_call_output", "call_id": "c2", "output": "nothing"},
        {"type": "function_call_output", "call_id": "c3", "output": "hello.txt"},
    ]
    # offering them: tests/app/test_responses_api.py
    second = client.responses.create(model=MODEL, input=history, max_output_tokens=8, temperature=0)
    assert second.status in ("completed", "incomplete") and second.output


def test_an_agent_calls_its_tool_and_the_run_ends(base_url: str) -> None:
    """The OpenAI Agents SDK (``openai-agents``) on the Responses API: a function tool, called with valid
    arguments, whose result ends the run. (The built-in 135M model, asked again after a result, mostly calls
    the tool again: the run stops at the first tool's result rather than running the model to a turn
    limit.)"""
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)  # nothing leaves this machine
    cities: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        cities.append(city)
        return f"It is 18 C and sunny in {city}."

    async def run() -> Any:
        model = OpenAIResponsesModel(
            MODEL, openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
        )
        settings = ModelSettings(
            tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=64
        )
        agent = Agent(
            name="weather",
            instructions="You answer questions about the weather.",
            tools=[get_weather],
            model=model,
            model_settings=settings,
            tool_use_behavior="stop_on_first_tool",
        )
        return await Runner.run(agent, "What is the weather in Paris?", max_turns=3)

    result = asyncio.run(run())
    assert len(cities) == 1 and cities[0]
    assert result.final_output == f"It is 18 C and sunny in {cities[0]}."
    assert [type(item).__name__ for item in result.new_items] == ["ToolCallItem", "ToolCallOutputItem"]
