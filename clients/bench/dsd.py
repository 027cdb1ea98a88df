"""``specgate bench dsd``: DSD's overlapped drafting and adaptive γ (docs/design.md §3.8) against fixed
draft lengths per emulated link, each cell beside its bound and physical bound with the overlap
counted where it happened; the cells, the pairing and the formula are in docs/performance.md ("DSD")."""

from __future__ import annotations

import argparse
import statistics
from contextlib import ExitStack
from typing import Any

import httpx

from clients.bench.common import (
    LINKS,
    Bar,
    Samples,
    finish,
    gateway_client,
    measure,
    request,
    run_cells,
    setup,
    start_workers,
)
from clients.bench.floors import Floors, bound_tokens_per_s, measure_floors, physical_bound
from clients.bench.plots import plot_dsd
from clients.prompts import PROMPTS as ALL_PROMPTS
from core.config import LinkConfig
from core.cores import usable_cores

GAMMAS = (2, 4, 6, 8)
AUTO_TOLERANCE = 0.05  # auto becomes the built-in default only if never worse than the best fixed γ by more


def cells() -> list[tuple[str, dict[str, Any]]]:
    """(name, speculative block) of every cell, ``autoregressive`` first (the baseline)."""
    exact = {"mode": "exact", "draft_top_k": 32}
    out: list[tuple[str, dict[str, Any]]] = [("autoregressive", {"mode": "autoregressive"})]
    for gamma in GAMMAS:
        out += [
            (f"γ={gamma}", exact | {"num_draft_tokens": gamma}),
            (f"γ={gamma} overlap", exact | {"num_draft_tokens": gamma, "overlap": True}),
        ]
    out += [
        ("auto", exact | {"num_draft_tokens": "auto"}),
        ("auto overlap", exact | {"num_draft_tokens": "auto", "overlap": True}),
    ]
    return out


def bench_dsd(args: argparse.Namespace) -> int:
    plan = _plan(args)
    specs = cells()
    groups = [(1, link) for link in plan["links"]] + [(2, LINKS[0])] * plan["builtin_pair"]
    bar = Bar(len(groups) * len(specs) * plan["runs"])
    rows: list[dict[str, Any]] = []
    with ExitStack() as stack:
        urls = start_workers(stack)
        floors = measure_floors(list(range(1, max(GAMMAS) + 2)), ALL_PROMPTS[0], f"1–{max(GAMMAS) + 1}")
        for num_workers, (link_name, link) in groups:
            with gateway_client(urls[:num_workers], link, 4) as client:
                request(client, plan["prompts"][0], 4, plan["temperature"], specs[1][1], seed=0)  # warm-up
                samples = run_cells(
                    specs,
                    plan["runs"],
                    bar,
                    f"N={num_workers} {link_name}",
                    lambda run, spec: _measure(client, plan, run, spec),
                )
            rows += summarise(samples, num_workers, link_name, link, floors)
    results = {
        "setup": setup(plan, cpu_count=usable_cores(), mode="exact, draft top-32"),
        "floors": floors.as_dict(),
        "cells": rows,
        "auto_vs_best_fixed": auto_verdict(rows),
    }
    return finish(results, args, _print, plot_dsd)


def _plan(args: argparse.Namespace) -> dict[str, Any]:
    quick = args.quick  # one run, one prompt, the 50 ms link only
    return {
        "runs": 1 if quick else max(3, args.runs),
        "prompts": ALL_PROMPTS,
        "prompts_per_cell": 1 if quick else args.prompts,
        "max_tokens": 16 if quick else args.max_tokens,
        "temperature": args.temperature,
        "links": [LINKS[2]] if quick else LINKS,
        "builtin_pair": not quick,
    }


def _measure(client: httpx.Client, plan: dict[str, Any], run: int, spec: dict[str, Any]) -> dict[str, float]:
    """Run r starts at prompt r; ``auto`` sends no seed (it is off for seeded requests)."""
    seed = None if spec.get("num_draft_tokens") == "auto" else run
    prompts = [plan["prompts"][(run + i) % len(plan["prompts"])] for i in range(plan["prompts_per_cell"])]
    return measure(client, prompts, plan["max_tokens"], plan["temperature"], spec, seed)


def cell_gamma(name: str, run: dict[str, float]) -> float:
    """The cell's draft length: its fixed γ, or the mean γ ``auto`` chose (0 for autoregressive)."""
    if name == "autoregressive":
        return 0.0
    if name.startswith("auto"):
        return run.get("gamma_mean", 4.0)
    return float(name.split()[0].removeprefix("γ="))


def summarise(
    samples: Samples, num_workers: int, link_name: str, link: LinkConfig, floors: Floors
) -> list[dict[str, Any]]:
    """Medians per cell, the paired ratios, and each run's bound and physical bound (medians reported)."""
    baseline = samples["autoregressive"]
    rows = []
    for name, runs in samples.items():
        plain = samples[name.removesuffix(" overlap")]
        medians = {key: statistics.median(r[key] for r in runs if key in r) for key in runs[0]}
        bounds = [
            bound_tokens_per_s(r, cell_gamma(name, r), p["draft_ms_per_token"] / 1e3, link, num_workers)
            for r, p in zip(runs, plain)
        ]
        ar_bounds = [bound_tokens_per_s(b, 0.0, 0.0, link, num_workers) for b in baseline]
        physical = [physical_bound(r, cell_gamma(name, r), link, num_workers, floors) for r in runs]
        ar_physical = [physical_bound(b, 0.0, link, num_workers, floors) for b in baseline]
        row: dict[str, Any] = {
            "cell": name,
            "workers": num_workers,
            "link": link_name,
            "rtt_ms": link.rtt_ms,
            "runs": len(runs),
            **medians,
            "overlap": name.endswith("overlap"),
            "auto": name.split()[0] == "auto",
            "gamma": statistics.median(cell_gamma(name, r) for r in runs),
            "speedup_vs_autoregressive": statistics.median(
                r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(runs, baseline)
            ),
            "bound_tokens_per_s": statistics.median(bounds),
            "bound_speedup_vs_autoregressive": statistics.median(b / a for b, a in zip(bounds, ar_bounds)),
            "measured_over_bound": statistics.median(r["tokens_per_s"] / b for r, b in zip(runs, bounds)),
            "physical_bound_tokens_per_s": statistics.median(physical),
            "measured_over_physical": statistics.median(
                r["tokens_per_s"] / b for r, b in zip(runs, physical)
            ),
            "physical_speedup_bound": statistics.median(b / a for b, a in zip(physical, ar_physical)),
            "speedup_over_physical": statistics.median(
                (r["tokens_per_s"] / a["tokens_per_s"]) / (p / q)
                for r, a, p, q in zip(runs, baseline, physical, ar_physical)
            ),
        }
        if row["overlap"]:
            row["overlap_gain"] = statistics.median(
                r["tokens_per_s"] / p["tokens_per_s"] for r, p in zip(runs, plain)
            )
            row["prepared_used_share"] = sum(r["prepared_used"] for r in runs) / max(
                sum(r["prepared"] for r in runs), 1
            )
        rows.append(row)
    return rows


def auto_verdict(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per (workers, link, overlap): auto's tokens/s over the best fixed γ's, and whether it met the default's
    bar (never worse by > AUTO_TOLERANCE)."""
    groups = []
    for key in sorted(
        {(r["workers"], r["link"], r["overlap"]) for r in rows if r["cell"] != "autoregressive"}, key=str
    ):
        same = [
            r
            for r in rows
            if (r["workers"], r["link"], r["overlap"]) == key and r["cell"] != "autoregressive"
        ]
        fixed = max((r for r in same if not r["auto"]), key=lambda r: r["tokens_per_s"])
        auto = next(r for r in same if r["auto"])
        groups.append(
            {
                "workers": key[0],
                "link": key[1],
                "overlap": key[2],
                "best_fixed": fixed["cell"],
                "best_fixed_tokens_per_s": fixed["tokens_per_s"],
                "auto_tokens_per_s": auto["tokens_per_s"],
                "auto_gamma_mean": auto.get("gamma_mean"),
                "auto_over_best_fixed": auto["tokens_per_s"] / fixed["tokens_per_s"],
            }
        )
    worst = min((g["auto_over_best_fixed"] for g in groups), default=None)
    return {
        "groups": groups,
        "worst": worst,
        "tolerance": AUTO_TOLERANCE,
        "meets_bar": worst is not None and worst >= 1 - AUTO_TOLERANCE,
    }


def _print(results: dict[str, Any]) -> None:
    setup = results["setup"]
    print(
        f"\nspecgate bench dsd: {setup['mode']}, T = {setup['temperature']:g}, "
        f"{setup['prompts_per_cell']} prompt(s) per cell (run r starts at prompt r of "
        f"{len(setup['prompts'])}) × ≤ {setup['max_tokens']} tokens, median of {setup['runs']} "
        "runs"
    )
    floors = results["floors"]
    print(
        f"physical bound from llama.cpp's floors ({floors['threads']} thread(s)): draft step "
        f"{floors['draft_step_ms']:.2f} ms, scoring "
        + ", ".join(f"{m}: {ms:.1f}" for m, ms in floors["scoring_ms"].items())
        + " ms"
    )
    print(
        f"{'N':>2} {'link':<17}{'cell':<13}{'γ':>5}{'tok/s':>7}{'speed-up':>9}{'tok/rnd':>8}"
        f"{'bound':>7}{'bnd spd':>8}{'meas/bnd':>9}{'phys':>7}{'phys spd':>9}{'spd/phys':>9}"
        f"{'ovl gain':>9}{'used':>6}"
    )
    for r in results["cells"]:
        gamma = "" if r["cell"] == "autoregressive" else f"{r['gamma']:.1f}"
        gain = f"{r['overlap_gain']:.2f}×" if "overlap_gain" in r else ""
        used = f"{r['prepared_used_share']:.2f}" if "prepared_used_share" in r else ""
        print(
            f"{r['workers']:>2} {r['link']:<17}{r['cell']:<13}{gamma:>5}{r['tokens_per_s']:>7.1f}"
            f"{r['speedup_vs_autoregressive']:>8.2f}×"
            f"{r['mean_accepted_length']:>8.2f}{r['bound_tokens_per_s']:>7.1f}"
            f"{r['bound_speedup_vs_autoregressive']:>7.2f}×"
            f"{r['measured_over_bound']:>9.2f}{r['physical_bound_tokens_per_s']:>7.1f}"
            f"{r['physical_speedup_bound']:>8.2f}×"
            f"{r['speedup_over_physical']:>9.2f}{gain:>9}{used:>6}"
        )
    verdict = results["auto_vs_best_fixed"]
    print("\nauto vs the best fixed γ (tokens/s):")
    for g in verdict["groups"]:
        print(
            f"  N={g['workers']} {g['link']:<17} overlap {'on ' if g['overlap'] else 'off'}: "
            f"best {g['best_fixed']:<12} auto {g['auto_over_best_fixed']:.2f}×"
        )
    if verdict["worst"] is not None:
        print(
            f"worst {verdict['worst']:.2f}×: auto "
            f"{'meets' if verdict['meets_bar'] else 'misses'} the bar for the built-in default "
            f"(≥ {1 - verdict['tolerance']:.2f}×)"
        )
