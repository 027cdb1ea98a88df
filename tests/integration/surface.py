"""Generated requests for the whole request surface (issue 46), and the checks every answer must
pass: what ``tests/integration/test_request_surface.py`` sends to a running gateway.

A request is built field by field: each parameter is absent, valid, or — deliberately — broken
(a wrong type, a value out of range, a spelling no parser should take). Valid values reach far:
text in every script (digits of other scripts, control characters, emoji, lone surrogates),
prompts past the limit, schemas nested past the limit, tools with their own schemas, every
mode and drafter, stream and not, n, stop strings, logprobs. The body is serialised by hand
(ASCII JSON, so a lone surrogate travels as a client would send it; sometimes a key twice).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

import jsonschema
from hypothesis import strategies as st

from app.drafting.drafters import DRAFTERS
from core.modes import MODES
from core.names import Mode

MODEL = "specgate-surface"
BROKEN = object()  # the marker of a deliberately broken field in ``Case.broken``

# Text a careful client may send: other scripts' digits, controls, combining marks, emoji, the
# chat template's own markers, JSON's quote and backslash; a lone surrogate now and then.
_PIECES = [
    "²",
    "٣",
    "۷",
    "߂",
    "१",
    "𝟘",
    "Ⅻ",
    "\x00",
    "\x1b[0m",
    "\u200b",
    "\u202e",
    "e\u0301",
    "😀",
    "👩‍👩‍👧",
    "𝄞",
    "<|im_end|>",
    "<|im_start|>",
    '"',
    "\\",
    "\n",
    "{",
    "}",
]
LONE_SURROGATES = ["\ud83d", "\udc00"]
WORDS = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)
TEXT = st.lists(
    st.one_of(
        WORDS,
        st.sampled_from(_PIECES),
        st.sampled_from(["Tell me about the sea.", "Say hello", "weather in Paris?", " the"]),
    ),
    max_size=5,
).map("".join)


@dataclass
class Case:
    """One generated request: where it goes, its body, and what the checks need to know."""

    path: str
    body: dict[str, Any]
    broken: list[str] = field(default_factory=list)  # the fields deliberately made invalid
    faults: bool = True  # fields may be broken on purpose
    duplicate: str | None = None  # a key written twice (the second value wins: JSON parsers take the last)

    @property
    def stream(self) -> bool:
        return self.body.get("stream") is True

    def text(self) -> str:
        """The body as ASCII JSON, a key written twice when ``duplicate`` says so."""
        body = dict(self.body)
        if self.duplicate is None or self.duplicate not in body:
            return json.dumps(body, ensure_ascii=True)
        first = json.dumps({self.duplicate: "an earlier value"}, ensure_ascii=True)[1:-1]
        return "{" + first + ", " + json.dumps(body, ensure_ascii=True)[1:]


# ----------------------------------------------------------------------------- schemas and tools

_LEAF_SCHEMAS = st.sampled_from(
    [
        {"type": "string", "maxLength": 12},
        {"type": "integer", "minimum": -5, "maximum": 50},
        {"type": "number"},
        {"type": "boolean"},
        {"type": "null"},
        {"enum": ["red", "green", "٣"]},
        {"const": "fixed"},
        {"type": "string", "enum": ["a", "b"]},
    ]
)


def _object(children: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    names = st.sampled_from(["name", "city", "n", "unit", "ok", "items", "x"])
    return st.dictionaries(names, children, min_size=1, max_size=3).flatmap(
        lambda props: st.sets(st.sampled_from(sorted(props)), max_size=len(props)).map(
            lambda required: {
                "type": "object",
                "properties": props,
                "required": sorted(required),
                "additionalProperties": False,
            },
        ),
    )


SCHEMAS = st.recursive(
    _LEAF_SCHEMAS,
    lambda inner: st.one_of(
        _object(inner),
        st.builds(lambda s: {"type": "array", "items": s, "maxItems": 2}, inner),
        st.builds(lambda a, b: {"anyOf": [a, b]}, inner, inner),
    ),
    max_leaves=6,
)
OBJECT_SCHEMAS = _object(SCHEMAS)


def deep_schema(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        schema = {"anyOf": [schema]}
    return schema


STRUCTURED = st.one_of(  # vLLM's structured_outputs
    st.builds(
        lambda c: {"choice": c},
        st.lists(st.sampled_from(["yes", "no", "٣", "maybe so"]), min_size=1, max_size=3, unique=True),
    ),
    st.just({"regex": "[a-z]{1,6}"}),
    st.just({"regex": "(cat|dog)s?"}),
    st.builds(lambda s: {"json": s}, OBJECT_SCHEMAS),
    st.just({"grammar": 'start: "ab" | "cd"'}),
)
TOOL_NAMES = st.sampled_from(["get_weather", "get_time", "lookup", "add-2"])


@st.composite
def tools(draw: st.DrawFn) -> list[dict[str, Any]]:
    names = draw(st.lists(TOOL_NAMES, min_size=1, max_size=3, unique=True))
    out = []
    for name in names:
        function: dict[str, Any] = {"name": name}
        if draw(st.booleans()):
            function["description"] = draw(TEXT)
        if draw(st.integers(0, 3)):
            function["parameters"] = draw(OBJECT_SCHEMAS)
        out.append({"type": "function", "function": function})
    return out


# ----------------------------------------------------------------------------- fields


def chance(draw: st.DrawFn, percent: int) -> bool:
    """True about ``percent`` times in a hundred (hypothesis leans floats to 0 and 1: not them)."""
    return draw(st.sampled_from(range(100))) >= 100 - percent


def _valid_or_broken(
    draw: st.DrawFn,
    case: Case,
    name: str,
    valid: st.SearchStrategy[Any],
    broken: st.SearchStrategy[Any],
    present: int = 50,
) -> None:
    """Set ``name``: absent, valid (``present`` percent of the time), or — 2 %, when the case
    takes faults — broken, recorded in ``case.broken``."""
    roll = draw(st.sampled_from(range(100)))
    if roll >= 98 and case.faults:
        case.body[name] = draw(broken)
        case.broken.append(name)
    elif roll >= 98 - present:
        case.body[name] = draw(valid)


WRONG = st.sampled_from(["many", [1], {"a": 1}])  # no type above takes these (None and booleans some do)


@st.composite
def messages(draw: st.DrawFn, with_tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if draw(st.booleans()):
        out.append({"role": draw(st.sampled_from(["system", "developer"])), "content": draw(TEXT)})
    for turn in range(draw(st.integers(0, 2))):
        out.append({"role": "user", "content": draw(TEXT)})
        if with_tools and draw(st.booleans()):
            call = {
                "id": f"call_{turn}",
                "type": "function",
                "function": {
                    "name": with_tools[0]["function"]["name"],
                    "arguments": draw(st.sampled_from(['{"city":"Paris"}', "{}", "not json", "[[[[1]]]]"])),
                },
            }
            out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            out.append({"role": "tool", "tool_call_id": f"call_{turn}", "content": draw(TEXT)})
        else:
            out.append(
                {
                    "role": "assistant",
                    "content": draw(st.one_of(TEXT, st.just([{"type": "text", "text": "parts"}]))),
                }
            )
    out.append(
        {
            "role": "user",
            "content": draw(
                st.one_of(TEXT, st.just([{"type": "text", "text": "Hi"}, {"type": "text", "text": " there"}]))
            ),
        }
    )
    return out


@st.composite
def speculative(draw: st.DrawFn, every_mode: bool = True) -> dict[str, Any]:
    """A ``speculative`` object; ``every_mode`` False leaves out ``pipeline`` (a 400 without a pipeline
    target)."""
    mode = draw(st.sampled_from([m.value for m in MODES if every_mode or m is not Mode.PIPELINE]))
    spec: dict[str, Any] = {"mode": mode}
    takes = MODES[next(m for m in MODES if m.value == mode)].fields
    if "num_draft_tokens" in takes and draw(st.booleans()):
        spec["num_draft_tokens"] = draw(st.one_of(st.integers(1, 6), st.just("auto")))
    if "k" in takes and draw(st.booleans()):
        spec["k"] = draw(st.one_of(st.integers(1, 40), st.just("full")))
    if "draft_top_k" in takes and draw(st.booleans()):
        spec["draft_top_k"] = draw(st.integers(0, 64))
    if "overlap" in takes and draw(st.booleans()):
        spec["overlap"] = True
    if "drafter" in takes and draw(st.booleans()):
        # the registered ones, model, lookup, model+lookup
        spec["drafter"] = draw(st.sampled_from(list(DRAFTERS)))
    if "tree" in takes and draw(st.booleans()):
        spec["tree"] = draw(
            st.one_of(
                st.builds(
                    lambda w: {"rule": "sampled", "widths": w},
                    st.lists(st.integers(1, 2), min_size=1, max_size=3),
                ),
                st.builds(lambda n: {"rule": "fixed", "nodes": n, "depth": 2, "top_k": 2}, st.integers(1, 4)),
                st.just({"payload": "exact"}),
            )
        )
    if not every_mode:  # the combinations a mode refuses (each a 400 of its own, tested in tests/app)
        if spec.get("overlap"):
            spec.pop("drafter", None)
        if spec.get("tree", {}).get("payload") == "exact":
            spec.pop("k", None)
    return spec


@st.composite
def cases(
    draw: st.DrawFn, faults: bool = True, structured: bool = False, with_tools: bool | None = None
) -> Case:
    """A request; ``faults``: some fields broken on purpose; ``structured``: a chat request with
    tools or a grammar, and room for them to finish (what checks calls and schemas); ``with_tools``:
    tools always (a call required or named) or never, not by chance."""
    chat = structured or draw(st.booleans())
    case = Case("/v1/chat/completions" if chat else "/v1/completions", {}, faults=faults)
    body = case.body
    body["model"] = MODEL

    def fault(percent: int) -> bool:
        return faults and chance(draw, percent)

    if fault(3):
        body["model"] = draw(st.sampled_from(["nope", "", "٣", 7]))
        case.broken.append("model")
    tooled = chance(draw, 50 if structured else 25) if with_tools is None else with_tools
    given_tools = draw(tools()) if chat and tooled else None
    if chat:
        body["messages"] = draw(messages(given_tools))
        if fault(2):
            body["messages"] = draw(st.sampled_from([[], "hi", [{"role": "wizard", "content": "x"}]]))
            case.broken.append("messages")
    else:
        body["prompt"] = draw(
            st.one_of(TEXT.filter(bool), st.lists(st.integers(0, 49151), min_size=1, max_size=6))
        )
        if fault(2):
            body["prompt"] = draw(st.sampled_from([[-1], [1, 10**12], {"text": "x"}]))
            case.broken.append("prompt")
    key = "messages" if chat else "prompt"
    if fault(3):  # extreme sizes: past max_prompt_tokens (a 400)
        long = "word " * draw(st.sampled_from([1500, 6000]))
        body[key] = [{"role": "user", "content": long}] if chat else long
        case.broken.append(key)
    elif fault(3):  # half a surrogate pair, which no text holds (a 400)
        lone = draw(st.sampled_from(LONE_SURROGATES))
        body[key] = [{"role": "user", "content": f"a{lone}b"}] if chat else f"a{lone}b"
        case.broken.append(key)
    token_limit = "max_completion_tokens" if chat and draw(st.booleans()) else "max_tokens"
    _valid_or_broken(
        draw,
        case,
        token_limit,
        st.integers(1, 8),
        st.one_of(st.just(-3), st.just(10**30), st.just(1.5), WRONG),
        present=90,
    )
    _valid_or_broken(
        draw,
        case,
        "temperature",
        st.sampled_from([0, 0.0, 1e-9, 0.7, 1.0, 2.0]),
        st.one_of(st.just(-1), st.just(9.5), st.just("hot")),
    )
    _valid_or_broken(
        draw, case, "top_p", st.sampled_from([0.1, 0.9, 1.0]), st.one_of(st.just(0), st.just(1.5)), present=20
    )
    _valid_or_broken(
        draw, case, "top_k", st.sampled_from([-1, 0, 1, 5, 50, 10**6, 10**40]), st.just(-2), present=20
    )
    _valid_or_broken(draw, case, "n", st.integers(1, 3), st.one_of(st.just(0), st.just(99)), present=25)
    _valid_or_broken(
        draw, case, "seed", st.integers(0, 2**63 - 1), st.one_of(st.just(-1), st.just(2**64)), present=60
    )
    _valid_or_broken(
        draw,
        case,
        "stop",
        st.one_of(TEXT, st.lists(TEXT, max_size=4), st.sampled_from([".", "\n", '"', "}", ",", " the"])),
        st.just(["a", "b", "c", "d", "e"]),
        present=30,
    )
    _valid_or_broken(draw, case, "stream", st.booleans(), st.just("maybe"), present=50)
    if case.stream and draw(st.booleans()):
        body["stream_options"] = {"include_usage": draw(st.booleans())}
    _valid_or_broken(
        draw, case, "presence_penalty", st.sampled_from([-2, -0.5, 0, 1.5]), st.just(2.5), present=15
    )
    _valid_or_broken(draw, case, "frequency_penalty", st.sampled_from([-1, 0.5, 2]), st.just(-3), present=15)
    _valid_or_broken(
        draw, case, "repetition_penalty", st.sampled_from([0.5, 1.0, 1.3, 20]), st.just(0), present=15
    )
    _valid_or_broken(draw, case, "min_p", st.sampled_from([0.0, 0.05, 0.5]), st.just(1.0), present=15)
    ids = st.integers(0, 49151).map(str)
    odd_keys = st.sampled_from(["²", "٣", "-1", "1e3", "0x10", "99999999999999999999"])
    _valid_or_broken(
        draw,
        case,
        "logit_bias",
        st.dictionaries(ids, st.sampled_from([-100, -5, 0, 3.5, 100]), max_size=4),
        st.dictionaries(odd_keys, st.just(1.0), min_size=1, max_size=2),
        present=20,
    )
    if not structured:  # with a grammar: a 400 (the grammar decides where the answer ends)
        _valid_or_broken(
            draw, case, "min_tokens", st.sampled_from([0, 1, 2, 4, 10**30]), st.just(-1), present=15
        )
        _valid_or_broken(draw, case, "ignore_eos", st.booleans(), st.just("nah"), present=10)
    if chat:
        _valid_or_broken(draw, case, "logprobs", st.booleans(), st.just(3), present=15)
        if body.get("logprobs") is True and draw(st.booleans()):
            body["top_logprobs"] = draw(st.integers(0, 5))
    else:
        _valid_or_broken(draw, case, "logprobs", st.integers(0, 5), st.just(21), present=15)
        _valid_or_broken(draw, case, "echo", st.booleans(), st.just("x"), present=10)
    schema_formats = st.one_of(
        st.just({"type": "text"}),
        st.just({"type": "json_object"}),
        st.builds(
            lambda s: {"type": "json_schema", "json_schema": {"name": "answer", "schema": s, "strict": True}},
            st.one_of(OBJECT_SCHEMAS, SCHEMAS),
        ),
    )
    if structured and given_tools is None:
        body["response_format"] = (
            draw(schema_formats.filter(lambda f: f["type"] != "text"))
            if draw(st.integers(0, 3))
            else {"type": "text"}
        )
        if body["response_format"]["type"] == "text":
            del body["response_format"]
            body["structured_outputs"] = draw(STRUCTURED)
    elif structured and chance(draw, 25):  # tools, and a response of a schema of its own
        body["response_format"] = draw(schema_formats.filter(lambda f: f["type"] != "text"))
    if not structured:
        _valid_or_broken(
            draw,
            case,
            "response_format",
            schema_formats,
            st.sampled_from(
                [
                    {"type": "yaml"},
                    {"type": "json_schema"},
                    {"type": "json_schema", "json_schema": {"name": "d", "schema": deep_schema(300)}},
                ]
            ),
            present=25,
        )
    if (
        "response_format" not in body
        and "structured_outputs" not in body
        and given_tools is None
        and chance(draw, 10)
    ):
        body["structured_outputs"] = draw(STRUCTURED)
        if fault(10):
            body["structured_outputs"] = {"json": json.dumps(deep_schema(300))}
            case.broken.append("structured_outputs")
    if structured and token_limit not in case.broken:  # room to finish what the grammar writes
        body[token_limit] = 64 if with_tools else 40  # a call's arguments: a whole object
    if given_tools is not None:
        body["tools"] = given_tools
        names = [t["function"]["name"] for t in given_tools]
        choice = draw(
            st.sampled_from(
                ["required", "named"]
                if with_tools
                else ["required", "named", "required", "auto"]
                if structured
                else ["auto", "required", "none", "named", None]
            )
        )
        if choice == "named":
            body["tool_choice"] = {"type": "function", "function": {"name": draw(st.sampled_from(names))}}
        elif choice is not None:
            body["tool_choice"] = choice
        if (
            with_tools
        ):  # one call, which then ends the answer (a small model repeats its call until the limit)
            body["parallel_tool_calls"] = False
        elif draw(st.booleans()):
            body["parallel_tool_calls"] = draw(st.booleans())
    if chance(draw, 50):
        body["speculative"] = draw(speculative(every_mode=faults))
        if fault(3):
            # a field the mode may not take, or garbage
            body["speculative"][draw(st.sampled_from(["k", "tree", "bogus"]))] = draw(WRONG)
            case.broken.append("speculative")
    if fault(2):
        name = draw(st.sampled_from(["suffix", "best_of", "functions", "colour"]))  # unsupported or unknown
        body[name] = 1
        case.broken.append(name)
    if chance(draw, 5):
        case.duplicate = draw(st.sampled_from(sorted(body)))
    case.broken += [name for name in _combined_faults(body) if name not in case.broken]
    return case


def _combined_faults(body: dict[str, Any]) -> list[str]:
    """Fields refused for what they are combined with (each a 400 of its own): a case with one
    of them is not one with a single field at fault."""
    out = []
    limit = next(
        (body[k] for k in ("max_completion_tokens", "max_tokens") if isinstance(body.get(k), int)), None
    )
    grammar = (
        "tools" in body
        and body.get("tool_choice") != "none"
        or _field_object(body, "response_format").get("type", "text") != "text"
        or "structured_outputs" in body
    )
    if isinstance(body.get("min_tokens"), int) and (
        limit is not None and body["min_tokens"] > limit or grammar and body["min_tokens"] > 0
    ):
        out.append("min_tokens")
    if grammar and body.get("ignore_eos") is True:
        out.append("ignore_eos")
    spec = _field_object(body, "speculative")
    if (
        spec.get("mode") == "pipeline"
        or spec.get("overlap")
        and spec.get("drafter", "model") != "model"
        or _field_object(spec, "tree").get("payload") == "exact"
        and isinstance(spec.get("k"), int)
    ):
        out.append("speculative")
    return out


def _field_object(parent: dict[str, Any], key: str) -> dict[str, Any]:
    """``parent[key]`` where it is an object (a field broken on purpose may be anything)."""
    value = parent.get(key)
    return value if isinstance(value, dict) else {}


# ----------------------------------------------------------------------------- checks


def check_error(status: int, payload: Any, case: Case) -> None:
    """A 4xx in the OpenAI envelope; with one field broken on purpose, the error names it."""
    assert 400 <= status < 500, f"status {status}: {payload}"
    error = payload["error"]
    assert (
        set(error) == {"message", "type", "param", "code"}
        and isinstance(error["message"], str)
        and error["message"]
    )
    # valid tools and messages can render past max_prompt_tokens on their own
    too_long = error["code"] == "context_length_exceeded" and error["param"] in ("messages", "prompt")
    if len(case.broken) == 1 and case.duplicate is None and status == 400 and not too_long:
        assert isinstance(error["param"], str) and error["param"].split(".")[0] == case.broken[0], (
            f"{case.broken[0]} broken, error names {error['param']!r}: {error['message']}"
        )


@dataclass
class Answer:
    """One choice as a client holds it at the end: its content, tool calls and finish reason."""

    content: str | None
    calls: list[tuple[str, str]]  # (name, arguments)
    finish_reason: str | None


def check_answer(answer: Answer, case: Case) -> None:
    """What a well-formed choice must hold given what the request asked for."""
    body = case.body
    assert answer.finish_reason in ("stop", "length", "tool_calls"), answer
    if answer.finish_reason == "tool_calls":
        assert answer.calls, "finish_reason tool_calls without a call"
        parameters = {
            t["function"]["name"]: t["function"].get("parameters") or {"type": "object", "properties": {}}
            for t in body.get("tools", [])
        }
        for name, arguments in answer.calls:
            assert name in parameters, f"a call of {name!r}, not among the tools"
            # parses, and follows the tool's parameters
            jsonschema.validate(json.loads(arguments), parameters[name])
    elif answer.calls:
        assert answer.finish_reason == "length", (
            f"tool calls reported with finish_reason {answer.finish_reason}"
        )
    if answer.finish_reason != "stop" or answer.calls:
        return
    schema = _content_schema(body)
    if schema is not None and not body.get("echo"):
        jsonschema.validate(json.loads(answer.content or ""), schema)
    outputs = body.get("structured_outputs") or {}
    if "choice" in outputs:
        assert answer.content in outputs["choice"], answer.content
    if "regex" in outputs:
        assert re.fullmatch(outputs["regex"], answer.content or ""), answer.content


def _content_schema(body: dict[str, Any]) -> Any:
    fmt = body.get("response_format") or {}
    if fmt.get("type") == "json_object":
        return {"type": "object"}
    if fmt.get("type") == "json_schema":
        return fmt["json_schema"].get("schema", {"type": "object"})
    outputs = body.get("structured_outputs") or {}
    if "json" in outputs:
        return json.loads(outputs["json"]) if isinstance(outputs["json"], str) else outputs["json"]
    return None


def answers_of_body(payload: dict[str, Any], chat: bool) -> dict[int, Answer]:
    out = {}
    for choice in payload["choices"]:
        if chat:
            message = choice["message"]
            calls = [
                (c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []
            ]
            out[choice["index"]] = Answer(message.get("content"), calls, choice["finish_reason"])
        else:
            out[choice["index"]] = Answer(choice["text"], [], choice["finish_reason"])
    return out


def answers_of_stream(events: list[Any], chat: bool) -> dict[int, Answer]:
    """The choices a client reassembles from a stream's chunks (the SDK's way: tool calls by index)."""
    content: dict[int, str] = {}
    calls: dict[int, dict[int, list[str]]] = {}
    finish: dict[int, str] = {}
    for event in events:
        for choice in event.get("choices", []):
            i = choice["index"]
            assert i not in finish, f"choice {i} went on after its finish_reason"
            piece = choice["delta"] if chat else {"content": choice["text"]}
            content[i] = content.get(i, "") + (piece.get("content") or "")
            for call in piece.get("tool_calls") or []:
                entry = calls.setdefault(i, {}).setdefault(call["index"], ["", ""])
                if "id" in call:
                    assert call["id"].startswith("call_") and call["function"]["name"], call
                entry[0] += call.get("function", {}).get("name") or ""
                entry[1] += call.get("function", {}).get("arguments") or ""
            if choice.get("finish_reason"):
                finish[i] = choice["finish_reason"]
    indices = set(content) | set(finish)
    return {
        i: Answer(content.get(i, ""), [tuple(calls[i][k]) for k in sorted(calls.get(i, {}))], finish.get(i))
        for i in indices
    }  # type: ignore[misc]
