"""Tools in the chat template's own format (app.tool_formats, one registered class a family), over the
built-in model's vocabulary: each family's template (tests/data/chat_templates, written from the format each
family renders) is recognised, in llama.cpp's order, and renders tools, calls and results as the family does;
the lazy grammar leaves free text free and holds a call to its tool's parameters, from the first token when a
call is required; the reader turns an answer into OpenAI's deltas, and never streams a piece of a trigger as
text. Markers that are special tokens, on real tokenizers: tests/app/test_special_markers.py. End to end on
the real model, every mode: tests/integration/test_tool_formats_real.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from app.text import ChoiceText
from app.tool_formats import (
    FORMATS,
    GENERIC,
    Markers,
    NativeToolOutput,
    ToolFormat,
    by_name,
    detect,
    template_tools,
)
from app.tool_formats.json_calls import JsonCallFormat
from app.tools import Tool, message_of
from core.errors import ConfigError
from core.grammar import GrammarKind, Grammars, GrammarSpec
from core.runners import ModelRunner

TEMPLATES = Path(__file__).resolve().parents[1] / "data" / "chat_templates"
HERMES, LLAMA3, MISTRAL, MISTRAL_ARGS, QWEN3_CODER = (
    FORMATS[n] for n in ("hermes", "llama3_json", "mistral", "mistral_args", "qwen3_coder")
)
FAMILIES = [HERMES, LLAMA3, MISTRAL, MISTRAL_ARGS, QWEN3_CODER]
WEATHER = Tool(
    "get_weather",
    "The weather in a city.",
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]},
)
TIME = Tool(
    "get_time",
    "The time in a zone.",
    {
        "type": "object",
        "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
        "required": ["zone"],
    },
)
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_abc",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_abc", "content": "18 C"},
    {"role": "user", "content": "And Rome?"},
]


def template(fmt: ToolFormat) -> str:
    return (TEMPLATES / f"{fmt.name}.jinja").read_text()


def call_text(fmt: ToolFormat, *calls: tuple[str, dict[str, Any]]) -> str:
    """Calls written as ``fmt`` writes them (the JSON as the templates render it)."""
    if fmt is MISTRAL_ARGS:
        return "".join(f"[TOOL_CALLS]{name}[ARGS]{json.dumps(arguments)}" for name, arguments in calls)
    if fmt is QWEN3_CODER:

        def value(v: Any) -> str:
            return json.dumps(v) if isinstance(v, dict | list) else str(v)

        return "\n".join(
            "<tool_call>\n<function="
            + name
            + ">\n"
            + "".join(f"<parameter={k}>\n{value(v)}\n</parameter>\n" for k, v in arguments.items())
            + "</function>\n</tool_call>"
            for name, arguments in calls
        )
    assert isinstance(fmt, JsonCallFormat)
    style = fmt.style
    objects = [json.dumps({"name": name, style.args_key: arguments}) for name, arguments in calls]
    after = style.after_trigger[0]
    return style.trigger + after + (style.separator or "").join(objects) + style.end


def reader(fmt: ToolFormat) -> Any:
    return fmt.reader(Markers(), {t.name: t.parameters for t in (WEATHER, TIME)})


@pytest.fixture(scope="module")
def grammars(builtin_llama_shared: ModelRunner) -> Grammars:
    info = builtin_llama_shared.info
    return Grammars(builtin_llama_shared.tokenizer, info.vocab_size, info.eos_ids)


def test_each_familys_template_is_recognised_and_the_rest_are_generic(
    builtin_llama_shared: ModelRunner,
) -> None:
    """Qwen3-Coder's template holds <tool_call> too, and Mistral's v11 one [TOOL_CALLS]: each is told apart
    first."""
    assert [detect(template(fmt)) for fmt in FAMILIES] == FAMILIES
    # the built-in model's: no tool syntax
    assert detect(builtin_llama_shared.tokenizer.chat_template) is GENERIC
    assert detect(None) is GENERIC and detect("{{ '<tool_call>' }}") is GENERIC
    # the order detection tries
    assert list(FORMATS) == ["qwen3_coder", "hermes", "llama3_json", "mistral_args", "mistral", "generic"]


@pytest.mark.parametrize(
    "fmt, marks",
    [
        (
            HERMES,
            [
                '<tools>\n{"type": "function", "function": {"name": "get_weather"',
                '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
                "<tool_response>\n18 C\n</tool_response>",
                "<|im_start|>assistant\n",
            ],
        ),
        (
            LLAMA3,
            [
                "Environment: ipython",
                '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>',
                "<|start_header_id|>ipython<|end_header_id|>\n\n18 C<|eot_id|>",
                "<|start_header_id|>assistant<|end_header_id|>\n\n",
            ],
        ),
        (
            MISTRAL,
            [
                '[AVAILABLE_TOOLS] [{"type": "function"',
                '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "',
                '[TOOL_RESULTS] {"content": "18 C", "call_id": "',
                "And Rome?[/INST]",
            ],
        ),
        (
            MISTRAL_ARGS,
            [
                '[SYSTEM_PROMPT]Be brief.[/SYSTEM_PROMPT][AVAILABLE_TOOLS][{"type": "function"',
                '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}',
                "[TOOL_RESULTS]18 C[/TOOL_RESULTS]",
                "[INST]And Rome?[/INST]",
            ],
        ),
        (
            QWEN3_CODER,
            [
                "<function>\n<name>get_weather</name>",
                "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",
                "<tool_response>\n18 C\n</tool_response>",
                "<|im_start|>assistant\n",
            ],
        ),
    ],
)
def test_a_familys_template_renders_tools_calls_and_results_as_the_family_does(
    builtin_llama_shared: ModelRunner, fmt: ToolFormat, marks: list[str]
) -> None:
    tokenizer = builtin_llama_shared.tokenizer
    text = tokenizer.apply_chat_template(
        fmt.template_messages(CONVERSATION),
        tools=template_tools([WEATHER]),
        chat_template=template(fmt),
        tokenize=False,
        add_generation_prompt=True,
    )
    for mark in marks:
        assert mark in text, (mark, text)
    if fmt is MISTRAL:  # its template takes ids of nine letters and digits: the call's and the result's agree
        ids = [text.split(key, 1)[1][:9] for key in ('"id": "', '"call_id": "')]
        assert ids[0] == ids[1] and ids[0].isalnum()
        with pytest.raises(Exception, match="length 9"):
            tokenizer.apply_chat_template(
                CONVERSATION, tools=template_tools([WEATHER]), chat_template=template(fmt), tokenize=False
            )


@pytest.mark.parametrize("fmt", FAMILIES)
def test_the_lazy_grammar_leaves_text_free_and_holds_calls_to_their_parameters(
    grammars: Grammars, builtin_llama_shared: ModelRunner, fmt: ToolFormat
) -> None:
    tokenizer, eos = builtin_llama_shared.tokenizer, builtin_llama_shared.info.eos_ids[0]

    def walk(source: str, text: str) -> tuple[bool, bool]:
        matcher = grammars.compile(GrammarSpec(GrammarKind.GRAMMAR, source)).matcher()
        taken = all(matcher.consume(token) for token in tokenizer.encode(text))
        return taken, taken and bool(matcher.allowed()[eos])

    lazy = fmt.grammar([WEATHER, TIME], required=False, parallel=True, markers=Markers())
    good = call_text(fmt, ("get_weather", {"city": "Paris"}))
    assert walk(lazy, "It is sunny today, I think.") == (True, True)  # free text, and it may end
    assert walk(lazy, good) == (True, True)
    # Qwen3-Coder writes a string as it is: 7 is one; 15 characters are too many
    bad_city = "Ouagadougou, BF" if fmt is QWEN3_CODER else 7
    # arguments follow the parameters
    assert walk(lazy, call_text(fmt, ("get_weather", {"city": bad_city}))) == (False, False)
    assert walk(lazy, call_text(fmt, ("get_time", {"zone": "PST"}))) == (False, False)
    assert walk(lazy, call_text(fmt, ("launch", {}))) == (False, False)  # only the tools given
    assert walk(lazy, good[:-3])[1] is False  # an unfinished call cannot end
    matcher = grammars.compile(GrammarSpec(GrammarKind.GRAMMAR, lazy)).matcher()
    for token in tokenizer.encode("Let me see"):
        assert matcher.consume(token)
    allowed = int(matcher.allowed().sum())
    # free text is free: nearly every token
    assert allowed >= 0.99 * builtin_llama_shared.info.vocab_size, allowed
    required = fmt.grammar([WEATHER], required=True, parallel=False, markers=Markers())
    assert walk(required, "It is sunny.")[0] is False and walk(required, good) == (True, True)
    if fmt is not LLAMA3:  # Llama 3.1 calls one tool an answer
        assert walk(
            lazy,
            "Two: " * (fmt is HERMES)
            + call_text(fmt, ("get_weather", {"city": "Paris"}), ("get_time", {"zone": "UTC"})),
        ) == (True, True)
        # parallel_tool_calls: false
        assert (
            walk(
                required,
                call_text(fmt, ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})),
            )[0]
            is False
        )


def _read(
    tokenizer: Any, fmt: ToolFormat, text: str, reason: str = "stop", step: int = 1
) -> tuple[list[list[dict[str, Any]]], str]:
    """The deltas of each push of ``step`` tokens, and the finish reason."""
    reader_ = ChoiceText(tokenizer, [], tools=reader(fmt), grammar=True)
    tokens = tokenizer.encode(text)
    pushes = [reader_.push(tokens[i : i + step]) for i in range(0, len(tokens), step)]
    tail, finish = reader_.finish(reason)
    return [*pushes, tail], finish


@pytest.mark.parametrize("fmt", FAMILIES)
def test_the_reader_turns_an_answer_into_openais_deltas_and_never_streams_a_trigger(
    builtin_llama_shared: ModelRunner, fmt: ToolFormat
) -> None:
    tokenizer = builtin_llama_shared.tokenizer
    prose = "" if fmt is LLAMA3 else "Let me check. "
    calls = [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "UTC"})][: 1 if fmt is LLAMA3 else 2]
    text = prose + call_text(fmt, *calls)
    for step in (1, 3, 1000):
        pushes, finish = _read(tokenizer, fmt, text, step=step)
        message = message_of([d for push in pushes for d in push])
        assert finish == "tool_calls"
        assert [
            (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]
        ] == calls
        assert all(c["id"].startswith("call_") for c in message["tool_calls"])
        assert (message["content"] or "") == prose
        streamed = "".join(d.get("content", "") for push in pushes for d in push)
        trigger = (
            fmt.style.trigger
            if isinstance(fmt, JsonCallFormat)
            else "[TOOL_CALLS]"
            if fmt is MISTRAL_ARGS
            else "<tool_call>"
        )
        assert trigger[:2] not in streamed or not trigger  # no piece of the trigger became text
    pushes, finish = _read(tokenizer, fmt, "Plain words, no call.")
    assert finish == "stop" and message_of([d for p in pushes for d in p]) == {
        "role": "assistant",
        "content": "Plain words, no call.",
        "refusal": None,
    }


def test_a_possible_trigger_is_held_back_until_it_is_one_or_is_not() -> None:
    reader = NativeToolOutput(style=HERMES.style)  # type: ignore[attr-defined]
    assert reader.push("Sure <tool_ca") == [{"content": "Sure "}]  # "<tool_ca" may start a call: held
    assert reader.push("t is a cat") == [{"content": "<tool_cat is a cat"}]  # it did not
    assert reader.push(" <") == [{"content": " "}]
    assert reader.flush() == [{"content": "<"}]  # the end: what was held is text
    reader = NativeToolOutput(style=MISTRAL.style)  # type: ignore[attr-defined]
    assert reader.push("[TOOL_") == [] and reader.push("CALLS] [") == []
    started = reader.push('{"name": "get_weather", "arguments": {"ci')
    assert started == [
        {
            "tool_calls": [
                {
                    "index": 0,
                    "id": started[0]["tool_calls"][0]["id"],
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"ci'},
                }
            ]
        }
    ]


def test_a_call_cut_by_max_tokens_is_reported_as_it_is(builtin_llama_shared: ModelRunner) -> None:
    pushes, finish = _read(
        builtin_llama_shared.tokenizer,
        HERMES,
        '<tool_call>\n{"name": "get_weather", "arguments": {"ci',
        reason="length",
    )
    message = message_of([d for p in pushes for d in p])
    assert finish == "length" and message["tool_calls"][0]["function"] == {
        "name": "get_weather",
        "arguments": '{"ci',
    }


def test_what_the_counter_example_hunt_found_stays_fixed() -> None:
    """A Llama call that arrives in one piece is read at once; a trigger that does not go on as a call is
    text, trigger and all; a call cut by max_tokens, before its name or after a complete one, is never text
    (issue 75)."""
    llama = reader(LLAMA3)
    whole = llama.push('{"name": "get_time", "parameters": {}}')
    assert whole and whole[0]["tool_calls"][0]["function"] == {"name": "get_time", "arguments": "{}"}
    hermes = reader(HERMES)
    assert message_of(hermes.push("see <tool_call> tag") + hermes.flush())["content"] == "see <tool_call> tag"
    hermes = reader(HERMES)
    deltas = hermes.push('x<tool_call>\n{"name": "ge') + hermes.flush(cut=True)
    assert message_of(deltas) == {"role": "assistant", "content": "x", "refusal": None}
    for fmt, cut in [
        (HERMES, '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n{"na'),
        (MISTRAL, '[TOOL_CALLS] [{"name": "a", "arguments": {}}, {"name'),
        (MISTRAL, "[TOOL_CALLS] "),
        (MISTRAL_ARGS, "[TOOL_CALLS]get_weather[ARGS]{}[TOOL_CALLS]get_"),
        (QWEN3_CODER, "<tool_call>\n<function=get_weather>\n<parameter=ci"),
    ]:
        cut_reader = reader(fmt)
        message = message_of(cut_reader.push(cut) + cut_reader.flush(cut=True))
        assert message["content"] is None or message["content"] == "", (fmt, cut, message)


def test_a_template_that_needs_roles_to_alternate_gets_them_merged(builtin_llama_shared: ModelRunner) -> None:
    """Issue 75: a coding agent sends its instructions, a developer message (a system one here) and several
    user messages in a row, which Mistral's templates refuse. Merged as mistral-common and vLLM merge them,
    the turn renders."""
    tokenizer = builtin_llama_shared.tokenizer
    agent = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "system", "content": "Sandbox: workspace-write."},
        {"role": "user", "content": "<environment_context>"},
        {"role": "user", "content": "Fix the bug."},
        {"role": "assistant", "content": "Looking."},
        {"role": "assistant", "content": None, "tool_calls": CONVERSATION[2]["tool_calls"]},
        {"role": "tool", "tool_call_id": "call_abc", "content": "ok"},
        {"role": "user", "content": "Thanks."},
    ]
    with pytest.raises(Exception, match="alternate"):
        tokenizer.apply_chat_template(agent, chat_template=template(MISTRAL_ARGS), tokenize=False)
    merged = MISTRAL_ARGS.template_messages(agent)
    # v7+: a text and its calls one message
    assert [m["role"] for m in merged] == ["system", "user", "assistant", "tool", "user"]
    text = tokenizer.apply_chat_template(merged, chat_template=template(MISTRAL_ARGS), tokenize=False)
    assert "[SYSTEM_PROMPT]You are a coding agent.\n\nSandbox: workspace-write.[/SYSTEM_PROMPT]" in text
    assert "[INST]<environment_context>\n\nFix the bug.[/INST]Looking.[TOOL_CALLS]get_weather[ARGS]" in text
    # v0.3 counts them apart
    assert [m["role"] for m in MISTRAL.template_messages(agent)] == [
        "system",
        "user",
        "assistant",
        "assistant",
        "tool",
        "user",
    ]
    answered = [
        *agent[:-1],
        {"role": "assistant", "content": "Done."},
        {"role": "assistant", "content": "All good."},
        {"role": "user", "content": "Thanks."},
    ]
    with pytest.raises(Exception, match="alternate"):
        tokenizer.apply_chat_template(answered, chat_template=template(MISTRAL_ARGS), tokenize=False)
    assert (
        f"[TOOL_RESULTS]ok[/TOOL_RESULTS]Done.\n\nAll good.{tokenizer.eos_token}[INST]Thanks.[/INST]"
        in tokenizer.apply_chat_template(
            MISTRAL_ARGS.template_messages(answered), chat_template=template(MISTRAL_ARGS), tokenize=False
        )
    )
    # a template that takes them as they are
    assert [m["role"] for m in HERMES.template_messages(agent)] == [m["role"] for m in agent]


def test_a_tool_format_by_name_is_a_registered_one() -> None:
    assert by_name("qwen3_coder") is QWEN3_CODER
    with pytest.raises(ConfigError, match="qwen3_coder, hermes, llama3_json, mistral_args, mistral, generic"):
        by_name("hermes2")


def test_qwen3_coder_holds_each_parameter_as_the_reader_reads_it(
    grammars: Grammars, builtin_llama_shared: ModelRunner
) -> None:
    """What the counter-example hunt found (issue 75): a value ends at its first closing tag in the grammar as
    in the reader (a string with a minimum length once let a second parameter in), a string's pattern and a
    freeform tool's grammar hold its text, a choice is written and read as the template writes it."""
    tokenizer, eos = builtin_llama_shared.tokenizer, builtin_llama_shared.info.eos_ids[0]
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "minLength": 1, "maxLength": 12},
            "mode": {"type": "string", "const": "fast"},
            "n": {"enum": [1, 2]},
            "patch": {"type": "string", "x-freeform": {"syntax": "regex", "definition": "[a-z]+/[0-9]"}},
        },
        "required": ["city"],
    }
    source = QWEN3_CODER.grammar([Tool("f", "", schema)], required=True, parallel=False, markers=Markers())

    def text(*params: tuple[str, str]) -> str:
        return (
            "<tool_call>\n<function=f>\n"
            + "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
            + "</function>\n</tool_call>"
        )

    def walk(answer: str) -> bool:
        matcher = grammars.compile(GrammarSpec(GrammarKind.GRAMMAR, source)).matcher()
        return all(matcher.consume(t) for t in tokenizer.encode(answer)) and bool(matcher.allowed()[eos])

    good = text(("city", "Paris"), ("mode", "fast"), ("n", "2"), ("patch", "ab/3"))
    assert walk(good)
    for bad in (
        text(("city", "")),
        "<tool_call>\n<function=f>\n<parameter=city>\n\n</parameter>\n<parameter=evil>\nx\n</parameter>\n</function>\n</tool_call>",
        text(("city", "Paris"), ("mode", '"fast"')),
        text(("city", "Paris"), ("n", "7")),
        text(("city", "Paris"), ("patch", "ab3")),
    ):
        assert not walk(bad), bad
    qwen = QWEN3_CODER.reader(Markers(), {"f": schema})
    qwen.push(good)
    qwen.flush()
    assert json.loads(qwen.calls[0].arguments) == {"city": "Paris", "mode": "fast", "n": 2, "patch": "ab/3"}


def test_a_marker_spelled_out_or_cut_is_never_a_call_or_text_of_one() -> None:
    # <|python_tag|> is no special token here: spelled out, it is free text, not a call's lead
    llama = reader(LLAMA3)
    message = message_of(llama.push('<|python_tag|>{"name": "launch", "parameters": {}}') + llama.flush())
    assert "tool_calls" not in message and message["content"].startswith("<|python_tag|>")
    for fmt, cut in [
        (HERMES, "Let me check. <tool_ca"),
        (MISTRAL, "Let me check. [TOOL_"),
        (MISTRAL_ARGS, "Let me check. [TOOL_"),
        (QWEN3_CODER, "Let me check. <tool_"),
    ]:
        cut_reader = reader(fmt)
        assert message_of(cut_reader.push(cut) + cut_reader.flush(cut=True))["content"] == "Let me check. ", (
            fmt.name
        )


@pytest.mark.parametrize(
    "pattern, held",
    [
        ("^[a-z]+$", "(?:[a-z]+)"),
        ("abc", "(?s:.*)(?:abc)(?s:.*)"),
        ("^(a|b)$", "(?:(a|b))"),
        ("^x/y$", "(?:x\\/y)"),
        # anchors inside, or alternatives the ends bind apart: not held, never a 400
        ("^a$|^b$", "(?s:.*)"),
        ("^a|b$", "(?s:.*)"),
    ],
)
def test_a_qwen3_coder_string_pattern_is_held_where_llguidance_can_hold_it(pattern: str, held: str) -> None:
    from app.tool_formats.qwen3_coder import _text_regex

    assert _text_regex({"type": "string", "pattern": pattern}) == held
