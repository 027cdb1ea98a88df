"""A request to a job (docs/design.md §5): the body checked, the prompt tokenised, the speculative options,
sampling and transform resolved against the config and the targets; every refusal a 400 naming its
parameter."""

from __future__ import annotations

import json
import secrets
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel

from app.adaptive import DEFAULT_GAMMA
from app.drafting.drafters import DRAFTERS, MODEL, DraftModel
from app.engine import Engine, GenerationRequest, SpecOptions
from app.engine.late import waits_for_a_model
from app.errors import ApiError
from app.reasoning import Thinking, after_reasoning, opens_thinking, thinking_markers
from app.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    NamedToolChoice,
    SpeculativeParams,
    TokenizeRequest,
)
from app.targets.pipeline import PipelineTarget
from app.targets.pool import TargetSet
from app.tool_formats import GENERIC, Markers, ToolFormat, by_name, detect, template_tools
from app.tools import Tool, generic_schema, render_messages, tools_prompt
from app.usage import Usage, used_tree
from core.config import PipelineParams, SpecgateConfig, TreeParams
from core.errors import ConfigError
from core.grammar import GrammarError, GrammarKind, GrammarSpec, engine_version, load_schema
from core.math.relaxed import Relaxation
from core.math.sampling import MIN_TEMPERATURE, SamplingParams
from core.modes import MODES, mode_named, target_problem
from core.names import Mode
from core.protocol import InfoResponse
from core.transform import TransformSpec

_EXACT_DRAFT_TOP_K = 32  # exact needs a truncated draft (docs/design.md §3.5)
Body = CompletionRequest | ChatCompletionRequest
T = TypeVar("T")


@dataclass
class Job:
    """One parsed request, ready to run: its choices and how to report them."""

    id: str
    created: int
    model: str
    choices: list[GenerationRequest]
    stops: list[str]
    usage: Usage
    prompt_text: str = ""
    echo_logprobs: bool = False  # the prompt's tokens carry logprobs: its text leaves with them (first event)
    tokens_as_ids: bool = False  # logprobs name tokens token_id:N (vLLM's return_tokens_as_token_ids)
    arrived: float = field(default_factory=time.monotonic)  # for time to first token / latency
    grammar_param: str = "response_format"  # the parameter that asked for the grammar (what an error names)
    tools: bool = False  # the answer is in the generic tool format (app.tools): calls or a response
    # tools: the response has a schema of its own (response_format): its JSON is the content
    tool_response_schema: bool = False
    # a grammar writes the answer (stop strings apply only to a tools answer's free text)
    has_grammar: bool = False
    # each tool's schema (what a compile error names)
    tool_parameters: list[dict[str, Any]] = field(default_factory=list)
    tool_format: ToolFormat = GENERIC  # tools: the format the answer is written in (app.tool_formats)
    # tools: each tool's parameters by name (a reader that types values)
    tool_schemas: dict[str, dict[str, Any]] = field(default_factory=dict)
    # the format's and the thinking's markers that are special tokens: decoded, never skipped
    markers: Markers = field(default_factory=Markers)
    # a thinking template: the answer's reasoning is told apart (app.reasoning)
    thinking: Thinking | None = None


COMPLETION_MAX_TOKENS = 16  # /v1/completions without max_tokens (chat and responses: the context left)


class Requests:
    """Requests to jobs, against the config, the draft, the targets and the engine's context
    (``Gateway.requests``)."""

    def __init__(self, config: SpecgateConfig, draft: DraftModel, pool: TargetSet, engine: Engine) -> None:
        self.config, self.draft, self.pool, self.engine = config, draft, pool, engine
        self.tokenizer = draft.runner.tokenizer
        # the operator's template (the targets' own, where the draft's differs); None: the tokenizer's
        self.chat_template: str | None = None
        if config.draft.chat_template is not None:
            try:
                self.chat_template = Path(config.draft.chat_template).expanduser().read_text()
            except OSError as exc:
                raise ConfigError(
                    f"draft.chat_template: cannot read {config.draft.chat_template}: {exc.strerror or exc}"
                ) from None
        template = self.chat_template or getattr(self.tokenizer, "chat_template", None)
        given = config.draft.tool_format
        # the format tools are written in
        self.tool_format = detect(template) if given == "auto" else by_name(given)
        # the template's thinking markers
        self.thinking = thinking_markers(template) if config.draft.reasoning == "auto" else None
        thinking = (self.thinking.open, self.thinking.close) if self.thinking is not None else ()
        # those the tokenizer holds as special tokens
        self.markers = Markers.of(self.tokenizer, self.tool_format.markers + thinking)
        if config.speculative.drafter is not None and config.speculative.drafter not in DRAFTERS:
            raise ConfigError(
                f"speculative.drafter: {config.speculative.drafter!r} is not a drafter: use one "
                f"of {sorted(DRAFTERS)}"
            )

    def completion_job(self, body: CompletionRequest) -> Job:
        self._check_common(body)
        if body.max_tokens == 0 and not body.echo:
            raise ApiError(400, "max_tokens: 0 needs echo: true (the prompt's logprobs alone)", "max_tokens")
        prompt_logprobs = body.logprobs if body.echo else None
        if prompt_logprobs is not None and any(w.is_openai_logprobs for w in self.pool.workers):
            raise ApiError(
                400,
                "echo with logprobs needs specgate workers: an openai-logprobs engine does not "
                "score prompts here",
                "echo",
            )
        if prompt_logprobs is not None and any(isinstance(w, PipelineTarget) for w in self.pool.workers):
            raise ApiError(
                400,
                "echo with logprobs needs whole-model workers: a pipeline's stages do not score prompts",
                "echo",
            )
        prompt = (
            list(self.tokenizer.encode(body.prompt)) if isinstance(body.prompt, str) else list(body.prompt)
        )
        if any(t >= self.draft.vocab_size for t in prompt):
            raise ApiError(400, f"prompt token ids must be < {self.draft.vocab_size}", "prompt")
        # OpenAI's default for completions, and vLLM's
        max_tokens = COMPLETION_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        job = self._job(body, prompt, "cmpl", max_tokens, body.logprobs, prompt_logprobs)
        if body.echo:
            job.prompt_text = body.prompt if isinstance(body.prompt, str) else self.tokenizer.decode(prompt)
        return job

    def chat_job(self, body: ChatCompletionRequest) -> Job:
        self._check_common(body)
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        messages, grammar, extra = self._tool_messages(body)
        try:
            prompt = list(
                self.tokenizer.apply_chat_template(
                    messages,
                    add_generation_prompt=True,
                    tokenize=True,
                    return_dict=False,
                    **self._template_args(extra),
                )
            )
        except Exception as exc:  # noqa: BLE001 - a template that refuses the conversation (jinja raises anything)
            raise ApiError(400, f"the chat template refuses these messages: {exc}", "messages") from None
        top = (body.top_logprobs or 0) if body.logprobs else None
        thinking = (
            opens_thinking(self.tokenizer.decode(prompt[-16:]), self.thinking)
            if self.thinking is not None
            else None
        )
        job = self._job(
            body,
            prompt,
            "chatcmpl",
            body.max_completion_tokens or body.max_tokens,
            top,
            grammar=grammar,
            thinking=thinking,
        )
        job.tools = grammar is not None and grammar[1] == "tools"
        job.tool_response_schema = (
            job.tools and body.response_format is not None and body.response_format.type != "text"
        )
        job.tool_parameters = [t.function.parameters or {} for t in body.tools or []] if job.tools else []
        job.tool_format = extra.get("format", GENERIC) if job.tools else GENERIC
        job.tool_schemas = (
            {t.function.name: t.function.parameters or {} for t in body.tools or []} if job.tools else {}
        )
        job.markers = self.markers
        return job

    def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        """``POST /tokenize``: the tokens ``/v1/completions`` (a prompt) or ``/v1/chat/completions``
        (messages, tools) would take, their count and ``max_model_len`` (the context a request may fill, as
        ``/v1/models`` says)."""
        self._check_model(body.model)
        _check_text(body)
        problem = body.problem()
        if problem is not None:
            raise ApiError(400, problem[1], problem[0])
        if body.prompt is not None:
            tokens = list(
                self.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
            )
        else:
            chat = ChatCompletionRequest(
                model=self.config.model, messages=body.messages or [], tools=body.tools
            )
            messages, _, given = self._tool_messages(chat)
            extra = {
                **self._template_args(given),
                **({"continue_final_message": True} if body.continue_final_message else {}),
            }
            try:
                if body.add_special_tokens:
                    # the rendered text encoded with the tokenizer's own specials (BOS …) added
                    text = self.tokenizer.apply_chat_template(
                        messages, add_generation_prompt=body.add_generation_prompt, tokenize=False, **extra
                    )
                    tokens = list(self.tokenizer.encode(text, add_special_tokens=True))
                else:
                    tokens = list(
                        self.tokenizer.apply_chat_template(
                            messages,
                            add_generation_prompt=body.add_generation_prompt,
                            tokenize=True,
                            return_dict=False,
                            **extra,
                        )
                    )
            except Exception as exc:  # noqa: BLE001 - a template that refuses the conversation (jinja raises anything)
                raise ApiError(400, f"the chat template refuses these messages: {exc}", "messages") from None
        out: dict[str, Any] = {
            "count": len(tokens),
            "max_model_len": self.engine.max_context,
            "tokens": tokens,
        }
        if body.return_token_strs:
            out["token_strs"] = self.tokenizer.convert_ids_to_tokens(tokens)
        return out

    def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        """``POST /detokenize``: the text of ``tokens`` (special tokens written as they are)."""
        self._check_model(body.model)
        bad = next((i for i, t in enumerate(body.tokens) if not 0 <= t < self.draft.vocab_size), None)
        if bad is not None:
            raise ApiError(
                400,
                f"tokens[{bad}] = {body.tokens[bad]} is not a token id: they lie in [0, "
                f"{self.draft.vocab_size})",
                f"tokens.{bad}",
            )
        return {"prompt": self.tokenizer.decode(body.tokens)}

    def _template_args(self, extra: dict[str, Any]) -> dict[str, Any]:
        """What the chat template takes beside the messages: ``_tool_messages``' ``extra`` (but its
        ``format``, the gateway's own) and the operator's template."""
        given = {k: v for k, v in extra.items() if k != "format"}
        return given | ({"chat_template": self.chat_template} if self.chat_template is not None else {})

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.config.model:
            raise ApiError(
                404,
                f"model {model!r} does not exist; this gateway serves {self.config.model!r}",
                "model",
                "model_not_found",
            )

    def _tool_messages(
        self, body: ChatCompletionRequest
    ) -> tuple[list[dict[str, Any]], tuple[GrammarSpec | None, str] | None, dict[str, Any]]:
        """The conversation to render, with tools to call the grammar of their format (docs/design.md §3.9),
        and what else the template takes (``tools``; ``format``: the native format, not for the template): the
        chat template's own format where it has one (app.tool_formats), else the generic format — which also
        takes a response_format beside tools."""
        messages = body.chat_messages()
        called: set[str] = set()
        for i, m in enumerate(messages):
            called.update(call["id"] for call in m.get("tool_calls", []))
            if m["role"] == "tool" and not m.get("tool_call_id"):
                raise ApiError(
                    400,
                    f"messages[{i}]: a message of role tool needs tool_call_id",
                    f"messages.{i}.tool_call_id",
                )
            if m["role"] == "tool" and m["tool_call_id"] not in called:
                raise ApiError(
                    400,
                    f"messages[{i}]: tool_call_id {m['tool_call_id']!r} answers no call of an "
                    "earlier assistant message",
                    f"messages.{i}.tool_call_id",
                )
        # arguments are an object
        tools = [
            Tool(
                t.function.name,
                t.function.description or "",
                {"type": "object", **(t.function.parameters or {"properties": {}})},
            )
            for t in body.tools or []
        ]
        choice = body.tool_choice
        if choice is not None and not tools and choice != "none":
            raise ApiError(400, "tool_choice needs tools", "tool_choice")
        if len({t.name for t in tools}) != len(tools):
            raise ApiError(400, "tools: two functions share a name", "tools")
        if isinstance(choice, NamedToolChoice):
            named = [t for t in tools if t.name == choice.function.name]
            if not named:
                raise ApiError(
                    400,
                    f"tool_choice names {choice.function.name!r}, which is not among the tools "
                    f"{[t.name for t in tools]}",
                    "tool_choice",
                )
            tools = named
        fmt = self.tool_format
        if not tools or choice == "none":  # no grammar; earlier calls and results as the template writes them
            return (
                (render_messages(messages, None) if fmt is GENERIC else fmt.template_messages(messages)),
                None,
                {},
            )
        if body.structured_outputs is not None:
            raise ApiError(400, "tools cannot be combined with structured_outputs", "structured_outputs")
        required = choice == "required" or isinstance(choice, NamedToolChoice)
        if fmt is not GENERIC and (body.response_format is None or body.response_format.type == "text"):
            try:
                grammar = fmt.grammar(tools, required, body.parallel_tool_calls, self.markers)
            except ValueError as exc:
                # a parameter's grammar that cannot be held (a freeform one: core.freeform)
                raise ApiError(400, f"tools: {exc}", "tools") from None
            extra = {"tools": template_tools(tools), "format": fmt}
            return (
                fmt.template_messages(messages),
                (GrammarSpec(GrammarKind.GRAMMAR, grammar), "tools"),
                extra,
            )
        response = None
        if body.response_format is not None and body.response_format.type != "text":
            given, _ = request_grammar(body)
            response = json.loads(given.source) if given is not None else None
        schema = generic_schema(tools, required, body.parallel_tool_calls, response)
        return (
            render_messages(messages, tools_prompt(tools, schema, required)),
            (GrammarSpec.json_schema(schema), "tools"),
            {},
        )

    def _check_common(self, body: Body) -> None:
        _check_text(body)
        self._check_model(body.model)
        unsupported = body.unsupported()
        if unsupported:
            message = "; ".join(f"{param} {why}" for param, why in unsupported)
            raise ApiError(400, message, unsupported[0][0], "unsupported_parameter")

    def _job(
        self,
        body: Body,
        prompt: list[int],
        prefix: str,
        max_tokens: int | None,
        top_logprobs: int | None,
        prompt_logprobs: int | None = None,
        grammar: tuple[GrammarSpec | None, str] | None = None,
        thinking: Thinking | None = None,
    ) -> Job:
        limits = self.config.limits
        param = "messages" if prefix == "chatcmpl" else "prompt"  # where the prompt came from
        if not prompt:
            raise ApiError(400, "the prompt must not be empty", param)
        context = self.engine.max_context
        if limits.max_prompt_tokens is not None and len(prompt) > limits.max_prompt_tokens:
            raise ApiError(
                400,
                f"the prompt has {len(prompt)} tokens, more than max_prompt_tokens "
                f"{limits.max_prompt_tokens}",
                param,
                "context_length_exceeded",
            )
        if len(prompt) >= context:
            raise ApiError(
                400,
                f"the prompt has {len(prompt)} tokens, the context is {context}",
                param,
                "context_length_exceeded",
            )
        # the field that set it
        limit = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) else "max_tokens"
        if max_tokens is not None and len(prompt) + max_tokens > context:
            raise ApiError(
                400,
                f"the context is {context} tokens: {len(prompt)} in the prompt plus {limit} "
                f"{max_tokens} do not fit",
                limit,
                "context_length_exceeded",
            )
        if max_tokens is not None and body.min_tokens > max_tokens:
            raise ApiError(
                400, f"min_tokens ({body.min_tokens}) must be at most {limit} ({max_tokens})", "min_tokens"
            )
        # absent: the context left (as vLLM)
        max_tokens = context - len(prompt) if max_tokens is None else max_tokens
        # the config caps it
        max_tokens = max_tokens if limits.max_tokens is None else min(max_tokens, limits.max_tokens)
        spec = self._spec(body.speculative)
        # as vLLM: tiny T is greedy
        temperature = body.temperature if body.temperature >= MIN_TEMPERATURE else 0.0
        # −1, 0 or the whole vocabulary (or more): no truncation
        top_k = body.top_k if 0 < body.top_k < self.draft.vocab_size else 0
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=body.top_p, min_p=body.min_p)
        grammar = grammar or request_grammar(body)
        if thinking is not None and grammar[0] is not None:
            # the grammar holds the reply, after the reasoning
            wrapped = after_reasoning(grammar[0], thinking, own=grammar[1] == "tools", markers=self.markers)
            # a grammar that cannot wait for it: no reasoning told apart
            thinking = thinking if wrapped is not None else None
            grammar = (wrapped or grammar[0], grammar[1])
        transform = self._transform(body, len(prompt), *grammar)
        seed = body.seed if body.seed is not None else secrets.randbits(63)
        request_id = f"{prefix}-{uuid.uuid4().hex[:24]}"
        choices = [
            GenerationRequest(
                request_id=request_id,
                prompt=prompt,
                max_tokens=max_tokens,
                params=params,
                seed=seed,
                choice=index,
                spec=spec,
                top_logprobs=top_logprobs,
                seeded=body.seed is not None,
                prompt_logprobs=prompt_logprobs,
                ignore_eos=body.ignore_eos,
                # no answer is longer than max_tokens
                min_tokens=min(body.min_tokens, max_tokens),
                transform=transform,
                draft_after=self._draft_after(spec, len(prompt)),
            )
            for index in range(body.n)
        ]
        return Job(
            request_id,
            int(time.time()),
            self.config.model,
            choices,
            body.stops(),
            Usage(
                spec,
                len(prompt),
                tree=used_tree(spec, params),
                reasoning_tokens=None if thinking is None else 0,
            ),
            echo_logprobs=prompt_logprobs is not None,
            tokens_as_ids=body.return_tokens_as_token_ids,
            grammar_param=grammar[1],
            has_grammar=transform is not None and transform.grammar is not None,
            thinking=thinking,
        )

    def _draft_after(self, spec: SpecOptions, prompt_len: int) -> int:
        """Rounds with no draft while the draft prefills a long prompt (app.engine.late): one from
        ``draft.background_prefill_from`` tokens on — a function of the request, so a seeded text does not
        depend on load."""
        since = self.config.draft.background_prefill_from
        return 1 if since is not None and prompt_len >= since and waits_for_a_model(spec) else 0

    def _transform(
        self, body: Body, prompt_len: int, grammar: GrammarSpec | None, param: str
    ) -> TransformSpec | None:
        """The request's transform (docs/design.md §3.9), checked against what the targets can apply; None
        when it asks for none."""
        bias = tuple(sorted((int(key), float(value)) for key, value in (body.logit_bias or {}).items()))
        if any(token >= self.draft.vocab_size for token, _ in bias):
            raise ApiError(
                400,
                f"logit_bias names a token id ≥ the vocabulary size {self.draft.vocab_size}",
                "logit_bias",
            )
        transform = TransformSpec(
            bias, body.presence_penalty, body.frequency_penalty, body.repetition_penalty, grammar, prompt_len
        )
        asked = [
            name
            for name, on in (
                (param, grammar is not None),
                ("logit_bias", bool(bias)),
                ("presence_penalty", body.presence_penalty != 0),
                ("frequency_penalty", body.frequency_penalty != 0),
                ("repetition_penalty", body.repetition_penalty != 1),
                ("min_p", body.min_p != 0),
            )
            if on
        ]
        if not asked:
            return None
        engines = [w.name for w in self.pool.workers if w.is_openai_logprobs]
        if engines:
            raise ApiError(
                400,
                f"{asked[0]} needs specgate workers: {engines[0]} is an openai-logprobs engine, "
                "whose log-probabilities do not carry it",
                asked[0],
            )
        if grammar is not None:
            self._check_peers(grammar, param)
            for flag in ("ignore_eos", "min_tokens"):
                if getattr(body, flag):
                    raise ApiError(
                        400,
                        f"{flag} cannot be combined with {param}: the grammar decides where the answer ends",
                        flag,
                    )
        return None if transform.is_identity else transform

    def _check_peers(self, grammar: GrammarSpec, param: str) -> None:
        """Every worker (its /v1/info) can apply ``grammar`` as the gateway does: the same engine (forced
        tokens and masks agree), a source within its limit, EOS ids among ours (else its EOS would be taken
        for text)."""
        ours, engine, size = (
            set(self.draft.runner.info.eos_ids),
            engine_version(),
            len(grammar.source.encode()),
        )
        for where, info in self.replica_infos():
            if not set(info.eos_ids) <= ours:
                raise ApiError(
                    400,
                    f"{param} needs every worker's EOS ids among the draft's {sorted(ours)}: "
                    f"{where} ends with {sorted(info.eos_ids)}",
                    param,
                )
            if info.grammar_engine is not None and info.grammar_engine != engine:
                raise ApiError(
                    400,
                    f"{param} needs the gateway's grammar engine ({engine}) on every worker: "
                    f"{where} has {info.grammar_engine}; "
                    "install the same version on both",
                    param,
                    "grammar_engine_mismatch",
                )
            if (
                info.max_grammar_bytes is not None
                and info.max_grammar_bytes < size <= self.config.limits.max_grammar_bytes
            ):
                # past the gateway's own: compile says so
                raise ApiError(
                    400,
                    f"{param}: the {grammar.kind.value} is {size} bytes; {where} compiles at "
                    f"most {info.max_grammar_bytes} "
                    "(its max_grammar_bytes)",
                    param,
                    "grammar_too_large",
                )

    def _spec(self, override: SpeculativeParams | None) -> SpecOptions:
        base = self.config.speculative
        given = override.model_dump(exclude_none=True) if override else {}
        mode = mode_named(given.get("mode", base.mode))  # the registry's key: a Mode where built in
        takes = MODES[mode]
        extra = sorted(set(given) - takes.fields)
        if extra:
            raise ApiError(400, f"mode {str(mode)!r} does not take {extra}", f"speculative.{extra[0]}")
        engines = [w.name for w in self.pool.workers if w.is_openai_logprobs]
        pipelines = [w.name for w in self.pool.workers if isinstance(w, PipelineTarget)]
        problem = target_problem(mode, len(self.pool.workers), engines, pipelines)
        if problem is not None:
            raise ApiError(400, f"speculative.{problem}", "speculative.mode")
        k = given.get("k", base.k)
        gamma = given.get("num_draft_tokens", base.num_draft_tokens)
        top_k = given.get("draft_top_k", base.draft_top_k)
        top_p = given.get("draft_top_p", base.draft_top_p)
        tree, pipeline = (override.tree, override.pipeline) if override else (None, None)
        tree_payload = (
            _tree_payload(tree or base.tree or TreeParams(), given.get("k", base.k))
            if mode is Mode.TREE
            else Mode.AGGREGATE
        )
        if tree_payload is Mode.EXACT and isinstance(given.get("k"), int):
            raise ApiError(
                400,
                "a tree with exact's payload sends no top-k: drop k, or use payload aggregate",
                "speculative.k",
            )
        # split on whole rows: its draft truncated unless a truncation is named (draft_top_k: 0 keeps it
        # whole), so the worker draws at a rejection: no row back
        whole_split = mode is Mode.SPLIT and (k is None or k == "full") and top_k is None
        if (
            (mode is Mode.EXACT or tree_payload is Mode.EXACT or whole_split)
            and not top_k
            and (top_p is None or top_p == 1)
        ):
            top_k = _EXACT_DRAFT_TOP_K
        drafter = self._drafter(mode, given.get("drafter"))
        overlap = "overlap" in takes.fields and given.get("overlap", base.overlap)
        if overlap and not DRAFTERS[drafter].overlaps:
            raise ApiError(
                400,
                f"overlap drafts the next round with the draft model alone: drafter {drafter!r} "
                "cannot prepare it",
                "speculative.overlap",
            )
        return SpecOptions(
            mode=mode,
            num_draft_tokens=DEFAULT_GAMMA if gamma == "auto" else gamma,
            auto_gamma=gamma == "auto",
            relaxation=Relaxation(**given["relaxation"]) if "relaxation" in given else None,
            k=None if k == "full" or not takes.takes_k else k,
            reconstruction=given.get("reconstruction", base.reconstruction),
            draft_top_k=top_k or 0,
            draft_top_p=1.0 if top_p is None else top_p,
            engine_targets=bool(engines),
            overlap=overlap,
            tree=(
                (_parsed("tree", tree.shape) if tree else None) or (base.tree.shape() if base.tree else None)
            )
            if mode is Mode.TREE
            else None,
            tree_payload=tree_payload,
            pipeline=_parsed("pipeline", (pipeline or base.pipeline or PipelineParams()).schedule)
            if mode is Mode.PIPELINE
            else None,
            profile=bool(given.get("profile", False)),
            drafter=drafter,
        )

    def _drafter(self, mode: str, given: str | None) -> str:
        """The request's drafter (a name in ``DRAFTERS``), else the configured one, else the draft model
        (lookup when the gateway has none)."""
        has_model = self.draft.runner.has_weights
        if "drafter" not in MODES[mode].fields:
            if MODES[mode].drafts and not has_model:
                raise ApiError(
                    400,
                    f"mode {str(mode)!r} drafts with a model and this gateway has none "
                    "(draft.model: none): use aggregate, split, exact or tree (lookup drafts) "
                    "or autoregressive",
                    "speculative.mode",
                )
            return MODEL.name
        name = given or self.config.speculative.drafter or (MODEL.name if has_model else "lookup")
        drafter = DRAFTERS.get(name)
        if drafter is None:
            raise ApiError(
                400,
                f"speculative.drafter: {name!r} is not a drafter: use one of {sorted(DRAFTERS)}",
                "speculative.drafter",
            )
        if mode is Mode.PIPELINE and not drafter.grows_trees:
            raise ApiError(
                400,
                "a pipeline keeps its stages busy by expanding its tree with the draft model: "
                "use drafter 'model' or 'model+lookup'"
                + ("" if has_model else " (this gateway has none: draft.model: none)"),
                "speculative.drafter",
            )
        if drafter.uses_model and not has_model:
            raise ApiError(
                400,
                f"drafter {name!r} needs a draft model and this gateway has none (draft.model: "
                "none): use drafter 'lookup'",
                "speculative.drafter",
            )
        return name

    def replica_infos(self) -> Iterator[tuple[str, InfoResponse]]:
        """("name (url)", /v1/info) of every replica checked so far."""
        for worker in self.pool.workers:
            for replica in getattr(worker, "replicas", []):
                info = getattr(replica, "info", None)
                if info is not None:
                    yield f"{worker.name} ({replica.url})", info


def request_grammar(body: Body) -> tuple[GrammarSpec | None, str]:
    """The grammar a request asks for (``response_format`` or vLLM's ``structured_outputs``) and the parameter
    that asked."""
    fmt, outputs = body.response_format, body.structured_outputs
    asked = fmt is not None and fmt.type != "text"
    if asked and outputs is not None:
        raise ApiError(400, "give response_format or structured_outputs, not both", "structured_outputs")
    if fmt is not None and fmt.type == "json_object":
        return GrammarSpec.json_schema({"type": "object"}), "response_format"
    if fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise ApiError(
                400,
                "response_format of type json_schema needs json_schema: {name, schema}",
                "response_format.json_schema",
            )
        schema = fmt.json_schema.json_schema
        return GrammarSpec.json_schema(
            {"type": "object"} if schema is None else schema
        ), "response_format.json_schema"
    if outputs is None:
        return None, "response_format"
    given = [
        name
        for name, value in (
            ("json", outputs.json_),
            ("regex", outputs.regex),
            ("choice", outputs.choice),
            ("grammar", outputs.grammar),
        )
        if value is not None
    ]
    if len(given) != 1:
        raise ApiError(
            400,
            f"structured_outputs takes exactly one of json, regex, choice, grammar (got {given or 'none'})",
            "structured_outputs",
        )
    param, given_schema = f"structured_outputs.{given[0]}", outputs.json_
    if given_schema is None:  # a regex, choice or grammar: its kind
        source = (
            json.dumps(outputs.choice)
            if outputs.choice is not None
            else outputs.regex or outputs.grammar or ""
        )
        return GrammarSpec(GrammarKind(given[0]), source), param
    try:
        return GrammarSpec.json_schema(
            load_schema(given_schema) if isinstance(given_schema, str) else given_schema
        ), param
    except GrammarError as exc:  # a schema given as text that is not one
        raise ApiError(400, f"{param}: {exc}", param) from None


def _check_text(body: BaseModel) -> None:
    """A 400 naming the first field that holds a lone UTF-16 surrogate: no tokenizer takes it as text."""
    where = _lone_surrogate(body.model_dump(by_alias=True, exclude_defaults=True))
    if where is not None:
        raise ApiError(
            400,
            f"{where} holds a lone UTF-16 surrogate (an escape such as \\ud83d without its pair): not text",
            where,
        )


def _lone_surrogate(value: Any) -> str | None:
    """The path (``messages.0.content``) of the first string holding half a surrogate pair (JSON can escape
    one), or None."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            if any("\ud800" <= ch <= "\udfff" for ch in item):
                return ascii(path)[1:-1] or "body"  # a key may hold one too
        elif isinstance(item, dict):
            stack.extend((v, f"{path}.{k}" if path else str(k)) for k, v in item.items())
            stack.extend((k, path) for k in item if isinstance(k, str))
        elif isinstance(item, list | tuple):
            stack.extend((v, f"{path}.{i}" if path else str(i)) for i, v in enumerate(item))
    return None


def _parsed(key: str, make: Callable[[], T]) -> T:
    """``make()``, its ValueError a 400 naming ``speculative.<key>``."""
    try:
        return make()
    except ValueError as exc:
        raise ApiError(400, f"speculative.{key}: {exc}", f"speculative.{key}") from None


def _tree_payload(tree: TreeParams, k: int | str | None) -> Mode:
    """A tree's payload: as asked, else exact's sparse one — lossless, and a few hundred bytes a node where
    aggregate's full rows are a vocabulary's (4 B × 49,152 a node: 2.75 MB a round of the default tree) —
    unless a top-k was asked (then aggregate's top-k rows, as with a chain) or a request asked for ``k:
    "full"`` (aggregate's full rows)."""
    if tree.payload is not None:
        return Mode(tree.payload)
    return Mode.AGGREGATE if isinstance(k, int) or k == "full" else Mode.EXACT
