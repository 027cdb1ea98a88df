"""Hermes 2 Pro, Qwen2.5, Qwen3: ``<tool_call>\\n{"name": …, "arguments": …}\\n</tool_call>``."""

from __future__ import annotations

from app.tool_formats.base import register
from app.tool_formats.json_calls import CallStyle, JsonCallFormat


@register
class Hermes(JsonCallFormat):
    name = "hermes"
    style = CallStyle("<tool_call>", ("\n",), "arguments", "\n</tool_call>\n<tool_call>\n", "\n</tool_call>")
    markers = ("<tool_call>", "</tool_call>")

    def detects(self, template: str) -> bool:
        return "<tool_call>" in template
