"""``specgate bench tree``: token trees against chains at equal verified-node budgets, per link and T
(docs/design.md §3.6; docs/performance.md, "Trees")."""

from __future__ import annotations

import argparse
import statistics
from contextlib import ExitStack
from functools import partial
from typing import Any

from clients.bench.common import (
    Bar,
    Samples,
    finish,
    gateway_client,
    measure,
    medians,
    progress,
    request,
    run_cells,
    setup,
)
from clients.bench.plots import plot_tree
from clients.procs import WorkerProcess
from clients.prompts import PROMPTS
from core.config import LinkConfig
from core.cores import usable_cores

BUDGETS = [4, 8, 14, 32]
EXACT_BUDGET = 14  # the default trees' size: the one budget also run on exact's payload
# round-trip delays only: k: full costs ~0.2 MB per node, so a bandwidth cap would measure the
# payload, not the shape (bytes per round are reported beside)
LINKS = [(f"{rtt} ms", LinkConfig(rtt_ms=rtt)) for rtt in (0, 20, 50, 100)]


def tree_spec(budget: int, temperature: float) -> dict[str, Any]:
    """The tree of ``budget`` nodes at this temperature (the defaults' shapes, resized)."""
    if temperature == 0:
        return {
            "mode": "tree",
            "k": "full",
            "tree": {"rule": "fixed", "nodes": budget, "depth": min(budget, 8), "top_k": 4},
        }
    return {
        "mode": "tree",
        "k": "full",
        "tree": {"rule": "sampled_distinct", "widths": [2] + [1] * (budget // 2 - 1)},
    }


def cells(budgets: list[int], temperature: float) -> list[tuple[str, dict[str, Any]]]:
    out: list[tuple[str, dict[str, Any]]] = [("autoregressive", {"mode": "autoregressive"})]
    for n in budgets:
        out.append((f"chain {n}", {"mode": "aggregate", "k": "full", "num_draft_tokens": n}))
        out.append((f"tree {n}", tree_spec(n, temperature)))
    if EXACT_BUDGET in budgets:
        # the same tree on exact's sparse payload (lossless too; the draft truncated to its top 32)
        out.append(
            (
                f"exact-tree {EXACT_BUDGET}",
                {"mode": "tree", "tree": tree_spec(EXACT_BUDGET, temperature)["tree"] | {"payload": "exact"}},
            )
        )
    return out


def bench_tree(args: argparse.Namespace) -> int:
    plan = _plan(args)
    bar, rows = (
        Bar(len(plan["links"]) * len(plan["temperatures"]) * len(cells(plan["budgets"], 0)) * plan["runs"]),
        [],
    )
    with ExitStack() as stack:
        progress("starting one worker (builtin, llama.cpp, one thread) on 127.0.0.1")
        # the draft gets the rest
        url = stack.enter_context(WorkerProcess("builtin", "llama.cpp", threads=max(1, usable_cores() // 2)))
        for link_name, link in plan["links"]:
            with gateway_client([url], link, 4) as client:
                for temperature in plan["temperatures"]:
                    specs = cells(plan["budgets"], temperature)
                    request(client, plan["prompts"][0], 4, temperature, specs[-1][1], seed=0)  # warm-up
                    samples = run_cells(
                        specs,
                        plan["runs"],
                        bar,
                        f"{link_name} T={temperature:g}",
                        partial(_measure_at, client, plan, temperature),
                        note="{mean_accepted_length:.2f} tok/round",
                    )
                    rows += _summarise(samples, link_name, link.rtt_ms, temperature)
    return finish(
        {"setup": setup(plan, cpu_count=usable_cores()), "cells": rows}, args, _print_table, plot_tree
    )


def _plan(args: argparse.Namespace) -> dict[str, Any]:
    if args.quick:
        return {
            "runs": 1,
            "prompts": PROMPTS[:1],
            "max_tokens": 16,
            "temperatures": [0.0],
            "budgets": [4, 14],
            "links": LINKS[:1],
        }
    return {
        "runs": args.runs,
        "prompts": PROMPTS[: args.prompts],
        "max_tokens": args.max_tokens,
        "temperatures": [0.0, 1.0],
        "budgets": BUDGETS,
        "links": LINKS,
    }


def _summarise(samples: Samples, link: str, rtt_ms: float, temperature: float) -> list[dict[str, Any]]:
    baseline = samples["autoregressive"]
    rows = []
    for name, runs in samples.items():
        cell = medians(runs)
        kind, _, budget = name.partition(" ")
        row: dict[str, Any] = {
            "cell": name,
            "shape": kind,
            "budget": int(budget) if budget else 0,
            "link": link,
            "rtt_ms": rtt_ms,
            "temperature": temperature,
            "runs": len(runs),
            **cell,
        }
        row["speedup_vs_autoregressive"] = statistics.median(
            r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(runs, baseline)
        )
        rows.append(row)
    for row in rows:  # the tree against the chain of the same budget, same link and T
        if row["shape"] in ("tree", "exact-tree"):
            chain = next(r for r in rows if r["shape"] == "chain" and r["budget"] == row["budget"])
            row["tokens_per_round_vs_chain"] = row["mean_accepted_length"] / chain["mean_accepted_length"]
            row["tokens_per_s_vs_chain"] = row["tokens_per_s"] / chain["tokens_per_s"]
    return rows


def _print_table(results: dict[str, Any]) -> None:
    setup = results["setup"]
    print(
        f"\nspecgate bench tree: {len(setup['prompts'])} prompt(s) × ≤ {setup['max_tokens']} "
        f"tokens, median of {setup['runs']} run(s), aggregate k: full"
    )
    print(
        f"{'link':<17}{'T':>3} {'cell':<15}{'tok/rnd':>8}{'vs chain':>9}{'tok/s':>7}"
        f"{'vs chain':>9}{'speed-up':>9}{'verify ms/rnd':>14}{'down B/rnd':>11}"
    )
    for r in results["cells"]:
        per_round = f"{r['tokens_per_round_vs_chain']:.2f}×" if "tokens_per_round_vs_chain" in r else ""
        per_s = f"{r['tokens_per_s_vs_chain']:.2f}×" if "tokens_per_s_vs_chain" in r else ""
        print(
            f"{r['link']:<17}{r['temperature']:>3g} {r['cell']:<15}"
            f"{r['mean_accepted_length']:>8.2f}{per_round:>9}{r['tokens_per_s']:>7.1f}{per_s:>9}"
            f"{r['speedup_vs_autoregressive']:>8.2f}×{r['verify_model_ms_per_round']:>14.1f}"
            f"{r['bytes_down_per_round']:>11.0f}"
        )


def _measure_at(
    client: Any, plan: dict[str, Any], temperature: float, run: int, spec: dict[str, Any]
) -> dict[str, float]:
    """One cell's run at ``temperature`` (``run_cells``' ``one``)."""
    return measure(client, plan["prompts"], plan["max_tokens"], temperature, spec, seed=run)
