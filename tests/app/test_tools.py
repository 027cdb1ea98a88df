"""The generic tool format (app/tools.py): its schema, the conversation it renders, and the
reader that turns an answer, arriving in any pieces, into OpenAI's message and deltas."""

from __future__ import annotations

import json

import jsonschema
import pytest

from app.tools import Tool, ToolOutput, generic_schema, render_messages, tools_prompt

WEATHER = Tool("get_weather", "The weather in a city", {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
TIME = Tool("get_time", "The time", {"type": "object", "properties": {}})
CALLS = '{"tool_calls":[{"name":"get_weather","arguments":{"city":"Paris \\"}{\\" x","n":[1,{"a":2}]}},{"name":"get_time","arguments":{}}]}'


def test_the_schema_takes_calls_or_a_response_and_only_calls_when_required() -> None:
    schema = generic_schema([WEATHER, TIME], required=False, parallel=True)
    jsonschema.validate(json.loads(CALLS), schema)
    jsonschema.validate({"response": "hello"}, schema)
    required = generic_schema([WEATHER, TIME], required=True, parallel=True)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"response": "hello"}, required)
    with pytest.raises(jsonschema.ValidationError):  # arguments follow the tool's parameters
        jsonschema.validate({"tool_calls": [{"name": "get_weather", "arguments": {}}]}, required)
    with pytest.raises(jsonschema.ValidationError):  # one call only without parallel_tool_calls
        jsonschema.validate(json.loads(CALLS), generic_schema([WEATHER, TIME], required=True, parallel=False))
    assert "response" not in tools_prompt([WEATHER], required, True) and "get_weather" in tools_prompt([WEATHER], required, True)


def test_a_conversation_with_calls_and_results_renders_in_the_same_format() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    ]
    out = render_messages(messages, "TOOLS")
    assert out[0] == {"role": "system", "content": "Be brief.\n\nTOOLS"}
    assert out[2] == {"role": "assistant", "content": '{"tool_calls":[{"name":"get_weather","arguments":{"city":"Paris"}}]}'}
    assert out[3] == {"role": "tool", "content": '{"tool_response":{"name":"get_weather","content":"sunny"}}'}
    assert render_messages(messages[1:2], "TOOLS")[0] == {"role": "system", "content": "TOOLS"}


@pytest.mark.parametrize("size", [1, 2, 5, 1000])
def test_calls_arrive_as_openai_deltas_whatever_the_pieces(size: int) -> None:
    output, deltas = ToolOutput(), []
    for start in range(0, len(CALLS), size):
        deltas += output.push(CALLS[start : start + size])
    deltas += output.flush()
    firsts = [d["tool_calls"][0] for d in deltas if "id" in d["tool_calls"][0]]
    assert [(f["index"], f["type"], f["function"]["name"]) for f in firsts] == [(0, "function", "get_weather"), (1, "function", "get_time")]
    assert all(f["id"].startswith("call_") and len(f["id"]) == 29 for f in firsts)
    arguments = {0: "", 1: ""}
    for d in deltas:
        piece = d["tool_calls"][0]
        assert "index" in piece  # every piece names its call (clients break without it)
        arguments[piece["index"]] += piece["function"].get("arguments", "")
    expected = json.loads(CALLS)["tool_calls"]
    assert [json.loads(arguments[i]) for i in (0, 1)] == [c["arguments"] for c in expected]
    assert [c.to_dict()["function"]["arguments"] for c in output.calls] == [arguments[0], arguments[1]] and not output.content


@pytest.mark.parametrize("size", [1, 3, 1000])
def test_a_response_arrives_as_its_decoded_text(size: int) -> None:
    text = json.dumps({"response": 'Hi "there"\n—café \\ ok'}, separators=(",", ":"), ensure_ascii=True)
    output, deltas = ToolOutput(), []
    for start in range(0, len(text), size):
        deltas += output.push(text[start : start + size])
    assert "".join(d["content"] for d in deltas) == 'Hi "there"\n—café \\ ok' == output.content and not output.calls


def test_an_answer_cut_short_before_its_form_is_content() -> None:
    output = ToolOutput()
    assert output.push('{"tool_') == []
    assert output.flush() == [{"content": '{"tool_'}] and output.content == '{"tool_'
