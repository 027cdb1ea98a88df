"""The generic tool format (app/tools.py): its schema, the conversation it renders, and the
reader that turns an answer, arriving in any pieces, into OpenAI's message and deltas."""

from __future__ import annotations

import json

import jsonschema
import pytest

from app.tools import Tool, ToolOutput, generic_schema, message_of, render_messages, tools_prompt

WEATHER = Tool(
    "get_weather",
    "The weather in a city",
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)
TIME = Tool("get_time", "The time", {"type": "object", "properties": {}})
CALLS = (
    '{"tool_calls":[{"name":"get_weather","arguments":{"city":"Paris \\"}{\\" '
    'x","n":[1,{"a":2}]}},{"name":"get_time","arguments":{}}]}'
)


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
    assert "response" not in tools_prompt([WEATHER], required, True) and "get_weather" in tools_prompt(
        [WEATHER], required, True
    )


def test_a_conversation_with_calls_and_results_renders_in_the_same_format() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                }
            ],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    ]
    out = render_messages(messages, "TOOLS")
    assert out[0] == {"role": "system", "content": "Be brief.\n\nTOOLS"}
    assert out[2] == {
        "role": "assistant",
        "content": '{"tool_calls":[{"name":"get_weather","arguments":{"city":"Paris"}}]}',
    }
    assert out[3] == {"role": "tool", "content": '{"tool_response":{"name":"get_weather","content":"sunny"}}'}
    assert render_messages(messages[1:2], "TOOLS")[0] == {"role": "system", "content": "TOOLS"}


@pytest.mark.parametrize("size", [1, 2, 5, 1000])
def test_calls_arrive_as_openai_deltas_whatever_the_pieces(size: int) -> None:
    output, deltas = ToolOutput(), []
    for start in range(0, len(CALLS), size):
        deltas += output.push(CALLS[start : start + size])
    deltas += output.flush()
    firsts = [d["tool_calls"][0] for d in deltas if "id" in d["tool_calls"][0]]
    assert [(f["index"], f["type"], f["function"]["name"]) for f in firsts] == [
        (0, "function", "get_weather"),
        (1, "function", "get_time"),
    ]
    assert all(f["id"].startswith("call_") and len(f["id"]) == 29 for f in firsts)
    arguments = {0: "", 1: ""}
    for d in deltas:
        piece = d["tool_calls"][0]
        assert "index" in piece  # every piece names its call (clients break without it)
        arguments[piece["index"]] += piece["function"].get("arguments", "")
    expected = json.loads(CALLS)["tool_calls"]
    assert [json.loads(arguments[i]) for i in (0, 1)] == [c["arguments"] for c in expected]
    assert [c.arguments for c in output.calls] == [arguments[0], arguments[1]] and not output.content


@pytest.mark.parametrize("size", [1, 3, 1000])
def test_a_response_arrives_as_its_decoded_text(size: int) -> None:
    text = json.dumps({"response": 'Hi "there"\n—café \\ ok'}, separators=(",", ":"), ensure_ascii=True)
    output, deltas = ToolOutput(), []
    for start in range(0, len(text), size):
        deltas += output.push(text[start : start + size])
    assert (
        "".join(d["content"] for d in deltas) == 'Hi "there"\n—café \\ ok' == output.content
        and not output.calls
    )


def test_an_answer_cut_short_before_its_form_is_content() -> None:
    output = ToolOutput()
    assert output.push('{"tool_') == []
    assert output.flush() == [{"content": '{"tool_'}] and output.content == '{"tool_'


def _read(
    text: str, size: int, output: ToolOutput | None = None, cut: bool = False
) -> tuple[ToolOutput, list[dict[str, object]]]:
    output = output or ToolOutput()
    deltas = []
    for start in range(0, len(text), size):
        deltas += output.push(text[start : start + size])
    return output, deltas + output.flush(cut)


@pytest.mark.parametrize("size", [1, 2, 5, 7, 1000])
def test_an_escaped_surrogate_pair_is_one_character(size: int) -> None:
    """Issue 46: ``\\ud83d\\ude00`` was decoded half by half into two lone surrogates, which
    cut the stream (no error, no [DONE]) and made the whole answer a 500."""
    text = json.dumps({"response": "hi 😀 there 𝄞"}, separators=(",", ":"), ensure_ascii=True)
    assert "\\ud83d\\ude00" in text
    output, deltas = _read(text, size)
    assert (
        "".join(str(d["content"]) for d in deltas) == "hi 😀 there 𝄞" == output.content and output.is_complete
    )


@pytest.mark.parametrize(
    "escaped, shown",
    [
        ("a\\ud83d b", "a\ufffd b"),
        ("a\\ude00", "a\ufffd"),
        ("\\ud83d\\u0041", "\ufffdA"),
        ("\\ud83d\\ud83d\\ude00", "\ufffd😀"),
    ],
)
def test_a_lone_surrogate_is_the_replacement_character(escaped: str, shown: str) -> None:
    for size in (1, 3, 1000):
        output, _ = _read('{"response":"' + escaped + '"}', size)
        assert output.content == shown and output.is_complete
        output.content.encode("utf-8")  # text a response can carry


@pytest.mark.parametrize("value", [4, -2.5e3, 'abc " x \\', True, None, [1, {"a": "}"}], {"a": [1, "]"]}])
def test_a_response_with_a_schema_of_its_own_is_its_json(value: object) -> None:
    """Issue 46: an integer response kept the wrapper's closing brace (``'4}'``); a string one
    was decoded instead of being the JSON its schema describes."""
    raw = json.dumps(value, separators=(",", ":"))
    for size in (1, 2, 1000):
        output, deltas = _read('{"response":' + raw + "}", size, ToolOutput(raw_response=True))
        assert (
            output.content == raw == "".join(str(d["content"]) for d in deltas)
            and json.loads(output.content) == value
        )
        assert output.is_complete and not output.calls


def test_a_call_cut_by_max_tokens_is_never_text() -> None:
    """Issue 75: a call cut inside its name came back as message text beside the complete calls (``"content":
    "{\"name\":\"get_weather"``). It is dropped; one cut inside its arguments stays a call (finish_reason
    length); a response's own text keeps what was generated (issue 46)."""
    output, deltas = _read('{"tool_calls":[{"name":"get_w', 3, cut=True)
    assert not output.content and not output.calls and deltas == []
    output, deltas = _read('{"tool_calls":[{"name":"get_weather","arguments":{"city":"Par', 4, cut=True)
    assert (
        [c.name for c in output.calls] == ["get_weather"]
        and output.calls[0].arguments == '{"city":"Par'
        and not output.content
    )
    assert not output.is_complete
    for cut in (
        '{"tool_calls":[{"name":"get_time","arguments":{}},{"name":"get_w',
        '{"tool_calls":[{"name":"get_time","arguments":{}}',
        '{"tool_',
    ):
        output, deltas = _read(cut, 1000, cut=True)
        assert not output.content and all("content" not in d for d in deltas), cut
    assert [
        c.arguments
        for c in _read('{"tool_calls":[{"name":"get_time","arguments":{}},{"name":"get_w', 5, cut=True)[
            0
        ].calls
    ] == ["{}"]
    output, _ = _read('{"response":"Hello \\ud83d', 1000, cut=True)
    assert output.content == "Hello \\ud83d"  # the escape never completed: as generated
    output, _ = _read("not the format", 3, cut=True)
    assert output.content == "not the format"  # no grammar held it: text


def test_the_message_is_what_the_deltas_add_up_to() -> None:
    output, deltas = _read(CALLS, 4)
    message = message_of(deltas)
    assert message["content"] is None and [c["function"]["name"] for c in message["tool_calls"]] == [
        "get_weather",
        "get_time",
    ]
    assert [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]] == [
        c["arguments"] for c in json.loads(CALLS)["tool_calls"]
    ]
    assert [c["id"] for c in message["tool_calls"]] == [c.id for c in output.calls]
    assert message_of([{"content": "a"}, {"content": "b"}]) == {
        "role": "assistant",
        "content": "ab",
        "refusal": None,
    }
    assert message_of([]) == {"role": "assistant", "content": "", "refusal": None}
