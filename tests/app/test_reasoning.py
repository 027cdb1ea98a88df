"""Reasoning output (app.reasoning): a template that marks thinking is recognised; an answer is split into its
reasoning and its reply as it streams, with no marker ever streamed; a grammar (a schema, tools) holds the
reply after the reasoning, which stays free; chat answers carry ``reasoning_content``, the Responses API a
``reasoning`` item, both in OpenAI's schema; ``draft.reasoning: off`` leaves the reasoning in the text."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from app.reasoning import ReasoningSplitter, Thinking, after_reasoning, opens_thinking, thinking_markers
from app.text import ChoiceText
from app.tool_formats import FORMATS, Markers
from app.tools import Tool, message_of
from core.grammar import GrammarKind, Grammars, GrammarSpec
from core.runners import ModelRunner
from tests.app.conftest import Gateway
from tests.app.helpers import sse_events
from tests.app.test_openai_schema import check, event_schemas

TEMPLATES = Path(__file__).resolve().parents[1] / "data" / "chat_templates"
THINK = Thinking("<think>", "</think>")


def test_a_thinking_template_is_recognised_and_its_prompt_opens_the_reasoning(
    builtin_llama_shared: ModelRunner,
) -> None:
    template = (TEMPLATES / "thinking.jinja").read_text()
    assert thinking_markers(template) == THINK
    assert (
        thinking_markers(builtin_llama_shared.tokenizer.chat_template) is None
        and thinking_markers(None) is None
    )
    prompt = builtin_llama_shared.tokenizer.apply_chat_template(
        [{"role": "user", "content": "2+2?"}],
        chat_template=template,
        tokenize=False,
        add_generation_prompt=True,
    )
    assert opens_thinking(prompt, THINK).inside is True
    assert opens_thinking("<|im_start|>assistant\n", THINK).inside is False
    assert opens_thinking("<think>x</think>\n<|im_start|>assistant\n", THINK).inside is False


def _split(
    tokenizer: Any, text: str, thinking: Thinking, reason: str = "stop"
) -> tuple[list[dict[str, Any]], ChoiceText]:
    reader = ChoiceText(tokenizer, [], reasoning=ReasoningSplitter(thinking))
    deltas = [d for token in tokenizer.encode(text) for d in reader.push([token])]
    tail, _ = reader.finish(reason)
    return deltas + tail, reader


@pytest.mark.parametrize(
    "thinking, text",
    [
        (THINK, "<think>\nLet me add: 2 and 2.\n</think>\n\nIt is 4."),
        (Thinking("<think>", "</think>", inside=True), "Let me add: 2 and 2.</think>It is 4."),
        (Thinking("[THINK]", "[/THINK]"), "  [THINK]Let me add: 2 and 2.[/THINK]\nIt is 4."),
    ],
)
def test_an_answer_is_split_into_its_reasoning_and_its_reply_token_by_token(
    builtin_llama_shared: ModelRunner, thinking: Thinking, text: str
) -> None:
    tokenizer = builtin_llama_shared.tokenizer
    deltas, reader = _split(tokenizer, text, thinking)
    message = message_of(deltas)
    assert message["content"] == "It is 4." and message["reasoning_content"].strip() == "Let me add: 2 and 2."
    assert not any(
        mark in d.get("reasoning_content", "") + d.get("content", "")
        for d in deltas
        for mark in (thinking.open, thinking.close, thinking.close[:3])
    )
    reply = len(tokenizer.encode(text.rpartition(thinking.close)[2].lstrip()))
    assert 0 < reader.reasoning_tokens <= len(tokenizer.encode(text)) - reply + 1


def test_an_answer_without_reasoning_is_all_reply_and_reasoning_cut_short_stays_reasoning(
    builtin_llama_shared: ModelRunner,
) -> None:
    tokenizer = builtin_llama_shared.tokenizer
    deltas, reader = _split(tokenizer, "Just the answer, <thin king>.", THINK)
    assert (
        message_of(deltas)
        == {"role": "assistant", "content": "Just the answer, <thin king>.", "refusal": None}
        and reader.reasoning_tokens == 0
    )
    deltas, _ = _split(tokenizer, "<think>Still thinking about </th", THINK, reason="length")
    assert (
        message_of(deltas)["reasoning_content"] == "Still thinking about </th"
        and message_of(deltas)["content"] == ""
    )
    splitter = ReasoningSplitter(THINK)
    assert (
        splitter.push(" <thi") == ("", "")
        and splitter.push("nk>a</") == ("a", "")
        and splitter.push("think>\n\nb") == ("", "b")
    )


@pytest.fixture(scope="module")
def grammars(builtin_llama_shared: ModelRunner) -> Grammars:
    info = builtin_llama_shared.info
    return Grammars(builtin_llama_shared.tokenizer, info.vocab_size, info.eos_ids)


def test_a_grammar_holds_the_reply_after_the_reasoning_which_stays_free(
    grammars: Grammars, builtin_llama_shared: ModelRunner
) -> None:
    tokenizer, eos, size = (
        builtin_llama_shared.tokenizer,
        builtin_llama_shared.info.eos_ids[0],
        builtin_llama_shared.info.vocab_size,
    )

    def walk(spec: GrammarSpec, text: str) -> tuple[bool, bool, int]:
        matcher = grammars.compile(spec).matcher()
        taken = all(matcher.consume(token) for token in tokenizer.encode(text))
        return taken, taken and bool(matcher.allowed()[eos]), int(matcher.allowed().sum()) if taken else 0

    schema = GrammarSpec.json_schema(
        {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    )
    wrapped = after_reasoning(schema, THINK)
    assert wrapped is not None
    assert walk(wrapped, '<think>any { text "here</think>\n{"ok":true}')[:2] == (True, True)
    assert walk(wrapped, '{"ok":false}')[:2] == (True, True)  # no reasoning at all
    assert walk(wrapped, "<think>x</think>\nnot json")[0] is False  # the reply follows the schema
    assert walk(wrapped, "<think>let me see")[2] >= 0.99 * size  # the reasoning is free
    opened = after_reasoning(schema, Thinking("<think>", "</think>", inside=True))
    assert (
        opened is not None
        and walk(opened, 'well</think>{"ok":true}')[:2] == (True, True)
        and walk(opened, '{"ok":true}')[1] is False
    )
    tool = Tool(
        "get_weather",
        "",
        {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    )
    tools = after_reasoning(
        GrammarSpec(
            GrammarKind.GRAMMAR,
            FORMATS["hermes"].grammar([tool], required=True, parallel=False, markers=Markers()),
        ),
        THINK,
        own=True,
    )
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert tools is not None and walk(tools, "<think>I should call it.</think>\n" + call)[:2] == (True, True)
    assert walk(tools, "<think>I should call it.</think>\nNo.")[0] is False
    choice = after_reasoning(GrammarSpec(GrammarKind.CHOICE, json.dumps(["yes", "no"])), THINK)
    assert (
        choice is not None
        and walk(choice, "<think>hmm</think>yes")[:2] == (True, True)
        and walk(choice, "<think>hmm</think>maybe")[0] is False
    )
    # GBNF: applies from the first token
    assert after_reasoning(GrammarSpec(GrammarKind.GRAMMAR, 'root ::= "a"'), THINK) is None
    # a request's Lark: not ours to rename
    assert after_reasoning(GrammarSpec(GrammarKind.GRAMMAR, 'start: answer\nanswer: "yes"'), THINK) is None
    # from the counter-example hunt: no reasoning, no leading blank lines the grammar alone forbids; a schema
    # of true; a regex with a slash
    assert walk(choice, "\n\nyes")[0] is False
    llama = after_reasoning(
        GrammarSpec(
            GrammarKind.GRAMMAR,
            FORMATS["llama3_json"].grammar([tool], required=True, parallel=False, markers=Markers()),
        ),
        THINK,
        own=True,
    )
    assert (
        llama is not None
        and walk(llama, '\n{"name": "get_weather", "parameters": {"city": "Rome"}}')[0] is False
    )
    anything = after_reasoning(GrammarSpec.json_schema(True), THINK)
    assert anything is not None and walk(anything, "<think>x</think>[1,2]")[:2] == (True, True)
    assert after_reasoning(GrammarSpec.json_schema(False), THINK) is None
    slash = after_reasoning(GrammarSpec(GrammarKind.REGEX, "[0-9]+/[0-9]+"), THINK)
    assert slash is not None and walk(slash, "<think>x</think>3/4")[:2] == (True, True)


async def test_chat_and_responses_carry_the_reasoning_apart_and_off_leaves_it_in_the_text(
    gateway: Gateway,
) -> None:
    """Over fake workers (their text is noise): the thinking template's prompt opens the reasoning, so an
    answer that never closes it is all reasoning — in reasoning_content, the reasoning item, and usage's
    reasoning tokens."""
    body = {
        "model": "test-model",
        "messages": [{"role": "user", "content": "2+2?"}],
        "max_tokens": 5,
        "seed": 3,
    }
    draft = {"chat_template": str(TEMPLATES / "thinking.jinja")}
    async with gateway(draft=draft) as client:
        chat = (await client.post("/v1/chat/completions", json=body)).json()
        check(chat, "CreateChatCompletionResponse")
        message = chat["choices"][0]["message"]
        assert (
            message["content"] == ""
            and message["reasoning_content"]
            and "</think>" not in message["reasoning_content"]
        )
        assert chat["usage"]["completion_tokens_details"] == {"reasoning_tokens": 5}
        chunks = sse_events((await client.post("/v1/chat/completions", json={**body, "stream": True})).text)[
            :-1
        ]
        for chunk in chunks:
            check(chunk, "CreateChatCompletionStreamResponse")
        assert (
            "".join(c["choices"][0]["delta"].get("reasoning_content", "") for c in chunks)
            == message["reasoning_content"]
        )
        response = (
            await client.post(
                "/v1/responses",
                json={"model": "test-model", "input": "2+2?", "max_output_tokens": 5, "seed": 3},
            )
        ).json()
        check(response, "Response")
        assert (
            response["output"][0]["type"] == "reasoning"
            and response["output"][0]["content"][0]["text"] == message["reasoning_content"]
        )
        assert response["usage"]["output_tokens_details"]["reasoning_tokens"] == 5
        stream = sse_events(
            (
                await client.post(
                    "/v1/responses",
                    json={
                        "model": "test-model",
                        "input": "2+2?",
                        "max_output_tokens": 5,
                        "seed": 3,
                        "stream": True,
                    },
                )
            ).text
        )
        for event in stream:
            check(event, event_schemas()[event["type"]])
        assert (
            "".join(e["delta"] for e in stream if e["type"] == "response.reasoning_text.delta")
            == message["reasoning_content"]
        )
    async with gateway(draft={**draft, "reasoning": "off"}) as client:
        plain = (await client.post("/v1/chat/completions", json=body)).json()["choices"][0]["message"]
        assert plain["content"] == message["reasoning_content"] and "reasoning_content" not in plain
