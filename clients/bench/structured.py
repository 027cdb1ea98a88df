"""``specgate bench structured``: constrained answers (a json_schema, a required tool call) beside the
same prompts unconstrained, alternately, per mode × T through ``specgate serve`` on the built-in default:
tokens per round, tok/s, forced tokens, the time the masks add per round, bytes per token, valid share."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from functools import partial
from typing import Any

import httpx

from clients.bench.common import Bar, finish, median, progress
from clients.bench.grammar import SCHEMA, TOOLS, timed
from clients.procs import free_port, serve_process

MODES: dict[str, dict[str, Any]] = {
    "autoregressive": {"mode": "autoregressive"},
    "exact": {"mode": "exact"},
    "tree": {"mode": "tree"},
}
SCHEMA_PROMPTS = [
    "Invent a person and describe them as JSON with name, age, city, tags, married and score.",
    "Make up a character for a novel: give their name, age, home city, a few tags, whether they "
    "are married and a score.",
    "Describe a famous scientist as a JSON record (name, age, city, tags, married, score).",
]
TOOL_PROMPTS = [
    "What is the weather like in Paris right now?",
    "What time is it in Tokyo?",
    "Should I take an umbrella in London today?",
]
TOOL_DEFS = [
    {
        "type": "function",
        "function": {"name": t.name, "description": t.description, "parameters": t.parameters},
    }
    for t in TOOLS
]
GOAL_SPEED = 0.9  # constrained tok/s over unconstrained
GOAL_TOKENS_PER_ROUND = 1.3  # constrained tokens/round over unconstrained (schema output)


def bench_structured(args: argparse.Namespace) -> int:
    plan = _plan(args)
    compile_ms = _compile_ms()
    progress(
        f"starting specgate serve (the built-in default) for {len(plan['cells'])} cells × "
        f"{plan['runs']} seed(s) × 3 prompts × 2"
    )
    with serve_process(None, free_port()) as url, httpx.Client(base_url=url, timeout=600) as client:
        for workload in ("schema", "tool"):  # warm-up: the grammars compiled, every path once
            _request(client, workload, True, MODES["exact"], 1.0, 0, 8)
        rows = _run(plan, client)
    return finish({"setup": plan, "compile_ms": compile_ms, "cells": rows}, args, print_table)


def _plan(args: argparse.Namespace) -> dict[str, Any]:
    modes, temperatures = (["autoregressive", "exact"], [1.0]) if args.quick else (list(MODES), [0.0, 1.0])
    cells = [(mode, t, workload) for workload in ("schema", "tool") for t in temperatures for mode in modes]
    return {"runs": 1 if args.quick else max(1, args.runs), "max_tokens": args.max_tokens, "cells": cells}


def _compile_ms() -> dict[str, dict[str, float]]:
    from app.tools import generic_schema
    from core.grammar import Grammars, GrammarSpec
    from core.runners.models import resolve_model
    from core.runners.tokenizer import load_tokenizer

    grammars = Grammars(load_tokenizer(resolve_model("builtin")), 49152, [2])
    out = {}
    for name, schema in (("schema", SCHEMA), ("tool", generic_schema(TOOLS, True, True))):
        spec = GrammarSpec.json_schema(schema)
        out[name] = {
            "cold": timed(partial(grammars.compile, spec))[0],
            "cached": timed(partial(grammars.compile, spec))[0],
        }
    return out


def _request(
    client: httpx.Client,
    workload: str,
    constrained: bool,
    spec: dict[str, Any],
    temperature: float,
    seed: int,
    max_tokens: int,
    prompt: int = 0,
) -> dict[str, Any]:
    prompts = SCHEMA_PROMPTS if workload == "schema" else TOOL_PROMPTS
    body: dict[str, Any] = {
        "model": "specgate",
        "messages": [{"role": "user", "content": prompts[prompt]}],
        "max_tokens": max_tokens,
        "temperature": temperature,
        "seed": seed,
        "speculative": {**spec, "profile": True},
    }
    if constrained and workload == "schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    if constrained and workload == "tool":
        body |= {"tools": TOOL_DEFS, "tool_choice": "required"}
    started = time.perf_counter()
    resp = client.post("/v1/chat/completions", json=body).raise_for_status().json()
    seconds = time.perf_counter() - started
    usage, choice = resp["usage"], resp["choices"][0]
    block = usage["speculative"]
    rounds = block["profile"]

    def per_round(*parts: str) -> float:
        return statistics.mean(sum(r["parts_ms"][p] for p in parts) for r in rounds) if rounds else 0.0

    return {
        "tokens": usage["completion_tokens"],
        "seconds": seconds,
        "rounds": block["rounds"],
        "forced": block.get("forced_tokens", 0),
        "bytes": block["bytes_to_workers"] + block["bytes_from_workers"],
        "finish": choice["finish_reason"],
        "gateway_ms": per_round("draft_sampling", "gateway_math"),
        "worker_ms": per_round("worker_scoring"),
        "valid": _valid(workload, constrained, choice),
    }


def _valid(workload: str, constrained: bool, choice: dict[str, Any]) -> bool | None:
    if not constrained:
        return None
    if workload == "tool":
        return choice["finish_reason"] == "tool_calls"
    if choice["finish_reason"] != "stop":
        return False
    try:
        json.loads(choice["message"]["content"])
    except ValueError:
        return False
    return True


def _run(plan: dict[str, Any], client: httpx.Client) -> list[dict[str, Any]]:
    rows, bar = [], Bar(len(plan["cells"]))
    for mode, t, workload in plan["cells"]:
        runs: dict[bool, list[dict[str, Any]]] = {True: [], False: []}
        for seed in range(plan["runs"]):
            for prompt in range(3):
                for constrained in (True, False):  # alternately: the machine's noise falls on both
                    runs[constrained].append(
                        _request(
                            client, workload, constrained, MODES[mode], t, seed, plan["max_tokens"], prompt
                        )
                    )
        rows.append(r := _summary(mode, t, workload, runs))
        bar.step(
            f"{mode} T={t:g} {workload}: {r['constrained']['tokens_per_s']:.1f} vs "
            f"{r['unconstrained']['tokens_per_s']:.1f} tok/s"
        )
    return rows


def _summary(mode: str, t: float, workload: str, runs: dict[bool, list[dict[str, Any]]]) -> dict[str, Any]:
    def side(samples: list[dict[str, Any]]) -> dict[str, Any]:
        tokens, rounds = sum(s["tokens"] for s in samples), sum(s["rounds"] for s in samples)
        return {
            "tokens_per_s": tokens / sum(s["seconds"] for s in samples),
            "tokens_per_round": tokens / max(rounds, 1),
            "forced_per_answer": statistics.mean(s["forced"] for s in samples),
            "bytes_per_token": sum(s["bytes"] for s in samples) / max(tokens, 1),
            "gateway_ms_per_round": median([s["gateway_ms"] for s in samples]),
            "worker_ms_per_round": median([s["worker_ms"] for s in samples]),
            "tokens": tokens,
            "rounds": rounds,
        }

    constrained, free = side(runs[True]), side(runs[False])
    valid = [s["valid"] for s in runs[True]]
    return {
        "mode": mode,
        "temperature": t,
        "workload": workload,
        "constrained": constrained,
        "unconstrained": free,
        "speed_ratio": constrained["tokens_per_s"] / free["tokens_per_s"],
        "tokens_per_round_ratio": constrained["tokens_per_round"] / free["tokens_per_round"],
        "mask_gateway_ms": constrained["gateway_ms_per_round"] - free["gateway_ms_per_round"],
        "mask_worker_ms": constrained["worker_ms_per_round"] - free["worker_ms_per_round"],
        "valid_share": sum(bool(v) for v in valid) / len(valid),
    }


def print_table(results: dict[str, Any]) -> None:
    setup = results["setup"]
    print(
        f"\nspecgate bench structured: the built-in default, zero link, {setup['runs']} seed(s) "
        f"× 3 prompts, ≤ {setup['max_tokens']} tokens; "
        "constrained vs the same prompts unconstrained"
    )
    print(
        f"{'mode':<16}{'T':>3} {'workload':<8}{'tok/s':>14}{'×':>6}{'tokens/round':>15}{'×':>6}"
        f"{'forced':>8}{'mask ms gw/wk':>15}{'B/token':>9}{'valid':>7}"
    )
    for r in results["cells"]:
        c, u = r["constrained"], r["unconstrained"]
        print(
            f"{r['mode']:<16}{r['temperature']:>3g} {r['workload']:<8}{c['tokens_per_s']:>6.1f} "
            f"/{u['tokens_per_s']:>6.1f}{r['speed_ratio']:>6.2f}"
            f"{c['tokens_per_round']:>7.2f} /{u['tokens_per_round']:>6.2f}"
            f"{r['tokens_per_round_ratio']:>6.2f}{c['forced_per_answer']:>8.1f}"
            f"{r['mask_gateway_ms']:>8.2f}/{r['mask_worker_ms']:>5.2f}"
            f"{c['bytes_per_token']:>9.0f}{r['valid_share']:>7.0%}"
        )
    compile_ms = results["compile_ms"]
    print(
        "grammar compile (ms, cold / cached): "
        + ", ".join(f"{k} {v['cold']:.2f} / {v['cached']:.3f}" for k, v in compile_ms.items())
    )
    print(
        f"goals: constrained tok/s ≥ {GOAL_SPEED}× unconstrained; tokens/round on schema output "
        f"≥ {GOAL_TOKENS_PER_ROUND}× unconstrained"
    )
