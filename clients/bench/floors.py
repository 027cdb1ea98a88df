"""What a round would cost with nothing of ours in it: llama.cpp's draft step and scoring, a bare HTTP round
trip (docs/performance.md, "Where a round's time goes"); each in this process, its llama.cpp context made as
the runner makes it, so only our code differs."""

from __future__ import annotations

import asyncio
import ctypes
import sys
import time
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np

from clients.bench.common import median, progress
from clients.procs import ServerProcess, free_port
from core.config import LinkConfig
from core.cores import usable_cores
from core.math.draft_length import RoundCosts
from core.runners.llama_cpp_tools import quiet_llama_cpp
from core.runners.model_thread import CallingThread
from core.runners.models import resolve_model

_CONTEXT = 1024
_DECODE_TOKENS = 32  # as the runner: never a decode of 64 or more


class LlamaFloor:
    """One GGUF in a bare llama.cpp context (the runner's parameters), a prompt prefilled.
    Usage: ``with closing(LlamaFloor("builtin-draft", threads=2, prompt=ids)) as f: f.draft_step_ms(32)``"""

    def __init__(self, model: str, threads: int, prompt: list[int], n_ctx: int = _CONTEXT) -> None:
        import llama_cpp
        from llama_cpp import _internals

        quiet_llama_cpp()
        self.api, self.prompt = llama_cpp, list(prompt)
        source = resolve_model(model)
        params = llama_cpp.llama_model_default_params()
        params.n_gpu_layers = 0
        self.model = _internals.LlamaModel(path_model=str(source.path), params=params, verbose=False)
        ctx_params = llama_cpp.llama_context_default_params()
        ctx_params.n_ctx = n_ctx
        ctx_params.n_batch = ctx_params.n_ubatch = _DECODE_TOKENS
        ctx_params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
        ctx_params.n_threads = ctx_params.n_threads_batch = threads
        ctx_params.no_perf = True
        self.ctx = _internals.LlamaContext(model=self.model, params=ctx_params, verbose=False)
        self.batch = _internals.LlamaBatch(n_tokens=_DECODE_TOKENS, embd=0, n_seq_max=1, verbose=False)
        self.vocab_size = int(self.model.n_vocab())
        self._decode(self.prompt[:1], 0, logits=False)  # the first decode pages the weights in: not timed
        self._trim(0)
        started = time.perf_counter()
        for begin in range(0, len(self.prompt), _DECODE_TOKENS):
            self._decode(self.prompt[begin : begin + _DECODE_TOKENS], begin, logits=False)
        # the prompt, as a target alone would prefill it
        self.prefill_ms = (time.perf_counter() - started) * 1e3

    def draft_step_ms(self, top_k: int, steps: int = 8, repeats: int = 3) -> list[float]:
        """Per step: a decode of one token, then llama.cpp's sampler chain (top-k → temperature 1 → dist)."""
        api = self.api
        chain = api.llama_sampler_chain_init(api.llama_sampler_chain_default_params())
        for sampler in (
            api.llama_sampler_init_top_k(top_k),
            api.llama_sampler_init_temp(1.0),
            api.llama_sampler_init_dist(0),
        ):
            api.llama_sampler_chain_add(chain, sampler)
        times = []
        try:
            for _ in range(repeats):
                token, position = self.prompt[-1], len(self.prompt) - 1
                self._trim(position)
                for _ in range(steps):
                    started = time.perf_counter()
                    self._decode([token], position, logits=True)
                    token = int(api.llama_sampler_sample(chain, self.ctx.ctx, -1))
                    times.append((time.perf_counter() - started) * 1e3)
                    position += 1
        finally:
            api.llama_sampler_free(chain)
            self._trim(len(self.prompt))
        return times

    def scoring_ms(self, positions: int, repeats: int = 5) -> list[float]:
        """A decode of ``positions`` tokens after the prompt with logits at every one, read in place (a verify
        call's)."""
        tokens = (self.prompt * (positions // len(self.prompt) + 1))[:positions]
        times = []
        for _ in range(repeats):
            self._trim(len(self.prompt))
            started = time.perf_counter()
            for begin in range(0, positions, _DECODE_TOKENS):
                self._decode(tokens[begin : begin + _DECODE_TOKENS], len(self.prompt) + begin, logits=True)
                rows = min(_DECODE_TOKENS, positions - begin)
                _ = [self._logits(i) for i in range(rows)]
            times.append((time.perf_counter() - started) * 1e3)
        self._trim(len(self.prompt))
        return times

    def close(self) -> None:
        self.batch.close()
        self.ctx.close()
        self.model.close()

    def _decode(self, tokens: list[int], first: int, logits: bool) -> None:
        raw = self.batch.batch
        raw.n_tokens = len(tokens)
        for i, token in enumerate(tokens):
            raw.token[i], raw.pos[i], raw.n_seq_id[i] = token, first + i, 1
            raw.seq_id[i][0] = 0
            raw.logits[i] = logits or i == len(tokens) - 1
        self.ctx.decode(self.batch)

    def _logits(self, index: int) -> np.ndarray:
        ptr = self.ctx.get_logits_ith(index)
        return np.ctypeslib.as_array(
            ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(self.vocab_size,)
        )

    def _trim(self, length: int) -> None:
        self.api.llama_memory_seq_rm(self.ctx.memory, 0, length, -1)


class DraftAlone:
    """Our own ``DraftModel`` alone here, the servers idle, on the calling thread (the floors'): one OpenMP
    team for every llama.cpp call. Usage: ``with closing(DraftAlone(threads=2, prompt=ids)) as d:
    d.step_ms(temperature=1.0, top_k=32)``"""

    def __init__(self, threads: int, prompt: list[int]) -> None:
        from app.drafting import DraftModel
        from core.runners import load_runner

        self.prompt = list(prompt)
        self.draft = DraftModel(load_runner("builtin-draft", threads=threads), CallingThread())

    def close(self) -> None:
        self.draft.runner.close()

    def step_ms(self, temperature: float, top_k: int = 0, gamma: int = 8, repeats: int = 3) -> list[float]:
        """ms per drafted token of ``repeats`` drafts of ``gamma`` after the prompt (prefilled first)."""
        from app.drafting import DraftRequest
        from core.math.sampling import SamplingParams

        params = SamplingParams(temperature)

        async def drafts() -> list[float]:
            await self.draft.propose(DraftRequest("alone", self.prompt, params, 0, 0, (top_k, 1.0)), 1)
            times = []
            for seed in range(repeats):
                timing: dict[str, float] = {}
                draft = await self.draft.propose(
                    DraftRequest("alone", self.prompt, params, seed, 0, (top_k, 1.0)), gamma, timing=timing
                )
                times.append(sum(timing.values()) * 1e3 / max(len(draft), 1))
            await self.draft.free("alone")
            return times

        return asyncio.run(drafts())


async def bare_app(scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
    """An ASGI app that reads the body and answers ``x-answer-bytes`` zero bytes: HTTP and nothing else (no
    lifespan)."""
    more = True
    while more:
        message = await receive()
        more = message.get("more_body", False)
    size = int(dict(scope["headers"]).get(b"x-answer-bytes", b"0"))
    headers = [(b"content-type", b"application/octet-stream"), (b"content-length", str(size).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": bytes(size)})


def BareServer() -> ServerProcess:
    """``bare_app`` under uvicorn (its defaults, as the worker's) on 127.0.0.1."""
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "uvicorn",
        "clients.bench.floors:bare_app",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "warning",
        "--lifespan",
        "off",
    ]
    return ServerProcess(command, port, "/health", timeout_s=60)


def http_round_trip_ms(url: str, up_bytes: int, down_bytes: int, repeats: int = 20) -> list[float]:
    """POSTs of ``up_bytes`` answered with ``down_bytes``, through one httpx.AsyncClient (keep-alive, no
    retries)."""

    async def run() -> list[float]:
        body, headers = (
            bytes(up_bytes),
            {"x-answer-bytes": str(down_bytes), "content-type": "application/octet-stream"},
        )
        times = []
        async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(retries=0)) as client:
            await client.post(f"{url}/verify", content=body, headers=headers)  # the connection
            for _ in range(repeats):
                started = time.perf_counter()
                resp = await client.post(f"{url}/verify", content=body, headers=headers)
                _ = resp.content
                times.append((time.perf_counter() - started) * 1e3)
        return times

    return asyncio.run(run())


@dataclass(frozen=True)
class Floors:
    """llama.cpp's costs here: a draft step, scoring m positions (m → s), the target's own step (a decode + a
    whole-vocabulary sample: *direct*)."""

    threads: int
    draft_step_s: float
    scoring_s: dict[int, float]
    direct_step_s: float = 0.0
    direct_prefill_s: float = 0.0  # the bench's first prompt on the target alone

    def scoring(self, positions: float) -> float:
        """Seconds to score ``positions`` (a cell's mean γ + 1: the nearest measured)."""
        return self.scoring_s[min(self.scoring_s, key=lambda m: abs(m - positions))]

    def as_dict(self) -> dict[str, Any]:
        return {
            "threads": self.threads,
            "draft_step_ms": self.draft_step_s * 1e3,
            "scoring_ms": {m: s * 1e3 for m, s in self.scoring_s.items()},
            "direct_step_ms": self.direct_step_s * 1e3,
            "direct_prefill_ms": self.direct_prefill_s * 1e3,
        }


def bound_tokens_per_s(
    run: dict[str, float], gamma: float, draft_s: float, link: LinkConfig, num_workers: int
) -> float:
    """A run's tokens over R·T(γ) + (D − R·γ)·t_d: ``core.math.draft_length``'s round (overlapped at the
    run's share of prepared drafts used), with the run's own bytes (links in parallel) and model time."""
    rounds = max(run["rounds"], 1.0)
    costs = RoundCosts(
        alphas=(),
        draft_s=draft_s,
        verify_s=(run["verify_model_ms_per_round"] / 1e3, 0.0),
        rtt_s=link.rtt_ms / 1e3,
        up_bytes=(run["bytes_up_per_round"] / num_workers, 0.0),
        down_bytes=(run["bytes_down_per_round"] / num_workers, 0.0),
        up_bits_per_s=(link.up_mbps or 0) * 1e6 or None,
        down_bits_per_s=(link.down_mbps or 0) * 1e6 or None,
        overlap=True,
        prepared_used=run.get("prepared_used", 0.0) / rounds,
    )
    return run["tokens"] / (rounds * costs.round_s(gamma) + (run["drafted"] - rounds * gamma) * draft_s)


def physical_bound(
    run: dict[str, float], gamma: float, link: LinkConfig, num_workers: int, floors: Floors
) -> float:
    """``bound_tokens_per_s`` with llama.cpp's floors for t_d and t_v (γ + 1 positions a round)."""
    floored = run | {"verify_model_ms_per_round": floors.scoring(gamma + 1) * 1e3}
    return bound_tokens_per_s(floored, gamma, floors.draft_step_s, link, num_workers)


def measure_floors(positions: list[int], prompt: str, scored: str) -> Floors:
    """The floors (medians) with a two-worker bench's threads per process, after ``prompt``; the direct step
    samples the whole vocabulary (top-k 0)."""
    threads = max(1, usable_cores() // 2)
    progress(f"measuring llama.cpp's floors ({threads} thread(s)): a draft step, scoring {scored} positions")
    ids = chat_ids(prompt)
    with closing(LlamaFloor("builtin-draft", threads, ids)) as draft:
        step = median(draft.draft_step_ms(32)) / 1e3
    with closing(LlamaFloor("builtin", threads, ids)) as target:
        scoring = {m: median(target.scoring_ms(m)) / 1e3 for m in sorted(set(positions))}
        direct = median(target.draft_step_ms(0)) / 1e3
        prefill = target.prefill_ms / 1e3
    return Floors(threads, step, scoring, direct, prefill)


def chat_ids(prompt: str, tokenizer: Any = None) -> list[int]:
    """The chat prompt's token ids under ``tokenizer``'s template (default: the built-in target's)."""
    from core.runners.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model("builtin")) if tokenizer is None else tokenizer
    return list(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
    )
