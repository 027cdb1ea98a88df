"""Structured outputs, penalties and logit_bias end to end (docs/design.md §3.9): a real uvicorn gateway
(draft builtin-draft) on a real worker (builtin), the official ``openai`` client. Answers are checked
with ``jsonschema``; at T = 0 every lossless mode must give autoregressive's text under the same
constraint, through a gateway federating two workers (builtin 0.6, builtin-alt 0.4): each worker's
constrained rows mixed."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import ExitStack

import httpx
import jsonschema
import openai
import pydantic
import pytest

from core.config import parse_config
from tests.app.helpers import FULL_RUN
from tests.integration.gateways import SharedDraft, gateway_in_process

pytestmark = pytest.mark.integration

MODEL = "specgate-structured"
PROMPT = [{"role": "user", "content": "Invent a person and describe them as JSON."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 24},
        "married": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "married"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
# every lossless mode the two-worker federation serves (split: one worker; pipeline:
# tests/integration/test_pipeline_real.py)
LOSSLESS = {
    "autoregressive": {"mode": "autoregressive"},
    "aggregate k=full": {"mode": "aggregate", "k": "full"},
    "exact": {"mode": "exact"},
    "tree exact": {"mode": "tree", "tree": {"payload": "exact"}},
    "tree full": {"mode": "tree", "k": "full"},
    "exact + overlap": {"mode": "exact", "overlap": True},
}
FULL = bool(os.environ.get("SPECGATE_FULL_STATISTICS"))
# A layer above the engine (the Responses API, a template's tool format, a schema at T = 1) in two modes by
# default: the reference and the one that runs the most of the draft (a tree, its exact payload, the grammar's
# masks on its nodes); in every lossless mode with SPECGATE_FULL_STATISTICS. That every mode gives the
# reference's text is proven in the default run on the real model
# (test_greedy_answers_equal_autoregressive_in_every_lossless_mode below, with a schema and penalties;
# tests/integration/test_gateway_e2e.py) and exactly for every cell (tests/app/test_lossless_matrix.py).
SOME_MODES = LOSSLESS if FULL else {mode: LOSSLESS[mode] for mode in ("autoregressive", "tree exact")}
# seeded answers per mode at T = 1 (tests/integration/test_request_surface.py checks schemas across modes
# under generated requests)
SAMPLES = 200 if FULL else 2
MAX_TOKENS = 64


def _gateway(stack: ExitStack, urls: list[str], draft: SharedDraft) -> str:
    config = parse_config(
        {
            "model": MODEL,
            "draft": {"model": "builtin-draft", "threads": 1},
            "workers": [{"url": url, "weight": w} for url, w in zip(urls, (0.6, 0.4))],
            "speculative": {"mode": "exact", "num_draft_tokens": 4},
        }
    )
    return gateway_in_process(stack, config, draft)


@pytest.fixture(scope="module")
def base_url(builtin_workers: list[str], shared_draft: SharedDraft) -> Iterator[str]:
    """One worker: what is checked here is the constraint, not the federation (which the greedy test below and
    the lossless matrix's transform cells check with two workers)."""
    with ExitStack() as stack:
        yield _gateway(stack, builtin_workers[:1], shared_draft)


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def pair_client(builtin_workers: list[str], shared_draft: SharedDraft) -> Iterator[openai.OpenAI]:
    with ExitStack() as stack:
        yield openai.OpenAI(
            base_url=f"{_gateway(stack, builtin_workers, shared_draft)}/v1",
            api_key="unused",
            max_retries=0,
            timeout=300,
        )


def _chat(
    client: openai.OpenAI, spec: dict, max_tokens: int = MAX_TOKENS, **params: object
) -> openai.types.chat.ChatCompletion:  # type: ignore[type-arg]
    params.setdefault("extra_body", {"speculative": spec})
    return client.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=max_tokens, **params)  # type: ignore[arg-type, call-overload]


@pytest.mark.parametrize(
    "mode", [m if m in SOME_MODES else pytest.param(m, marks=FULL_RUN) for m in LOSSLESS]
)
def test_seeded_answers_follow_the_schema_in_every_lossless_mode(client: openai.OpenAI, mode: str) -> None:
    stopped = 0
    for seed in range(SAMPLES):
        answer = _chat(client, LOSSLESS[mode], temperature=1.0, seed=seed, response_format=FORMAT)
        choice = answer.choices[0]
        if choice.finish_reason == "stop":
            jsonschema.validate(json.loads(choice.message.content or ""), SCHEMA)
            stopped += 1
        else:
            assert choice.finish_reason == "length"
        speculative = answer.usage.model_extra["speculative"]  # type: ignore[union-attr, index]
        assert speculative["lossless"] is True
    print(f"{mode}: {stopped} of {SAMPLES} ended with stop, every one valid")  # the figure (-rP shows it)
    assert stopped >= 0.9 * SAMPLES


def test_greedy_answers_equal_autoregressive_in_every_lossless_mode(pair_client: openai.OpenAI) -> None:
    """Through the two workers' federation."""
    params = {
        "temperature": 0.0,
        "response_format": FORMAT,
        "frequency_penalty": 0.5,
        "presence_penalty": 0.3,
        "logit_bias": {"45": 2.0},
    }
    texts = {
        mode: _chat(pair_client, spec, **params).choices[0].message.content for mode, spec in LOSSLESS.items()
    }
    assert len(set(texts.values())) == 1, texts
    jsonschema.validate(json.loads(texts["autoregressive"] or ""), SCHEMA)


def test_the_sdk_parses_into_a_pydantic_model(client: openai.OpenAI) -> None:
    class Person(pydantic.BaseModel):
        name: str
        age: int
        city: str

    answer = client.chat.completions.parse(
        model=MODEL, messages=PROMPT, response_format=Person, max_tokens=MAX_TOKENS, temperature=0, seed=3
    )  # type: ignore[arg-type]
    person = answer.choices[0].message.parsed
    assert isinstance(person, Person) and person.name


def test_json_object_regex_and_choice(client: openai.OpenAI) -> None:
    obj = _chat(client, {"mode": "exact"}, temperature=1.0, seed=5, response_format={"type": "json_object"})
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content or ""), dict)
    answer = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Is the sea blue?"}],
        max_tokens=8,
        temperature=1.0,
        seed=2,
        extra_body={
            "structured_outputs": {"choice": ["yes", "no", "sometimes"]},
            "speculative": {"mode": "exact"},
        },
    )
    assert (
        answer.choices[0].message.content in ("yes", "no", "sometimes")
        and answer.choices[0].finish_reason == "stop"
    )
    code = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Give me a US phone number."}],
        max_tokens=16,
        temperature=1.0,
        seed=2,
        extra_body={
            "structured_outputs": {"regex": r"\+1-[0-9]{3}-[0-9]{4}"},
            "speculative": {"mode": "tree"},
        },
    )
    content = code.choices[0].message.content or ""
    assert code.choices[0].finish_reason == "stop" and content.startswith("+1-") and len(content) == 11
    speculative = code.usage.model_extra["speculative"]  # type: ignore[union-attr, index]
    assert speculative["forced_tokens"] >= 1  # "+1-" is the regex's own: decided at the gateway


def test_logit_bias_of_100_decides_the_token(client: openai.OpenAI) -> None:
    # "="
    completion = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=4, temperature=1.0, seed=1, logit_bias={"45": 100}
    )
    assert completion.choices[0].text == "====", completion.choices[0].text


def test_max_tokens_inside_a_value_is_length(client: openai.OpenAI) -> None:
    answer = _chat(client, {"mode": "exact"}, temperature=0.0, response_format=FORMAT, max_tokens=5)
    assert answer.choices[0].finish_reason == "length"


def test_a_streamed_schema_answer_joins_to_valid_json(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        response_format=FORMAT,
        stream=True,
    )  # type: ignore[arg-type, call-overload]
    text, finish = "", None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    assert finish == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nope"}},
                }
            },
            "response_format.json_schema",
            "does not compile",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format.type", ""),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "needs json_schema"),
        ({"structured_outputs": {"regex": "(("}}, "structured_outputs.regex", "does not compile"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {"regex": "a" * 70000}}, "structured_outputs.regex", "the limit is"),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "structured_outputs",
            "not both",
        ),
        ({"logit_bias": {"a": 1}}, "logit_bias", "token ids"),
        ({"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
        ({"logit_bias": {"99999": 1}}, "logit_bias", "vocabulary"),
        ({"presence_penalty": 2.5}, "presence_penalty", ""),
        ({"frequency_penalty": -3}, "frequency_penalty", ""),
        ({"repetition_penalty": 0}, "repetition_penalty", ""),
        ({"min_p": 1.5}, "min_p", ""),
        ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos", "grammar decides"),
    ],
)
def test_bad_constraints_get_a_400_naming_the_parameter(
    base_url: str, body: dict, param: str, says: str
) -> None:
    answer = httpx.post(
        f"{base_url}/v1/chat/completions",
        json={"model": MODEL, "messages": PROMPT, "max_tokens": 4, **body},
        timeout=60,
    )
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and says in error["message"], error
    ok = httpx.post(
        f"{base_url}/v1/chat/completions",
        json={"model": MODEL, "messages": PROMPT, "max_tokens": 2},
        timeout=60,
    )
    assert ok.status_code == 200  # the server keeps serving


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 20}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _valid_calls(message: openai.types.chat.ChatCompletionMessage, names: set[str]) -> None:
    assert message.tool_calls and message.content is None
    for call in message.tool_calls:
        assert call.id.startswith("call_") and call.type == "function" and call.function.name in names
        tool = WEATHER if call.function.name == "get_weather" else CLOCK
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])  # type: ignore[index]


@pytest.mark.parametrize(
    "mode",
    [
        m if m in SOME_MODES else pytest.param(m, marks=FULL_RUN)
        for m in ("autoregressive", "exact", "tree exact")
    ],
)
def test_tool_choice_required_gives_valid_calls(client: openai.OpenAI, mode: str) -> None:
    for seed in range(min(SAMPLES, 3)):
        answer = client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=[WEATHER, CLOCK],
            tool_choice="required",
            temperature=1.0,
            seed=seed,
            max_tokens=96,  # type: ignore[list-item]
            extra_body={"speculative": LOSSLESS[mode]},
        )
        choice = answer.choices[0]
        if choice.finish_reason == "length":
            continue
        assert choice.finish_reason == "tool_calls"
        _valid_calls(choice.message, {"get_weather", "get_time"})


def test_a_named_function_is_the_one_called(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER, CLOCK],
        tool_choice={"type": "function", "function": {"name": "get_time"}},  # type: ignore[list-item]
        temperature=0,
        max_tokens=96,
        parallel_tool_calls=False,
    )
    assert answer.choices[0].finish_reason == "tool_calls"
    _valid_calls(answer.choices[0].message, {"get_time"})
    assert len(answer.choices[0].message.tool_calls or []) == 1


def test_a_streamed_tool_call_is_reassembled_by_the_sdk(client: openai.OpenAI) -> None:
    with client.chat.completions.stream(
        model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required", temperature=0, max_tokens=96
    ) as stream:  # type: ignore[list-item]
        for _ in stream:
            pass
        final = stream.get_final_completion()
    assert final.choices[0].finish_reason == "tool_calls"
    _valid_calls(final.choices[0].message, {"get_weather"})


def test_auto_may_answer_in_text_and_a_tool_result_continues_the_conversation(client: openai.OpenAI) -> None:
    auto = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hello."}],
        tools=[WEATHER],
        temperature=0,
        max_tokens=48,
    )  # type: ignore[list-item]
    choice = auto.choices[0]
    assert (choice.finish_reason == "tool_calls" and choice.message.tool_calls) or (
        choice.message.content is not None and not choice.message.tool_calls
    )
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_abc",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Paris","unit":"celsius"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_abc", "content": "18 degrees and sunny"},
    ]
    answer = client.chat.completions.create(
        model=MODEL, messages=history, tools=[WEATHER], tool_choice="none", temperature=0, max_tokens=24
    )  # type: ignore[arg-type, list-item]
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "absent"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "object", "properties": {"a": {"type": "nope"}}},
                        },
                    }
                ]
            },
            "tools.0.function.parameters",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
            "tools.0.function.parameters",
        ),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
        ({"messages": [*ASK, {"role": "tool", "content": "x"}]}, "messages.1.tool_call_id"),
    ],
)
def test_bad_tools_get_a_400_naming_the_parameter(base_url: str, body: dict, param: str) -> None:
    answer = httpx.post(
        f"{base_url}/v1/chat/completions",
        json={"model": MODEL, "messages": ASK, "max_tokens": 4, **body},
        timeout=60,
    )
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param, answer.json()


def test_tool_call_responses_follow_openais_published_schema(base_url: str) -> None:
    """The tool-call shapes (message and stream deltas) against OpenAI's OpenAPI document."""
    from tests.app.helpers import sse_events
    from tests.app.test_openai_schema import check

    body = {
        "model": MODEL,
        "messages": ASK,
        "tools": [WEATHER, CLOCK],
        "tool_choice": "required",
        "temperature": 0,
        "max_tokens": 96,
    }
    answer = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=120).json()
    assert answer["choices"][0]["finish_reason"] == "tool_calls"
    check(answer, "CreateChatCompletionResponse")
    streamed = httpx.post(f"{base_url}/v1/chat/completions", json={**body, "stream": True}, timeout=120)
    chunks = [e for e in sse_events(streamed.text) if e != "[DONE]"]
    for chunk in chunks:
        check(chunk, "CreateChatCompletionStreamResponse")
    pieces = [p for c in chunks for p in (c["choices"][0]["delta"].get("tool_calls") or [])]
    assert (
        pieces[0]["id"].startswith("call_")
        and pieces[0]["type"] == "function"
        and all("index" in p for p in pieces)
    )
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_a_grammar_that_allows_nothing_more_ends_the_answer_cleanly(client: openai.OpenAI) -> None:
    """Only the empty string: the grammar allows only the end tokens at once (no hang, no 500).
    The built-in model has two (0 and 2), so nothing is forced: one round decides which, as each
    target weighs them."""
    for spec in LOSSLESS.values():
        answer = _chat(
            client,
            spec,
            temperature=1.0,
            seed=1,
            extra_body={"structured_outputs": {"regex": ""}, "speculative": spec},
        )
        assert answer.choices[0].message.content == "" and answer.choices[0].finish_reason == "stop"
        assert answer.usage.completion_tokens == 1  # type: ignore[union-attr]
        assert answer.usage.model_extra["speculative"].get("forced_tokens", 0) == 0  # type: ignore[union-attr, index]


def test_langchain_with_structured_output_and_bind_tools(base_url: str) -> None:
    """langchain-openai's structured output (a json_schema response_format) and tool binding."""
    from langchain_openai import ChatOpenAI

    class City(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=24)
        country: str = pydantic.Field(max_length=24)

    class get_weather(pydantic.BaseModel):  # noqa: N801 - a tool's name, as the model sees it
        """The current weather in a city."""

        city: str = pydantic.Field(max_length=20)

    llm = ChatOpenAI(
        base_url=f"{base_url}/v1", api_key="unused", model=MODEL, temperature=0, max_tokens=64, max_retries=0
    )  # type: ignore[arg-type]
    city = llm.with_structured_output(City).invoke("Name a big city in Europe.")
    assert isinstance(city, City) and city.name
    # greedy, this model repeats a call
    message = llm.bind_tools([get_weather], tool_choice="required", parallel_tool_calls=False).invoke(
        "What is the weather in Paris?"
    )
    assert (
        message.tool_calls
        and message.tool_calls[0]["name"] == "get_weather"
        and isinstance(message.tool_calls[0]["args"]["city"], str)
    )  # type: ignore[attr-defined]


@pytest.mark.parametrize("max_tokens", [6, 14])
def test_a_call_cut_by_max_tokens_carries_what_was_generated_streamed_and_whole(
    base_url: str, max_tokens: int
) -> None:
    """Issue 46: past the call's name the stream sent pieces the whole answer dropped. Now both carry the
    partial call, with finish_reason length, and the whole answer is what the stream adds up to. Issue 75:
    no piece of a call is ever content (before its name the cut call is dropped)."""
    body = {
        "model": MODEL,
        "messages": ASK,
        "tools": [WEATHER],
        "tool_choice": "required",
        "temperature": 1.0,
        "seed": 5,
        "max_tokens": max_tokens,
    }
    whole = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=60).json()
    events = [
        json.loads(line[6:])
        for line in httpx.post(
            f"{base_url}/v1/chat/completions", json={**body, "stream": True}, timeout=60
        ).text.splitlines()
        if line.startswith("data: {")
    ]
    message, choice = whole["choices"][0]["message"], whole["choices"][0]
    assert choice["finish_reason"] == "length" and whole["usage"]["completion_tokens"] == max_tokens
    assert not message["content"], message  # never the call's JSON as text
    content = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
    arguments = "".join(
        t["function"].get("arguments", "")
        for e in events
        for c in e["choices"]
        for t in c["delta"].get("tool_calls") or []
    )
    assert content == (message["content"] or "") and arguments == "".join(
        t["function"]["arguments"] for t in message.get("tool_calls") or []
    )
    assert [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]] == ["length"]


def test_a_stop_string_inside_a_call_does_not_cut_it(client: openai.OpenAI) -> None:
    """Issue 46: stop strings apply to free text only; a call the grammar writes ends whole."""
    answer = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER],
        tool_choice="required",
        temperature=0,
        max_tokens=96,
        stop=['"', ",", "city"],  # type: ignore[list-item]
    )
    assert answer.choices[0].finish_reason == "tool_calls"
    _valid_calls(answer.choices[0].message, {"get_weather"})
