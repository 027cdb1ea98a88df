"""Incremental detokenisation and stop strings."""

from __future__ import annotations

import json
from typing import Any

import pytest

from app.text import ChoiceText, IncrementalDetokenizer, StopMatcher, delta_text
from app.tools import ToolOutput, message_of
from core.runners import ModelRunner


@pytest.fixture(scope="module")
def tokenizer(tiny_runner_shared: ModelRunner) -> Any:
    return tiny_runner_shared.tokenizer


def test_pieces_add_up_to_the_whole_text(tokenizer: Any) -> None:
    text = "Héllo wörld — naïve café, 東京タワー 🗼 done."
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.push([t]) for t in ids] + [detok.flush()]
    assert "".join(pieces) == tokenizer.decode(ids)
    assert all("\ufffd" not in p for p in pieces)
    assert sum(1 for p in pieces if p) > 5  # it really streams


def test_multibyte_characters_are_never_split(tokenizer: Any) -> None:
    ids = tokenizer.encode("🗼🗼")
    assert len(ids) > 2  # byte-level BPE spreads an emoji over several tokens
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.push([t]) for t in ids]
    assert "".join(pieces) == "🗼🗼" and all(p in ("", "🗼", "🗼🗼") for p in pieces)


def test_special_tokens_are_not_shown(tokenizer: Any) -> None:
    detok = IncrementalDetokenizer(tokenizer)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert detok.push(tokenizer.encode("Hi") + [eos]) + detok.flush() == "Hi"


@pytest.mark.parametrize(
    "chunks, stops, expected, stopped",
    [
        (["Hello wor", "ld. END here"], ["END"], ["Hello wor", "ld. "], True),
        (["abc E", "N", "D more"], ["END"], ["abc ", "", ""], True),
        (["abc E", "N", "X"], ["END"], ["abc ", "", "ENX"], False),
        (["xx\n\n", "yy"], ["\n\n"], ["xx"], True),
        (["one", "two"], [], ["one", "two"], False),
        (["a STO", "P b"], ["STOP", "TOP!"], ["a ", ""], True),
    ],
)
def test_stop_strings_never_leak(
    chunks: list[str], stops: list[str], expected: list[str], stopped: bool
) -> None:
    matcher = StopMatcher(stops)
    out = []
    for chunk in chunks:
        out.append(matcher.push(chunk))
        if matcher.stopped:
            break
    assert out == expected and matcher.stopped is stopped
    tail = matcher.flush()
    assert all(s not in "".join(out) + tail for s in stops)


def test_held_back_text_comes_out_at_the_end() -> None:
    matcher = StopMatcher(["</end>"])
    assert matcher.push("result </e") == "result "
    assert matcher.flush() == "</e"


@pytest.mark.parametrize("round_size", [1, 3])
def test_a_long_answer_costs_linear_decoding(tokenizer: Any, round_size: int) -> None:
    """A 2,000-token stream: the tokens passed to the tokenizer grow as O(n) (vLLM's prefix /
    read offsets), not O(n²) — counted, not timed; the text is still the whole decode."""
    text = " ".join(f"Line {i}: naïve café 東京 🗼 and more words." for i in range(200))
    ids = tokenizer.encode(text)[:2000]
    assert len(ids) == 2000
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.push(ids[i : i + round_size]) for i in range(0, len(ids), round_size)] + [detok.flush()]
    assert "".join(pieces) == tokenizer.decode(ids)
    assert detok.num_decoded <= 6 * len(ids), detok.num_decoded  # re-decoding everything: ~n²/2 = 2,000,000


def _read_all(
    reader: ChoiceText, tokenizer: Any, text: str, reason: str = "stop"
) -> tuple[list[dict[str, Any]], str]:
    deltas: list[dict[str, Any]] = []
    for token in tokenizer.encode(text):
        deltas += reader.push([token])
        if reader.stopped:
            break
    tail, finish = reader.finish("stop" if reader.stopped else reason)
    return deltas + tail, finish


def test_stop_strings_do_not_cut_a_tool_call(tokenizer: Any) -> None:
    """Issue 46: a stop string matching inside the call's JSON cut it, and the cut call was still
    reported with arguments that do not parse. Stop strings apply to free text only."""
    calls = '{"tool_calls":[{"name":"get_weather","arguments":{"city":"Paris. STOP here"}}]}'
    deltas, finish = _read_all(
        ChoiceText(tokenizer, ["STOP", "."], tools=ToolOutput(), grammar=True), tokenizer, calls
    )
    message = message_of(deltas)
    assert finish == "tool_calls" and json.loads(message["tool_calls"][0]["function"]["arguments"]) == {
        "city": "Paris. STOP here"
    }
    answer = '{"response":"It is sunny. STOP now"}'
    deltas, finish = _read_all(
        ChoiceText(tokenizer, ["STOP"], tools=ToolOutput(), grammar=True), tokenizer, answer
    )
    assert (
        finish == "stop"
        and message_of(deltas)["content"] == "It is sunny. "
        and "tool_calls" not in message_of(deltas)
    )


def test_stop_strings_do_not_cut_what_a_schema_writes(tokenizer: Any) -> None:
    text = '{"a":"x, y"}'
    deltas, finish = _read_all(ChoiceText(tokenizer, [","], grammar=True), tokenizer, text)
    assert finish == "stop" and delta_text(deltas) == text  # the grammar ended it; the schema's JSON is whole
    deltas, finish = _read_all(ChoiceText(tokenizer, [","]), tokenizer, text)
    assert finish == "stop" and delta_text(deltas) == '{"a":"x'  # free text: cut


def test_a_call_cut_by_max_tokens_is_reported_as_it_is(tokenizer: Any) -> None:
    """Issue 46: the text of an answer cut inside a call was lost; now the partial call comes
    with finish_reason length. Issue 75: a cut before the call's name is not text either (it was
    its JSON, as content): nothing."""
    deltas, finish = _read_all(
        ChoiceText(tokenizer, [], tools=ToolOutput(), grammar=True),
        tokenizer,
        '{"tool_calls":[{"name":"get_weather","arguments":{"ci',
        "length",
    )
    assert finish == "length" and message_of(deltas)["tool_calls"][0]["function"] == {
        "name": "get_weather",
        "arguments": '{"ci',
    }
    deltas, finish = _read_all(
        ChoiceText(tokenizer, [], tools=ToolOutput(), grammar=True),
        tokenizer,
        '{"tool_calls":[{"na',
        "length",
    )
    assert finish == "length" and message_of(deltas) == {"role": "assistant", "content": "", "refusal": None}
