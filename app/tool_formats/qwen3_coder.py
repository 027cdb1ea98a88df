"""Qwen3-Coder: calls in XML, each parameter's value as text (a string as it is; numbers, booleans and JSON
values as their text)::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Its template also holds ``<tool_call>``, so it is told apart first (as llama.cpp does), by ``<function=`` and
``<parameter=``. The reader turns each value into JSON by its parameter's type, as vLLM's qwen3_coder parser
does."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from app.tool_formats.base import JSON_STYLE, Markers, SteppedOutput, ToolFormat, after_trigger, register
from app.tools import _INVALID, Tool, ToolCall, ToolOutput, _loads, partial
from core.freeform import freeform_pattern
from core.grammar import FREEFORM, strict

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_NUMBER = r"/-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?/"


@register
class Qwen3Coder(ToolFormat):
    name = "qwen3_coder"
    markers = (OPEN, CLOSE)

    def detects(self, template: str) -> bool:
        return "<function=" in template and "<parameter=" in template

    def grammar(self, tools: list[Tool], required: bool, parallel: bool, markers: Markers) -> str:
        """Free text until ``<tool_call>``, then calls whose parameters are their tool's, in its order (the
        required ones always), each value as its type is written."""
        opening, closing = markers.grammar(OPEN), markers.grammar(CLOSE)
        rules = [f"calls: call ({json.dumps(chr(10))} {opening} call)*" if parallel else "calls: call"]
        rules.append('call: "\\n<function=" (' + " | ".join(f"fn_{i}" for i in range(len(tools))) + ")")
        for i, tool in enumerate(tools):
            params = []
            properties = tool.parameters.get("properties") or {}
            required_names = set(tool.parameters.get("required") or [])
            for j, (key, schema) in enumerate(properties.items()):
                text = _text_regex(schema)
                if text is None:
                    rules.append(
                        f"p_{i}_{j}: {json.dumps(f'<parameter={key}>' + chr(10))} "
                        f"{_value(schema)} {json.dumps(chr(10) + '</parameter>' + chr(10))}"
                    )
                else:
                    # one lexeme to the first closing tag, which it holds: a greedy one would run past it, the
                    # reader stops at it
                    rules.append(f"p_{i}_{j}: {json.dumps(f'<parameter={key}>' + chr(10))} TEXT_{i}_{j}")
                    rules.append(
                        rf"TEXT_{i}_{j}: /(?:{text})\n<\/parameter>\n/ & ~/(?s:.*)\n<\/parameter>\n(?s:.)+/"
                    )
                params.append(f"p_{i}_{j}" + ("" if key in required_names else "?"))
            rules.append(
                f"fn_{i}: {json.dumps(tool.name + '>' + chr(10))} {' '.join(params)} "
                f"{json.dumps('</function>' + chr(10))} {closing}"
            )
        start, more = after_trigger(OPEN, "calls", required, markers)
        return "\n".join([start, *rules, *more]) + "\n"

    def reader(self, markers: Markers, tools: dict[str, dict[str, Any]]) -> ToolOutput:
        return XmlToolOutput(schemas=tools)


def _text_regex(schema: Any) -> str | None:
    """A string parameter's text as a regex (its pattern, a freeform tool's grammar, its length), or None for
    another type."""
    if (
        not isinstance(schema, dict)
        or schema.get("type") != "string"
        or "const" in schema
        or "enum" in schema
    ):
        return None
    if isinstance(schema.get(FREEFORM), dict):
        pattern = freeform_pattern(
            str(schema[FREEFORM].get("syntax")), str(schema[FREEFORM].get("definition", ""))
        )
    elif isinstance(schema.get("pattern"), str):
        pattern = schema["pattern"]  # JSON Schema's: found anywhere in the string unless anchored
    else:
        low, high = int(schema.get("minLength", 0)), schema.get("maxLength", "")
        return f"(?s:.){{{low},{high}}}" if (low, high) != (0, "") else "(?s:.*)"
    head = "" if pattern.startswith("^") else "(?s:.*)"
    tail = "" if re.search(r"(?<!\\)(?:\\\\)*\$$", pattern) else "(?s:.*)"
    body = pattern.removeprefix("^")
    body = body[:-1] if tail == "" else body
    if _bare(body):
        # an anchor inside, or alternatives the ends would bind apart: not held here (llguidance has no
        # anchors)
        return "(?s:.*)"
    # a slash would end the Lark regex
    return head + "(?:" + re.sub(r"(?<!\\)((?:\\\\)*)/", r"\1\\/", body) + ")" + tail


def _bare(regex: str) -> bool:
    """Whether ``regex`` has an anchor (``^``, ``$``) outside a class, or a ``|`` outside every group and
    class."""
    depth, classes, at = 0, 0, 0
    while at < len(regex):
        ch = regex[at]
        if ch == "\\":
            at += 2
            continue
        if classes:
            classes += (ch == "[") - (ch == "]")
        elif ch == "[":
            classes, at = 1, at + (2 if regex[at + 1 : at + 2] in ("]", "^") else 1)
            continue
        elif ch in "^$" or (ch == "|" and depth == 0):
            return True
        else:
            depth += (ch == "(") - (ch == ")")
        at += 1
    return False


def _rendered(value: Any) -> list[str]:
    """How the template writes a value: a string as it is, a mapping or a list as JSON, anything else as its
    text."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, bool):
        return ["true", "True"] if value else ["false", "False"]
    return [json.dumps(value)] + (["None"] if value is None else [])


def _value(schema: Any) -> str:
    """A parameter's value as the template writes it: a number or a boolean as its text, a choice as its own,
    else JSON."""
    schema = schema if isinstance(schema, dict) else {}
    kind = schema.get("type")
    choices = (
        schema["enum"]
        if isinstance(schema.get("enum"), list)
        else [schema["const"]]
        if "const" in schema
        else None
    )
    if choices is not None:
        return "(" + " | ".join(json.dumps(text) for choice in choices for text in _rendered(choice)) + ")"
    if kind == "integer":
        return "/-?(0|[1-9][0-9]*)/"
    if kind == "number":
        return _NUMBER
    if kind == "boolean":
        return '("true" | "false" | "True" | "False")'
    return f"%json {json.dumps({**strict(schema), 'x-guidance': JSON_STYLE})}"


def typed(value: str, schema: Any) -> Any:
    """A value's text as the JSON its parameter's type takes (vLLM's qwen3_coder parser's conversions): text
    that does not convert stays a string."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    choices = (
        (
            schema.get("enum")
            if isinstance(schema.get("enum"), list)
            else [schema["const"]]
            if "const" in schema
            else None
        )
        if isinstance(schema, dict)
        else None
    )
    if choices is not None:  # the choice the text writes, of whatever type
        return next((choice for choice in choices if value in _rendered(choice)), value)
    if kind == "string":
        return value
    if kind == "boolean" and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if kind in ("integer", "number"):
        try:
            return (
                int(value)
                if kind == "integer"
                else float(value)
                if re.search(r"[.eE]", value)
                else int(value)
            )
        except ValueError:
            return value
    parsed = _loads(value)
    return value if parsed is _INVALID else parsed


_PARAM = re.compile(r"<parameter=([^>\n]*)>\n")


@dataclass
class XmlToolOutput(SteppedOutput):
    """Reads ``text<tool_call>\\n<function=…>…</function>\\n</tool_call>`` as it arrives: text as content (a
    piece that may start the trigger held back), each call's name, then its arguments as JSON, a parameter at
    a time."""

    schemas: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def is_complete(self) -> bool:
        return (
            self._state == "between"
            and not self._buffer[self._at :].strip("\n")
            and bool(self.calls)
            and all(_loads(call.arguments) is not _INVALID for call in self.calls)
        )

    def _step(self) -> dict[str, Any] | None:
        rest = self._buffer[self._at :]
        if self._state in ("start", "text"):
            at = rest.find(OPEN)
            if at >= 0:
                delta = self._content(at)
                self._at, self._state = self._at + len(OPEN), "function"
                return delta
            return self._content(len(rest) - partial(rest, OPEN))
        if self._state == "function":  # "\n<function=NAME>\n"
            match = re.match(r"\n<function=([^>\n]*)>\n", rest)
            if match is None:
                return (
                    None if "\n<function=".startswith(rest[:11]) and "\n" not in rest[1:] else self._give_up()
                )
            call = ToolCall(len(self.calls), f"call_{uuid.uuid4().hex[:24]}", match.group(1))
            self.calls.append(call)
            self._at, self._state = self._at + match.end(), "parameters"
            return {
                "tool_calls": [
                    {
                        "index": call.index,
                        "id": call.id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": ""},
                    }
                ]
            }
        if self._state == "parameters":
            return self._parameter(rest)
        if self._state == "between":  # "\n<tool_call>" starts the next call
            if rest.startswith("\n" + OPEN):
                self._at, self._state = self._at + 1 + len(OPEN), "function"
                return None
            return None if ("\n" + OPEN).startswith(rest) else self._give_up()
        return self._give_up()

    def _parameter(self, rest: str) -> dict[str, Any] | None:
        """A parameter whole (its value converted), or the call's end: each as its piece of the arguments'
        JSON."""
        call = self.calls[-1]
        end = "</function>\n" + CLOSE
        if rest.startswith(end):
            self._at, self._state = self._at + len(end), "between"
            return self._arguments("{}" if not call.arguments else "}")
        if end.startswith(rest):
            return None
        match = _PARAM.match(rest)
        if match is None:
            return None if "<parameter=".startswith(rest[:11]) and "\n" not in rest else self._give_up()
        close = rest.find("\n</parameter>\n", match.end())
        if close < 0:
            return None
        key, text = match.group(1), rest[match.end() : close]
        schema = (self.schemas.get(call.name, {}).get("properties") or {}).get(key, {})
        self._at += close + len("\n</parameter>\n")
        piece = (
            ("{" if not call.arguments else ", ")
            + json.dumps(key)
            + ": "
            + json.dumps(typed(text, schema), ensure_ascii=False)
        )
        return self._arguments(piece)

    def _arguments(self, piece: str) -> dict[str, Any]:
        call = self.calls[-1]
        call.arguments += piece
        return {"tool_calls": [{"index": call.index, "function": {"arguments": piece}}]}

    def flush(self, cut: bool = False) -> list[dict[str, Any]]:
        rest = self._buffer[self._at :]
        if self._state in ("start", "text"):
            # held back, a piece that may start the trigger: text, unless cut (it may have been one)
            return [d for d in [self._content(len(rest) - (partial(rest, OPEN) if cut else 0))] if d]
        if cut and self._state in ("function", "parameters", "between"):
            # a call cut by max_tokens: never text
            self._at = len(self._buffer)
            return []
        if self._state == "between" and not rest.strip("\n"):
            return []
        return [d for d in [self._give_up()] if d]
