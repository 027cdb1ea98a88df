"""Llama 3.1 / 3.2 / 3.3: ``{"name": …, "parameters": …}`` as the whole answer, after ``<|python_tag|>`` where
the model writes it (one special token in Llama 3's tokenizer)."""

from __future__ import annotations

from app.tool_formats.base import register
from app.tool_formats.json_calls import CallStyle, JsonCallFormat


@register
class Llama3Json(JsonCallFormat):
    name = "llama3_json"
    style = CallStyle("", ("",), "parameters", None, "", lead="<|python_tag|>")
    markers = ("<|python_tag|>",)

    def detects(self, template: str) -> bool:
        return "<|python_tag|>" in template or "<|start_header_id|>ipython<|end_header_id|>" in template
