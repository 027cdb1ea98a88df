"""The body of ``POST /v1/responses`` (OpenAI's Responses API): pydantic at the HTTP boundary only.

Every field that changes the answer is read or refused by name; the fields coding agents send with every
request that a server without hosted tools can pass over honestly (``include``, ``reasoning``,
``prompt_cache_key``, ``client_metadata`` …) are accepted and have no effect (docs/responses.md)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator

from app.schemas import FunctionDef, SpeculativeParams, _shallow

_NAME = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
HOSTED_TOOLS = frozenset(
    {  # tools OpenAI runs on its side: not in the prompt here, and the response says so
        "web_search",
        "web_search_preview",
        "web_search_2025_08_26",
        "web_search_preview_2025_03_11",
        "file_search",
        "code_interpreter",
        "image_generation",
        "computer_use_preview",
        "computer_use",
        "mcp",
    }
)
# run by the client: offered as functions, called as their own items
CLIENT_TOOLS = frozenset({"local_shell", "shell", "apply_patch"})
# what a client may ask to include that this gateway has nothing of (no hosted tools, no encrypted reasoning)
PASSED_OVER_INCLUDES = frozenset(
    {
        "reasoning.encrypted_content",
        "web_search_call.results",
        "web_search_call.action.sources",
        "file_search_call.results",
        "code_interpreter_call.outputs",
        "computer_call_output.output.image_url",
        "message.input_image.image_url",
    }
)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Lenient(BaseModel):
    """Items, parts and tools as clients send them back: a field this gateway does not know (a newer one: a
    message's ``end_turn``, a tool's ``output_schema``) changes nothing here and is passed over, as unknown
    top-level fields are."""

    model_config = ConfigDict(extra="ignore")


class InputText(_Lenient):
    type: Literal["input_text", "output_text", "text"]
    text: str
    annotations: list[Any] | None = None  # an earlier answer's output_text, sent back as it came
    logprobs: list[Any] | None = None


class Refusal(_Lenient):
    type: Literal["refusal"]
    refusal: str


class UnsupportedPart(BaseModel):
    """An image, a file or audio: this gateway serves text models (a 400 naming the part)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["input_image", "input_file", "input_audio"]


ContentPart = Annotated[InputText | Refusal | UnsupportedPart, Field(discriminator="type")]


class MessageItem(_Lenient):
    """A message: ``{"role", "content"}`` (type ``message`` or none), content a string or parts."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]
    id: str | None = None
    status: str | None = None
    phase: str | None = None  # an assistant message's phase (commentary | final_answer), as it came

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(
            p.text if isinstance(p, InputText) else p.refusal if isinstance(p, Refusal) else ""
            for p in self.content
        )


class _Call(_Lenient):
    """What every call sent back has: the id that its output names, the tool's name and namespace."""

    call_id: str = Field(min_length=1)
    name: str
    namespace: str | None = None
    id: str | None = None
    status: str | None = None


class FunctionCallItem(_Call):
    """An earlier answer's call, sent back with the conversation."""

    type: Literal["function_call"]
    arguments: str


class _Output(_Lenient):
    """A call's result: text, or parts whose text is joined."""

    call_id: str = Field(min_length=1)
    output: str | list[ContentPart]
    name: str | None = None
    namespace: str | None = None
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return (
            self.output
            if isinstance(self.output, str)
            else "".join(p.text for p in self.output if isinstance(p, InputText))
        )


class FunctionCallOutputItem(_Output):
    """A function call's result."""

    type: Literal["function_call_output"]


class ReasoningItem(BaseModel):
    """An earlier answer's reasoning, sent back: given to the template with the assistant turn it precedes (as
    ``reasoning_content``), which renders it where it renders thinking (Qwen3: the turns after the last user
    message)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["reasoning"]
    content: list[dict[str, Any]] | None = None
    summary: list[dict[str, Any]] | None = None

    def text(self) -> str:
        parts = [p.get("text", "") for p in self.content or [] if p.get("type") == "reasoning_text"]
        return "".join(parts) or "\n\n".join(
            p.get("text", "") for p in self.summary or [] if p.get("type") == "summary_text"
        )


class CustomToolCallItem(_Call):
    """An earlier answer's call of a freeform (custom) tool: its input is one string."""

    type: Literal["custom_tool_call"]
    input: str


class CustomToolCallOutputItem(_Output):
    """A freeform tool call's result."""

    type: Literal["custom_tool_call_output"]


class ClientCallItem(BaseModel):
    """A call of a client-run tool (``local_shell_call``, ``shell_call``, ``apply_patch_call``) or its output,
    sent back: read by app.responses_api.client_tools."""

    model_config = ConfigDict(extra="allow")
    type: Literal[
        "local_shell_call",
        "local_shell_call_output",
        "shell_call",
        "shell_call_output",
        "apply_patch_call",
        "apply_patch_call_output",
    ]
    call_id: str | None = None
    id: str | None = None


class OtherItem(BaseModel):
    """Any other item type: a 400 naming it (item references, hosted tools' calls, custom tools' calls …)."""

    model_config = ConfigDict(extra="allow")
    type: str


_CLIENT_ITEMS = (
    "local_shell_call",
    "local_shell_call_output",
    "shell_call",
    "shell_call_output",
    "apply_patch_call",
    "apply_patch_call_output",
)


def _item_kind(value: Any) -> str:
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", "message")
    if kind in _CLIENT_ITEMS:
        return "client"
    return (
        kind
        if kind
        in (
            "message",
            "function_call",
            "function_call_output",
            "reasoning",
            "custom_tool_call",
            "custom_tool_call_output",
        )
        else "other"
    )


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")]
    | Annotated[CustomToolCallItem, Tag("custom_tool_call")]
    | Annotated[CustomToolCallOutputItem, Tag("custom_tool_call_output")]
    | Annotated[ClientCallItem, Tag("client")]
    | Annotated[OtherItem, Tag("other")],
    Discriminator(_item_kind),
]


class FunctionTool(FunctionDef):
    """A function tool, flat (chat nests the same fields under ``function``); newer fields passed over."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    defer_loading: bool | None = None


class CustomTextFormat(_Strict):
    type: Literal["text"]


class CustomGrammarFormat(_Strict):
    """A freeform tool's input held to a grammar: Lark (regular, written out as one regex: core.freeform) or a
    regex."""

    type: Literal["grammar"]
    syntax: Literal["lark", "regex"]
    definition: str = Field(min_length=1)


class CustomTool(_Lenient):
    """A freeform tool (a coding agent's ``apply_patch``): the model calls it with one string, its
    ``input``."""

    type: Literal["custom"]
    name: str = _NAME
    description: str | None = None
    format: Annotated[CustomTextFormat | CustomGrammarFormat, Field(discriminator="type")] | None = None
    defer_loading: bool | None = None


class NamespaceTool(_Lenient):
    """Tools grouped under a name (what coding agents send for an MCP server's tools): offered as
    ``<namespace>__<name>``, called back with the namespace and the name apart."""

    type: Literal["namespace"]
    name: str = _NAME
    description: str | None = None
    tools: list[Annotated[FunctionTool | CustomTool, Field(discriminator="type")]]


class OtherTool(BaseModel):
    """A client-run tool (``local_shell``, ``shell``, ``apply_patch``): offered as a function; a hosted tool
    (``web_search`` …): left out of the prompt with a warning; any other type: a 400."""

    model_config = ConfigDict(extra="allow")
    type: str


def _tool_kind(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if kind in ("function", "namespace", "custom") else "other"


Tool = Annotated[
    Annotated[FunctionTool, Tag("function")]
    | Annotated[NamespaceTool, Tag("namespace")]
    | Annotated[CustomTool, Tag("custom")]
    | Annotated[OtherTool, Tag("other")],
    Discriminator(_tool_kind),
]


class FormatText(_Strict):
    type: Literal["text"]


class FormatJsonObject(_Strict):
    type: Literal["json_object"]


class FormatJsonSchema(_Strict):
    """``text.format`` of type ``json_schema``: OpenAI's named schema, flat (not nested as in chat's
    ``response_format``)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["json_schema"]
    name: str = _NAME
    description: str | None = None
    json_schema: dict[str, Any] | bool = Field(alias="schema")
    strict: bool | None = None

    _depth = field_validator("json_schema")(_shallow)


class TextParam(_Lenient):
    format: (
        Annotated[FormatText | FormatJsonObject | FormatJsonSchema, Field(discriminator="type")] | None
    ) = None
    verbosity: Literal["low", "medium", "high"] | None = None  # a hint to OpenAI's models: passed over


class FunctionChoice(_Lenient):
    type: Literal["function"]
    name: str
    namespace: str | None = None


class ReasoningParam(BaseModel):
    """Hints to OpenAI's reasoning models (``effort``, ``summary``, ``context``, ``mode`` …): accepted,
    whatever they say, and passed over (the template decides whether the model thinks)."""

    model_config = ConfigDict(extra="allow")
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class StreamOptionsParam(_Lenient):
    # OpenAI pads events against length side channels; nothing to pad here
    include_obfuscation: bool | None = None


class ResponsesRequest(BaseModel):
    """``POST /v1/responses``. Other fields are passed over (newer hints), unless a name is a near miss of one
    of these (app.responses_api.request: a 400 that names the field meant)."""

    model_config = ConfigDict(extra="allow")

    model: str
    input: str | list[InputItem] | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = Field(default=None, ge=0, lt=2**63)  # as chat's: seeded text is reproducible
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextParam | None = None
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    user: str | None = None
    store: bool | None = None
    stream: bool = False
    stream_options: StreamOptionsParam | None = None
    include: list[str] | None = None
    reasoning: ReasoningParam | None = None
    truncation: Literal["disabled", "auto"] | None = None
    background: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    max_tool_calls: int | None = Field(default=None, ge=1)
    # a hint to OpenAI's cache: passed over (the workers keep no cache across requests)
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    client_metadata: dict[str, Any] | None = None  # the client's own (Codex sends it): passed over
    prompt_cache_options: dict[str, Any] | None = None  # a hint to OpenAI's cache: passed over
    safety_identifier: str | None = None
    service_tier: str | None = None
    speculative: SpeculativeParams | None = None

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        for key, text in (value or {}).items():
            if len(key) > 64 or len(text) > 512:
                raise ValueError("metadata keys are at most 64 characters and values at most 512")
        return value
