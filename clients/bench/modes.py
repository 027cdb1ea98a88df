"""``specgate bench``: tokens/s of the decoding modes × emulated links × worker counts × T.

Two real workers (builtin, builtin-alt; the cores split between them) run once; for each
(worker count, link) a gateway is started whose worker entries carry that link (DESIGN §4).
Within each run the mode cells alternate, so the host's drift hits them alike; each figure is
the median over runs; speed-ups are ratios to `autoregressive` through the same workers and
link in the same run. Each cell also gets the analytic bound from its own measurements:

    E = (1 − α^{γ+1}) / (1 − α) tokens per round,
    round = γ·t_d + RTT + bytes_up·8/BW_up + bytes_down·8/BW_down + t_v,   bound = E / round,

with α implied by the measured tokens per round, t_d the draft time per token, t_v the
workers' model time per round, bytes per worker per round. That bound only checks the time
model. The physical bound puts llama.cpp's own costs, measured in the same run
(``clients.bench.floors``: a decode + top-k sampler on the draft, a decode of γ+1 positions on the
target, the bench's threads) in place of t_d and t_v: what the same α, γ, bytes and link
would give if our draft and worker cost what llama.cpp costs. ``meas/phys`` is the measured
tokens/s over it; ``spd/phys`` the measured speed-up over the physical bound's speed-up.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

from clients.bench.common import Bar, measure, medians, progress, request, write_json
from clients.bench.floors import Floors, bound_tokens_per_s, measure_floors, physical_bound
from clients.procs import GatewayProcess, WorkerProcess
from clients.prompts import PROMPTS as ALL_PROMPTS
from core.config import LinkConfig, builtin_config, dump_config
from core.cores import usable_cores

PROMPTS = ALL_PROMPTS[:3]
MODES: list[tuple[str, dict[str, Any]]] = [
    ("autoregressive", {"mode": "autoregressive"}),
    ("aggregate k=full", {"mode": "aggregate", "k": "full"}),
    ("aggregate k=32", {"mode": "aggregate", "k": 32}),
    ("split", {"mode": "split"}),
    ("exact", {"mode": "exact"}),
]
LINKS: list[tuple[str, LinkConfig]] = [
    ("0 ms", LinkConfig()),
    ("20 ms / 100 Mbps", LinkConfig(rtt_ms=20, up_mbps=100, down_mbps=100)),
    ("50 ms / 10 Mbps", LinkConfig(rtt_ms=50, up_mbps=10, down_mbps=10)),
    ("100 ms / 10 Mbps", LinkConfig(rtt_ms=100, up_mbps=10, down_mbps=10)),
]


def bench_modes(args: argparse.Namespace) -> int:
    plan = _plan(args)
    rows: list[dict[str, Any]] = []
    bar = Bar(sum(len(_modes(n, plan)) for n in plan["workers"]) * len(plan["links"]) * len(plan["temperatures"]) * plan["runs"])
    with ExitStack() as stack:
        urls = _start_workers(stack)
        floors = _floors(plan["gamma"])
        for num_workers in plan["workers"]:
            for link_name, link in plan["links"]:
                with ExitStack() as gateway_stack:
                    base = _start_gateway(gateway_stack, urls[:num_workers], link, plan["gamma"])
                    with httpx.Client(base_url=base, timeout=900) as client:
                        for temperature in plan["temperatures"]:
                            modes = _modes(num_workers, plan)
                            samples = _run_cells(client, modes, plan, temperature, bar, f"N={num_workers} {link_name} T={temperature:g}")
                            rows += _summarise(samples, modes, plan["gamma"], num_workers, link_name, link, temperature, floors)
    setup = {k: v for k, v in plan.items() if k != "links"} | {"links": [name for name, _ in plan["links"]], "cpu_count": usable_cores()}
    results = {"setup": setup, "floors": floors.as_dict(), "cells": rows}
    _print_table(results)
    write_json(args.json_path, results)
    if args.plots:
        from clients.bench.plots import plot_bench

        for path in plot_bench(results, Path(args.plots)):
            progress(f"wrote {path}")
    return 0


def _plan(args: argparse.Namespace) -> dict[str, Any]:
    if args.quick:
        return {
            "runs": 3, "prompts": PROMPTS[:1], "max_tokens": 16, "temperatures": [1.0], "workers": [1],
            "links": [LINKS[0], LINKS[2]], "modes": ["autoregressive", "aggregate k=32", "exact"], "gamma": args.gamma,
        }
    return {
        "runs": max(3, args.runs), "prompts": PROMPTS[: args.prompts], "max_tokens": args.max_tokens,
        "temperatures": [0.0, 1.0], "workers": [1, 2], "links": LINKS, "modes": [name for name, _ in MODES], "gamma": args.gamma,
    }


def _modes(num_workers: int, plan: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(n, s) for n, s in MODES if n in plan["modes"] and not (n == "split" and num_workers > 1)]


def _start_workers(stack: ExitStack) -> list[str]:
    config = builtin_config().with_local_urls().with_split_cores(usable_cores())
    progress("starting two workers (builtin, builtin-alt) on 127.0.0.1")
    urls = []
    for entry in config.workers:
        assert entry.model is not None
        urls.append(stack.enter_context(WorkerProcess(entry.model, entry.backend.value, threads=entry.threads)))
    return urls


def _floors(gamma: int) -> Floors:
    """llama.cpp's floors with the threads each process of the bench gets (two workers)."""
    threads = max(1, usable_cores() // 2)
    progress(f"measuring llama.cpp's floors ({threads} thread(s)): a draft step, scoring 1 and {gamma + 1} positions")
    return measure_floors(threads, [1, gamma + 1], PROMPTS[0])


def _start_gateway(stack: ExitStack, urls: list[str], link: LinkConfig, gamma: int) -> str:
    base = builtin_config().with_split_cores(usable_cores())
    workers = [{"url": url, "weight": 1.0, "link": link.model_dump()} for url in urls]
    data = base.model_dump(mode="json", exclude_none=True) | {"workers": workers}
    data["speculative"] = {"mode": "aggregate", "num_draft_tokens": gamma}  # cells pick their mode; exact truncates to top-32
    path = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="specgate-bench-"))) / "config.yaml"
    path.write_text(dump_config(type(base)(**data)))
    return stack.enter_context(GatewayProcess(str(path)))


def _run_cells(client: httpx.Client, modes: list[tuple[str, dict[str, Any]]], plan: dict[str, Any], temperature: float, bar: Bar, label: str) -> dict[str, list[dict[str, float]]]:
    samples: dict[str, list[dict[str, float]]] = {name: [] for name, _ in modes}
    request(client, plan["prompts"][0], 4, temperature, modes[0][1], seed=0)  # warm-up
    for run in range(plan["runs"]):
        for name, spec in modes:
            samples[name].append(measure(client, plan["prompts"], plan["max_tokens"], temperature, spec, seed=run))
            bar.step(f"{label} {name}: {samples[name][-1]['tokens_per_s']:.1f} tok/s")
    return samples


def _summarise(
    samples: dict[str, list[dict[str, float]]], modes: list[tuple[str, dict[str, Any]]], gamma: int, num_workers: int, link_name: str, link: LinkConfig,
    temperature: float, floors: Floors,
) -> list[dict[str, Any]]:
    baseline = samples[modes[0][0]]
    rows = []
    for name, runs in samples.items():
        cell = medians(runs)
        row: dict[str, Any] = {"mode": name, "workers": num_workers, "link": link_name, "rtt_ms": link.rtt_ms, "temperature": temperature, "runs": len(runs), **cell}
        row["speedup_vs_autoregressive"] = statistics.median(r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(runs, baseline))
        drafting = name != "autoregressive"
        row["alpha_implied"] = implied_alpha(cell["mean_accepted_length"], gamma) if drafting else None
        row["bound_tokens_per_s"] = analytic_bound(row, gamma if drafting else 0, link, num_workers)
        row["measured_over_bound"] = row["tokens_per_s"] / row["bound_tokens_per_s"]
        row["direct_tokens_per_s"] = direct_tokens_per_s(cell["tokens_per_answer"], link, floors)
        row["vs_direct"] = row["tokens_per_s"] / row["direct_tokens_per_s"] if row["direct_tokens_per_s"] else None
        row["physical_bound_tokens_per_s"] = physical_bound(per_round(row, gamma if drafting else 0), gamma if drafting else 0, link, num_workers, floors)
        row["measured_over_physical"] = row["tokens_per_s"] / row["physical_bound_tokens_per_s"]
        rows.append(row)
    autoregressive = rows[0]["physical_bound_tokens_per_s"]
    for row in rows:
        row["physical_speedup_bound"] = row["physical_bound_tokens_per_s"] / autoregressive
        row["speedup_over_physical"] = row["speedup_vs_autoregressive"] / row["physical_speedup_bound"]
    return rows


DIRECT_REQUEST_BYTES = 2_000  # a chat request up the link
DIRECT_CHUNK_BYTES = 200  # an SSE chunk of one token down it (OpenAI's shape)


def direct_tokens_per_s(tokens_per_answer: float, link: LinkConfig, floors: Floors) -> float:
    """The *direct* baseline: the target generating alone on its own machine (its prefill of the
    prompt, then llama.cpp's decode + sampler per token: ``floors.direct_*``) and streaming its
    tokens over the same link — the round trip paid once per answer, each token's chunk
    serialised while the next is generated."""
    if not floors.direct_step_s or tokens_per_answer <= 0:
        return 0.0
    chunk = link.delay_s(DIRECT_CHUNK_BYTES, upstream=False) - link.delay_s(0, upstream=False)
    seconds = link.delay_s(DIRECT_REQUEST_BYTES, upstream=True) + link.delay_s(0, upstream=False) + floors.direct_prefill_s + tokens_per_answer * max(floors.direct_step_s, chunk)
    return tokens_per_answer / seconds


def per_round(row: dict[str, Any], gamma: int) -> dict[str, Any]:
    """A cell's medians as one round of ``bound_tokens_per_s``: E tokens (1 without a draft), γ drafted."""
    return row | {"rounds": 1.0, "tokens": row["mean_accepted_length"] if gamma else 1.0, "drafted": float(gamma), "prepared_used": 0.0}


def analytic_bound(row: dict[str, Any], gamma: int, link: LinkConfig, num_workers: int) -> float:
    """E / (γ·t_d + RTT + serialisation both ways + t_v), from the cell's own figures."""
    return bound_tokens_per_s(per_round(row, gamma), gamma, row["draft_ms_per_token"] / 1e3, link, num_workers)


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
    print(f"\nspecgate bench: γ = {setup['gamma']}, {len(setup['prompts'])} prompt(s) × ≤ {setup['max_tokens']} tokens, median of {setup['runs']} runs")
    floors = results["floors"]
    print(f"physical bound from llama.cpp's floors ({floors['threads']} thread(s)): draft step {floors['draft_step_ms']:.2f} ms, "
          + ", ".join(f"scoring {m} {ms:.2f} ms" for m, ms in floors["scoring_ms"].items()))
    print(f"direct: the target alone, its prefill {floors.get('direct_prefill_ms', 0.0):.1f} ms, then llama.cpp's decode + sampler {floors.get('direct_step_ms', 0.0):.2f} ms a token, "
          "the link's round trip once per answer; "
          "tgt ms/tok: the workers' model time per generated token, summed over workers")
    print(f"{'N':>2} {'link':<17}{'T':>3} {'mode':<17}{'tok/s':>7}{'speed-up':>9}{'direct':>7}{'vs dir':>7}{'tgt ms/tok':>11}{'tok/rnd':>8}{'α':>6}{'up B/rnd':>10}{'down B/rnd':>12}{'bound':>8}{'meas/bnd':>9}{'phys':>7}{'meas/phys':>10}{'spd/phys':>9}")
    for r in results["cells"]:
        alpha = "" if r["alpha_implied"] is None else f"{r['alpha_implied']:.2f}"
        print(
            f"{r['workers']:>2} {r['link']:<17}{r['temperature']:>3g} {r['mode']:<17}{r['tokens_per_s']:>7.1f}{r['speedup_vs_autoregressive']:>8.2f}×"
            f"{r['direct_tokens_per_s']:>7.1f}{(r['vs_direct'] or 0.0):>6.2f}×{r['target_ms_per_token']:>11.2f}"
            f"{r['mean_accepted_length']:>8.2f}{alpha:>6}{r['bytes_up_per_round']:>10.0f}{r['bytes_down_per_round']:>12.0f}"
            f"{r['bound_tokens_per_s']:>8.1f}{r['measured_over_bound']:>9.2f}"
            f"{r['physical_bound_tokens_per_s']:>7.1f}{r['measured_over_physical']:>10.2f}{r['speedup_over_physical']:>9.2f}"
        )
