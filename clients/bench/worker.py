"""``specgate bench worker``: a verify call over HTTP to a real worker beside the same forward
in-process, per backend and positions scored; and the acceptance α = E[Σ_x min(p, q)] of the
built-in draft against the built-in target at T = 1. Medians; cells alternate."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import httpx
import numpy as np
import torch

from clients.bench.common import progress, write_json
from clients.bench.floors import chat_ids
from clients.procs import WorkerProcess
from clients.prompts import PROMPTS as ALL_PROMPTS
from core.math.sampling import SamplingParams, apply_sampling
from core.protocol import VerifyRequest, VerifyResponse, decode, encode
from core.runners import ModelRunner, load_runner

# the fourth as measured so far
PROMPTS = [*ALL_PROMPTS[:3], "What is the capital of France, and what is it known for?"]


def bench_worker(args: argparse.Namespace) -> int:
    repeats = 5 if args.quick else args.repeats
    results: dict[str, Any] = {"model": "builtin", "repeats": repeats, "latency": [], "acceptance": {}}
    for backend in args.backends:
        progress(f"[{backend}] loading the built-in model in-process")
        runner = load_runner("builtin", backend)
        prompt = chat_ids(PROMPTS[0], runner.tokenizer)
        progress(f"[{backend}] starting a real worker on 127.0.0.1")
        with WorkerProcess("builtin", backend) as url:
            results["latency"] += _latency_rows(runner, url, prompt, args.positions, repeats, backend)
        runner.close()
    results["acceptance"] = _acceptance(num_tokens=16 if args.quick else 48)
    _print_tables(results)
    write_json(args.json_path, results)
    return 0


def _latency_rows(
    runner: ModelRunner, url: str, prompt: list[int], positions: list[int], repeats: int, backend: str
) -> list[dict[str, Any]]:
    """One row per m; the in-process and HTTP calls alternate, so noise hits them alike."""
    rows = []
    vocab_size = runner.info.vocab_size
    with httpx.Client(base_url=url, timeout=60) as client:
        for m in positions:
            draft = prompt[1:m]  # any real tokens will do; m − 1 of them
            cells: dict[str, Callable[[], tuple[int, int]]] = {
                "in_process": partial(_in_process, runner, prompt, draft)
            }
            cells |= {
                f"http_{'full' if k is None else f'k{k}'}": _http_call(client, prompt, draft, k, vocab_size)
                for k in (None, 32)
            }
            times, sizes = _alternate(cells, repeats)
            row: dict[str, Any] = {"backend": backend, "positions": m} | {
                f"{name}_ms": statistics.median(ts) for name, ts in times.items()
            }
            for name, (up, down) in sizes.items():
                if name.startswith("http_"):
                    row[f"bytes_up_{name[5:]}"], row[f"bytes_down_{name[5:]}"] = up, down
            rows.append(row)
            progress(
                f"[{backend}] m={m}: in-process {row['in_process_ms']:.1f} ms, HTTP full "
                f"{row['http_full_ms']:.1f} ms, HTTP k32 {row['http_k32_ms']:.1f} ms"
            )
    return rows


def _alternate(
    cells: dict[str, Callable[[], tuple[int, int]]], repeats: int
) -> tuple[dict[str, list[float]], dict[str, tuple[int, int]]]:
    times: dict[str, list[float]] = {name: [] for name in cells}
    sizes = {name: fn() for name, fn in cells.items()}  # warm-up, and the payload sizes
    for _ in range(repeats):
        for name, fn in cells.items():
            started = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - started) * 1e3)
    return times, sizes


def _in_process(runner: ModelRunner, prompt: list[int], draft: list[int]) -> tuple[int, int]:
    """The forward pass a verify call makes: crop to the agreed prefix, append, score."""
    session = "bench"
    if runner.length(session) < len(prompt) - 1:
        runner.prefill(session, prompt[:-1])
    runner.crop(session, len(prompt) - 1)
    runner.append(session, [prompt[-1], *draft], len(draft) + 1)
    return 0, 0


def _http_call(
    client: httpx.Client, prompt: list[int], draft: list[int], k: int | None, vocab_size: int
) -> Callable[[], tuple[int, int]]:
    """A steady-state verify call of a session that holds ``prompt[:-1]``."""
    session = f"bench-{len(draft)}-{k}"
    agreed = prompt[:-1]
    _post(client, VerifyRequest.after(session, [], agreed, [], k=k), vocab_size)  # prefill, untimed
    req = VerifyRequest.after(session, agreed, [prompt[-1]], draft, k=k)
    return lambda: _post(client, req, vocab_size)


def _post(client: httpx.Client, req: VerifyRequest, vocab_size: int) -> tuple[int, int]:
    body, content_type = encode(req, vocab_size)
    resp = client.post("/v1/verify", content=body, headers={"content-type": content_type})
    resp.raise_for_status()
    decode(VerifyResponse, resp.content, resp.headers["content-type"])
    return len(body), len(resp.content)


def _acceptance(num_tokens: int, seed: int = 0) -> dict[str, Any]:
    """α of builtin-draft vs builtin (llama.cpp, T = 1) along target-sampled continuations."""
    progress("[acceptance] loading builtin (target) and builtin-draft (draft)")
    target, draft = load_runner("builtin", "llama.cpp"), load_runner("builtin-draft", "llama.cpp")
    generator = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=1.0)
    betas: list[float] = []
    per_prompt = []
    for i, text in enumerate(PROMPTS):
        ids = chat_ids(text, target.tokenizer)
        prompt_betas = _prompt_betas(target, draft, ids, num_tokens, params, generator)
        per_prompt.append({"prompt": text, "alpha": float(np.mean(prompt_betas))})
        betas += prompt_betas
        progress(f"[acceptance] prompt {i + 1}/{len(PROMPTS)}: α = {per_prompt[-1]['alpha']:.3f}")
    target.close()
    draft.close()
    return {
        "temperature": 1.0,
        "tokens_per_prompt": num_tokens,
        "alpha": float(np.mean(betas)),
        "per_prompt": per_prompt,
    }


def _prompt_betas(
    target: ModelRunner,
    draft: ModelRunner,
    ids: list[int],
    num_tokens: int,
    params: SamplingParams,
    generator: torch.Generator,
) -> list[float]:
    p = apply_sampling(target.prefill("alpha", ids), params)[0]
    q = apply_sampling(draft.prefill("alpha", ids), params)[0]
    betas = []
    for _ in range(num_tokens):
        betas.append(float(torch.minimum(p, q).sum()))
        token = int(torch.multinomial(p, 1, generator=generator))
        if token in target.info.eos_ids:
            break
        p = apply_sampling(target.append("alpha", [token], 1), params)[0]
        q = apply_sampling(draft.append("alpha", [token], 1), params)[0]
    target.free("alpha")
    draft.free("alpha")
    return betas


def _print_tables(results: dict[str, Any]) -> None:
    print("\nverify latency, median ms (one call, m positions scored; bytes per call up/down)")
    print(
        f"{'backend':<13}{'m':>3}{'in-process':>12}{'HTTP full':>11}{'HTTP k32':>10}"
        f"{'overhead':>10}{'up B':>7}{'down full B':>13}{'down k32 B':>12}"
    )
    for r in results["latency"]:
        overhead = r["http_k32_ms"] - r["in_process_ms"]
        print(
            f"{r['backend']:<13}{r['positions']:>3}{r['in_process_ms']:>12.1f}{r['http_full_ms']:>11.1f}"
            f"{r['http_k32_ms']:>10.1f}{overhead:>10.1f}{r['bytes_up_k32']:>7}"
            f"{r['bytes_down_full']:>13}{r['bytes_down_k32']:>12}"
        )
    acc = results["acceptance"]
    print(
        f"\nacceptance of builtin-draft vs builtin at T = 1: α = {acc['alpha']:.3f} "
        f"({len(acc['per_prompt'])} prompts × ≤ {acc['tokens_per_prompt']} tokens)"
    )
