"""An existing engine as a target (docs/design.md §8), for real: llama-cpp-python's own OpenAI server
(``python -m llama_cpp.server``, the built-in GGUF, ``logits_all`` on) on 127.0.0.1, federated
with one of our workers by a real gateway, spoken to by the official ``openai`` client.

The engine runs the very model our ``builtin`` worker runs (flash attention on in both), so a
seeded request gives the same text through {engine, builtin-alt} as through {builtin,
builtin-alt} at the engine's top-k — the engine's answers are the worker's top-k, read back
from text prompts and token strings."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import ExitStack

import httpx
import openai
import pytest

from clients.procs import ServerProcess, free_port
from core.config import parse_config
from core.runners.models import builtin_gguf
from tests.integration.gateways import SharedDraft, gateway_in_process

pytestmark = pytest.mark.integration

K = 20  # the engine's top-k (vLLM's default cap)
# Sampled text must tokenise back to the sampled ids for a text-only engine (else a loud 502:
# tested with fakes); T = 0.7 keeps this 135M model's samples canonical here.
REQUEST = {"prompt": "The three primary colours are", "max_tokens": 12, "temperature": 0.7, "seed": 21}


def EngineProcess() -> ServerProcess:
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "llama_cpp.server",
        "--model",
        str(builtin_gguf()),
        "--model_alias",
        "smollm2",
        "--logits_all",
        "true",
        "--flash_attn",
        "true",
        "--n_ctx",
        "1024",
        "--n_threads",
        "1",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    return ServerProcess(command, port, "/v1/models", timeout_s=180)


@pytest.fixture(scope="module")
def servers(builtin_workers: list[str], shared_draft: SharedDraft) -> Iterator[dict[str, str]]:
    with ExitStack() as stack:
        engine = stack.enter_context(EngineProcess())
        builtin, alt = builtin_workers
        gateways = {}
        for name, first in (
            (
                "engine",
                {
                    "type": "openai-logprobs",
                    "url": engine,
                    "model": "smollm2",
                    "logprobs": K,
                    "read_timeout_s": 120,
                },
            ),
            ("worker", {"url": builtin}),
        ):
            config = parse_config(
                {
                    "model": "specgate",
                    "draft": {"model": "builtin-draft", "threads": 1},
                    "speculative": {"mode": "aggregate", "num_draft_tokens": 4, "k": K},
                    "workers": [{**first, "weight": 0.5}, {"url": alt, "weight": 0.5}],
                }
            )
            gateways[name] = gateway_in_process(stack, config, shared_draft)
        yield {"engine_server": engine, **gateways}


def _complete(url: str) -> openai.types.Completion:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    return client.completions.create(model="specgate", **REQUEST)  # type: ignore[call-overload,no-any-return]


def test_the_gateway_checked_the_engine(servers: dict[str, str]) -> None:
    ready = httpx.get(f"{servers['engine']}/health/ready", timeout=30)
    assert ready.status_code == 200, ready.text
    first = ready.json()["workers"][0]
    assert first["ready"] and first["model"] == "smollm2 (openai-logprobs)"


def test_an_engine_federated_with_a_worker_gives_the_workers_text(servers: dict[str, str]) -> None:
    through_engine, through_worker = _complete(servers["engine"]), _complete(servers["worker"])
    assert through_engine.choices[0].text and through_engine.choices[0].text == through_worker.choices[0].text
    spec, reference = (
        through_engine.usage.model_extra["speculative"],
        through_worker.usage.model_extra["speculative"],
    )  # type: ignore[union-attr]
    assert spec["lossless"] is False and reference["lossless"] is False
    # the worker sends σ of T(p) itself; the engine only p at T = 1: at T = 0.7 its σ is bounded
    assert reference["bias_bound_mean"] - 1e-4 <= spec["bias_bound_mean"] < 0.5
    assert spec["rounds"] == reference["rounds"] and spec["accepted_tokens"] == reference["accepted_tokens"]


def test_streaming_chat_and_autoregressive_through_the_engine(servers: dict[str, str]) -> None:
    client = openai.OpenAI(base_url=f"{servers['engine']}/v1", api_key="unused", max_retries=0, timeout=300)
    stream = client.chat.completions.create(
        model="specgate",
        messages=[{"role": "user", "content": "Name a colour."}],
        max_tokens=8,
        seed=3,
        temperature=0.7,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens <= 8
    plain = client.completions.create(
        model="specgate",
        prompt="Water is",
        max_tokens=4,
        seed=2,
        temperature=0.7,
        extra_body={"speculative": {"mode": "autoregressive"}},
    )
    spec = plain.usage.model_extra["speculative"]  # type: ignore[union-attr]
    assert plain.choices[0].text and spec["mode"] == "autoregressive" and spec["rounds"] == 4
    assert spec["lossless"] is False and 0 <= spec["bias_bound_mean"] < 1
