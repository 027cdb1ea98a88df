"""Issue 75: where a family's marker is one special token (Mistral's ``[TOOL_CALLS]``, Llama 3's
``<|python_tag|>``), the grammar wrote it as a string: llguidance masked the trained token and made the model
spell the marker out of ordinary pieces, and the detokenizer skipped special tokens, so the reader never saw
it. On the real tokenizers the packages ship (tests/tokenizers.py): the grammar allows the marker as its token
and never spelled, and the reader reads it by id. Mistral's Tekken in the default run; Llama 3's (8 s more to
load) with SPECGATE_FULL_STATISTICS."""

from __future__ import annotations

import json
from typing import Any

import pytest

from app.reasoning import ReasoningSplitter, Thinking, after_reasoning
from app.text import ChoiceText
from app.tool_formats import FORMATS, Markers
from app.tools import Tool, message_of
from core.grammar import GrammarKind, Grammars, GrammarSpec
from tests.app.helpers import FULL_RUN
from tests.tokenizers import llama3, tekken

WEATHER = Tool(
    "get_weather",
    "The weather in a city.",
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]},
)
CALL = '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'


@pytest.fixture(scope="module")
def mistral() -> tuple[Any, Grammars, Markers]:
    tokenizer = tekken()
    markers = Markers.of(tokenizer, FORMATS["mistral"].markers)
    return tokenizer, Grammars(tokenizer, len(tokenizer), [tokenizer.eos_token_id]), markers


def _walk(grammars: Grammars, source: str, tokens: list[int]) -> tuple[bool, Any]:
    matcher = grammars.compile(GrammarSpec(GrammarKind.GRAMMAR, source)).matcher()
    return all(matcher.consume(t) for t in tokens), matcher


def test_the_marker_is_its_token_in_the_grammar_and_never_spelled(
    mistral: tuple[Any, Grammars, Markers],
) -> None:
    tokenizer, grammars, markers = mistral
    assert (
        markers.ids == {"[TOOL_CALLS]": 9}
        and 9 not in markers.skipped
        and tokenizer.eos_token_id in markers.skipped
    )
    spelled = tokenizer.encode("[TOOL_CALLS]", add_special_tokens=False, split_special_tokens=True)
    assert 9 not in spelled and len(spelled) > 1  # the marker's text, out of ordinary pieces
    body = tokenizer.encode(CALL, add_special_tokens=False)
    fmt = FORMATS["mistral"]
    required = fmt.grammar([WEATHER], required=True, parallel=False, markers=markers)
    assert "<[9]>" in required
    matcher = grammars.compile(GrammarSpec(GrammarKind.GRAMMAR, required)).matcher()
    allowed = matcher.allowed()
    assert allowed[9] and not allowed[spelled[0]]  # the token, and only it
    taken, end = _walk(grammars, required, [9, *body])
    assert taken and end.allowed()[tokenizer.eos_token_id]
    assert not _walk(grammars, required, spelled + body)[0]
    lazy = fmt.grammar([WEATHER], required=False, parallel=True, markers=markers)
    prose = tokenizer.encode("Let me check. ", add_special_tokens=False)
    taken, end = _walk(grammars, lazy, prose)
    # free text may end, or call by the token
    assert taken and end.allowed()[9] and end.allowed()[tokenizer.eos_token_id]
    assert _walk(grammars, lazy, [*prose, 9, *body])[0]
    # the spelling is not free text either: a reader could take it for a call
    assert not _walk(grammars, lazy, prose + spelled)[0]
    # the marker as a string: the bug
    broken = FORMATS["mistral"].grammar([WEATHER], required=True, parallel=False, markers=Markers())
    assert not _walk(grammars, broken, [9, *body])[0] and _walk(grammars, broken, spelled + body)[0]


def test_the_reader_reads_the_marker_by_its_token(mistral: tuple[Any, Grammars, Markers]) -> None:
    tokenizer, _, markers = mistral
    tokens = [
        *tokenizer.encode("Let me check. ", add_special_tokens=False),
        9,
        *tokenizer.encode(CALL, add_special_tokens=False),
    ]

    def read(skipped: frozenset[int] | None) -> tuple[dict[str, Any], str]:
        text = ChoiceText(
            tokenizer, [], tools=FORMATS["mistral"].reader(markers, {}), grammar=True, skipped=skipped
        )
        deltas = [d for token in tokens for d in text.push([token])]
        tail, finish = text.finish("stop")
        return message_of(deltas + tail), finish

    message, finish = read(markers.skipped)
    assert finish == "tool_calls" and message["content"] == "Let me check. "
    assert [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]
    ] == [("get_weather", {"city": "Paris"})]
    skipped, _ = read(None)  # every special token skipped, as before: the call is lost into the text
    assert "tool_calls" not in skipped and '"get_weather"' in skipped["content"]


def test_a_lead_marker_that_is_a_special_token_opens_a_call() -> None:
    """The reader's side of Llama 3's <|python_tag|> (its id given: the real tokenizer is the next test's, in
    the full run)."""
    fmt = FORMATS["llama3_json"]
    markers = Markers({"<|python_tag|>": 128010})
    reader = fmt.reader(markers, {})
    message = message_of(
        reader.push('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}') + reader.flush()
    )
    assert not message["content"] and message["tool_calls"][0]["function"]["name"] == "get_weather"
    assert "<[128010]>? call" in fmt.grammar([WEATHER], required=True, parallel=False, markers=markers)


@FULL_RUN
def test_llama3s_python_tag_is_its_token_before_a_call() -> None:
    tokenizer = llama3()
    grammars = Grammars(tokenizer, len(tokenizer), [tokenizer.convert_tokens_to_ids("<|eot_id|>")])
    fmt = FORMATS["llama3_json"]
    markers = Markers.of(tokenizer, fmt.markers)
    tag = markers.ids["<|python_tag|>"]
    assert tag == 128010
    call = tokenizer.encode(
        '{"name": "get_weather", "parameters": {"city": "Paris"}}', add_special_tokens=False
    )
    source = fmt.grammar([WEATHER], required=True, parallel=False, markers=markers)
    assert _walk(grammars, source, [tag, *call])[0] and _walk(grammars, source, call)[0]
    assert not _walk(
        grammars,
        source,
        tokenizer.encode("<|python_tag|>", add_special_tokens=False, split_special_tokens=True) + call,
    )[0]
    text = ChoiceText(tokenizer, [], tools=fmt.reader(markers, {}), grammar=True, skipped=markers.skipped)
    deltas = [d for token in [tag, *call] for d in text.push([token])]
    tail, finish = text.finish("stop")
    message = message_of(deltas + tail)
    assert (
        finish == "tool_calls"
        and not message["content"]
        and message["tool_calls"][0]["function"]["name"] == "get_weather"
    )


def test_thinking_markers_that_are_special_tokens_are_their_tokens(
    mistral: tuple[Any, Grammars, Markers],
) -> None:
    """Magistral's [THINK] / [/THINK] are special tokens; the packages ship no tokenizer with them, so two of
    Tekken's control tokens stand in: the reasoning ends with the closing token (never its spelling), and is
    read apart."""
    tokenizer, grammars, _ = mistral
    thinking = Thinking("[INST]", "[/INST]")
    markers = Markers.of(tokenizer, (thinking.open, thinking.close))
    opened, closed = markers.ids[thinking.open], markers.ids[thinking.close]
    schema = GrammarSpec.json_schema(
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    )
    wrapped = after_reasoning(schema, thinking, markers=markers)
    assert wrapped is not None and f"<[{closed}]>" in wrapped.source
    thought, reply = (
        tokenizer.encode("I think so.", add_special_tokens=False),
        tokenizer.encode('\n\n{"a":1}', add_special_tokens=False),
    )
    assert _walk(grammars, wrapped.source, [opened, *thought, closed, *reply])[0]
    spelled = tokenizer.encode(thinking.close, add_special_tokens=False, split_special_tokens=True)
    assert not _walk(grammars, wrapped.source, [opened, *thought, *spelled, *reply])[0]
    text = ChoiceText(
        tokenizer, [], grammar=True, reasoning=ReasoningSplitter(thinking), skipped=markers.skipped
    )
    deltas = [d for token in [opened, *thought, closed, *reply] for d in text.push([token])]
    tail, _ = text.finish("stop")
    message = message_of(deltas + tail)
    assert message["reasoning_content"] == "I think so." and message["content"] == '{"a":1}'
