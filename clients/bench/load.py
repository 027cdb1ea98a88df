"""``specgate bench load``: concurrent streaming clients against ``specgate serve`` for a fixed time, at
one or several concurrency levels in turn (one server): errors, 429s (retried after Retry-After), tokens/s,
TTFT, inter-token and end-to-end latency percentiles, mean batches, cores busy, RSS at the start and end.
``--gateways 1,2``: each level through one gateway, then through two on the same workers (the clients
dealt out in turn), side by side in one run — what a second gateway adds to the aggregate."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

from clients.bench.common import progress, write_json
from clients.chat import parse_data_line
from clients.procs import GatewayProcess, ServerProcess, free_port, serve_process
from clients.prompts import PROMPTS
from core.config import SpecgateConfig, dump_config, load_config


@dataclass
class LoadStats:
    done: int = 0
    rejected: int = 0  # 429s, retried after Retry-After
    tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)
    latency_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)  # gaps between a stream's content events
    errors: Counter[str] = field(default_factory=Counter)


def concurrency_levels(text: str) -> list[int]:
    """``"1,4,8,16"`` → ``[1, 4, 8, 16]`` (argparse's type for ``--concurrency``)."""
    try:
        levels = [int(part) for part in text.split(",")]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(
            f"--concurrency takes positive integers separated by commas, not {text!r}"
        )
    return levels


def bench_load(args: argparse.Namespace) -> int:
    port = args.port or free_port()
    progress(f"bench load: starting specgate serve on port {port}")
    runs = []
    server = serve_process(args.config, port, args.startup_timeout)
    with server as base, tempfile.TemporaryDirectory(prefix="specgate-load-") as directory:
        assert server.proc is not None
        for count in args.gateways:  # a list, as --concurrency
            with ExitStack() as more:
                extra = [
                    _another_gateway(
                        more, base, args.config, Path(directory) / f"gateway{i}.yaml", args.startup_timeout
                    )
                    for i in range(2, count + 1)
                ]
                processes = _processes(server.proc.pid) | {
                    f"gateway:{i}": psutil.Process(g.proc.pid)
                    for i, g in enumerate(extra, 2)
                    if g.proc is not None
                }
                for concurrency in args.concurrency:  # a list: ``concurrency_levels``
                    runs.append(
                        asyncio.run(_run([base, *(g.url for g in extra)], processes, concurrency, args))
                    )
                    _print(runs[-1])
    if len(runs) > 1:
        for run in runs:
            run["tokens_per_s_vs_first"] = (
                round(run["tokens_per_s"] / runs[0]["tokens_per_s"], 2) if runs[0]["tokens_per_s"] else None
            )
        _print_levels(runs)
    write_json(args.json_path, {"levels": runs} if len(runs) > 1 else runs[0])
    return 0 if not any(run["errors"] for run in runs) else 1


def _another_gateway(
    stack: ExitStack, base: str, config_path: str | None, path: Path, timeout_s: float
) -> ServerProcess:
    """One more gateway on the workers of ``specgate serve``'s gateway at ``base``, started and entered on
    ``stack``."""
    ready, health = (
        httpx.get(f"{base}/health/ready", timeout=60).json(),
        httpx.get(f"{base}/health", timeout=10).json(),
    )
    config = gateway_beside(load_config(config_path), ready, health["threads"]["draft"])
    path.write_text(dump_config(config))
    progress(
        "bench load: starting another gateway on the same workers "
        f"({', '.join(str(w.name) for w in config.workers)})"
    )
    gateway = GatewayProcess(str(path), timeout_s=timeout_s)
    stack.enter_context(gateway)
    return gateway


def gateway_beside(
    config: SpecgateConfig, ready: dict[str, Any], draft_threads: int | None
) -> SpecgateConfig:
    """``config`` for another gateway on the workers a running one reports (its ``/health/ready`` body): each
    target's replicas by URL, what ``serve`` started locally dropped, a free port, the draft's thread
    count."""
    if any(w.pipeline for w in config.workers):
        raise SystemExit("bench load: --gateways over 1 takes whole-model workers, not a pipeline")
    urls = {e["name"]: [r["url"] for r in e["replicas"]] for e in ready["workers"]}
    # what serve started or resolved; an engine keeps its model (the name it serves)
    local = ("url", "urls", "port", "threads", "backend", "model", "discovery_interval_s")
    workers = [
        {
            **{
                k: v
                for k, v in w.model_dump(mode="json", exclude_none=True).items()
                if k not in local or (k == "model" and w.is_openai_logprobs)
            },
            "name": name,
            "urls": urls[name],
        }
        for name, w in zip(urls, config.workers)
    ]
    data = {**config.model_dump(mode="json", exclude_none=True), "workers": workers, "port": free_port()}
    data["draft"] = {**data["draft"], "threads": draft_threads}
    return SpecgateConfig.model_validate(data)


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


def _rss_mb_and_cpu_s(processes: dict[str, psutil.Process]) -> tuple[dict[str, float], dict[str, float]]:
    """Per process: its RSS in MB, and the CPU seconds (user + system) it has used so far."""
    return {n: round(p.memory_info().rss / 2**20, 1) for n, p in processes.items()}, {
        n: sum(p.cpu_times()[:2]) for n, p in processes.items()
    }


async def _run(
    bases: list[str], processes: dict[str, psutil.Process], concurrency: int, args: argparse.Namespace
) -> dict[str, Any]:
    """One level: ``concurrency`` clients, client i on gateway ``i % len(bases)``."""
    limits = httpx.Limits(max_connections=concurrency + 8)
    async with _Clients(bases, limits) as clients:
        on = [clients[i % len(clients)] for i in range(concurrency)]
        # warm-up, not counted: one burst at full concurrency fills the context pools, so RSS
        # at the start is the steady state and growth over the run means a leak
        progress(
            f"bench load: {concurrency} clients on {len(bases)} gateway(s): warm-up burst of "
            f"{concurrency} requests"
        )
        await asyncio.gather(*(_one(on[i], i, 8, LoadStats()) for i in range(concurrency)))
        rss_start, cpu_start = _rss_mb_and_cpu_s(processes)
        counters_start = await _all_counters(clients)
        stats = LoadStats()
        started = time.monotonic()
        deadline = started + args.duration
        reporter = asyncio.create_task(_report_progress(stats, started, args.duration))
        await asyncio.gather(
            *(_client_loop(on[i], i, concurrency, deadline, args, stats) for i in range(concurrency))
        )
        elapsed = time.monotonic() - started
        reporter.cancel()
        rss_end, cpu_end = _rss_mb_and_cpu_s(processes)
        metrics = "\n".join([(await c.get("/metrics")).text for c in clients])
    return {
        "gateways": len(bases),
        "concurrency": concurrency,
        "duration_s": args.duration,
        "elapsed_s": round(elapsed, 1),
        "max_tokens": args.max_tokens,
        "requests_done": stats.done,
        "errors": sum(stats.errors.values()),
        "error_messages": dict(stats.errors.most_common(10)),
        "rejected_429_retried": stats.rejected,
        "tokens": stats.tokens,
        "tokens_per_s": round(stats.tokens / elapsed, 2),
        **{
            f"{name}_p{q}_s": _percentile(getattr(stats, f"{name}_s"), q)
            for name in ("ttft", "latency", "itl")
            for q in (50, 99)
        },
        "mean_batch": _mean_batches(counters_start, _counters(metrics)),  # every gateway's counters summed
        "cpu_cores_busy": {
            n: round((cpu_end[n] - cpu_start[n]) / elapsed, 2) for n in cpu_start if n in cpu_end
        },
        "rss_start_mb": rss_start,
        "rss_end_mb": rss_end,
        "rss_growth_pct": {
            n: round(100 * (rss_end[n] - rss_start[n]) / rss_start[n], 1) for n in rss_start if n in rss_end
        },
        "gateway_metrics": [
            line for line in metrics.splitlines() if "failures_total" in line and not line.endswith(" 0.0")
        ],
    }


async def _client_loop(
    client: httpx.AsyncClient,
    index: int,
    concurrency: int,
    deadline: float,
    args: argparse.Namespace,
    stats: LoadStats,
) -> None:
    """One client: a streaming request after another until the deadline (the last one finishes)."""
    turn = index
    while time.monotonic() < deadline:
        await _one(client, turn, args.max_tokens, stats)
        turn += concurrency


async def _one(client: httpx.AsyncClient, turn: int, max_tokens: int, stats: LoadStats) -> None:
    body = {
        "model": "specgate",
        "messages": [{"role": "user", "content": PROMPTS[turn % len(PROMPTS)]}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started, first, last = time.monotonic(), None, None
    gaps: list[float] = []
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
                event = parse_data_line(line)
                if event == "[DONE]":
                    finished = True
                    break
                if not isinstance(event, dict):
                    continue
                if "error" in event:
                    stats.errors[f"stream: {event['error']['message'][:160]}"] += 1
                    return
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
                if any(c["delta"].get("content") for c in event.get("choices", [])):
                    now = time.monotonic()
                    if last is not None:
                        gaps.append(now - last)
                    first, last = first or now, now
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
    stats.itl_s.extend(gaps)


async def _report_progress(stats: LoadStats, started: float, duration: float) -> None:
    while True:
        await asyncio.sleep(30)
        elapsed = time.monotonic() - started
        progress(
            f"bench load: {elapsed:.0f}/{duration:.0f} s: {stats.done} done, "
            f"{sum(stats.errors.values())} errors, {stats.rejected} 429s, "
            f"{stats.tokens / elapsed:.1f} tok/s"
        )


class _Clients:
    """One ``httpx.AsyncClient`` per gateway, for an ``async with``."""

    def __init__(self, bases: list[str], limits: httpx.Limits) -> None:
        self.clients = [
            httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(600, connect=10), limits=limits)
            for base in bases
        ]

    async def __aenter__(self) -> list[httpx.AsyncClient]:
        return self.clients

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.gather(*(c.aclose() for c in self.clients))


async def _all_counters(clients: list[httpx.AsyncClient]) -> dict[str, float]:
    return _counters("\n".join([(await c.get("/metrics")).text for c in clients]))


def _counters(metrics: str) -> dict[str, float]:
    """The counters the mean batches come from, by series (``name{labels}``), from ``/metrics`` (several
    gateways' summed)."""
    wanted = (
        "specgate:draft_steps_total",
        "specgate:draft_step_drafts_total",
        "specgate:worker_calls_total",
        "specgate:worker_batch_sessions_total",
    )
    out: dict[str, float] = {}
    for series, _, value in (
        line.rpartition(" ") for line in metrics.splitlines() if line.startswith(wanted)
    ):
        out[series] = out.get(series, 0.0) + float(value)
    return out


def _mean_batches(start: dict[str, float], end: dict[str, float]) -> dict[str, float | None]:
    """Over the level: drafts per draft step, and per worker the sessions per verify forward (None where the
    gateway does not count them)."""

    def delta(series: str) -> float | None:
        return end[series] - start.get(series, 0.0) if series in end else None

    def ratio(top: float | None, bottom: float | None) -> float | None:
        return round(top / bottom, 2) if top is not None and bottom else None

    out = {"draft": ratio(delta("specgate:draft_step_drafts_total"), delta("specgate:draft_steps_total"))}
    for series in end:
        if series.startswith("specgate:worker_calls_total{"):
            worker = series[series.index('worker="') + 8 :].split('"')[0]
            out[f"worker:{worker}"] = ratio(
                delta(series.replace("worker_calls_total", "worker_batch_sessions_total")), delta(series)
            )
    return out


def _percentile(values: list[float], q: int) -> float | None:
    if len(values) < 2:
        return round(values[0], 3) if values else None
    return round(statistics.quantiles(values, n=100, method="inclusive")[q - 1], 3)


def _print(r: dict[str, Any]) -> None:
    print(
        f"load: {r['concurrency']} streaming clients on {r['gateways']} gateway(s) for "
        f"{r['duration_s']} s (ran {r['elapsed_s']} s), max_tokens {r['max_tokens']}"
    )
    print(
        f"  requests done {r['requests_done']}, errors {r['errors']}, 429s retried "
        f"{r['rejected_429_retried']}"
    )
    print(
        f"  time to first token p50 {r['ttft_p50_s']} s, p99 {r['ttft_p99_s']} s; latency p50 "
        f"{r['latency_p50_s']} s, p99 {r['latency_p99_s']} s"
    )
    print(f"  inter-token latency (between content events) p50 {r['itl_p50_s']} s, p99 {r['itl_p99_s']} s")
    print(f"  {r['tokens']} tokens, {r['tokens_per_s']} tok/s")
    print("  mean batch: " + ", ".join(f"{name} {value}" for name, value in r["mean_batch"].items()))
    print("  cores busy: " + ", ".join(f"{name} {value}" for name, value in r["cpu_cores_busy"].items()))
    for name in r["rss_start_mb"]:
        print(
            f"  RSS {name}: {r['rss_start_mb'][name]} MB → {r['rss_end_mb'].get(name)} MB "
            f"({r['rss_growth_pct'].get(name)} %)"
        )
    for message, count in r["error_messages"].items():
        print(f"  error ×{count}: {message}")


def _print_levels(runs: list[dict[str, Any]]) -> None:
    print(
        "gateways | concurrency | tok/s | × first level | ITL p50 s | ITL p99 s | TTFT p50 s | "
        "mean draft batch | cores busy | errors"
    )
    for r in runs:
        print(
            f"{r['gateways']:>8} | {r['concurrency']:>11} | {r['tokens_per_s']:>5} | "
            f"{r['tokens_per_s_vs_first']:>13} | {r['itl_p50_s']} | {r['itl_p99_s']} "
            f"| {r['ttft_p50_s']} | {r['mean_batch']['draft']} | "
            f"{round(sum(r['cpu_cores_busy'].values()), 2)} | {r['errors']}"
        )
