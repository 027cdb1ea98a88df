"""``specgate bench``: tokens/s of the decoding modes × emulated links × worker counts × T,
beside each cell's analytic bound and physical bound (llama.cpp's floors for t_d and t_v);
the set-up and the formulas are in docs/performance.md ("Modes × links × workers")."""

from __future__ import annotations

import argparse
import statistics
from contextlib import ExitStack
from functools import partial
from typing import Any

from clients.bench.common import (
    LINKS,
    Bar,
    Samples,
    finish,
    gateway_client,
    measure,
    medians,
    request,
    run_cells,
    setup,
    start_workers,
)
from clients.bench.floors import Floors, bound_tokens_per_s, measure_floors, physical_bound
from clients.bench.plots import plot_bench
from clients.prompts import PROMPTS as ALL_PROMPTS
from core.config import LinkConfig
from core.cores import usable_cores

PROMPTS = ALL_PROMPTS[:3]
MODES: list[tuple[str, dict[str, Any]]] = [
    ("autoregressive", {"mode": "autoregressive"}),
    ("aggregate k=full", {"mode": "aggregate", "k": "full"}),
    ("aggregate k=32", {"mode": "aggregate", "k": 32}),
    ("split", {"mode": "split"}),
    ("exact", {"mode": "exact"}),
]


def bench_modes(args: argparse.Namespace) -> int:
    plan = _plan(args)
    rows: list[dict[str, Any]] = []
    bar = Bar(
        sum(len(_modes(n, plan)) for n in plan["workers"])
        * len(plan["links"])
        * len(plan["temperatures"])
        * plan["runs"]
    )
    with ExitStack() as stack:
        urls = start_workers(stack)
        floors = measure_floors([1, plan["gamma"] + 1], PROMPTS[0], f"1 and {plan['gamma'] + 1}")
        for num_workers in plan["workers"]:
            for link_name, link in plan["links"]:
                with gateway_client(urls[:num_workers], link, plan["gamma"]) as client:
                    for temperature in plan["temperatures"]:
                        modes = _modes(num_workers, plan)
                        request(client, plan["prompts"][0], 4, temperature, modes[0][1], seed=0)  # warm-up
                        samples = run_cells(
                            modes,
                            plan["runs"],
                            bar,
                            f"N={num_workers} {link_name} T={temperature:g}",
                            partial(_measure_at, client, plan, temperature),
                        )
                        rows += _summarise(
                            samples, plan["gamma"], num_workers, link_name, link, temperature, floors
                        )
    results = {"setup": setup(plan, cpu_count=usable_cores()), "floors": floors.as_dict(), "cells": rows}
    return finish(results, args, _print_table, plot_bench)


def _plan(args: argparse.Namespace) -> dict[str, Any]:
    if args.quick:
        return {
            "runs": 3,
            "prompts": PROMPTS[:1],
            "max_tokens": 16,
            "temperatures": [1.0],
            "workers": [1],
            "links": [LINKS[0], LINKS[2]],
            "modes": ["autoregressive", "aggregate k=32", "exact"],
            "gamma": args.gamma,
        }
    return {
        "runs": max(3, args.runs),
        "prompts": PROMPTS[: args.prompts],
        "max_tokens": args.max_tokens,
        "temperatures": [0.0, 1.0],
        "workers": [1, 2],
        "links": LINKS,
        "modes": [name for name, _ in MODES],
        "gamma": args.gamma,
    }


def _modes(num_workers: int, plan: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(n, s) for n, s in MODES if n in plan["modes"] and not (n == "split" and num_workers > 1)]


def _summarise(
    samples: Samples,
    gamma: int,
    num_workers: int,
    link_name: str,
    link: LinkConfig,
    temperature: float,
    floors: Floors,
) -> list[dict[str, Any]]:
    baseline = next(iter(samples.values()))  # autoregressive, the first cell
    rows = []
    for name, runs in samples.items():
        cell, g = medians(runs), gamma if name != "autoregressive" else 0
        row: dict[str, Any] = {
            "mode": name,
            "workers": num_workers,
            "link": link_name,
            "rtt_ms": link.rtt_ms,
            "temperature": temperature,
            "runs": len(runs),
            **cell,
        }
        row["speedup_vs_autoregressive"] = statistics.median(
            r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(runs, baseline)
        )
        row["alpha_implied"] = (
            implied_alpha(cell["mean_accepted_length"], gamma) if name != "autoregressive" else None
        )
        row["bound_tokens_per_s"] = analytic_bound(row, g, link, num_workers)
        row["measured_over_bound"] = row["tokens_per_s"] / row["bound_tokens_per_s"]
        row["direct_tokens_per_s"] = direct_tokens_per_s(cell["tokens_per_answer"], link, floors)
        row["vs_direct"] = (
            row["tokens_per_s"] / row["direct_tokens_per_s"] if row["direct_tokens_per_s"] else None
        )
        row["physical_bound_tokens_per_s"] = physical_bound(per_round(row, g), g, link, num_workers, floors)
        row["measured_over_physical"] = row["tokens_per_s"] / row["physical_bound_tokens_per_s"]
        rows.append(row)
    for row in rows:
        row["physical_speedup_bound"] = (
            row["physical_bound_tokens_per_s"] / rows[0]["physical_bound_tokens_per_s"]
        )
        row["speedup_over_physical"] = row["speedup_vs_autoregressive"] / row["physical_speedup_bound"]
    return rows


DIRECT_REQUEST_BYTES = 2_000  # a chat request up the link
DIRECT_CHUNK_BYTES = 200  # an SSE chunk of one token down it (OpenAI's shape)


def direct_tokens_per_s(tokens_per_answer: float, link: LinkConfig, floors: Floors) -> float:
    """The *direct* baseline: the target alone (its prefill, then llama.cpp's step per token) streaming over
    the link: the round trip paid once per answer, each chunk serialised while the next token is generated."""
    if not floors.direct_step_s or tokens_per_answer <= 0:
        return 0.0
    chunk = link.delay_s(DIRECT_CHUNK_BYTES, upstream=False) - link.delay_s(0, upstream=False)
    seconds = (
        link.delay_s(DIRECT_REQUEST_BYTES, upstream=True)
        + link.delay_s(0, upstream=False)
        + floors.direct_prefill_s
        + tokens_per_answer * max(floors.direct_step_s, chunk)
    )
    return tokens_per_answer / seconds


def per_round(row: dict[str, Any], gamma: int) -> dict[str, Any]:
    """A cell's medians as one round of ``bound_tokens_per_s``: E tokens (1 without a draft), γ drafted."""
    return row | {
        "rounds": 1.0,
        "tokens": row["mean_accepted_length"] if gamma else 1.0,
        "drafted": float(gamma),
        "prepared_used": 0.0,
    }


def analytic_bound(row: dict[str, Any], gamma: int, link: LinkConfig, num_workers: int) -> float:
    """E / (γ·t_d + RTT + serialisation both ways + t_v), from the cell's own figures."""
    return bound_tokens_per_s(
        per_round(row, gamma), gamma, row["draft_ms_per_token"] / 1e3, link, num_workers
    )


def implied_alpha(mean_length: float, gamma: int) -> float:
    """The α for which (1 − α^{γ+1}) / (1 − α) equals the measured tokens per round."""
    low, high = 0.0, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        expected = sum(mid**i for i in range(gamma + 1))
        low, high = (mid, high) if expected < mean_length else (low, mid)
    return (low + high) / 2


def _print_table(results: dict[str, Any]) -> None:
    setup = results["setup"]
    print(
        f"\nspecgate bench: γ = {setup['gamma']}, {len(setup['prompts'])} prompt(s) × ≤ "
        f"{setup['max_tokens']} tokens, median of {setup['runs']} runs"
    )
    floors = results["floors"]
    print(
        f"physical bound from llama.cpp's floors ({floors['threads']} thread(s)): draft step "
        f"{floors['draft_step_ms']:.2f} ms, "
        + ", ".join(f"scoring {m} {ms:.2f} ms" for m, ms in floors["scoring_ms"].items())
    )
    print(
        f"direct: the target alone, its prefill {floors.get('direct_prefill_ms', 0.0):.1f} ms, "
        f"then llama.cpp's decode + sampler {floors.get('direct_step_ms', 0.0):.2f} ms a token, "
        "the link's round trip once per answer; "
        "tgt ms/tok: the workers' model time per generated token, summed over workers"
    )
    print(
        f"{'N':>2} {'link':<17}{'T':>3} {'mode':<17}{'tok/s':>7}{'speed-up':>9}{'direct':>7}"
        f"{'vs dir':>7}{'tgt ms/tok':>11}{'tok/rnd':>8}{'α':>6}{'up B/rnd':>10}{'down B/rnd':>12}"
        f"{'bound':>8}{'meas/bnd':>9}{'phys':>7}{'meas/phys':>10}{'spd/phys':>9}"
    )
    for r in results["cells"]:
        alpha = "" if r["alpha_implied"] is None else f"{r['alpha_implied']:.2f}"
        print(
            f"{r['workers']:>2} {r['link']:<17}{r['temperature']:>3g} {r['mode']:<17}"
            f"{r['tokens_per_s']:>7.1f}{r['speedup_vs_autoregressive']:>8.2f}×"
            f"{r['direct_tokens_per_s']:>7.1f}"
            f"{(r['vs_direct'] or 0.0):>6.2f}×{r['target_ms_per_token']:>11.2f}"
            f"{r['mean_accepted_length']:>8.2f}{alpha:>6}{r['bytes_up_per_round']:>10.0f}"
            f"{r['bytes_down_per_round']:>12.0f}"
            f"{r['bound_tokens_per_s']:>8.1f}{r['measured_over_bound']:>9.2f}"
            f"{r['physical_bound_tokens_per_s']:>7.1f}{r['measured_over_physical']:>10.2f}"
            f"{r['speedup_over_physical']:>9.2f}"
        )


def _measure_at(
    client: Any, plan: dict[str, Any], temperature: float, run: int, spec: dict[str, Any]
) -> dict[str, float]:
    """One cell's run at ``temperature`` (``run_cells``' ``one``)."""
    return measure(client, plan["prompts"], plan["max_tokens"], temperature, spec, seed=run)
