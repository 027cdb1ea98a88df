"""``specgate bench load``: many concurrent streaming clients against ``specgate serve`` for a
fixed time. Prints and writes: requests done, errors (by message), 429s (each retried after its
Retry-After), p50 / p99 time to first token and end-to-end latency, tokens/s, and the RSS of
the gateway and of each worker at the start (after a warm-up burst) and at the end."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
import psutil

from clients.procs import free_port, serve_process
from clients.prompts import PROMPTS as ALL_PROMPTS
from clients.report import progress, write_json

PROMPTS = ALL_PROMPTS


@dataclass
class LoadStats:
    done: int = 0
    rejected: int = 0  # 429s, retried after Retry-After
    tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)
    latency_s: list[float] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)


def bench_load(args: argparse.Namespace) -> int:
    port = args.port or free_port()
    progress(f"bench load: starting specgate serve on port {port}")
    with serve_process(args.config, port, args.startup_timeout) as base:
        serve_pid = _serve_pid(port)
        results = asyncio.run(_run(base, serve_pid, args))
    _print(results)
    write_json(args.json_path, results)
    return 0 if not results["errors"] else 1


def _serve_pid(port: int) -> int:
    """The ``specgate serve`` process started for ``port`` (the parent of gateway and workers)."""
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if "serve" in cmdline and "--port" in cmdline and cmdline[cmdline.index("--port") + 1] == str(port):
            return int(proc.pid)
    raise RuntimeError(f"no specgate serve process for port {port}")


def _processes(serve_pid: int) -> dict[str, psutil.Process]:
    """The gateway and each worker under ``specgate serve``, named from their command lines."""
    found = {}
    for child in psutil.Process(serve_pid).children(recursive=True):
        cmdline = child.cmdline()
        if "-m" in cmdline:
            module = cmdline[cmdline.index("-m") + 1]
            if module == "app":
                found["gateway"] = child
            elif module == "workers":
                found[f"worker:{cmdline[cmdline.index('--model') + 1]}"] = child
    return found


def _rss_mb(processes: dict[str, psutil.Process]) -> dict[str, float]:
    return {name: round(p.memory_info().rss / 2**20, 1) for name, p in processes.items()}


async def _run(base: str, serve_pid: int, args: argparse.Namespace) -> dict[str, Any]:
    processes = _processes(serve_pid)
    limits = httpx.Limits(max_connections=args.concurrency + 8)
    async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(600, connect=10), limits=limits) as client:
        # warm-up, not counted: one burst at full concurrency fills the context pools, so RSS
        # at the start is the steady state and growth over the run means a leak
        progress(f"bench load: warm-up burst of {args.concurrency} requests")
        await asyncio.gather(*(_one(client, i, 8, LoadStats()) for i in range(args.concurrency)))
        rss_start = _rss_mb(processes)
        stats = LoadStats()
        started = time.monotonic()
        deadline = started + args.duration
        reporter = asyncio.create_task(_report_progress(stats, started, args.duration))
        await asyncio.gather(*(_client_loop(client, i, deadline, args, stats) for i in range(args.concurrency)))
        elapsed = time.monotonic() - started
        reporter.cancel()
        rss_end = _rss_mb(processes)
        metrics = (await client.get("/metrics")).text
    return {
        "concurrency": args.concurrency,
        "duration_s": args.duration,
        "elapsed_s": round(elapsed, 1),
        "max_tokens": args.max_tokens,
        "requests_done": stats.done,
        "errors": sum(stats.errors.values()),
        "error_messages": dict(stats.errors.most_common(10)),
        "rejected_429_retried": stats.rejected,
        "tokens": stats.tokens,
        "tokens_per_s": round(stats.tokens / elapsed, 2),
        "ttft_p50_s": _percentile(stats.ttft_s, 50),
        "ttft_p99_s": _percentile(stats.ttft_s, 99),
        "latency_p50_s": _percentile(stats.latency_s, 50),
        "latency_p99_s": _percentile(stats.latency_s, 99),
        "rss_start_mb": rss_start,
        "rss_end_mb": rss_end,
        "rss_growth_pct": {n: round(100 * (rss_end[n] - rss_start[n]) / rss_start[n], 1) for n in rss_start if n in rss_end},
        "gateway_metrics": [line for line in metrics.splitlines() if "failures_total" in line and not line.endswith(" 0.0")],
    }


async def _client_loop(client: httpx.AsyncClient, index: int, deadline: float, args: argparse.Namespace, stats: LoadStats) -> None:
    """One client: a streaming request after another until the deadline (the last one finishes)."""
    turn = index
    while time.monotonic() < deadline:
        await _one(client, turn, args.max_tokens, stats)
        turn += args.concurrency


async def _one(client: httpx.AsyncClient, turn: int, max_tokens: int, stats: LoadStats) -> None:
    body = {
        "model": "specgate", "messages": [{"role": "user", "content": PROMPTS[turn % len(PROMPTS)]}],
        "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True},
    }
    started, first = time.monotonic(), None
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            if resp.status_code == 429:
                stats.rejected += 1
                await asyncio.sleep(float(resp.headers.get("retry-after", "1")))
                return
            if resp.status_code != 200:
                stats.errors[f"HTTP {resp.status_code}: {(await resp.aread())[:160]!r}"] += 1
                return
            tokens, finished = 0, False
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    finished = True
                    break
                event = orjson.loads(line[len("data: "):])
                if "error" in event:
                    stats.errors[f"stream: {event['error']['message'][:160]}"] += 1
                    return
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
                if first is None and any(c["delta"].get("content") for c in event.get("choices", [])):
                    first = time.monotonic()
    except httpx.HTTPError as exc:
        stats.errors[f"{type(exc).__name__}: {str(exc)[:160]}"] += 1
        return
    if not finished:
        stats.errors["stream ended without [DONE]"] += 1
        return
    stats.done += 1
    stats.tokens += tokens
    stats.ttft_s.append((first or time.monotonic()) - started)
    stats.latency_s.append(time.monotonic() - started)


async def _report_progress(stats: LoadStats, started: float, duration: float) -> None:
    while True:
        await asyncio.sleep(30)
        elapsed = time.monotonic() - started
        progress(f"bench load: {elapsed:.0f}/{duration:.0f} s: {stats.done} done, {sum(stats.errors.values())} errors, {stats.rejected} 429s, {stats.tokens / elapsed:.1f} tok/s")


def _percentile(values: list[float], q: int) -> float | None:
    if len(values) < 2:
        return round(values[0], 3) if values else None
    return round(statistics.quantiles(values, n=100, method="inclusive")[q - 1], 3)


def _print(r: dict[str, Any]) -> None:
    print(f"load: {r['concurrency']} streaming clients for {r['duration_s']} s (ran {r['elapsed_s']} s), max_tokens {r['max_tokens']}")
    print(f"  requests done {r['requests_done']}, errors {r['errors']}, 429s retried {r['rejected_429_retried']}")
    print(f"  time to first token p50 {r['ttft_p50_s']} s, p99 {r['ttft_p99_s']} s; latency p50 {r['latency_p50_s']} s, p99 {r['latency_p99_s']} s")
    print(f"  {r['tokens']} tokens, {r['tokens_per_s']} tok/s")
    for name in r["rss_start_mb"]:
        print(f"  RSS {name}: {r['rss_start_mb'][name]} MB → {r['rss_end_mb'].get(name)} MB ({r['rss_growth_pct'].get(name)} %)")
    for message, count in r["error_messages"].items():
        print(f"  error ×{count}: {message}")
