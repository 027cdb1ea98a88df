"""Tools in the chat template's own format (app.tool_formats), over the built-in model's vocabulary: each family's template
(tests/data/chat_templates, written from the format each family renders) is recognised and renders tools, calls and
results as the family does; the lazy grammar leaves free text free and holds a call to its tool's parameters, from the
first token when a call is required; the reader turns an answer into OpenAI's deltas, and never streams a piece of a
trigger as text. End to end on the real model, every mode: tests/integration/test_tool_formats_real.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from app.text import ChoiceText
from app.tool_formats import STYLES, NativeToolOutput, ToolFormat, detect, native_grammar, template_messages, template_tools
from app.tools import Tool, message_of
from core.grammar import GrammarKind, Grammars, GrammarSpec
from core.runners import ModelRunner

TEMPLATES = Path(__file__).resolve().parents[1] / "data" / "chat_templates"
FAMILIES = [ToolFormat.HERMES, ToolFormat.LLAMA3_JSON, ToolFormat.MISTRAL]
WEATHER = Tool("get_weather", "The weather in a city.", {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]})
TIME = Tool("get_time", "The time in a zone.", {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]})
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "call_abc", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_abc", "content": "18 C"},
    {"role": "user", "content": "And Rome?"},
]


def template(fmt: ToolFormat) -> str:
    return (TEMPLATES / f"{fmt.value}.jinja").read_text()


def call_text(fmt: ToolFormat, *calls: tuple[str, dict[str, Any]]) -> str:
    """Calls written as ``fmt`` writes them (the JSON as the templates render it)."""
    style = STYLES[fmt]
    objects = [json.dumps({"name": name, style.args_key: arguments}) for name, arguments in calls]
    after = style.after_trigger[0]
    return style.trigger + after + (style.separator or "").join(objects) + style.end


@pytest.fixture(scope="module")
def grammars(builtin_llama_shared: ModelRunner) -> Grammars:
    info = builtin_llama_shared.info
    return Grammars(builtin_llama_shared.tokenizer, info.vocab_size, info.eos_ids)


def test_each_familys_template_is_recognised_and_the_rest_are_generic(builtin_llama_shared: ModelRunner) -> None:
    assert [detect(template(fmt)) for fmt in FAMILIES] == FAMILIES
    assert detect(builtin_llama_shared.tokenizer.chat_template) is ToolFormat.GENERIC  # the built-in model's: no tool syntax
    assert detect(None) is ToolFormat.GENERIC and detect("{{ '<tool_call>' }}") is ToolFormat.GENERIC


@pytest.mark.parametrize("fmt, marks", [
    (ToolFormat.HERMES, ["<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"get_weather\"", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
                         "<tool_response>\n18 C\n</tool_response>", "<|im_start|>assistant\n"]),
    (ToolFormat.LLAMA3_JSON, ["Environment: ipython", '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>',
                              "<|start_header_id|>ipython<|end_header_id|>\n\n18 C<|eot_id|>", "<|start_header_id|>assistant<|end_header_id|>\n\n"]),
    (ToolFormat.MISTRAL, ['[AVAILABLE_TOOLS] [{"type": "function"', '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "',
                          '[TOOL_RESULTS] {"content": "18 C", "call_id": "', "And Rome?[/INST]"]),
])
def test_a_familys_template_renders_tools_calls_and_results_as_the_family_does(builtin_llama_shared: ModelRunner, fmt: ToolFormat, marks: list[str]) -> None:
    tokenizer = builtin_llama_shared.tokenizer
    text = tokenizer.apply_chat_template(
        template_messages(CONVERSATION, fmt), tools=template_tools([WEATHER]), chat_template=template(fmt), tokenize=False, add_generation_prompt=True,
    )
    for mark in marks:
        assert mark in text, (mark, text)
    if fmt is ToolFormat.MISTRAL:  # its template takes ids of nine letters and digits: the call's and the result's agree
        ids = [text.split(key, 1)[1][:9] for key in ('"id": "', '"call_id": "')]
        assert ids[0] == ids[1] and ids[0].isalnum()
        with pytest.raises(Exception, match="length 9"):
            tokenizer.apply_chat_template(CONVERSATION, tools=template_tools([WEATHER]), chat_template=template(fmt), tokenize=False)


@pytest.mark.parametrize("fmt", FAMILIES)
def test_the_lazy_grammar_leaves_text_free_and_holds_calls_to_their_parameters(grammars: Grammars, builtin_llama_shared: ModelRunner, fmt: ToolFormat) -> None:
    tokenizer, eos = builtin_llama_shared.tokenizer, builtin_llama_shared.info.eos_ids[0]

    def walk(source: str, text: str) -> tuple[bool, bool]:
        matcher = grammars.compile(GrammarSpec(GrammarKind.GRAMMAR, source)).matcher()
        taken = all(matcher.consume(token) for token in tokenizer.encode(text))
        return taken, taken and bool(matcher.allowed()[eos])

    lazy = native_grammar(fmt, [WEATHER, TIME], required=False, parallel=True)
    good = call_text(fmt, ("get_weather", {"city": "Paris"}))
    assert walk(lazy, "It is sunny today, I think.") == (True, True)  # free text, and it may end
    assert walk(lazy, good) == (True, True)
    assert walk(lazy, call_text(fmt, ("get_weather", {"city": 7}))) == (False, False)  # arguments follow the parameters
    assert walk(lazy, call_text(fmt, ("get_time", {"zone": "PST"}))) == (False, False)
    assert walk(lazy, call_text(fmt, ("launch", {}))) == (False, False)  # only the tools given
    assert walk(lazy, good[:-3])[1] is False  # an unfinished call cannot end
    matcher = grammars.compile(GrammarSpec(GrammarKind.GRAMMAR, lazy)).matcher()
    for token in tokenizer.encode("Let me see"):
        assert matcher.consume(token)
    allowed = int(matcher.allowed().sum())
    assert allowed >= 0.99 * builtin_llama_shared.info.vocab_size, allowed  # free text is free: nearly every token
    required = native_grammar(fmt, [WEATHER], required=True, parallel=False)
    assert walk(required, "It is sunny.")[0] is False and walk(required, good) == (True, True)
    if fmt is not ToolFormat.LLAMA3_JSON:  # Llama 3.1 calls one tool an answer
        assert walk(lazy, "Two: " * (fmt is ToolFormat.HERMES) + call_text(fmt, ("get_weather", {"city": "Paris"}), ("get_time", {"zone": "UTC"}))) == (True, True)
        assert walk(required, call_text(fmt, ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})))[0] is False  # parallel_tool_calls: false


def _read(tokenizer: Any, fmt: ToolFormat, text: str, reason: str = "stop", step: int = 1) -> tuple[list[list[dict[str, Any]]], str]:
    """The deltas of each push of ``step`` tokens, and the finish reason."""
    reader = ChoiceText(tokenizer, [], tools=NativeToolOutput(style=STYLES[fmt]), grammar=True)
    tokens = tokenizer.encode(text)
    pushes = [reader.push(tokens[i : i + step]) for i in range(0, len(tokens), step)]
    tail, finish = reader.finish(reason)
    return [*pushes, tail], finish


@pytest.mark.parametrize("fmt", FAMILIES)
def test_the_reader_turns_an_answer_into_openais_deltas_and_never_streams_a_trigger(builtin_llama_shared: ModelRunner, fmt: ToolFormat) -> None:
    tokenizer = builtin_llama_shared.tokenizer
    prose = "" if fmt is ToolFormat.LLAMA3_JSON else "Let me check. "
    calls = [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "UTC"})][: 1 if fmt is ToolFormat.LLAMA3_JSON else 2]
    text = prose + call_text(fmt, *calls)
    for step in (1, 3, 1000):
        pushes, finish = _read(tokenizer, fmt, text, step=step)
        message = message_of([d for push in pushes for d in push])
        assert finish == "tool_calls"
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == calls
        assert all(c["id"].startswith("call_") for c in message["tool_calls"])
        assert (message["content"] or "") == prose
        streamed = "".join(d.get("content", "") for push in pushes for d in push)
        assert STYLES[fmt].trigger[:2] not in streamed or not STYLES[fmt].trigger  # no piece of the trigger became text
    pushes, finish = _read(tokenizer, fmt, "Plain words, no call.")
    assert finish == "stop" and message_of([d for p in pushes for d in p]) == {"role": "assistant", "content": "Plain words, no call.", "refusal": None}


def test_a_possible_trigger_is_held_back_until_it_is_one_or_is_not() -> None:
    reader = NativeToolOutput(style=STYLES[ToolFormat.HERMES])
    assert reader.push("Sure <tool_ca") == [{"content": "Sure "}]  # "<tool_ca" may start a call: held
    assert reader.push("t is a cat") == [{"content": "<tool_cat is a cat"}]  # it did not
    assert reader.push(" <") == [{"content": " "}]
    assert reader.flush() == [{"content": "<"}]  # the end: what was held is text
    reader = NativeToolOutput(style=STYLES[ToolFormat.MISTRAL])
    assert reader.push("[TOOL_") == [] and reader.push("CALLS] [") == []
    started = reader.push('{"name": "get_weather", "arguments": {"ci')
    assert started == [{"tool_calls": [{"index": 0, "id": started[0]["tool_calls"][0]["id"], "type": "function", "function": {"name": "get_weather", "arguments": '{"ci'}}]}]


def test_a_call_cut_by_max_tokens_is_reported_as_it_is(builtin_llama_shared: ModelRunner) -> None:
    pushes, finish = _read(builtin_llama_shared.tokenizer, ToolFormat.HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"ci', reason="length")
    message = message_of([d for p in pushes for d in p])
    assert finish == "length" and message["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"ci'}


def test_what_the_counter_example_hunt_found_stays_fixed() -> None:
    """A Llama call that arrives in one piece is read at once; a trigger that does not go on as a call is text, trigger and all;
    a call cut by max_tokens, before its name or after a complete one, is never text (issue 75)."""
    reader = NativeToolOutput(style=STYLES[ToolFormat.LLAMA3_JSON])
    whole = reader.push('{"name": "get_time", "parameters": {}}')
    assert whole and whole[0]["tool_calls"][0]["function"] == {"name": "get_time", "arguments": "{}"}
    reader = NativeToolOutput(style=STYLES[ToolFormat.HERMES])
    assert message_of(reader.push("see <tool_call> tag") + reader.flush())["content"] == "see <tool_call> tag"
    reader = NativeToolOutput(style=STYLES[ToolFormat.HERMES])
    deltas = reader.push('x<tool_call>\n{"name": "ge') + reader.flush(cut=True)
    assert message_of(deltas) == {"role": "assistant", "content": "x", "refusal": None}
    for fmt, cut in [(ToolFormat.HERMES, '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n{"na'), (ToolFormat.MISTRAL, '[TOOL_CALLS] [{"name": "a", "arguments": {}}, {"name'), (ToolFormat.MISTRAL, "[TOOL_CALLS] ")]:
        reader = NativeToolOutput(style=STYLES[fmt])
        message = message_of(reader.push(cut) + reader.flush(cut=True))
        assert message["content"] is None or message["content"] == "", (fmt, cut, message)
