"""``specgate bench``: tokens/s of the decoding modes through the same gateway and workers.

It starts the built-in default (draft builtin-draft; workers builtin and builtin-alt, weights
0.5 / 0.5, the cores split between them) on free 127.0.0.1 ports, then times whole requests
per mode cell. Cells alternate within each run, so the host's drift hits them alike; each
figure is the median over runs, and speed-ups are ratios to `autoregressive` in the same run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

from clients.report import progress, write_json
from clients.procs import GatewayProcess, WorkerProcess
from core.config import builtin_config, dump_config

PROMPTS = [
    "Explain in two sentences why the sky is blue.",
    "Write a short poem about a lighthouse keeper.",
    "List three tips for learning a new programming language.",
    "Describe the water cycle for a ten-year-old.",
]
CELLS: list[tuple[str, dict[str, Any]]] = [
    ("autoregressive", {"mode": "autoregressive"}),
    ("aggregate k=full", {"mode": "aggregate", "k": "full"}),
    ("aggregate k=32", {"mode": "aggregate", "k": 32}),
]


def bench_modes(args: argparse.Namespace) -> int:
    runs = max(3, args.runs)
    prompts = PROMPTS[:1] if args.quick else PROMPTS
    max_tokens = 24 if args.quick else args.max_tokens
    temperatures = [0.0] if args.quick else [0.0, 1.0]
    with ExitStack() as stack:
        base = _start_stack(stack, args.gamma)
        rows = []
        with httpx.Client(base_url=base, timeout=600) as client:
            for temperature in temperatures:
                samples = _run_cells(client, prompts, max_tokens, temperature, runs)
                rows += _summarise(samples, temperature, args.gamma)
    results = {"setup": _setup(args.gamma, runs, prompts, max_tokens), "cells": rows}
    _print_table(results)
    write_json(args.json_path, results)
    return 0


def _start_stack(stack: ExitStack, gamma: int) -> str:
    config = builtin_config().with_local_urls().with_split_cores(os.cpu_count() or 1)
    progress("starting two workers (builtin, builtin-alt) and the gateway on 127.0.0.1")
    workers = []
    for entry in config.workers:
        assert entry.model is not None
        url = stack.enter_context(WorkerProcess(entry.model, entry.backend.value, threads=entry.threads))
        workers.append(entry.model_copy(update={"url": url, "model": None, "port": None}))
    config = config.model_copy(update={"workers": workers})
    config.speculative.num_draft_tokens = gamma
    path = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="specgate-bench-"))) / "config.yaml"
    path.write_text(dump_config(config))
    return stack.enter_context(GatewayProcess(str(path)))


def _run_cells(client: httpx.Client, prompts: list[str], max_tokens: int, temperature: float, runs: int) -> dict[str, list[dict[str, float]]]:
    samples: dict[str, list[dict[str, float]]] = {name: [] for name, _ in CELLS}
    _one(client, prompts[0], 4, temperature, CELLS[0][1], seed=0)  # warm-up: contexts, caches
    total = runs * len(CELLS)
    for run in range(runs):
        for i, (name, spec) in enumerate(CELLS):
            samples[name].append(_cell(client, prompts, max_tokens, temperature, spec, seed=run))
            done = run * len(CELLS) + i + 1
            tps = samples[name][-1]["tokens_per_s"]
            progress(f"[T={temperature:g}] run {run + 1}/{runs} {name}: {tps:.1f} tok/s  ({done}/{total})")
    return samples


def _cell(client: httpx.Client, prompts: list[str], max_tokens: int, temperature: float, spec: dict[str, Any], seed: int) -> dict[str, float]:
    tokens = seconds = rounds = drafted = accepted = sent = received = 0.0
    for prompt in prompts:
        elapsed, usage = _one(client, prompt, max_tokens, temperature, spec, seed)
        block = usage["speculative"]
        tokens += usage["completion_tokens"]
        seconds += elapsed
        rounds += block["rounds"]
        drafted += block["draft_tokens"]
        accepted += block["accepted_tokens"]
        sent += block["bytes_to_workers"]
        received += block["bytes_from_workers"]
    return {
        "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
        "acceptance_rate": accepted / drafted if drafted else float("nan"),
        "mean_accepted_length": tokens / rounds if rounds else float("nan"),
        "bytes_up_per_round": sent / rounds if rounds else 0.0,
        "bytes_down_per_round": received / rounds if rounds else 0.0,
    }


def _one(client: httpx.Client, prompt: str, max_tokens: int, temperature: float, spec: dict[str, Any], seed: int) -> tuple[float, dict[str, Any]]:
    body = {
        "model": "specgate", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
        "temperature": temperature, "seed": seed, "speculative": spec,
    }
    started = time.perf_counter()
    resp = client.post("/v1/chat/completions", json=body)
    elapsed = time.perf_counter() - started
    resp.raise_for_status()
    return elapsed, resp.json()["usage"]


def _summarise(samples: dict[str, list[dict[str, float]]], temperature: float, gamma: int) -> list[dict[str, Any]]:
    baseline = samples[CELLS[0][0]]
    rows = []
    for name, runs in samples.items():
        ratios = [r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(runs, baseline)]
        medians = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        row: dict[str, Any] = {"cell": name, "temperature": temperature, "runs": len(runs), **medians}
        row["speedup_vs_autoregressive"] = statistics.median(ratios)
        row["alpha_implied"] = implied_alpha(medians["mean_accepted_length"], gamma) if name != CELLS[0][0] else None
        rows.append(row)
    return rows


def implied_alpha(mean_length: float, gamma: int) -> float:
    """The α for which (1 − α^{γ+1}) / (1 − α) equals the measured tokens per round."""
    low, high = 0.0, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        expected = sum(mid**i for i in range(gamma + 1))
        low, high = (mid, high) if expected < mean_length else (low, mid)
    return (low + high) / 2


def _setup(gamma: int, runs: int, prompts: list[str], max_tokens: int) -> dict[str, Any]:
    return {
        "draft": "builtin-draft (llama.cpp)", "workers": ["builtin", "builtin-alt"], "weights": [0.5, 0.5],
        "num_draft_tokens": gamma, "runs": runs, "prompts": prompts, "max_tokens": max_tokens, "cpu_count": os.cpu_count(),
    }


def _print_table(results: dict[str, Any]) -> None:
    setup = results["setup"]
    print(f"\nspecgate bench: built-in default, γ = {setup['num_draft_tokens']}, {len(setup['prompts'])} prompts × ≤ {setup['max_tokens']} tokens, median of {setup['runs']} runs")
    print(f"{'T':>4} {'cell':<18}{'tok/s':>8}{'speed-up':>10}{'accept':>8}{'tok/round':>11}{'α implied':>11}{'up B/rnd':>10}{'down B/rnd':>12}")
    for r in results["cells"]:
        alpha = "" if r["alpha_implied"] is None else f"{r['alpha_implied']:.2f}"
        accept = "" if r["acceptance_rate"] != r["acceptance_rate"] else f"{r['acceptance_rate']:.2f}"
        print(
            f"{r['temperature']:>4g} {r['cell']:<18}{r['tokens_per_s']:>8.1f}{r['speedup_vs_autoregressive']:>9.2f}×{accept:>8}"
            f"{r['mean_accepted_length']:>11.2f}{alpha:>11}{r['bytes_up_per_round']:>10.0f}{r['bytes_down_per_round']:>12.0f}"
        )
