"""Mistral's tokenizers from v11 (Magistral, Devstral 2507 and later): each call
``[TOOL_CALLS]name[ARGS]{…}``, the arguments as the template's JSON; ``[TOOL_CALLS]`` and ``[ARGS]`` are
control tokens there. Its templates need roles to alternate."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from app.tool_formats.base import (
    JSON_STYLE,
    Markers,
    SteppedOutput,
    ToolFormat,
    after_trigger,
    nine_character_id,
    register,
)
from app.tools import _INVALID, Tool, ToolCall, ToolOutput, _loads, partial
from core.grammar import strict

TRIGGER, ARGS = "[TOOL_CALLS]", "[ARGS]"


@register
class MistralArgs(ToolFormat):
    name = "mistral_args"
    markers = (TRIGGER, ARGS)
    merge_roles = True
    text_with_calls = True

    def detects(self, template: str) -> bool:
        return TRIGGER in template and ARGS in template

    def call_id(self, given: str) -> str:
        return nine_character_id(given)

    def grammar(self, tools: list[Tool], required: bool, parallel: bool, markers: Markers) -> str:
        trigger, args = markers.grammar(TRIGGER), markers.grammar(ARGS)
        calls = [
            f"{json.dumps(t.name)} {args} %json "
            f"{json.dumps({**strict(t.parameters), 'x-guidance': JSON_STYLE})}"
            for t in tools
        ]
        body = f"call ({trigger} call)*" if parallel else "call"
        start, rules = after_trigger(TRIGGER, body, required, markers)
        return "\n".join([start, "call: " + "\n    | ".join(calls), *rules]) + "\n"

    def reader(self, markers: Markers, tools: dict[str, dict[str, Any]]) -> ToolOutput:
        return ArgsToolOutput()


@dataclass
class ArgsToolOutput(SteppedOutput):
    """Reads ``text[TOOL_CALLS]name[ARGS]{…}[TOOL_CALLS]…`` as it arrives: the text as content (a piece that
    may start the trigger held back), each call's name once ``[ARGS]`` ends it, its arguments as they come."""

    @property
    def is_complete(self) -> bool:
        return (
            self._state in ("between", "done")
            and not self._buffer[self._at :]
            and bool(self.calls)
            and all(_loads(call.arguments) is not _INVALID for call in self.calls)
        )

    def _step(self) -> dict[str, Any] | None:
        rest = self._buffer[self._at :]
        if self._state in ("start", "text"):
            at = rest.find(TRIGGER)
            if at >= 0:
                delta = self._content(at)
                self._at, self._state = self._at + len(TRIGGER), "name"
                return delta
            return self._content(len(rest) - partial(rest, TRIGGER))
        if self._state == "name":
            at = rest.find(ARGS)
            if at < 0:
                return None
            call = ToolCall(len(self.calls), f"call_{uuid.uuid4().hex[:24]}", rest[:at])
            self.calls.append(call)
            self._at, self._state, self._depth = self._at + at + len(ARGS), "arguments", 0
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
        if self._state == "arguments":
            return self._raw_value(rest, into_content=False)
        if self._state == "between":
            if rest.startswith(TRIGGER):
                self._at, self._state = self._at + len(TRIGGER), "name"
                return None
            return None if TRIGGER.startswith(rest) else self._give_up()
        return self._give_up()

    def flush(self, cut: bool = False) -> list[dict[str, Any]]:
        rest = self._buffer[self._at :]
        if self._state in ("start", "text"):
            # held back, a piece that may start the trigger: text, unless cut (it may have been one)
            return [d for d in [self._content(len(rest) - (partial(rest, TRIGGER) if cut else 0))] if d]
        if cut and self._state in ("name", "arguments", "between"):  # a call cut by max_tokens: never text
            self._at = len(self._buffer)
            return []
        if self._state == "between" and not rest:
            self._state = "done"
            return []
        return [d for d in [self._give_up()] if d]
