"""``specgate bench peer``: what the gateway costs and gives back beside the engine it wraps. llama-cpp-python
alone on the built-in target's GGUF (and with its own prompt-lookup decoding), with the threads a served
worker gets, beside specgate's modes and drafters through ``specgate serve --config config/one-worker.yaml``;
the repository's own short and long prompts, greedy, one request at a time, the cells alternating prompt by
prompt, each request's prompt its own (no prompt cache on either side beyond the chat template's header),
every answer exactly ``--max-tokens`` long (EOS ignored on both sides: equal lengths, and no EOS counted on
one side only). Each figure is tokens per second as the client sees it (the answer's tokens over the request's
wall time, its prefill included); docs/performance.md, "At the peer's speed"."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from contextlib import ExitStack
from functools import partial
from pathlib import Path
from typing import Any

import httpx

from clients.bench.common import Bar, finish, median, progress
from clients.bench.consistency import article
from clients.bench.workload_prompts import PROMPTS as WORKLOAD
from clients.procs import free_port, serve_process
from clients.prompts import PROMPTS as SHORT
from core.cores import usable_cores
from core.runners.models import builtin_gguf

CONFIG = Path(__file__).resolve().parents[2] / "config" / "one-worker.yaml"
ENGINE, LOOKUP = "llama-cpp-python", "llama-cpp-python + its prompt lookup"
OURS: dict[str, dict[str, Any]] = {  # cell -> the request's speculative block
    "specgate autoregressive": {"mode": "autoregressive"},
    "specgate exact, lookup drafter": {"mode": "exact", "drafter": "lookup"},
    "specgate exact, draft model": {"mode": "exact"},
    "specgate exact, model+lookup": {"mode": "exact", "drafter": "model+lookup"},
}
CELLS = [ENGINE, LOOKUP, *OURS]
SETS = ("short", "summaries", "RAG", "long")
# issue 74: × the engine alone
GOALS = {"specgate autoregressive": ("every set", 0.9), "specgate exact, lookup drafter": ("summaries", 1.5)}


def bench_peer(args: argparse.Namespace) -> int:
    if args.quick:
        args.runs = 1
    args.prompts = max(1, min(args.prompts, 4))
    prompts = _prompts(args)
    threads = usable_cores()
    total = sum(len(p) for p in prompts.values()) * len(CELLS) * args.runs
    progress(
        f"bench peer: {total} requests "
        f"({', '.join(f'{len(p)} {name}' for name, p in prompts.items())} prompts × {len(CELLS)} "
        f"cells × {args.runs} runs), "
        f"≤ {args.max_tokens} tokens, greedy, {threads} threads"
    )
    seconds: dict[tuple[str, str], list[float]] = {}
    tokens: dict[tuple[str, str], list[int]] = {}
    with ExitStack() as stack:
        port = free_port()
        progress(
            f"starting specgate serve --config {CONFIG.relative_to(CONFIG.parents[1])} and "
            "llama-cpp-python on the built-in GGUF"
        )
        url = stack.enter_context(serve_process(str(CONFIG), port))
        client = stack.enter_context(httpx.Client(base_url=url, timeout=900))
        ids = {name: [_chat_ids(client, m) for m in messages] for name, messages in prompts.items()}
        engines = {ENGINE: _engine(threads, lookup=False), LOOKUP: _engine(threads, lookup=True)}
        runners: dict[str, Callable[[list[dict[str, str]], list[int]], tuple[float, int]]] = {}
        for name, llm in engines.items():
            runners[name] = partial(_engine_answer, llm, max_tokens=args.max_tokens)
        # each answer's rounds, in the order of seconds and tokens
        rounds: dict[str, list[int]] = {name: [] for name in OURS}
        for name, spec in OURS.items():
            runners[name] = partial(_ours, client, spec=spec, max_tokens=args.max_tokens, rounds=rounds[name])
        for name in CELLS:  # warm-up: a short answer each
            warm = _marked(prompts["short"][0], -1)
            runners[name](warm, _chat_ids(client, warm))
        for kept in rounds.values():
            kept.clear()
        counts: dict[tuple[str, str], list[int]] = {}
        bar = Bar(total)
        for run in range(args.runs):
            for set_name, messages in prompts.items():
                for i, message in enumerate(messages):
                    # alternate: the host's drift hits every cell alike
                    order = CELLS if (run + i) % 2 == 0 else CELLS[::-1]
                    for name in order:
                        # a prompt of its own: no cell finds it in a prompt cache
                        marked = _marked(message, bar.done)
                        elapsed, count = runners[name](marked, _chat_ids(client, marked))
                        seconds.setdefault((name, set_name), []).append(elapsed)
                        tokens.setdefault((name, set_name), []).append(count)
                        if name in rounds:
                            counts.setdefault((name, set_name), []).append(rounds[name][-1])
                        bar.step(f"{set_name} {name}: {count / elapsed:.1f} tok/s")
    rows = [
        _row(name, set_name, seconds[name, set_name], tokens[name, set_name], counts.get((name, set_name)))
        for name in CELLS
        for set_name in prompts
    ]
    engine = {r["set"]: r["tokens_per_s"] for r in rows if r["cell"] == ENGINE}
    for r in rows:
        r["vs_engine"] = r["tokens_per_s"] / engine[r["set"]] if engine.get(r["set"]) else float("nan")
    import llama_cpp

    plan = {
        "runs": args.runs,
        "max_tokens": args.max_tokens,
        "threads": threads,
        "config": "config/one-worker.yaml",
        "prompts": {name: [len(p) for p in ids[name]] for name in prompts},
        "gguf": builtin_gguf().name,
        "ignore_eos": True,
        "llama_cpp_python": llama_cpp.__version__,
        "engine_flash_attn": True,
        "commit": _commit(),
    }
    return finish({"setup": plan, "cells": rows, "goals": _goals(rows)}, args, _print)


def _prompts(args: argparse.Namespace) -> dict[str, list[list[dict[str, str]]]]:
    """The sets: short chat questions, summaries and passage QA of the workload set, long articles to
    summarise."""
    from core.runners.models import resolve_model
    from core.runners.tokenizer import load_tokenizer

    count = 2 if args.quick else args.prompts
    tokenizer = load_tokenizer(resolve_model("builtin"))
    longs = [article(tokenizer, length, i) for i, length in enumerate([700, 1_000, 1_300, 1_000][:count])]
    return {
        "short": [[{"role": "user", "content": p}] for p in SHORT[:count]],
        "summaries": WORKLOAD["summarization"][:count],
        "RAG": WORKLOAD["passage QA"][:count],
        "long": [[{"role": "user", "content": text}] for text in longs],
    }


def _commit() -> str:
    """The checkout's commit, as the JSON records it (empty outside a git checkout)."""
    import subprocess

    done = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        cwd=CONFIG.parents[1],
        check=False,
    )
    return done.stdout.strip()


def _marked(messages: list[dict[str, str]], number: int) -> list[dict[str, str]]:
    """The messages with the request's number before the first one's text: each request its own prompt, so
    that neither the worker's prompt cache nor llama-cpp-python's finds a prefix an earlier cell left."""
    first, *rest = messages
    return [{**first, "content": f"(request {number})\n{first['content']}"}, *rest]


def _chat_ids(client: httpx.Client, messages: list[dict[str, str]]) -> list[int]:
    """The prompt's ids as the gateway renders a chat request (``/tokenize``): the engine alone gets the very
    same."""
    resp = client.post("/tokenize", json={"model": "specgate", "messages": messages})
    resp.raise_for_status()
    return list(resp.json()["tokens"])


def _engine(threads: int, lookup: bool) -> Any:
    """llama-cpp-python on the built-in GGUF as its user would load it, ``threads`` threads; ``lookup``: its
    prompt-lookup decoding."""
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    draft = LlamaPromptLookupDecoding() if lookup else None
    # with a draft model llama-cpp-python computes every row's logits whatever logits_all says, but sizes
    # their buffer by it: a prompt longer than n_batch fails unless it is said (0.3.36); flash attention on,
    # as the worker runs it
    return Llama(
        model_path=str(builtin_gguf()),
        n_ctx=4096,
        n_threads=threads,
        n_threads_batch=threads,
        draft_model=draft,
        logits_all=lookup,
        flash_attn=True,
        verbose=False,
    )


def _engine_answer(
    llm: Any, _: list[dict[str, str]], prompt: list[int], max_tokens: int
) -> tuple[float, int]:
    never = {int(llm.token_eos()): float("-inf")}  # EOS ignored, as specgate's ignore_eos
    started = time.perf_counter()
    out = llm.create_completion(prompt=prompt, max_tokens=max_tokens, temperature=0.0, logit_bias=never)
    return time.perf_counter() - started, int(out["usage"]["completion_tokens"])


def _ours(
    client: httpx.Client,
    messages: list[dict[str, str]],
    _: list[int],
    spec: dict[str, Any],
    max_tokens: int,
    rounds: list[int],
) -> tuple[float, int]:
    body = {
        "model": "specgate",
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "speculative": spec,
    }
    started = time.perf_counter()
    resp = client.post("/v1/chat/completions", json=body)
    elapsed = time.perf_counter() - started
    resp.raise_for_status()
    usage = resp.json()["usage"]
    rounds.append(int(usage["speculative"]["rounds"]))
    return elapsed, int(usage["completion_tokens"])


def _row(
    cell: str, set_name: str, seconds: list[float], tokens: list[int], rounds: list[int] | None
) -> dict[str, Any]:
    rates = [n / s for n, s in zip(tokens, seconds) if s > 0]
    row = {
        "cell": cell,
        "set": set_name,
        "tokens_per_s": median(rates),
        "tokens_per_s_range": [min(rates), max(rates)],
        "tokens_per_s_each": rates,
        "tokens": tokens,
        "seconds": seconds,
    }
    if rounds:  # specgate's: tokens per round (its first round, with the prefill, counted)
        row |= {"rounds": rounds, "tokens_per_round": sum(tokens) / max(sum(rounds), 1)}
    return row


def _goals(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for cell, (where, goal) in GOALS.items():
        sets = list(SETS) if where == "every set" else [where]
        ratios = {r["set"]: r["vs_engine"] for r in rows if r["cell"] == cell and r["set"] in sets}
        out.append(
            {
                "cell": cell,
                "sets": sets,
                "goal": goal,
                "ratios": ratios,
                "met": bool(ratios) and all(v >= goal for v in ratios.values()),
            }
        )
    return out


def _print(results: dict[str, Any]) -> None:
    setup, rows = results["setup"], results["cells"]
    sets = list(setup["prompts"])
    print(
        f"\nspecgate bench peer: greedy, ≤ {setup['max_tokens']} tokens, {setup['threads']} "
        f"threads, {setup['runs']} run(s); "
        f"prompt tokens {', '.join(f'{s} ' + '/'.join(map(str, setup['prompts'][s])) for s in sets)}"
    )
    print("median tokens/s as the client sees it (× the engine alone)")
    print(f"{'':38}" + "".join(f"{s:>18}" for s in sets))
    for cell in CELLS:
        line = f"{cell:38}"
        for s in sets:
            r = next(r for r in rows if r["cell"] == cell and r["set"] == s)
            line += f"{r['tokens_per_s']:>10.1f} ({r['vs_engine']:.2f}×)"
        print(line)
    ours = [r for r in rows if "tokens_per_round" in r]
    if ours:
        print(
            "specgate's tokens per round: "
            + "; ".join(
                f"{cell.removeprefix('specgate ')} "
                + ", ".join(f"{r['tokens_per_round']:.2f}" for r in ours if r["cell"] == cell)
                for cell in OURS
            )
        )
    for goal in results["goals"]:
        shown = ", ".join(f"{s} {v:.2f}×" for s, v in goal["ratios"].items())
        print(
            f"goal: {goal['cell']} ≥ {goal['goal']}× the engine alone ({shown}): "
            f"{'met' if goal['met'] else 'not met'}"
        )
