"""Mistral v0.3, Nemo: ``[TOOL_CALLS] [{"name": …, "arguments": …}, …]``; ``[TOOL_CALLS]`` is one control
token in Mistral's tokenizers. Its templates take call ids of nine letters and digits and need roles to
alternate."""

from __future__ import annotations

from app.tool_formats.base import nine_character_id, register
from app.tool_formats.json_calls import CallStyle, JsonCallFormat


@register
class Mistral(JsonCallFormat):
    name = "mistral"
    style = CallStyle("[TOOL_CALLS]", (" [", "["), "arguments", ", ", "]")
    markers = ("[TOOL_CALLS]",)
    merge_roles = True

    def detects(self, template: str) -> bool:
        return "[TOOL_CALLS]" in template

    def call_id(self, given: str) -> str:
        return nine_character_id(given)
