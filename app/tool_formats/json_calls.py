"""The families that write a call as a JSON object ``{"name": …, "<args_key>": {…}}`` after a trigger (Hermes,
Mistral v0.3, Llama 3): one grammar and one reader, each family a ``CallStyle``."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from app.tool_formats.base import JSON_STYLE, Markers, SteppedOutput, ToolFormat, after_trigger
from app.tools import _INVALID, Tool, ToolOutput, _loads, partial
from core.grammar import strict


@dataclass(frozen=True)
class CallStyle:
    """How a format writes its calls: ``trigger`` starts them (empty: the answer itself, starting with ``{``,
    after ``lead`` where the tokenizer has it as a special token); then one of ``after_trigger``; each call
    ``{"name": …, "<args_key>": …}``; ``separator`` between calls, ``end`` after the last."""

    trigger: str
    after_trigger: tuple[str, ...]
    args_key: str
    separator: str | None  # None: one call an answer
    end: str
    lead: str = ""


class JsonCallFormat(ToolFormat):
    style: ClassVar[CallStyle]

    def grammar(self, tools: list[Tool], required: bool, parallel: bool, markers: Markers) -> str:
        """Free text until the trigger, then calls that follow their tool's parameters and the closing marker;
        with ``required`` (tool_choice required or named), calls from the first token. A trigger the tokenizer
        holds as one special token is that token; its spelling out of ordinary pieces is not free text
        either."""
        style = self.style
        schemas = [
            strict(
                {
                    "type": "object",
                    "properties": {"name": {"const": t.name}, style.args_key: t.parameters},
                    "required": ["name", style.args_key],
                    "additionalProperties": False,
                }
            )
            for t in tools
        ]
        call = {"anyOf": schemas} if len(schemas) > 1 else schemas[0]
        calls = (
            f"call ({markers.grammar(style.separator)} call)*"
            if parallel and style.separator is not None
            else "call"
        )
        after = " | ".join(markers.grammar(a) if a else '""' for a in style.after_trigger)
        body = f"({after}) {calls}" + (f" {markers.grammar(style.end)}" if style.end else "")
        rules = [f"call: %json {json.dumps({**call, 'x-guidance': JSON_STYLE})}"]
        if not style.trigger:  # the call is the whole answer; free text may not start as one
            lead = f"{markers.grammar(style.lead)}? " if style.lead in markers else ""
            start = f"start: {lead}call" if required else f"start: FREE | {lead}call"
            rules.append(r"FREE: /(?s:.*)/ & ~/\{(?s:.*)/")
        else:
            start, more = after_trigger(style.trigger, body, required, markers)
            rules += more
        return "\n".join([start, *rules]) + "\n"

    def reader(self, markers: Markers, tools: dict[str, dict[str, Any]]) -> ToolOutput:
        # spelled out, it is free text (the grammar's): not a lead
        lead = self.style.lead if self.style.lead in markers else ""
        return NativeToolOutput(style=replace(self.style, lead=lead))


@dataclass
class NativeToolOutput(SteppedOutput):
    """Reads an answer in a JSON-call format as it arrives into OpenAI deltas: free text as content, a
    possible trigger held back until it is one (never streamed as text), then each call's name and its
    arguments as they come."""

    style: CallStyle = field(
        default_factory=lambda: CallStyle(
            "<tool_call>", ("\n",), "arguments", "\n</tool_call>\n<tool_call>\n", "\n</tool_call>"
        )
    )

    def __post_init__(self) -> None:
        self._name_open = '{"name": "'
        self._args_open = f'", "{self.style.args_key}": '

    @property
    def is_complete(self) -> bool:
        if self._state == "between" and self._buffer[self._at :] == "}" + self.style.end:
            return all(_loads(call.arguments) is not _INVALID for call in self.calls)
        return self._state == "done" and all(_loads(call.arguments) is not _INVALID for call in self.calls)

    def _step(self) -> dict[str, Any] | None:
        rest = self._buffer[self._at :]
        if self._state == "arguments":
            return self._raw_value(rest, into_content=False)
        if self._state in ("start", "text"):
            return self._free(rest)
        if self._state == "after":
            return self._after(rest)
        if self._state == "call":
            return self._call(rest)
        if self._state == "between":
            return self._between(rest)
        return self._give_up()  # done or raw: anything more is text (the grammar allows none)

    def _free(self, rest: str) -> dict[str, Any] | None:
        trigger = self.style.trigger
        if not trigger:
            # the answer is a call when it starts with "{" (after the lead token, if any), else text to its
            # end
            lead = self.style.lead
            if self._state == "start" and lead and rest.startswith(lead):
                self._at += len(lead)
                self._state = "call"
                return None
            if self._state == "start" and lead and lead.startswith(rest):
                return None  # may be the lead: wait
            if self._state == "start" and rest.startswith("{"):
                self._state = "call"
                return self._call(rest)
            self._state = "text"
            return self._content(len(rest))
        at = rest.find(trigger)
        if at >= 0:
            delta = self._content(at)
            self._state = "after"  # the trigger stays unread until what follows it is seen
            return delta
        held = partial(rest, trigger)
        return self._content(len(rest) - held)

    def _after(self, rest: str) -> dict[str, Any] | None:
        """The trigger and what must follow it (a newline, an opening bracket); not a call after all: text,
        trigger included."""
        options = [self.style.trigger + option for option in self.style.after_trigger]
        for option in sorted(options, key=len, reverse=True):
            if rest.startswith(option):
                self._at += len(option)
                self._state = "call"
                return None
        return None if any(option.startswith(rest) for option in options) else self._give_up()

    def _between(self, rest: str) -> dict[str, Any] | None:
        """After a call's arguments: "}" and the separator to the next call, or "}" and the end."""
        separator = None if self.style.separator is None else "}" + self.style.separator
        end = "}" + self.style.end
        if separator is not None and rest.startswith(separator):
            self._at, self._state = self._at + len(separator), "call"
        elif rest.startswith(end) and (separator is None or not separator.startswith(rest)):
            self._at, self._state = self._at + len(end), "done"
        elif not (end.startswith(rest) or (separator is not None and separator.startswith(rest))):
            return self._give_up()
        return None

    def flush(self, cut: bool = False) -> list[dict[str, Any]]:
        rest = self._buffer[self._at :]
        if self._state == "between" and rest == "}" + self.style.end:
            # the end, which could have been a separator's start
            self._at, self._state = len(self._buffer), "done"
            return []
        if self._state in ("start", "text"):
            # a held-back piece that never became the trigger: text after all (cut: it may have)
            delta = self._content(
                len(rest) - (partial(rest, self.style.trigger) if cut and self.style.trigger else 0)
            )
            return [delta] if delta else []
        if cut and self._state in ("after", "call", "arguments", "between"):
            # a call cut by max_tokens: never text (ToolOutput.flush)
            self._at = len(self._buffer)
            return []
        return super().flush(cut)
