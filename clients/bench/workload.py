"""``specgate bench workload``: where lookup drafting pays (docs/design.md §3.10): the bundled prompt set
(``clients.bench.workload_prompts``) per link × T × category, each prompt once per drafter in turn,
unseeded (a seeded request does not use the suffix index); docs/performance.md, "Lookup drafters"."""

from __future__ import annotations

import argparse
import re
import time
from contextlib import ExitStack
from typing import Any

import httpx

from clients.bench.common import (
    LINKS,
    Samples,
    finish,
    gateway_client,
    progress,
    request,
    setup,
    start_workers,
)
from clients.bench.workload_prompts import PROMPTS, Messages

DRAFTERS = ("model", "lookup", "model+lookup")
WORKLOAD_LINKS = [LINKS[0], LINKS[2]]  # zero, 50 ms / 10 Mbps
GOAL_MERGED = 1.3  # model+lookup over model, tokens/round, where the answer repeats its context
GOAL_OTHERS = 0.97  # ... and no worse elsewhere
REPEATING = ("summarization", "passage QA", "code editing")


def bench_workload(args: argparse.Namespace) -> int:
    plan = _plan(args)
    total = (
        len(plan["links"])
        * len(plan["temperatures"])
        * len(plan["categories"])
        * plan["prompts"]
        * len(DRAFTERS)
    )
    progress(
        f"bench workload: {total} requests ({plan['prompts']} prompt(s) per category, ≤ "
        f"{plan['max_tokens']} tokens)"
    )
    rows: list[dict[str, Any]] = []
    done, started = 0, time.monotonic()
    with ExitStack() as stack:
        urls = start_workers(stack)
        for link_name, link in plan["links"]:
            with gateway_client(urls, link, plan["gamma"]) as client:
                request(client, PROMPTS["translation"][0], 4, 0.0, {"mode": plan["mode"]}, None)  # warm-up
                for t in plan["temperatures"]:
                    for category in plan["categories"]:
                        samples: Samples = {d: [] for d in DRAFTERS}
                        for messages in PROMPTS[category][: plan["prompts"]]:
                            for drafter in DRAFTERS:
                                samples[drafter].append(
                                    _measured(client, messages, t, drafter, plan["max_tokens"], plan["mode"])
                                )
                                done += 1
                        rows += [_row(link_name, t, category, d, samples[d]) for d in DRAFTERS]
                        left = (time.monotonic() - started) / done * (total - done)
                        progress(
                            f"[{done}/{total}] ~{left:.0f}s left  {link_name} T={t:g} {category}: "
                            + ", ".join(f"{r['drafter']} {r['tokens_per_round']:.2f}" for r in rows[-3:])
                            + " tokens/round"
                        )
    return finish({"setup": setup(plan), "cells": rows}, args, print_table)


def _plan(args: argparse.Namespace) -> dict[str, Any]:
    links = [WORKLOAD_LINKS[0]] if args.quick else WORKLOAD_LINKS
    categories = args.categories.split(",") if args.categories else list(PROMPTS)
    unknown = [c for c in categories if c not in PROMPTS]
    if unknown:
        raise SystemExit(
            f"specgate bench workload: unknown categories {unknown}; the categories are {list(PROMPTS)}"
        )
    return {
        "prompts": max(1, min(args.prompts, 8)),
        "max_tokens": args.max_tokens,
        "gamma": 4,
        "links": links,
        "temperatures": [0.0] if args.quick else [0.0, 1.0],
        "categories": categories,
        "mode": getattr(args, "mode", "exact") or "exact",
    }


def _measured(
    client: httpx.Client, messages: Messages, temperature: float, drafter: str, max_tokens: int, mode: str
) -> dict[str, float]:
    before = _lookups(client)
    # unseeded: a seeded request leaves the suffix index out, and the bench measures what unseeded traffic
    # gets
    seconds, usage = request(
        client, messages, max_tokens, temperature, {"mode": mode, "drafter": drafter}, None
    )
    after = _lookups(client)
    block = usage["speculative"]
    return {
        "tokens": usage["completion_tokens"],
        "seconds": seconds,
        "rounds": block["rounds"],
        "draft_ms": block["draft_ms"],
        "accepted": block["accepted_tokens"],
        "drafted": block["draft_tokens"],
        "lookups": after[0] - before[0],
        "hits": after[1] - before[1],
    }


def _lookups(client: httpx.Client) -> tuple[float, float]:
    """The gateway's lookup counters: (lookups, hits)."""
    text = client.get("/metrics").text
    found = {
        name: float(value)
        for name, value in re.findall(r"^specgate:(lookups_total|lookup_hits_total) ([0-9.e+]+)$", text, re.M)
    }
    return found.get("lookups_total", 0.0), found.get("lookup_hits_total", 0.0)


def _row(
    link: str, temperature: float, category: str, drafter: str, samples: list[dict[str, float]]
) -> dict[str, Any]:
    total = {key: sum(s[key] for s in samples) for key in samples[0]}
    rounds = max(total["rounds"], 1.0)
    return {
        "link": link,
        "temperature": temperature,
        "category": category,
        "drafter": drafter,
        "tokens_per_round": total["tokens"] / rounds,
        "tokens_per_s": total["tokens"] / total["seconds"],
        "draft_ms_per_round": total["draft_ms"] / rounds,
        "acceptance_rate": total["accepted"] / total["drafted"] if total["drafted"] else None,
        "lookup_hit_rate": total["hits"] / total["lookups"] if total["lookups"] else None,
        "tokens": total["tokens"],
        "rounds": total["rounds"],
    }


def print_table(results: dict[str, Any]) -> None:
    cells = results["cells"]
    mode = results["setup"].get("mode", "exact")
    print(
        f"\nspecgate bench workload: {'exact (draft top-32)' if mode == 'exact' else mode}, two "
        f"workers, {results['setup']['prompts']} prompt(s) per category, ≤ "
        f"{results['setup']['max_tokens']} tokens"
    )
    print(
        f"{'link':18} {'T':>2} {'category':16} {'drafter':13} {'tokens/round':>12} {'tok/s':>7} "
        f"{'draft ms/rd':>11} {'hit rate':>8}"
    )
    for c in cells:
        hit = "" if c["lookup_hit_rate"] is None else f"{c['lookup_hit_rate']:.0%}"
        print(
            f"{c['link']:18} {c['temperature']:>2g} {c['category']:16} {c['drafter']:13} "
            f"{c['tokens_per_round']:>12.2f} {c['tokens_per_s']:>7.1f} "
            f"{c['draft_ms_per_round']:>11.1f} {hit:>8}"
        )
    print(
        "goals: model+lookup ≥ 1.3× model's tokens/round on summarization, passage QA, code "
        "editing and ≥ 0.97× elsewhere; lookup ≥ 1.5 tokens/round on summarization"
    )
    for c in cells:
        if c["drafter"] != "model+lookup":
            continue
        model = next(
            m
            for m in cells
            if (m["link"], m["temperature"], m["category"], m["drafter"])
            == (c["link"], c["temperature"], c["category"], "model")
        )
        ratio = c["tokens_per_round"] / model["tokens_per_round"]
        goal = GOAL_MERGED if c["category"] in REPEATING else GOAL_OTHERS
        print(
            f"  {c['link']:18} T={c['temperature']:g} {c['category']:16} model+lookup / model "
            f"{ratio:.2f}× {'met' if ratio >= goal else 'not met'} (goal {goal}×)"
        )
