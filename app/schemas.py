"""The OpenAI request bodies the gateway accepts and the ``speculative`` extension (docs/design.md §5):
pydantic at the HTTP boundary only."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from core.config import PipelineParams, TreeParams, in_range
from core.grammar import MAX_JSON_DEPTH, json_depth
from core.names import Reconstruction

# ASCII digits only: str.isdigit takes "²", which int() refuses
_TOKEN_ID = re.compile(r"\s*([0-9]{1,10})\s*")


def _shallow(value: Any) -> Any:
    """A JSON value nested at most MAX_JSON_DEPTH levels (deeper, the schema rewrite and the grammar engine
    would run out of stack)."""
    depth = json_depth(value)
    if depth > MAX_JSON_DEPTH:
        raise ValueError(f"nested {depth} levels deep; at most {MAX_JSON_DEPTH} are allowed")
    return value


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a typo in a field is a 400, not ignored


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")  # a request's extras are reported as unsupported, by name


class RelaxationParams(_Strict):
    """``"speculative": {"relaxation": {...}}``: DSD's relaxed verification (lossy, docs/design.md §3.8)."""

    tau_max: float = Field(default=0.5, ge=0, lt=1)  # τ's ceiling; 0 = strict
    kl_scale: float = Field(default=1.0, gt=0)  # nats: τ falls by e per kl_scale of KL(q ‖ p)


class SpeculativeParams(_Strict):
    """``"speculative": {...}`` in a request: overrides the configured decoding for it."""

    mode: str | None = None
    num_draft_tokens: int | Literal["auto"] | None = None
    k: int | Literal["full"] | None = None
    reconstruction: Reconstruction | None = None
    draft_top_k: int | None = Field(default=None, ge=0, le=256)
    draft_top_p: float | None = Field(default=None, gt=0, le=1)
    overlap: bool | None = None
    relaxation: RelaxationParams | None = None
    tree: TreeParams | None = None
    pipeline: PipelineParams | None = None  # mode pipeline: the tree and its segments (docs/design.md §3.7)
    profile: bool | None = None  # usage speculative.profile: each round's time by part, bytes and tokens
    # model | lookup | model+lookup, or a registered drafter: where a draft comes from (docs/design.md §3.10)
    drafter: str | None = None

    # the config's checks (mode: a 400 of its own, app.requests)
    _in_range = field_validator("k", "num_draft_tokens", "mode")(in_range)


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchemaFormat(_Strict):
    """``response_format.json_schema``: OpenAI's named schema."""

    model_config = ConfigDict(populate_by_name=True)

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    json_schema: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None

    _depth = field_validator("json_schema")(_shallow)


class ResponseFormat(_Strict):
    """``response_format``: ``text``, ``json_object`` (any JSON object) or ``json_schema``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Strict):
    """vLLM's ``structured_outputs``: exactly one of a schema, a regex, choices or a grammar."""

    json_: dict[str, Any] | str | bool | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(default=None, min_length=1)
    grammar: str | None = None

    _depth = field_validator("json_")(_shallow)


class _Common(_Open):
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=-1)  # 0 or -1: off
    n: int = Field(default=1, ge=1, le=8)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    # vLLM's (> 0 there; below 0.01 a logit ÷ it overflows fp32)
    repetition_penalty: float = Field(default=1.0, ge=0.01, le=20)
    min_p: float = Field(default=0.0, ge=0, lt=1)  # vLLM's
    logit_bias: dict[str, float] | None = None  # token id (as a string) → [−100, 100], added to its logit
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None  # vLLM's
    speculative: SpeculativeParams | None = None
    return_tokens_as_token_ids: bool = False  # vLLM's: logprobs name tokens "token_id:N"
    # vLLM's (benchmark clients fix output lengths with it): EOS does not end the answer
    ignore_eos: bool = False
    # vLLM's: neither EOS nor a stop string ends the answer before this many tokens
    min_tokens: int = Field(default=0, ge=0)

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > 4:
            raise ValueError("at most 4 stop sequences")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        """Keys as canonical ids ("07" → "7"); two spellings of one id are refused, not merged."""
        if value is None:
            return None
        out: dict[str, float] = {}
        for key, bias in value.items():
            match = _TOKEN_ID.fullmatch(key)
            if match is None:
                raise ValueError(
                    f"logit_bias keys are token ids (integers ≥ 0 written in ASCII digits), got {key!r}"
                )
            if not -100 <= bias <= 100:
                raise ValueError(f"logit_bias values lie in [-100, 100], got {bias} for token {key!r}")
            token = str(int(match.group(1)))
            if token in out:
                raise ValueError(f"logit_bias names token {token} twice (as {key!r} and another spelling)")
            out[token] = bias
        return out

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def unsupported(self) -> list[tuple[str, str]]:
        """(param, why) for every parameter set to something this gateway does not do."""
        found = [(name, "is not supported") for name in sorted(self.model_extra or {})]
        if self.stream_options is not None and not self.stream:
            found.append(("stream_options", "is only allowed with stream: true"))
        return found


class CompletionRequest(_Common):
    prompt: str | list[int]
    # 0 only with echo: the prompt's logprobs alone (lm-eval's loglikelihood)
    max_tokens: int | None = Field(default=None, ge=0)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value: str | list[int]) -> str | list[int]:
        if isinstance(value, list) and any(t < 0 for t in value):
            raise ValueError("token ids must be ≥ 0")
        return value


class FunctionDef(_Strict):
    """``tools[i].function``: a function the model may call."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of an object; none: no arguments
    strict: bool | None = None  # the arguments always follow ``parameters`` here

    @field_validator("parameters")
    @classmethod
    def _parameters(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and value.get("type", "object") != "object":
            raise ValueError("a function's parameters are a JSON schema of type object")
        return _shallow(value)


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    """``tool_choice: {"type": "function", "function": {"name": …}}``: call this one."""

    type: Literal["function"]
    function: FunctionName


class CalledFunction(_Open):
    name: str
    arguments: str  # JSON text, as the API sends it


class MessageToolCall(_Open):
    """An assistant message's ``tool_calls[i]`` in the conversation."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ContentPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool's result: the call it answers
    # an assistant's earlier thinking: rendered where the template renders it (Qwen3's)
    reasoning_content: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """As the chat template takes it: the text, developer as system, the calls or the call answered, an
        assistant's reasoning."""
        text = (
            "".join(part.text for part in self.content)
            if isinstance(self.content, list)
            else self.content or ""
        )
        message: dict[str, Any] = {
            "role": "system" if self.role == "developer" else self.role,
            "content": text,
        }
        if self.reasoning_content is not None and self.role == "assistant":
            message["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "id": c.id,
                    "type": c.type,
                    "function": {"name": c.function.name, "arguments": c.function.arguments},
                }
                for c in self.tool_calls
            ]
        if self.role == "tool":
            message["tool_call_id"] = self.tool_call_id
        return message


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    tools: list[ToolDef] | None = Field(default=None, min_length=1, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    def chat_messages(self) -> list[dict[str, Any]]:
        return [m.to_dict() for m in self.messages]


class TokenizeRequest(_Strict):
    """``POST /tokenize`` (vLLM's shape): a ``prompt`` as ``/v1/completions`` takes it, or ``messages`` (and
    ``tools``) as ``/v1/chat/completions`` renders them — so ``count`` is the ``usage.prompt_tokens`` that
    request would report."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    tools: list[ToolDef] | None = Field(default=None, min_length=1, max_length=128)
    # None: a prompt's (True), as completions encode it; messages: the template's own (False)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True  # messages: as a chat request renders them
    continue_final_message: bool = False  # messages: the last one left open (vLLM's), not a new turn
    return_token_strs: bool = False

    def problem(self) -> tuple[str, str] | None:
        """(param, why) when the body asks for something the fields cannot give together."""
        if (self.prompt is None) == (self.messages is None):
            return "prompt", "give exactly one of prompt or messages"
        if self.prompt is not None and (
            self.tools is not None or self.continue_final_message or not self.add_generation_prompt
        ):
            return "prompt", "tools, add_generation_prompt and continue_final_message go with messages"
        if self.continue_final_message and self.add_generation_prompt:
            return "continue_final_message", "continue_final_message needs add_generation_prompt: false"
        return None


class DetokenizeRequest(_Strict):
    """``POST /detokenize`` (vLLM's shape): token ids back to text."""

    model: str | None = None
    tokens: list[int] = Field(max_length=1_000_000)
