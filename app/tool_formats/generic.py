"""The generic format (app.tools): a system message that describes the tools and one JSON object as the
answer, ``{"tool_calls": [{"name": …, "arguments": {…}}]}`` or ``{"response": …}``. What a template without a
tool syntax of its own gets (the built-in model's); never detected, and the only one that takes a
response_format beside tools."""

from __future__ import annotations

from typing import Any

from app.tool_formats.base import Markers, ToolFormat, register
from app.tools import Tool, ToolOutput


@register
class Generic(ToolFormat):
    name = "generic"

    def detects(self, template: str) -> bool:
        return False

    def grammar(self, tools: list[Tool], required: bool, parallel: bool, markers: Markers) -> str:
        raise TypeError(
            "the generic format's grammar is a JSON schema: app.tools.generic_schema (app.requests builds it)"
        )

    def reader(self, markers: Markers, tools: dict[str, dict[str, Any]]) -> ToolOutput:
        # with a response_format beside the tools: ToolOutput(raw_response=True) (app.gateway)
        return ToolOutput()
