"""``specgate bench tree``: token trees against chains at equal verified-node budgets (DESIGN §3.6).

One real worker (builtin, llama.cpp) runs once; for each emulated link a gateway is started
whose worker entry carries that link. At each node budget N (4, 8, 14, 32) the chain drafts
γ = N tokens and the tree verifies N nodes: at T = 0 an EAGLE-2 tree (fixed children, the best
N by cumulative draft log-probability), at T = 1 sampled children without replacement,
⟨2,1,…,1⟩ (a 2-way root with chains below). Both ride on ``aggregate k: full``, so both are
lossless and differ only in the draft's shape; at 14 nodes the tree also runs on ``exact``'s
sparse payload (lossless, the draft truncated to its top 32), for its bytes per round. Within a run the cells alternate; each figure
is the median over runs; speed-ups are ratios to ``autoregressive`` through the same worker and
link in the same run.
"""

from __future__ import annotations

import argparse
import statistics
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

from clients.bench.common import Bar, measure, medians, progress, request, write_json
from clients.bench.modes import _start_gateway
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
        return {"mode": "tree", "k": "full", "tree": {"rule": "fixed", "nodes": budget, "depth": min(budget, 8), "top_k": 4}}
    return {"mode": "tree", "k": "full", "tree": {"rule": "sampled_distinct", "widths": [2] + [1] * (budget // 2 - 1)}}


def exact_tree_spec(budget: int, temperature: float) -> dict[str, Any]:
    """The same tree on exact's sparse payload (lossless too; the draft truncated to its top 32)."""
    spec = tree_spec(budget, temperature)
    del spec["k"]
    return spec | {"tree": spec["tree"] | {"payload": "exact"}}


def cells(budgets: list[int], temperature: float) -> list[tuple[str, dict[str, Any]]]:
    out: list[tuple[str, dict[str, Any]]] = [("autoregressive", {"mode": "autoregressive"})]
    for n in budgets:
        out.append((f"chain {n}", {"mode": "aggregate", "k": "full", "num_draft_tokens": n}))
        out.append((f"tree {n}", tree_spec(n, temperature)))
    if EXACT_BUDGET in budgets:
        out.append((f"exact-tree {EXACT_BUDGET}", exact_tree_spec(EXACT_BUDGET, temperature)))
    return out


def bench_tree(args: argparse.Namespace) -> int:
    plan = _plan(args)
    total = len(plan["links"]) * len(plan["temperatures"]) * len(cells(plan["budgets"], 0)) * plan["runs"]
    bar, rows = Bar(total), []
    with ExitStack() as stack:
        progress("starting one worker (builtin, llama.cpp, one thread) on 127.0.0.1")
        url = stack.enter_context(WorkerProcess("builtin", "llama.cpp", threads=max(1, usable_cores() // 2)))  # the draft gets the rest
        for link_name, link in plan["links"]:
            with ExitStack() as gateway_stack:
                base = _start_gateway(gateway_stack, [url], link, 4)
                with httpx.Client(base_url=base, timeout=900) as client:
                    for temperature in plan["temperatures"]:
                        specs = cells(plan["budgets"], temperature)
                        request(client, plan["prompts"][0], 4, temperature, specs[-1][1], seed=0)  # warm-up
                        samples: dict[str, list[dict[str, float]]] = {name: [] for name, _ in specs}
                        for run in range(plan["runs"]):
                            for name, spec in specs:
                                samples[name].append(measure(client, plan["prompts"], plan["max_tokens"], temperature, spec, seed=run))
                                bar.step(f"{link_name} T={temperature:g} {name}: {samples[name][-1]['mean_accepted_length']:.2f} tok/round")
                        rows += _summarise(samples, link_name, link.rtt_ms, temperature)
    results = {"setup": {k: v for k, v in plan.items() if k != "links"} | {"links": [n for n, _ in plan["links"]], "cpu_count": usable_cores()}, "cells": rows}
    _print_table(results)
    write_json(args.json_path, results)
    if args.plots:
        for path in plot_tree(results, Path(args.plots)):
            progress(f"wrote {path}")
    return 0


def _plan(args: argparse.Namespace) -> dict[str, Any]:
    if args.quick:
        return {"runs": 1, "prompts": PROMPTS[:1], "max_tokens": 16, "temperatures": [0.0], "budgets": [4, 14], "links": LINKS[:1]}
    return {"runs": args.runs, "prompts": PROMPTS[: args.prompts], "max_tokens": args.max_tokens, "temperatures": [0.0, 1.0], "budgets": BUDGETS, "links": LINKS}


def _summarise(samples: dict[str, list[dict[str, float]]], link: str, rtt_ms: float, temperature: float) -> list[dict[str, Any]]:
    baseline = samples["autoregressive"]
    rows = []
    for name, runs in samples.items():
        cell = medians(runs)
        kind, _, budget = name.partition(" ")
        row: dict[str, Any] = {"cell": name, "shape": kind, "budget": int(budget) if budget else 0, "link": link, "rtt_ms": rtt_ms, "temperature": temperature, "runs": len(runs), **cell}
        row["speedup_vs_autoregressive"] = statistics.median(r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(runs, baseline))
        rows.append(row)
    for row in rows:  # the tree against the chain of the same budget, same link and T
        if row["shape"] in ("tree", "exact-tree"):
            chain = next(r for r in rows if r["shape"] == "chain" and r["budget"] == row["budget"])
            row["tokens_per_round_vs_chain"] = row["mean_accepted_length"] / chain["mean_accepted_length"]
            row["tokens_per_s_vs_chain"] = row["tokens_per_s"] / chain["tokens_per_s"]
    return rows


def _print_table(results: dict[str, Any]) -> None:
    setup = results["setup"]
    print(f"\nspecgate bench tree: {len(setup['prompts'])} prompt(s) × ≤ {setup['max_tokens']} tokens, median of {setup['runs']} run(s), aggregate k: full")
    print(f"{'link':<17}{'T':>3} {'cell':<15}{'tok/rnd':>8}{'vs chain':>9}{'tok/s':>7}{'vs chain':>9}{'speed-up':>9}{'verify ms/rnd':>14}{'down B/rnd':>11}")
    for r in results["cells"]:
        per_round = f"{r['tokens_per_round_vs_chain']:.2f}×" if "tokens_per_round_vs_chain" in r else ""
        per_s = f"{r['tokens_per_s_vs_chain']:.2f}×" if "tokens_per_s_vs_chain" in r else ""
        print(
            f"{r['link']:<17}{r['temperature']:>3g} {r['cell']:<15}{r['mean_accepted_length']:>8.2f}{per_round:>9}{r['tokens_per_s']:>7.1f}{per_s:>9}"
            f"{r['speedup_vs_autoregressive']:>8.2f}×{r['verify_model_ms_per_round']:>14.1f}{r['bytes_down_per_round']:>11.0f}"
        )


def plot_tree(results: dict[str, Any], folder: Path) -> list[Path]:
    """Tokens per round against the node budget (chain vs tree, per T), and the speed-up over
    autoregressive against RTT at 14 nodes; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from clients.bench.plots import _save

    folder.mkdir(parents=True, exist_ok=True)
    rows = results["cells"]
    temperatures = sorted({r["temperature"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    first_link = rows[0]["link"]
    for i, t in enumerate(temperatures):
        for shape, style in (("chain", "--"), ("tree", "-")):
            points = sorted((r["budget"], r["mean_accepted_length"]) for r in rows if r["shape"] == shape and r["temperature"] == t and r["link"] == first_link)
            if points:
                axes[0].plot(*zip(*points), style, marker="o", color=f"C{i}", label=f"{shape}, T = {t:g}")
        points = sorted((r["rtt_ms"], r["speedup_vs_autoregressive"]) for r in rows if r["shape"] == "tree" and r["budget"] == 14 and r["temperature"] == t)
        chain = sorted((r["rtt_ms"], r["speedup_vs_autoregressive"]) for r in rows if r["shape"] == "chain" and r["budget"] == 14 and r["temperature"] == t)
        if points:
            axes[1].plot(*zip(*points), "-", marker="o", color=f"C{i}", label=f"tree 14, T = {t:g}")
        if chain:
            axes[1].plot(*zip(*chain), "--", marker="o", color=f"C{i}", label=f"chain 14, T = {t:g}")
    axes[0].set(xlabel="verified nodes per round", ylabel="tokens per round", title="tokens per round at equal budgets")
    axes[1].axhline(1.0, color="grey", linewidth=0.8)
    axes[1].set(xlabel="RTT (ms)", ylabel="speed-up over autoregressive", title="14 nodes per round")
    for ax in axes:
        ax.legend(fontsize=8)
    fig.tight_layout()
    return [_save(fig, folder / "tree_vs_chain.png")]
