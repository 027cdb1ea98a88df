"""Process settings of a worker: CLI flags, YAML or ``SPECGATE_WORKER_*`` environment."""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from core.config import DEFAULT_CONTEXT, secret_or_none, unguarded, without_service_links
from core.errors import ConfigError
from core.names import Backend
from core.runners.base import ModelRunner


class WorkerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPECGATE_WORKER_", extra="forbid")

    model: str = Field(
        default="builtin",
        description="builtin | builtin-draft | builtin-alt | tiny-random[:SEED] | builtin-random[:SEED] | "
        "path | hub id",
    )
    backend: Backend = Field(
        default=Backend.LLAMA_CPP, description="model runner: llama.cpp (GGUF, fast on CPU) or transformers"
    )
    host: str = Field(
        default="127.0.0.1", description="address to bind (0.0.0.0 for a gateway on another machine)"
    )
    port: int = Field(default=8101, ge=0, le=65535, description="the worker's port")
    max_context: int = Field(
        default=DEFAULT_CONTEXT,
        gt=0,
        description="tokens one session may hold (capped by the model's own): the context the gateway sizes "
        "its limits by",
    )
    memory_cap_mb: int = Field(default=1024, gt=0, description="KV caches of all sessions together")
    max_sessions: int = Field(default=64, gt=0, description="LRU eviction beyond this")
    session_ttl_s: float = Field(default=600.0, gt=0, description="idle sessions are dropped after this")
    session_live_s: float = Field(
        default=10.0,
        gt=0,
        description="a session used this recently keeps its KV slot: a new session finding every slot so "
        "held gets 503 + Retry-After",
    )
    max_body_bytes: int = Field(default=8 * 2**20, gt=0, description="larger request bodies get a 413")
    max_draft: int = Field(default=64, gt=0, description="draft tokens one verify call may carry")
    max_grammar_bytes: int = Field(
        default=64 * 1024,
        gt=0,
        description="the longest grammar source compiled (/v1/info reports it: the gateway refuses longer "
        "ones)",
    )
    max_batch_tokens: int = Field(
        default=256,
        gt=0,
        description="new tokens one scheduler step feeds the model, all its calls together (one call always "
        "goes)",
    )
    prefill_chunk: int | None = Field(
        default=None,
        gt=0,
        description="a long prompt's tokens per scheduler step, in the steps other calls leave free and one "
        "in four beside them (chunked prefill); None = 16 on llama.cpp, max_batch_tokens on "
        "transformers",
    )
    long_decode: Literal["auto", "one-thread", "pad-stream"] = Field(
        default="auto",
        description="llama.cpp: how a long session's decode of one token keeps its bits (docs/design.md "
        "§10): on one thread, or beside a throwaway token in a neighbouring stream; auto = "
        "one-thread up to 2 threads, pad-stream from 3",
    )
    decode_ahead: bool = Field(
        default=False,
        description="on the CPU, while idle: an autoregressive answer's token decoded before its session's "
        "next call carries it (a gateway across a link: its round trip hides the decode; on the "
        "gateway's own machine it takes the cores the answer crosses HTTP on)",
    )
    threads: int | None = Field(
        default=None,
        gt=0,
        description="CPU threads of the model; None = every core this process may use: its affinity, within "
        "its cgroup's CPU quota (a container's --cpus, a pod's CPU limit)",
    )
    device: str = Field(
        default="auto",
        pattern=r"^(auto|cpu|cuda(:\d+)?)$",
        description="transformers: where the model runs (auto = cuda if present); llama.cpp: the CPU",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto",
        description="transformers: model dtype (auto = bfloat16 on a GPU, float32 on the CPU); probabilities "
        "are fp32 always",
    )
    gpu_memory_utilization: float = Field(
        default=0.9, gt=0, le=1, description="share of the GPU's memory for the model and its KV slots"
    )
    forward: Literal["auto", "hf", "static"] = Field(
        default="auto",
        description="transformers: the model's forward — its own modules (hf), or the static forward over "
        "bucketed inputs for Llama-family models (static); auto = static on CUDA where the model "
        "allows",
    )
    scoring: Literal["auto", "host", "device"] = Field(
        default="auto",
        description="where a step's logits are scored: each call on the host (workers.scoring, the "
        "reference), or every call together where the logits are, one copy back "
        "(workers.device_scoring); auto = device where the model runs on a GPU",
    )
    layers: str | None = Field(
        default=None,
        pattern=r"^\d+:\d+$",
        description="a pipeline stage: the model's layers first:end (transformers); None = the whole model",
    )
    next: str | None = Field(
        default=None, description="a pipeline stage: the next stage's base URL, when the calls do not name it"
    )
    link_rtt_ms: float = Field(
        default=0.0, ge=0, description="a stage's link to the next stage, emulated: rtt/2 before each call"
    )
    link_mbps: float = Field(default=0.0, ge=0, description="... and bytes·8/rate (0 = no limit)")
    stage_wait_s: float = Field(
        default=30.0,
        gt=0,
        description="a stage waits this long for a session's earlier message before answering 409",
    )
    token: str | None = Field(
        default=None,
        description="SPECGATE_WORKER_TOKEN: /v1/* requires 'Authorization: Bearer <token>'; required where "
        "the worker binds an address other hosts reach, unless allow_no_token",
    )
    allow_no_token: bool = Field(
        default=False,
        description="SPECGATE_WORKER_ALLOW_NO_TOKEN: serve /v1/* without a token on an address other hosts "
        "reach (an explicit choice)",
    )
    drain_timeout_s: float = Field(
        default=30.0, ge=0, description="on SIGTERM, its sessions get this long (it exits once none is left)"
    )
    instance_id: str = Field(
        default_factory=lambda: uuid.uuid4().hex,
        description="/health reports it: `serve` checks it started what answers",
    )
    restarts: int = Field(
        default=0,
        ge=0,
        description="how many times `serve` restarted this worker after it died (its /metrics reports it)",
    )

    @field_validator("token")
    @classmethod
    def _not_empty(cls, value: str | None) -> str | None:
        return secret_or_none(value, "SPECGATE_WORKER_TOKEN")

    def check_access(self) -> None:
        """Fail closed: no token on an address other hosts reach is a start-up error unless
        ``allow_no_token``."""
        problem = unguarded(
            "the worker",
            self.host,
            self.token,
            self.allow_no_token,
            "SPECGATE_WORKER_TOKEN",
            "SPECGATE_WORKER_ALLOW_NO_TOKEN",
        )
        if problem is not None:
            raise ConfigError(problem)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # flags over the environment; Kubernetes' SPECGATE_WORKER_PORT=tcp://… is no port
        return init_settings, without_service_links(env_settings), *args

    @property
    def layer_range(self) -> tuple[int, int] | None:
        """``layers`` as ``(first, end)``."""
        if self.layers is None:
            return None
        first, end = self.layers.split(":")
        return int(first), int(end)


def prefill_chunk(settings: WorkerSettings) -> int:
    """The prompt tokens a step feeds of one long call: on the CPU every row costs, so a few decodes' worth;
    on a GPU a step's rows are nearly free."""
    if settings.prefill_chunk is not None:
        return settings.prefill_chunk
    return (
        min(LLAMA_CPP_PREFILL_CHUNK, settings.max_batch_tokens)
        if settings.backend is Backend.LLAMA_CPP
        else settings.max_batch_tokens
    )


# half a decode (core.runners.llama_cpp_runner.DECODE_TOKENS: 32): 0.05-0.3 s on one core; a prefill in
# decodes of 16 costs 1.5 % more than in 32
LLAMA_CPP_PREFILL_CHUNK = 16


def ready_target(settings: WorkerSettings) -> ModelRunner:
    """The worker's runner, as ``settings`` say, fingerprinted and warmed up (the first request as fast as the
    next); call it on the thread that will run it."""
    from core.runners import load_runner

    runner = load_runner(
        settings.model,
        settings.backend.value,
        settings.max_context,
        settings.memory_cap_mb,
        settings.threads,
        device=settings.device,
        dtype=settings.dtype,
        gpu_memory_utilization=settings.gpu_memory_utilization,
        layers=settings.layer_range,
        forward=settings.forward,
        long_decode=settings.long_decode,
    )
    _ = runner.fingerprint  # computed once, before the first /v1/info
    runner.warm_up()
    return runner
