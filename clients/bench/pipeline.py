"""``specgate bench pipeline``: FlowSpec's pipeline against pipelined autoregressive decoding
through the same stages, per stage count and per-hop delay (docs/design.md §3.7; docs/performance.md,
"Pipeline"). ALT: tokens per pipeline turn (segment answered); ALR: tokens per tree; bytes per
hop: the states sent stage to stage, per token."""

from __future__ import annotations

import argparse
import statistics
from contextlib import ExitStack
from typing import Any

import httpx

from clients.bench.common import Bar, Samples, finish, medians, progress, request, run_cells, start_gateway
from clients.procs import StageProcess
from clients.prompts import PROMPTS
from core.config import parse_config
from core.cores import usable_cores

NUM_LAYERS = 30  # the built-in model's


def split(stages: int) -> list[str]:
    """``stages`` even slices of the built-in model's layers, as first:end."""
    bounds = [round(i * NUM_LAYERS / stages) for i in range(stages + 1)]
    return [f"{a}:{b}" for a, b in zip(bounds, bounds[1:])]


def bench_pipeline(args: argparse.Namespace) -> int:
    stage_counts = [int(s) for s in str(args.stages).split(",")]
    hops = [float(h) for h in str(args.hop_ms).split(",")]
    prompts = PROMPTS[: args.prompts]
    cells = [("autoregressive", {"mode": "autoregressive"}), ("pipeline", {"mode": "pipeline"})]
    bar, rows = Bar(len(stage_counts) * len(hops) * len(cells) * args.runs), []
    for stages in stage_counts:
        for hop in hops:
            with ExitStack() as stack:
                progress(f"starting {stages} stages ({', '.join(split(stages))}), {hop:g} ms per hop")
                urls = [
                    stack.enter_context(StageProcess(layers, link_rtt_ms=2 * hop)) for layers in split(stages)
                ]
                config = parse_config(
                    {
                        "draft": {"model": "builtin-draft", "threads": 1},
                        "speculative": {"mode": "pipeline"},
                        "workers": [
                            {
                                "name": "pipe",
                                "pipeline": urls,
                                "read_timeout_s": 300,
                                "link": {"rtt_ms": 2 * hop},
                            }
                        ],
                    }
                )
                with httpx.Client(base_url=start_gateway(stack, config), timeout=900) as client:
                    request(client, prompts[0], 4, 0.0, {"mode": "pipeline"}, seed=0)  # warm-up
                    samples = run_cells(
                        cells,
                        args.runs,
                        bar,
                        f"{stages} stages, {hop:g} ms/hop,",
                        lambda run, spec: _measure(client, prompts, args.max_tokens, spec),
                        note="{tokens_per_s:.2f} tok/s",
                    )
                rows.append(_summarise(samples, stages, hop))
    results = {
        "setup": {
            "stages": stage_counts,
            "hop_ms": hops,
            "runs": args.runs,
            "max_tokens": args.max_tokens,
            "prompts": prompts,
            "cpu_count": usable_cores(),
        },
        "cells": rows,
    }
    return finish(results, args, _print_table)


def _measure(
    client: httpx.Client, prompts: list[str], max_tokens: int, spec: dict[str, Any]
) -> dict[str, float]:
    tokens = seconds = turns = trees = 0.0
    hop_bytes: list[float] = []
    for prompt in prompts:
        elapsed, usage = request(client, prompt, max_tokens, 0.0, spec, seed=0)
        block = usage["speculative"]
        tokens += usage["completion_tokens"]
        seconds += elapsed
        info = block.get("pipeline") or {}
        turns += info.get("turns", block["rounds"])
        trees += info.get("trees", block["rounds"])
        for hop, size in enumerate(info.get("hop_bytes", [])):
            hop_bytes += [0.0] * (hop + 1 - len(hop_bytes))
            hop_bytes[hop] += size
    return {
        "tokens_per_s": tokens / seconds,
        "tokens": tokens,
        "seconds": seconds,
        "alt": tokens / turns if turns else 0.0,
        "alr": tokens / trees if trees else 0.0,
        "hop_bytes_per_token": sum(hop_bytes) / len(hop_bytes) / tokens if hop_bytes and tokens else 0.0,
    }


def _summarise(samples: Samples, stages: int, hop: float) -> dict[str, Any]:
    row: dict[str, Any] = {"stages": stages, "hop_ms": hop, "layers": split(stages)} | {
        name: medians(runs) for name, runs in samples.items()
    }
    row["speedup"] = statistics.median(
        p["tokens_per_s"] / a["tokens_per_s"] for p, a in zip(samples["pipeline"], samples["autoregressive"])
    )
    return row


def _print_table(results: dict[str, Any]) -> None:
    setup = results["setup"]
    print(
        f"\nspecgate bench pipeline: {len(setup['prompts'])} prompt(s) × ≤ {setup['max_tokens']} "
        f"tokens, T = 0, median of {setup['runs']} run(s)"
    )
    print(
        f"{'stages':>6}{'ms/hop':>7}{'AR tok/s':>9}{'pipe tok/s':>11}{'speed-up':>9}{'ALT':>6}"
        f"{'ALR':>6}{'hop B/token':>12}"
    )
    for r in results["cells"]:
        a, p = r["autoregressive"], r["pipeline"]
        print(
            f"{r['stages']:>6}{r['hop_ms']:>7g}{a['tokens_per_s']:>9.2f}"
            f"{p['tokens_per_s']:>11.2f}{r['speedup']:>8.2f}×{p['alt']:>6.2f}{p['alr']:>6.2f}"
            f"{p['hop_bytes_per_token']:>12.0f}"
        )
