"""The YAML configuration (docs/design.md §6) of the gateway and ``specgate serve``, overridden by
``SPECGATE_<SECTION>__<KEY>`` variables; a bad key is a ConfigError naming it. docs/configuration.md is
generated from each field's description."""

from __future__ import annotations

import ipaddress
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from core.errors import ConfigError
from core.math.shapes import ChildRule, SegmentSchedule, TreeShape
from core.modes import mode_named, target_problem
from core.names import Backend, Mode, Reconstruction, TargetType
from core.plugins import load_plugins

_LOOPBACK = {"127.0.0.1", "localhost", "::1"}  # hosts on this machine (late_prefill_waits)
# what Kubernetes puts in <SERVICE>_PORT
_SERVICE_LINK = re.compile(r"^(tcp|udp|sctp)://[^\s/]+:\d+$", re.IGNORECASE)

log = logging.getLogger("specgate.config")

FIRST_LOCAL_PORT = 8101
DEFAULT_CONTEXT = 2048  # tokens a session holds where nothing sizes it: a worker's --max-context, the draft's


class DraftConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(
        default="builtin-draft",
        description="any --model value, or none: no draft model (lookup drafts alone, docs/design.md §3.10)",
    )
    tokenizer: str | None = Field(
        default=None,
        description="model none: whose tokenizer the gateway uses (a --model value; default builtin)",
    )
    backend: Backend = Field(default=Backend.LLAMA_CPP, description="model runner of the draft")
    memory_cap_mb: int = Field(default=1024, gt=0, description="KV caches of the draft, all sessions")
    threads: int | None = Field(
        default=None,
        gt=0,
        description="CPU threads; None = every core this process may use: its affinity, within its cgroup's "
        "CPU quota (serve splits them)",
    )
    device: str = Field(
        default="auto",
        pattern=r"^(auto|cpu|cuda(:\d+)?)$",
        description="transformers: where the draft runs (auto = cuda if present)",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto", description="transformers: the draft's dtype (auto = bfloat16 on a GPU)"
    )
    forward: Literal["auto", "hf", "static"] = Field(
        default="auto",
        description="transformers: the draft's forward, as a worker's --forward (auto = the static forward "
        "with CUDA graphs on a GPU)",
    )
    max_context: int | None = Field(
        default=None,
        gt=0,
        description="tokens a draft session holds (capped by the model's own); None = "
        "limits.max_prompt_tokens + limits.max_tokens where both are set, else 2048 (a worker's "
        "default); an agent-sized deployment sets it with the workers' --max-context "
        "(docs/serving.md)",
    )
    max_batch_tokens: int = Field(
        default=128,
        gt=0,
        description="new rows per draft step, every drafting request together (a prompt goes in chunks of "
        "half)",
    )
    chat_template: str | None = Field(
        default=None,
        description="a Jinja file: the chat template requests are rendered with, in place of the tokenizer's "
        "own (the targets' when theirs differs)",
    )
    reasoning: Literal["auto", "off"] = Field(
        default="auto",
        description="auto: where the chat template marks thinking (<think>…</think>), chat answers carry it "
        "in reasoning_content and /v1/responses in a reasoning item (docs/tools.md); off: it "
        "stays in the text",
    )
    tool_format: str = Field(
        default="auto",
        description="how tools are written: auto = the chat template's own format where it has one "
        "(docs/tools.md), else generic; or a registered format: generic, hermes, qwen3_coder, "
        "llama3_json, mistral, mistral_args",
    )
    background_prefill_from: int | None = Field(
        default=64,
        gt=0,
        description="a prompt this long or longer: the first round carries no draft (the targets sample it) "
        "while the draft prefills (app.engine.late); None: never",
    )
    background_prefill_wait: bool | None = Field(
        default=None,
        description="that prefill starts after the first round (the targets' prefill), not beside it: where "
        "they share cores; None = when every worker is on this machine",
    )


class TreeParams(BaseModel):
    """``"tree": {...}`` (config or request): mode ``tree``'s draft tree (docs/design.md §3.6); absent: the
    default by temperature."""

    model_config = ConfigDict(extra="forbid")

    rule: ChildRule | None = Field(
        default=None,
        description="sampled | sampled_distinct | fixed; default: sampled_distinct with widths, else fixed",
    )
    widths: list[int] | None = Field(
        default=None,
        description="sampled rules: children per node at each depth, ⟨k_1,…,k_L⟩ (default [2,1,1,1,1,1,1])",
    )
    nodes: int | None = Field(default=None, description="fixed (EAGLE-2): the node budget N (default 14)")
    depth: int | None = Field(default=None, description="fixed: the deepest level (default 6)")
    top_k: int | None = Field(
        default=None, description="fixed: children per expanded node and nodes expanded per depth (default 4)"
    )
    payload: Literal["aggregate", "exact"] | None = Field(
        default=None,
        description="per node on the wire: exact's sparse one (lossless, a few hundred bytes a node; "
        "draft_top_k defaults to 32; the default) or aggregate's rows (k: full or top-k; the "
        "default where k is a number)",
    )

    def shape(self) -> TreeShape | None:
        """The TreeShape these settings make (ValueError when they make none); None when they name none
        (payload alone)."""
        if (
            self.rule is None
            and self.widths is None
            and self.nodes is None
            and self.depth is None
            and self.top_k is None
        ):
            return None
        rule = self.rule or (ChildRule.SAMPLED_DISTINCT if self.widths is not None else ChildRule.FIXED)
        if rule is ChildRule.FIXED:
            if self.widths is not None:
                raise ValueError("a fixed tree takes nodes, depth and top_k, not widths")
            default = TreeShape.default(greedy=True)
            return TreeShape(
                rule,
                nodes=self.nodes or default.nodes,
                depth=self.depth or default.depth,
                top_k=self.top_k or default.top_k,
            )
        if self.nodes is not None or self.depth is not None or self.top_k is not None:
            raise ValueError(f"a {rule.value} tree takes widths, not nodes, depth or top_k")
        return TreeShape(
            rule,
            widths=tuple(self.widths) if self.widths is not None else TreeShape.default(greedy=False).widths,
        )


class PipelineParams(BaseModel):
    """``"pipeline": {...}`` (config or request): mode ``pipeline``'s schedule (docs/design.md §3.7); absent
    keys: the defaults."""

    model_config = ConfigDict(extra="forbid")

    nodes: int | None = Field(default=None, description="the round's tree: EAGLE-2 node budget (default 10)")
    depth: int | None = Field(
        default=None,
        description="... its deepest level, and how deep expansion goes below the walk (default 5)",
    )
    top_k: int | None = Field(default=None, description="... children per expanded node (default 3)")
    segment: int | None = Field(default=None, description="nodes per segment (default 6)")
    in_flight: int | None = Field(
        default=None, description="segments in the stages at once; 0 = one per stage (default 2)"
    )
    expand: bool | None = Field(
        default=None, description="expand the best live leaf while the live tree runs short (default true)"
    )

    def schedule(self) -> SegmentSchedule:
        """The SegmentSchedule these settings make (ValueError when they make none)."""
        default = SegmentSchedule()
        tree = TreeShape(
            ChildRule.FIXED,
            nodes=self.nodes or default.tree.nodes,
            depth=self.depth or default.tree.depth,
            top_k=self.top_k or default.tree.top_k,
        )
        return SegmentSchedule(
            tree,
            self.segment or default.segment,
            default.in_flight if self.in_flight is None else self.in_flight,
            default.expand if self.expand is None else self.expand,
        )


def in_range(value: Any, info: ValidationInfo) -> Any:
    """The range checks of ``speculative`` keys, in the config and in a request (app.schemas)."""
    if info.field_name == "k" and isinstance(value, int) and value < 1:
        raise ValueError("k must be ≥ 1 or 'full'")
    if info.field_name == "num_draft_tokens" and isinstance(value, int) and not 1 <= value <= 32:
        raise ValueError("num_draft_tokens must lie in [1, 32] or be 'auto'")
    if info.field_name == "mode" and value is not None:
        return mode_named(value)  # a built-in Mode, or a registered mode (core.modes.register)
    return value


class SpeculativeConfig(BaseModel):
    """The default decoding mode; a request's ``speculative`` object overrides it."""

    model_config = ConfigDict(extra="forbid")

    mode: str = Field(
        default=Mode.AGGREGATE,
        description="autoregressive, aggregate, split, exact, tree, pipeline, or a mode registered by a "
        "plug-in (core.modes.register; the built-in config: exact)",
    )
    num_draft_tokens: int | Literal["auto"] = Field(
        default=4, description="γ in [1, 32], or auto: chosen each round (fixed 4 with a seed)"
    )
    k: int | None = Field(
        default=None, description='top-k per position on the wire; None ("full") = whole distributions'
    )
    reconstruction: Reconstruction = Field(
        default=Reconstruction.RENORMALIZE, description="how top-k becomes a distribution (aggregate)"
    )
    draft_top_k: int | None = Field(
        default=None, ge=0, description="TSLT draft truncation; exact defaults to 32"
    )
    draft_top_p: float | None = Field(
        default=None, gt=0, le=1, description="... or keep the draft's nucleus of this mass"
    )
    overlap: bool = Field(
        default=False,
        description="DSD: draft the next round while this one is verified (same output, less waiting)",
    )
    tree: TreeParams | None = Field(
        default=None, description="mode tree: the draft tree; None = the default by temperature"
    )
    pipeline: PipelineParams | None = Field(
        default=None, description="mode pipeline: the tree and its segments; None = the defaults"
    )
    drafter: str | None = Field(
        default=None,
        description="model | lookup | model+lookup, or a registered drafter (chains, tree; pipeline: not "
        "lookup); None = model, or lookup when draft.model is none",
    )

    @field_validator("tree", "pipeline")
    @classmethod
    def _makes_shape(cls, value: TreeParams | PipelineParams | None) -> TreeParams | PipelineParams | None:
        if isinstance(value, TreeParams):
            value.shape()
        elif value is not None:
            value.schedule()
        return value

    @field_validator("k", mode="before")
    @classmethod
    def _full(cls, value: Any) -> Any:
        return None if value == "full" else value

    _in_range = field_validator("k", "num_draft_tokens", "mode")(in_range)


class LinkConfig(BaseModel):
    """Link emulation (docs/design.md §4): each exchange waits rtt/2 + bytes·8/rate per direction."""

    model_config = ConfigDict(extra="forbid")

    rtt_ms: float = Field(default=0.0, ge=0, description="round-trip time added to every exchange")
    up_mbps: float | None = Field(default=None, gt=0, description="gateway → worker; None = unlimited")
    down_mbps: float | None = Field(default=None, gt=0, description="worker → gateway; None = unlimited")

    def delay_s(self, num_bytes: int, upstream: bool) -> float:
        """Seconds one direction of one exchange takes on this link."""
        rate = self.up_mbps if upstream else self.down_mbps
        return self.rtt_ms / 2e3 + (num_bytes * 8 / (rate * 1e6) if rate else 0.0)


class StageEntry(BaseModel):
    """One stage of a ``pipeline`` target (docs/design.md §3.7): ``url``, a bare string, or ``model`` +
    ``layers`` (started by ``serve``)."""

    model_config = ConfigDict(extra="forbid")

    url: str | None = Field(default=None, description="base URL of a stage worker")
    model: str | None = Field(default=None, description="a local stage: what it loads")
    layers: str | None = Field(
        default=None, pattern=r"^\d+:\d+$", description="a local stage: its layers, first:end"
    )
    port: int | None = Field(default=None, ge=1, le=65535, description="a local stage's port")
    threads: int | None = Field(
        default=None, gt=0, description="a local stage's CPU threads (serve splits the cores)"
    )
    link_rtt_ms: float = Field(
        default=0.0,
        ge=0,
        description="a local stage: the emulated delay of its link to the next stage (per segment, on the "
        "way out)",
    )
    link_mbps: float = Field(default=0.0, ge=0, description="... and that link's rate; 0 = unlimited")
    replicas: list[str] = Field(
        default=[],
        description="other stage workers serving the same layers: the stage fails over to them (its sessions "
        "start again from zero)",
    )

    @model_validator(mode="before")
    @classmethod
    def _bare_url(cls, value: Any) -> Any:
        return {"url": value} if isinstance(value, str) else value

    @model_validator(mode="after")
    def _one_source(self) -> StageEntry:
        if (self.url is None) == (self.model is None):
            raise ValueError("give a stage one of url (running elsewhere) or model + layers (local)")
        if self.model is not None and self.layers is None:
            raise ValueError("a local stage needs layers, e.g. '0:15'")
        return self

    @property
    def is_local(self) -> bool:
        return self.model is not None


class WorkerEntry(BaseModel):
    """One target: ``url`` / ``urls`` (remote replicas), ``model`` (local), ``pipeline`` (docs/design.md §3.7)
    or an engine (docs/design.md §8)."""

    model_config = ConfigDict(extra="forbid")

    type: TargetType = Field(
        default=TargetType.SPECGATE, description="specgate (our worker) or openai-logprobs (an engine)"
    )
    url: str | None = Field(
        default=None, description="base URL, e.g. http://127.0.0.1:8101 (an engine's: without /v1)"
    )
    urls: list[str] | None = Field(
        default=None, description="replicas serving the same model with the same weight"
    )
    pipeline: list[StageEntry] | None = Field(
        default=None,
        description="the stages of one model, first layers first (URLs, or local model + layers)",
    )
    model: str | None = Field(
        default=None, description="what a local worker loads; for an engine, the model name it serves"
    )
    weight: float = Field(
        default=1.0,
        ge=0,
        allow_inf_nan=False,
        description="w_n before normalisation (finite: w / Σw must be a number)",
    )
    name: str | None = Field(default=None, description="shown in errors and metrics; defaults to w<index>")
    backend: Backend = Field(default=Backend.LLAMA_CPP, description="a local worker's backend")
    port: int | None = Field(default=None, ge=1, le=65535, description="a local worker's port")
    threads: int | None = Field(
        default=None, gt=0, description="a local worker's CPU threads (serve splits the cores)"
    )
    link: LinkConfig | None = Field(
        default=None, description="emulate a network between the gateway and this worker"
    )
    connect_timeout_s: float = Field(default=3.0, gt=0, description="opening a connection to a replica")
    read_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="a verify answer not here after this long: the replica's /health is asked (then every "
        "quarter of this), and the call waits on while the worker answers calls and its model is "
        "not stuck (busy, not dead); else it failed. An engine's: a deadline",
    )
    stall_timeout_s: float | None = Field(
        default=None,
        gt=0,
        description="a worker whose model has finished no step (or decode) for this long, while work waits, "
        "is stuck: a slow call there fails, a probe leaves its breaker open; None = "
        "read_timeout_s",
    )
    logprobs: int = Field(
        default=20, ge=1, le=1000, description="engine: top-k logprobs asked per position (vLLM's cap: 20)"
    )
    max_context: int | None = Field(
        default=None, gt=0, description="engine: its context length, when /v1/models does not say"
    )
    discovery_interval_s: float | None = Field(
        default=None,
        gt=0,
        description="re-resolve url's host this often: each address a replica (a headless Service); None = "
        "url as it is",
    )

    @model_validator(mode="after")
    def _one_source(self) -> WorkerEntry:
        if self.urls is not None and not self.urls:
            raise ValueError("urls must list at least one replica")
        if self.discovery_interval_s is not None and self.url is None:
            raise ValueError("discovery_interval_s needs url: the name whose addresses are the replicas")
        remote = (self.url is not None) + (self.urls is not None)
        if self.pipeline is not None:
            if self.is_openai_logprobs or remote or self.model is not None:
                raise ValueError(
                    "a pipeline target lists its stages under pipeline: no url, urls, model or type"
                )
            if len(self.pipeline) < 2:
                raise ValueError("a pipeline needs at least two stages")
            return self
        if self.is_openai_logprobs:
            if remote != 1 or not self.model:
                raise ValueError(
                    "an openai-logprobs target needs url (or urls) and model (the name the engine serves)"
                )
        elif remote + (self.model is not None) != 1:
            raise ValueError("give a worker one of url / urls (remote) or model (local)")
        return self

    @property
    def is_openai_logprobs(self) -> bool:
        return self.type is TargetType.OPENAI_LOGPROBS

    @property
    def is_local(self) -> bool:
        return self.model is not None and not self.is_openai_logprobs


class LimitsConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_tokens: int | None = Field(
        default=None,
        gt=0,
        description="the cap of max_tokens; None = none: an absent max_tokens is the context left after the "
        "prompt (as vLLM), capped by this where set",
    )
    max_prompt_tokens: int | None = Field(
        default=None,
        gt=0,
        description="longer prompts get a 400; None = the context (the smallest of the draft's and the "
        "targets', /v1/models' max_model_len) less one",
    )
    max_concurrent_requests: int = Field(default=16, gt=0, description="requests generating at once")
    max_queued_requests: int = Field(default=64, ge=0, description="waiting for a slot; beyond it a 429")
    queue_timeout_s: float = Field(default=60.0, gt=0, description="a queued request gets a 429 after this")
    max_body_bytes: int = Field(default=2**20, gt=0, description="larger request bodies get a 413")
    drain_timeout_s: float = Field(
        default=30.0, ge=0, description="on SIGTERM, open requests get this long (it exits once none is left)"
    )
    max_grammar_bytes: int = Field(
        default=64 * 1024,
        gt=0,
        description="a schema, regex, choice list or grammar longer than this gets a 400",
    )
    grammar_compile_s: float = Field(
        default=10.0, gt=0, description="one that takes longer to compile (off the event loop) gets a 400"
    )


class HealthConfig(BaseModel):
    """The circuit breaker of each replica (docs/design.md §4)."""

    model_config = ConfigDict(extra="forbid")

    failure_threshold: int = Field(default=3, gt=0, description="failures in a row that open the breaker")
    probe_interval_s: float = Field(
        default=2.0, gt=0, description="how often an open replica's /health is probed"
    )
    ready_timeout_s: float = Field(
        default=2.0,
        gt=0,
        description="/health/ready answers within about this: a replica silent so long is not ready this "
        "time (its check goes on); it is for people and alerts, no probe asks it",
    )


class DiscoveryConfig(BaseModel):
    """How worker names are resolved (entries with ``discovery_interval_s``)."""

    model_config = ConfigDict(extra="forbid")

    dns_servers: list[str] = Field(
        default=[],
        description="host[:port] of DNS servers to ask; [] = the system's resolver (/etc/hosts, "
        "resolv.conf's servers and search domains)",
    )
    timeout_s: float = Field(
        default=2.0, gt=0, description="one resolution; a failed one keeps the replicas as they are"
    )


class ResponsesConfig(BaseModel):
    """``/v1/responses``: where responses are kept for ``previous_response_id`` and ``GET
    /v1/responses/{id}``."""

    model_config = ConfigDict(extra="forbid")

    store: str = Field(
        default="auto",
        description="a SQLite file's path; auto = $XDG_STATE_HOME/specgate/responses.sqlite3 "
        "(~/.local/state/…); memory = this process only; none = no store (previous_response_id "
        "gets a 400)",
    )
    retention_s: float = Field(
        default=7 * 24 * 3600.0,
        gt=0,
        description="a stored response unused this long (neither made nor continued) is gone (deleted at the "
        "next write)",
    )
    max_bytes: int = Field(
        default=128 * 2**20,
        gt=0,
        description="the store's size cap: past it, the least recently used responses go first (a chain in "
        "use stays whole)",
    )


class SpecgateConfig(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPECGATE_", env_nested_delimiter="__", extra="forbid")

    model: str = Field(default="specgate", description="the model id clients pass and /v1/models lists")
    host: str = Field(
        default="127.0.0.1", description="address the gateway binds (0.0.0.0 to be reachable from outside)"
    )
    port: int = Field(default=8000, ge=0, le=65535, description="the gateway's port")
    draft: DraftConfig = DraftConfig()
    speculative: SpeculativeConfig = SpeculativeConfig()
    workers: list[WorkerEntry] = Field(
        default_factory=list, description="the targets, at least one; weights w_n"
    )
    limits: LimitsConfig = LimitsConfig()
    health: HealthConfig = HealthConfig()
    discovery: DiscoveryConfig = DiscoveryConfig()
    responses: ResponsesConfig = ResponsesConfig()
    api_key: str | None = Field(
        default=None,
        description="clients must send it as a bearer token (env SPECGATE_API_KEY); required where the "
        "gateway binds an address other hosts reach, unless allow_no_api_key",
    )
    allow_no_api_key: bool = Field(
        default=False,
        description="serve /v1/* without a key on an address other hosts reach (env "
        "SPECGATE_ALLOW_NO_API_KEY): an explicit choice, never the result of a missing secret",
    )
    metrics_port: int | None = Field(
        default=None,
        ge=1,
        le=65535,
        description="a second port that alone answers /metrics and /health/ready (Prometheus, humans); None "
        "= both on the API port",
    )
    worker_token: str | None = Field(
        default=None, description="sent to every worker as a bearer token (env SPECGATE_WORKER_TOKEN)"
    )

    @field_validator("api_key", "worker_token")
    @classmethod
    def _not_empty(cls, value: str | None, info: ValidationInfo) -> str | None:
        return secret_or_none(value, f"SPECGATE_{str(info.field_name).upper()}")

    @model_validator(mode="after")
    def _check(self) -> SpecgateConfig:
        if not self.workers:
            raise ValueError("workers: at least one worker is needed")
        if sum(w.weight for w in self.workers) <= 0:
            raise ValueError("workers: weights must not all be 0")
        for index, worker in enumerate(self.workers):
            worker.name = worker.name or f"w{index}"
        names = [w.name for w in self.workers]
        if len(set(names)) != len(names):
            raise ValueError(f"workers: names must be unique, got {names}")
        pipelines = [str(w.name) for w in self.workers if w.pipeline is not None]
        engines = [str(w.name) for w in self.workers if w.is_openai_logprobs]
        if self.metrics_port is not None and self.metrics_port == self.port:
            raise ValueError(
                f"metrics_port: {self.metrics_port} is the API's port too: give the metrics a "
                "port of their own"
            )
        problem = target_problem(self.speculative.mode, len(self.workers), engines, pipelines)
        if problem is not None:
            raise ValueError(f"speculative.{problem}")
        return self

    def check_access(self) -> None:
        """Fail closed: no API key on an address other hosts reach is a start-up error unless
        ``allow_no_api_key``."""
        problem = unguarded(
            "the gateway",
            self.host,
            self.api_key,
            self.allow_no_api_key,
            "SPECGATE_API_KEY",
            "SPECGATE_ALLOW_NO_API_KEY",
        )
        if problem is not None:
            raise ConfigError(problem)

    @property
    def draft_context(self) -> int:
        """The configured draft context, else the longest request the limits let in where both are set, else a
        worker's default context (the runner caps it by the model's own)."""
        if self.draft.max_context:
            return self.draft.max_context
        limits = self.limits
        return (
            limits.max_prompt_tokens + limits.max_tokens
            if limits.max_prompt_tokens and limits.max_tokens
            else DEFAULT_CONTEXT
        )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return without_service_links(env_settings), init_settings  # environment over the YAML file

    def with_local_urls(self, pick_port: Callable[[], int] | None = None) -> SpecgateConfig:
        """A copy giving each local worker and stage its port: its ``port``, else ``pick_port()``, else
        FIRST_LOCAL_PORT + its index (stages after workers)."""
        fallback = iter(range(FIRST_LOCAL_PORT + len(self.workers), 1 << 16))
        return self._with_locals(
            lambda index, w: {"port": w.port or (pick_port() if pick_port else FIRST_LOCAL_PORT + index)},
            lambda s: {"port": s.port or (pick_port() if pick_port else next(fallback))},
        )

    def with_split_cores(self, cores: int) -> SpecgateConfig:
        """A copy in which local workers, stages and the draft that set no ``threads`` share ``cores`` equally
        (they verify at once), and a late draft's prefill waits for the first round where they do (unless the
        draft says)."""
        local = [w for w in self.workers if w.is_local] + self.local_stages
        share = max(1, cores // max(1, len(local)))
        # a late draft's prefill would slow theirs
        wait = (
            self.draft.background_prefill_wait
            if self.draft.background_prefill_wait is not None
            else bool(local)
        )
        draft = self.draft.model_copy(
            update={
                "threads": self.draft.threads or (share if local else None),
                "background_prefill_wait": wait,
            }
        )
        return self._with_locals(
            lambda _, w: {"threads": w.threads or share},
            lambda s: {"threads": s.threads or share},
            draft=draft,
        )

    def _with_locals(
        self,
        worker: Callable[[int, WorkerEntry], dict[str, Any]],
        stage: Callable[[StageEntry], dict[str, Any]],
        **update: Any,
    ) -> SpecgateConfig:
        """A copy with ``worker(index, w)`` applied to each local worker, ``stage(s)`` to each local stage, in
        order."""
        workers = []
        for index, w in enumerate(self.workers):
            if w.is_local:
                w = w.model_copy(update=worker(index, w))
            if w.pipeline is not None:
                w = w.model_copy(
                    update={
                        "pipeline": [s.model_copy(update=stage(s)) if s.is_local else s for s in w.pipeline]
                    }
                )
            workers.append(w)
        return self.model_copy(update={"workers": workers, **update})

    def late_prefill_waits(self) -> bool:
        """Whether a late draft's prefill waits for the first round (app.engine.late): as
        ``draft.background_prefill_wait`` says, else when every worker is on this machine (started by
        ``serve``, or at a loopback address): they share its cores."""
        if self.draft.background_prefill_wait is not None:
            return self.draft.background_prefill_wait
        urls = [w.url for w in self.workers if not w.is_local and w.pipeline is None]
        urls += [s.url for w in self.workers for s in w.pipeline or [] if not s.is_local]
        return all(urlsplit(url or "").hostname in _LOOPBACK for url in urls)

    @property
    def local_stages(self) -> list[StageEntry]:
        """The pipeline stages ``serve`` starts, every pipeline's, in order."""
        return [s for w in self.workers for s in (w.pipeline or []) if s.is_local]

    def stage_urls(self, worker: WorkerEntry) -> list[str]:
        """A pipeline's stage URLs, first stage first (a local stage's own)."""
        return [(s.url or f"http://127.0.0.1:{s.port}").rstrip("/") for s in worker.pipeline or []]

    def stage_replicas(self, worker: WorkerEntry) -> list[list[str]]:
        """Per stage, first stage first: its URL, then its replicas'."""
        return [
            [url, *(r.rstrip("/") for r in s.replicas)]
            for url, s in zip(self.stage_urls(worker), worker.pipeline or [])
        ]

    def worker_url(self, worker: WorkerEntry) -> str:
        """The first replica's URL (a local worker's own)."""
        return self.worker_urls(worker)[0]

    def worker_urls(self, worker: WorkerEntry) -> list[str]:
        if worker.pipeline is not None:
            return self.stage_urls(worker)
        if worker.urls:
            return [u.rstrip("/") for u in worker.urls]
        return [(worker.url or f"http://127.0.0.1:{worker.port}").rstrip("/")]


def builtin_config() -> SpecgateConfig:
    """The built-in default: local workers builtin and builtin-alt (0.5 / 0.5), mode exact, draft top-32."""
    return parse_config(
        {
            "speculative": {"mode": "exact", "draft_top_k": 32},
            "workers": [{"model": "builtin", "weight": 0.5}, {"model": "builtin-alt", "weight": 0.5}],
        }
    )


def load_config(path: str | Path | None) -> SpecgateConfig:
    """Read (or take the built-in default), merge with the environment, validate; the plug-ins first
    (core.plugins: a mode they register is a mode the config may name)."""
    load_plugins()
    if path is None:
        return builtin_config()
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"config {path} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config {path} must be a mapping at the top")
    return parse_config(data, str(path))


def parse_config(data: dict[str, Any], where: str = "config") -> SpecgateConfig:
    try:
        return SpecgateConfig(**data)
    except ValidationError as exc:
        first = exc.errors()[0]
        key = ".".join(str(p) for p in first["loc"]) or "(top)"
        raise ConfigError(f"{where}: {key}: {first['msg']}") from exc


SECRETS = ("api_key", "worker_token")  # never written to files: they travel in the environment


def dump_config(config: SpecgateConfig, changed_only: bool = False) -> str:
    """YAML that ``load_config`` reads back to ``config``, less the secrets; ``changed_only``: only what
    differs from the defaults."""
    return yaml.safe_dump(
        config.model_dump(
            mode="json", exclude_none=True, exclude=set(SECRETS), exclude_defaults=changed_only
        ),
        sort_keys=False,
    )


def without_service_links(env_settings: PydanticBaseSettingsSource) -> PydanticBaseSettingsSource:
    """``env_settings`` without Kubernetes' service-link variables: a Service named ``specgate``
    (``specgate-worker``) makes the kubelet give every pod of its namespace
    ``SPECGATE_PORT=tcp://10.0.0.1:80`` (``SPECGATE_WORKER_PORT``), which is not a port. Each is ignored with
    a warning naming the Service (pods should say ``enableServiceLinks: false``)."""
    env_vars = getattr(env_settings, "env_vars", None)
    if not env_vars:
        return env_settings
    prefix = str(getattr(env_settings, "env_prefix", "") or "").lower()
    links = {
        name: value
        for name, value in env_vars.items()
        if name.lower().startswith(prefix) and isinstance(value, str) and _SERVICE_LINK.match(value.strip())
    }
    for name, value in sorted(links.items()):
        upper = name.upper()
        service = (
            upper[: upper.rfind("_PORT")].lower().replace("_", "-") if "_PORT" in upper else upper.lower()
        )
        log.warning(
            "%s=%s is a Kubernetes service link (a Service named %r in this namespace), not a "
            "setting: ignored "
            "(set enableServiceLinks: false in the pod spec, or name the Service otherwise)",
            upper,
            value,
            service,
        )
    if links:
        env_settings.env_vars = {name: value for name, value in env_vars.items() if name not in links}  # type: ignore[attr-defined]
    return env_settings


def secret_or_none(value: str | None, variable: str) -> str | None:
    """A key or token as given; an empty one is an error, never "no key": ``SPECGATE_API_KEY=`` left blank in
    a secret would otherwise switch client authentication off without a word. A placeholder (``change-me``,
    ``<your key>``) is an error too: an example's value deployed as it is, known to anyone who read the
    example."""
    if value is not None and not value.strip():
        raise ValueError(
            f"{variable} is set but empty: give it a value, or leave the variable unset to serve without one"
        )
    if value is not None and is_placeholder(value):
        raise ValueError(
            f"{variable} is the placeholder {value.strip()!r}: generate a value (`openssl rand -hex 32`)"
        )
    # a file's newline (kubectl create secret --from-file) is no part of it
    return None if value is None else value.strip()


PLACEHOLDERS = frozenset(
    {
        "changeme",
        "replaceme",
        "setme",
        "fillme",
        "secret",
        "password",
        "passw0rd",
        "token",
        "key",
        "apikey",
        "yourkey",
        "yourapikey",
        "yourtoken",
        "yoursecret",
        "mykey",
        "example",
        "placeholder",
        "todo",
        "fixme",
        "xxx",
        "none",
        "null",
        "default",
    }
)


def is_placeholder(value: str) -> bool:
    """``change-me``, ``CHANGE_ME``, ``<your-key>``, ``xxxx``: what examples and templates write where a
    secret goes."""
    text = value.strip()
    plain = re.sub(r"[^a-z0-9]", "", text.lower())
    return (
        plain in PLACEHOLDERS
        or (text.startswith("<") and text.endswith(">"))
        or re.fullmatch(r"(x|\*|0|\.)+", text.lower()) is not None
    )


def is_loopback(host: str) -> bool:
    """Whether ``host`` is an address on this machine only (``127.0.0.1``, ``::1``, ``localhost``): nothing
    else reaches it."""
    if host in _LOOPBACK:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def unguarded(
    what: str, host: str, secret: str | None, allowed: bool, variable: str, opt_out: str
) -> str | None:
    """Why a server that binds ``host`` must not start without its secret (fail closed), or None: it has one,
    it binds a loopback address, or the deployment said ``opt_out`` explicitly."""
    if secret is not None or allowed or is_loopback(host):
        return None
    return (
        f"{what} binds {host}, which other hosts reach, and {variable} is unset: set it "
        "(`openssl rand -hex 32`), "
        f"or set {opt_out}=true to serve without one"
    )
