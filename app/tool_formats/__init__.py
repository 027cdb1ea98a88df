"""Tool calls in the model's own format, free of I/O (docs/tools.md): one registered class a family, each in a
file of its own with its detection, rendering, grammar and reader (app.tool_formats.base.ToolFormat). The
import order below is the order detection tries them, as llama.cpp's chat code orders them: Qwen3-Coder's XML
before Hermes (its template holds ``<tool_call>`` too), Mistral's ``[ARGS]`` before its v0.3 JSON array. The
generic format (app.tools) is the fallback, and what ``draft.tool_format: generic`` asks for."""

from __future__ import annotations

# isort: off
# registration, in detection order
from app.tool_formats import qwen3_coder, hermes, llama3_json, mistral_args, mistral, generic  # noqa: F401

# isort: on
from app.tool_formats.base import FORMATS, Markers, ToolFormat, special_ids, template_tools
from app.tool_formats.json_calls import CallStyle, NativeToolOutput
from core.errors import ConfigError

GENERIC = FORMATS["generic"]
__all__ = [
    "FORMATS",
    "GENERIC",
    "CallStyle",
    "Markers",
    "NativeToolOutput",
    "ToolFormat",
    "by_name",
    "detect",
    "special_ids",
    "template_tools",
]


def detect(template: str | None) -> ToolFormat:
    """The format a chat template renders tool calls in, by its signature strings; a template that takes no
    ``tools`` gets the generic format."""
    if not template or "tools" not in template:
        return GENERIC
    return next((fmt for fmt in FORMATS.values() if fmt.detects(template)), GENERIC)


def by_name(name: str) -> ToolFormat:
    """A registered format (``draft.tool_format``), or a ConfigError that lists them."""
    if name not in FORMATS:
        raise ConfigError(
            f"draft.tool_format: {name!r} is not a tool format: use auto or one of {', '.join(FORMATS)}"
        )
    return FORMATS[name]
