"""``specgate bench overhead``: where a round's time goes, part by part (``speculative.profile``),
beside llama.cpp's and bare HTTP's floors measured in the same run (``clients.bench.floors``);
``--baseline DIR`` runs an earlier checkout's servers beside ours. See docs/performance.md."""

from __future__ import annotations

import argparse
import statistics
from contextlib import ExitStack, closing
from pathlib import Path
from typing import Any

import httpx

from clients.bench import common
from clients.bench.common import Bar, finish, median, progress, start_gateway
from clients.bench.floors import BareServer, DraftAlone, LlamaFloor, chat_ids, http_round_trip_ms
from clients.procs import WorkerProcess
from clients.prompts import PROMPTS
from core.config import builtin_config
from core.cores import usable_cores

PARTS = (
    "draft_model",
    "draft_sampling",
    "gateway_math",
    "gateway_codec",
    "link",
    "http",
    "worker_codec",
    "worker_queue",
    "worker_model",
    "worker_scoring",
    "worker_other",
    "other",
)
CELLS: dict[str, dict[str, Any]] = {
    "autoregressive": {"mode": "autoregressive"},
    "aggregate k=32": {"mode": "aggregate", "k": 32},
    "split": {"mode": "split"},
    "exact": {"mode": "exact"},
    "tree": {"mode": "tree"},
}
# outside the models, per round (issue 74); chains: CHAIN_GOAL_MS
GOAL_OUTSIDE_MS = {"autoregressive": 2.0, "tree": 8.0}
CHAIN_GOAL_MS = 4.0
GOAL_TREE_SAMPLING_MS = 3.0  # a tree's draft sampling per round (issue 74)


def goal_ms(mode: str) -> float:
    """The goal for the round's time outside the models: autoregressive, chains, trees."""
    return GOAL_OUTSIDE_MS.get(mode.split()[0], CHAIN_GOAL_MS)


def bench_overhead(args: argparse.Namespace) -> int:
    plan = _plan(args)
    threads = max(1, usable_cores())  # one request at a time: the draft and the worker take turns
    with ExitStack() as stack:
        progress(
            "starting a worker (builtin) and a gateway (draft builtin-draft) on 127.0.0.1, "
            f"{threads} threads each"
        )
        ours = _start_pair(stack, threads, None)
        before = _start_pair(stack, threads, args.baseline) if args.baseline else None
        http_url = stack.enter_context(BareServer())
        client = stack.enter_context(httpx.Client(base_url=ours, timeout=600))
        old = stack.enter_context(httpx.Client(base_url=before, timeout=600)) if before else None
        prompt_ids = _prompt_ids(client, plan["prompts"][0])
        draft_floor = stack.enter_context(closing(LlamaFloor("builtin-draft", threads, prompt_ids)))
        worker_floor = stack.enter_context(closing(LlamaFloor("builtin", threads, prompt_ids)))
        alone = stack.enter_context(closing(DraftAlone(threads, prompt_ids)))
        rows, floors = _run(plan, client, old, draft_floor, worker_floor, alone, http_url)
    budget = (
        {"verify_ms": args.verify_ms, "rtt_ms": args.link_rtt_ms, "mbps": args.link_mbps}
        if args.verify_ms is not None
        else None
    )
    for row in rows if budget else []:
        row["projection"] = projection(row, budget["verify_ms"], budget["rtt_ms"], budget["mbps"])  # type: ignore[index]
    results = {
        "setup": plan
        | {"threads": threads, "cpu_count": usable_cores(), "baseline": args.baseline, "budget": budget},
        "floors": floors,
        "cells": rows,
    }
    return finish(results, args, print_table)


def _plan(args: argparse.Namespace) -> dict[str, Any]:
    quick = args.quick
    return {
        "runs": 1 if quick else max(1, args.runs),
        "prompts": PROMPTS[: 1 if quick else args.prompts],
        "max_tokens": 16 if quick else args.max_tokens,
        "temperatures": [0.0, 1.0],
        "cells": list(CELLS),
    }


def _start_pair(stack: ExitStack, threads: int, checkout: str | None) -> str:
    """A worker and a gateway of this tree (or of ``checkout``); the gateway's URL."""
    cwd = str(Path(checkout).resolve()) if checkout else None
    url = stack.enter_context(WorkerProcess("builtin", "llama.cpp", threads=threads, cwd=cwd))
    config = builtin_config()
    data = config.model_dump(mode="json", exclude_none=True) | {"workers": [{"url": url, "weight": 1.0}]}
    data["draft"] = {**data.get("draft", {}), "threads": threads}
    return start_gateway(stack, type(config)(**data), cwd)


def _prompt_ids(client: httpx.Client, prompt: str) -> list[int]:
    """The chat prompt's token ids, checked against the gateway's count (a one-token completion)."""
    body = {
        "model": "specgate",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 1,
        "temperature": 0,
    }
    usage = client.post("/v1/chat/completions", json=body).raise_for_status().json()["usage"]
    ids = chat_ids(prompt)
    assert len(ids) == usage["prompt_tokens"], "the bench's chat template differs from the gateway's"
    return ids


def _run(
    plan: dict[str, Any],
    client: httpx.Client,
    old: httpx.Client | None,
    draft_floor: LlamaFloor,
    worker_floor: LlamaFloor,
    alone: DraftAlone,
    http_url: str,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    cells = [(name, t) for t in plan["temperatures"] for name in plan["cells"]]
    samples: dict[tuple[str, float], list[dict[str, Any]]] = {cell: [] for cell in cells}
    baseline: dict[tuple[str, float], list[dict[str, Any]]] = {cell: [] for cell in cells}
    floors: dict[str, list[float]] = {"draft_step_ms": []}
    for name, t in cells:  # warm-up: every code path once
        request(client, plan["prompts"][0], 4, t, CELLS[name], seed=0)
    bar = Bar(plan["runs"] * len(cells))
    for run in range(plan["runs"]):
        for cell in cells:
            name, t = cell
            for prompt in plan["prompts"]:
                samples[cell].append(request(client, prompt, plan["max_tokens"], t, CELLS[name], seed=run))
                if old is not None:
                    baseline[cell].append(
                        _baseline_sample(old, prompt, plan["max_tokens"], t, CELLS[name], run)
                    )
            bar.step(f"{name} T={t:g}: {samples[cell][-1]['tokens_per_s']:.1f} tok/s")
        floors["draft_step_ms"] += draft_floor.draft_step_ms(32)
        for t, top_k in sorted(
            {(t, _draft_top_k(name) if t > 0 else 0) for t in plan["temperatures"] for name in plan["cells"]}
        ):
            floors.setdefault(_alone_key(t, top_k), []).extend(alone.step_ms(t, top_k))
        for runs in samples.values():
            # the worker's floor at every cell's positions per call, the HTTP floor at its bytes
            rounds = [r for s in runs for r in s["rounds"]]
            if rounds:
                positions, up, down = _call_shape(rounds)
                floors.setdefault(f"worker_scoring_ms@{positions}", []).extend(
                    worker_floor.scoring_ms(positions, repeats=3)
                )
                floors.setdefault(f"http_ms@{up}/{down}", []).extend(
                    http_round_trip_ms(http_url, up, down, repeats=10)
                )
    rows = [summarise(name, t, samples[(name, t)], baseline[(name, t)], floors) for name, t in cells]
    return rows, {key: median(values) for key, values in floors.items()}


def _baseline_sample(
    old: httpx.Client, prompt: str, max_tokens: int, temperature: float, spec: dict[str, Any], seed: int
) -> dict[str, Any]:
    """The baseline's figures for one request: ``coarse``, and its rounds' parts (``rounds``) where that
    version profiles (``speculative.profile``; a version without it answers 400 and is asked again
    without)."""
    try:
        sample = request(old, prompt, max_tokens, temperature, spec, seed)
    except httpx.HTTPStatusError as exc:
        if exc.response.status_code != 400:
            raise
        return coarse(request(old, prompt, max_tokens, temperature, spec | {"profile": None}, seed))
    return coarse(sample) | {"rounds": sample["rounds"]}


def _call_shape(rounds: list[dict[str, Any]]) -> tuple[int, int, int]:
    """A cell's positions per verify call and bytes up / down per call (medians over its rounds)."""
    positions = int(statistics.median(r["drafted"] + 1 for r in rounds))
    return (
        positions,
        int(statistics.median(r["bytes_up"] / r["calls"] for r in rounds)),
        int(statistics.median(r["bytes_down"] / r["calls"] for r in rounds)),
    )


def request(
    client: httpx.Client, prompt: str, max_tokens: int, temperature: float, spec: dict[str, Any], seed: int
) -> dict[str, Any]:
    """One chat completion with ``speculative.profile``: its seconds, usage, and rounds (the first, with the
    prefill, left out)."""
    spec = {k: v for k, v in ({"profile": True} | spec).items() if v is not None}
    elapsed, usage = common.request(client, prompt, max_tokens, temperature, spec, seed)
    return {
        "seconds": elapsed,
        "usage": usage,
        "rounds": usage["speculative"].get("profile", [])[1:],
        "tokens_per_s": usage["completion_tokens"] / elapsed,
    }


def coarse(sample: dict[str, Any]) -> dict[str, float]:
    """What every version's usage has: tokens/s, and per round the verify time outside the worker's model, the
    draft's time per drafted token, and the bytes to and from the workers."""
    block, rounds = sample["usage"]["speculative"], max(sample["usage"]["speculative"]["rounds"], 1)
    drafted = block["draft_tokens"]
    return {
        "tokens_per_s": sample["tokens_per_s"],
        "verify_outside_model_ms": (block["verify_ms"] - block["worker_model_ms"]) / rounds,
        "draft_ms_per_token": block["draft_ms"] / drafted if drafted else 0.0,
        "bytes_up_per_round": block.get("bytes_to_workers", 0) / rounds,
        "bytes_down_per_round": block.get("bytes_from_workers", 0) / rounds,
    }


def summarise(
    name: str,
    temperature: float,
    runs: list[dict[str, Any]],
    baseline: list[dict[str, Any]],
    floors: dict[str, list[float]],
) -> dict[str, Any]:
    """Medians over the cell's rounds, part by part; the goals' figures beside the floors."""
    rounds = [r for s in runs for r in s["rounds"]]
    row: dict[str, Any] = {
        "mode": name,
        "temperature": temperature,
        "requests": len(runs),
        "rounds": len(rounds),
    }
    row["tokens_per_s"] = statistics.median(s["tokens_per_s"] for s in runs)
    row.update(round_figures(rounds))
    row["api_ms_per_round"] = statistics.median(
        (s["seconds"] * 1e3 - s["usage"]["speculative"]["timing_ms"]["rounds"])
        / max(s["usage"]["speculative"]["rounds"], 1)
        for s in runs
    )
    if rounds:
        positions, up, down = _call_shape(rounds)
        row["worker_floor_ms"] = median(floors.get(f"worker_scoring_ms@{positions}", []))
        row["worker_over_floor"] = (
            row["parts_ms"]["worker_model"] + row["parts_ms"]["worker_scoring"]
        ) / row["worker_floor_ms"]
        row["http_floor_ms"] = median(floors.get(f"http_ms@{up}/{down}", []))
        if row["drafted_per_round"] and name != "tree":  # a tree's draft decodes per depth, not per node
            row["draft_floor_ms"] = median(floors["draft_step_ms"])
            row["draft_over_floor"] = row["draft_step_ms"] / row["draft_floor_ms"]
            row["draft_alone_ms"] = median(floors.get(_alone_key(temperature, _draft_top_k(name)), []))
            row["draft_alone_over_floor"] = row["draft_alone_ms"] / row["draft_floor_ms"]
    if baseline:
        keys = [key for key in baseline[0] if key != "rounds"]
        row["baseline"] = {key: statistics.median(b[key] for b in baseline) for key in keys}
        row["ours_coarse"] = {key: statistics.median(coarse(s)[key] for s in runs) for key in keys}
        before = [r for b in baseline for r in b.get("rounds", [])]
        if before:  # the baseline's median round, part by part, as ours
            figures = round_figures(before)
            row["baseline"] |= {
                "round_ms": figures["round_ms"],
                "parts_ms": figures["parts_ms"],
                "outside_models_ms": figures["outside_models_ms"],
            }
    return row


def _draft_top_k(cell: str) -> int:
    """The draft truncation a cell runs with: exact's default, none elsewhere."""
    return 32 if cell == "exact" else 0


def _alone_key(temperature: float, top_k: int) -> str:
    return f"draft_alone_ms@T{temperature:g}" + (f"k{top_k}" if top_k and temperature > 0 else "")


def round_figures(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Per round: the median round (by its time; the two middle ones averaged) and its parts, which add up to
    it (medians per part need not: rounds differ in what they hold); outside the models; the rest (drafted,
    bytes, calls, a draft step) as medians."""
    if not rounds:
        return {
            "round_ms": 0.0,
            "parts_ms": dict.fromkeys(PARTS, 0.0),
            "outside_models_ms": 0.0,
            "drafted_per_round": 0.0,
            "draft_step_ms": 0.0,
            "bytes_up_per_round": 0.0,
            "bytes_down_per_round": 0.0,
            "calls_per_round": 0.0,
            "tokens_per_round": 0.0,
        }
    ranked = sorted(rounds, key=lambda r: r["round_ms"])
    middle = ranked[(len(ranked) - 1) // 2 : len(ranked) // 2 + 1]  # one round, or the two middle ones
    parts = {part: statistics.mean(r["parts_ms"].get(part, 0.0) for r in middle) for part in PARTS}
    drafted = statistics.median(r["drafted"] for r in rounds)
    draft_steps = [
        (r["parts_ms"]["draft_model"] + r["parts_ms"]["draft_sampling"]) / r["drafted"]
        for r in rounds
        if r["drafted"]
    ]
    return {
        "round_ms": statistics.mean(r["round_ms"] for r in middle),  # the median round
        "parts_ms": parts,
        "outside_models_ms": statistics.mean(
            r["round_ms"] - r["parts_ms"]["draft_model"] - r["parts_ms"]["worker_model"] for r in middle
        ),
        "drafted_per_round": drafted,
        "draft_step_ms": statistics.median(draft_steps) if draft_steps else 0.0,
        "bytes_up_per_round": statistics.median(r["bytes_up"] for r in rounds),
        "bytes_down_per_round": statistics.median(r["bytes_down"] for r in rounds),
        "calls_per_round": statistics.median(r["calls"] for r in rounds),
        "tokens_per_round": statistics.mean(r["tokens"] for r in rounds),
    }


def projection(
    row: dict[str, Any], verify_ms: float, rtt_ms: float = 0.0, mbps: float = 0.0
) -> dict[str, float]:
    """A cell's round as it would be with a verify step of ``verify_ms`` (the worker's model and scoring: a
    GPU's) over a link of ``rtt_ms`` and ``mbps`` (0: no limit), everything else as measured: its ms,
    tokens/s, and the share outside the models."""
    parts = row["parts_ms"]
    wire_ms = (
        (row["bytes_up_per_round"] + row["bytes_down_per_round"]) * 8 / (mbps * 1e3) if mbps > 0 else 0.0
    )
    round_ms = (
        row["round_ms"] - parts["worker_model"] - parts["worker_scoring"] + verify_ms + rtt_ms + wire_ms
    )
    outside = round_ms - parts["draft_model"] - verify_ms
    return {
        "round_ms": round_ms,
        "tokens_per_s": row.get("tokens_per_round", 0.0) / round_ms * 1e3 if round_ms > 0 else 0.0,
        "outside_share": outside / round_ms if round_ms > 0 else 0.0,
    }


_SHORT = {
    "draft_model": "d.model",
    "draft_sampling": "d.samp",
    "gateway_math": "g.math",
    "gateway_codec": "g.codec",
    "link": "link",
    "http": "http",
    "worker_codec": "w.codec",
    "worker_queue": "w.queue",
    "worker_model": "w.model",
    "worker_scoring": "w.score",
    "worker_other": "w.other",
    "other": "other",
}


def print_table(results: dict[str, Any]) -> None:
    setup, floors = results["setup"], results["floors"]
    print(
        f"\nspecgate bench overhead: {len(setup['prompts'])} prompt(s) × ≤ {setup['max_tokens']} "
        f"tokens, {setup['runs']} run(s), "
        f"{setup['threads']} threads, zero link; median ms per round (the first round, with the "
        "prefill, left out)"
    )
    shown = [p for p in PARTS if p != "link"]
    print(
        f"{'mode':<16}{'T':>3}{'round':>7}"
        + "".join(f"{_SHORT[p]:>8}" for p in shown)
        + f"{'outside':>8}{'out %':>6}{'api':>6}{'up':>10}{'back':>10}"
    )
    for r in results["cells"]:
        share = 100 * r["outside_models_ms"] / r["round_ms"] if r["round_ms"] else 0.0
        print(
            f"{r['mode']:<16}{r['temperature']:>3g}{r['round_ms']:>7.1f}"
            + "".join(f"{r['parts_ms'][p]:>8.2f}" for p in shown)
            + f"{r['outside_models_ms']:>8.2f}{share:>6.0f}{r['api_ms_per_round']:>6.1f}"
            f"{_size(r['bytes_up_per_round']):>10}{_size(r['bytes_down_per_round']):>10}"
        )
    budget = setup.get("budget")
    if budget:
        print(
            f"\nwith a verify step of {budget['verify_ms']:g} ms over a link of {budget['rtt_ms']:g} ms"
            + (f" and {budget['mbps']:g} Mbit/s" if budget["mbps"] else "")
            + ", the rest as measured: round ms, tokens/s, share outside the models"
        )
        for r in results["cells"]:
            p = r["projection"]
            print(
                f"{r['mode']:<16}{r['temperature']:>3g}{p['round_ms']:>9.1f}"
                f"{p['tokens_per_s']:>9.1f}{100 * p['outside_share']:>7.0f} %"
            )
    print(
        "\nfloors (same run): draft step (llama.cpp decode + top-k sampler) "
        f"{floors['draft_step_ms']:.2f} ms; "
        + ", ".join(
            f"{k} {v:.2f}"
            for k, v in sorted(floors.items())
            if k != "draft_step_ms" and not k.startswith("draft_alone")
        )
    )
    print(
        "draft step: in the gateway beside the worker, and alone (our DraftModel in the bench's "
        "process, the servers idle)"
    )
    print(
        f"{'mode':<16}{'T':>3}{'draft step':>11}{'alone':>7}{'floor':>7}{'×':>6}{'×alone':>7}"
        f"{'worker':>8}{'floor':>7}{'×':>6}{'http':>7}{'floor':>7}{'outside':>9}{'goal':>6}"
        f"{'met':>5}"
    )
    for r in results["cells"]:
        worker = r["parts_ms"]["worker_model"] + r["parts_ms"]["worker_scoring"]
        draft = (
            f"{r['draft_step_ms']:>11.2f}{r['draft_alone_ms']:>7.2f}{r['draft_floor_ms']:>7.2f}"
            f"{r['draft_over_floor']:>6.2f}{r['draft_alone_over_floor']:>7.2f}"
            if "draft_floor_ms" in r
            else f"{'':>38}"
        )
        goal = goal_ms(r["mode"])
        met = "yes" if r["outside_models_ms"] <= goal else "no"
        print(
            f"{r['mode']:<16}{r['temperature']:>3g}{draft}{worker:>8.2f}"
            f"{r.get('worker_floor_ms', float('nan')):>7.2f}"
            f"{r.get('worker_over_floor', float('nan')):>6.2f}"
            f"{r['parts_ms']['http']:>7.2f}{r.get('http_floor_ms', float('nan')):>7.2f}"
            f"{r['outside_models_ms']:>9.2f}{goal:>6g}{met:>5}"
        )
        if r["mode"] == "tree":
            sampling = r["parts_ms"]["draft_sampling"]
            print(
                f"{'':<19}tree draft sampling {sampling:.2f} ms a round, goal ≤ "
                f"{GOAL_TREE_SAMPLING_MS:g}: "
                f"{'met' if sampling <= GOAL_TREE_SAMPLING_MS else 'not met'}"
            )
    if any("baseline" in r for r in results["cells"]):
        print(
            f"\nbefore ({setup['baseline']}) vs after, side by side, every round counted: tok/s, "
            "verify outside the model ms/round, draft ms/token, bytes back/round"
        )
        for r in results["cells"]:
            b, a = r["baseline"], r["ours_coarse"]
            print(
                f"{r['mode']:<16}{r['temperature']:>3g}  tok/s {b['tokens_per_s']:>6.1f} → "
                f"{a['tokens_per_s']:>6.1f}   "
                f"verify−model {b['verify_outside_model_ms']:>6.2f} → "
                f"{a['verify_outside_model_ms']:>6.2f}   draft/token "
                f"{b['draft_ms_per_token']:>6.2f} → {a['draft_ms_per_token']:>6.2f}   "
                f"bytes back {_size(b['bytes_down_per_round']):>8} → {_size(a['bytes_down_per_round']):>8}"
            )
        profiled = [r for r in results["cells"] if "parts_ms" in r["baseline"]]
        if profiled:
            print(
                "\nthe median round before → after, part by part (ms; the baseline profiles its "
                "rounds as ours do)"
            )
            print(
                f"{'mode':<16}{'T':>3}{'round':>17}{'d.model':>17}{'d.samp':>15}{'g.math':>15}"
                f"{'http':>15}{'outside':>17}"
            )
            for r in profiled:
                b, a = r["baseline"], r
                pair = lambda x, y, w: f"{x:>{w}.2f} →{y:>6.2f}"  # noqa: E731
                print(
                    f"{r['mode']:<16}{r['temperature']:>3g}"
                    f"{pair(b['round_ms'], a['round_ms'], 8)}"
                    f"{pair(b['parts_ms']['draft_model'], a['parts_ms']['draft_model'], 8)}"
                    f"{pair(b['parts_ms']['draft_sampling'], a['parts_ms']['draft_sampling'], 6)}"
                    f"{pair(b['parts_ms']['gateway_math'], a['parts_ms']['gateway_math'], 6)}"
                    f"{pair(b['parts_ms']['http'], a['parts_ms']['http'], 6)}"
                    f"{pair(b['outside_models_ms'], a['outside_models_ms'], 8)}"
                )


def _size(count: float) -> str:
    return (
        f"{count / 2**20:.2f} MB"
        if count >= 2**20
        else f"{count / 2**10:.1f} KB"
        if count >= 2**10
        else f"{count:.0f} B"
    )
