"""What every bench shares: servers, emulated links, the cell runner (cells alternating per run), medians, the
tail (table, JSON, plots); progress and JSON as the device benches write them (clients.bench.device)."""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

from clients.bench.device import progress, write_json
from clients.procs import GatewayProcess, WorkerProcess
from core.config import LinkConfig, SpecgateConfig, builtin_config, dump_config
from core.cores import usable_cores

Samples = dict[str, list[dict[str, float]]]  # cell name -> its figures, one dict per run
LINKS: list[tuple[str, LinkConfig]] = [
    ("0 ms", LinkConfig()),
    ("20 ms / 100 Mbps", LinkConfig(rtt_ms=20, up_mbps=100, down_mbps=100)),
    ("50 ms / 10 Mbps", LinkConfig(rtt_ms=50, up_mbps=10, down_mbps=10)),
    ("100 ms / 10 Mbps", LinkConfig(rtt_ms=100, up_mbps=10, down_mbps=10)),
]


def finish(
    results: dict[str, Any],
    args: argparse.Namespace,
    printer: Callable[[dict[str, Any]], None],
    plot: Callable[[dict[str, Any], Path], list[Path]] | None = None,
) -> int:
    """A bench's tail: its table, its JSON (``--json``), its plots (``--plots``); exit status 0."""
    printer(results)
    write_json(args.json_path, results)
    if plot is not None and args.plots:
        for path in plot(results, Path(args.plots)):
            progress(f"wrote {path}")
    return 0


def setup(plan: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """A plan as the JSON's ``setup``: its links by name."""
    return (
        {k: v for k, v in plan.items() if k != "links"}
        | {"links": [name for name, _ in plan["links"]]}
        | extra
    )


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def medians(runs: list[dict[str, float]]) -> dict[str, float]:
    """Per figure, its median over the runs of a cell (the keys of the first run)."""
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]}


class Bar:
    """A one-line progress bar on stderr."""

    def __init__(self, total: int) -> None:
        self.total, self.done, self.started = total, 0, time.monotonic()

    def step(self, note: str) -> None:
        self.done += 1
        filled = int(30 * self.done / self.total)
        elapsed = time.monotonic() - self.started
        left = elapsed / self.done * (self.total - self.done)
        progress(f"[{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total} ~{left:.0f}s left  {note}")


def run_cells(
    specs: list[tuple[str, dict[str, Any]]],
    runs: int,
    bar: Bar,
    label: str,
    one: Callable[[int, dict[str, Any]], dict[str, float]],
    note: str = "{tokens_per_s:.1f} tok/s",
) -> Samples:
    """``one(run, spec)`` for every cell, the cells alternating within each run (the host's drift hits them
    alike)."""
    samples: Samples = {name: [] for name, _ in specs}
    for run in range(runs):
        for name, spec in specs:
            samples[name].append(one(run, spec))
            bar.step(f"{label} {name}: " + note.format(**samples[name][-1]))
    return samples


def start_workers(stack: ExitStack) -> list[str]:
    """The built-in default's two workers (builtin, builtin-alt), the cores split between them."""
    config = builtin_config().with_local_urls().with_split_cores(usable_cores())
    progress("starting two workers (builtin, builtin-alt) on 127.0.0.1")
    urls = []
    for entry in config.workers:
        assert entry.model is not None
        urls.append(
            stack.enter_context(WorkerProcess(entry.model, entry.backend.value, threads=entry.threads))
        )
    return urls


def start_gateway(stack: ExitStack, config: SpecgateConfig, cwd: str | None = None) -> str:
    """A gateway process for ``config`` (written to a temporary file); its URL. For another checkout (``cwd``:
    a baseline) the file names only what differs from the defaults: a setting added since is not in it, and
    the checkout keeps its own defaults."""
    path = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="specgate-bench-"))) / "config.yaml"
    path.write_text(dump_config(config, changed_only=cwd is not None))
    return stack.enter_context(GatewayProcess(str(path), cwd=cwd))


@contextlib.contextmanager
def gateway_client(urls: list[str], link: LinkConfig, gamma: int) -> Iterator[httpx.Client]:
    """The built-in gateway over ``urls``, each worker entry carrying ``link``, and a client of it."""
    base = builtin_config().with_split_cores(usable_cores())
    data = base.model_dump(mode="json", exclude_none=True) | {
        "workers": [{"url": url, "weight": 1.0, "link": link.model_dump()} for url in urls]
    }
    # cells pick their mode; exact truncates to top-32
    data["speculative"] = {"mode": "aggregate", "num_draft_tokens": gamma}
    with ExitStack() as stack:
        yield stack.enter_context(
            httpx.Client(base_url=start_gateway(stack, type(base)(**data)), timeout=900)
        )


def measure(
    client: httpx.Client,
    prompts: list[str],
    max_tokens: int,
    temperature: float,
    spec: dict[str, Any],
    seed: int | None,
) -> dict[str, float]:
    """One cell-run: the prompts in turn through the gateway; its totals and per-round figures from the usage
    blocks."""
    totals: dict[str, float] = {}
    gammas = []
    for prompt in prompts:
        elapsed, usage = request(client, prompt, max_tokens, temperature, spec, seed)
        block = usage["speculative"]
        for key, value in (
            ("tokens", usage["completion_tokens"]),
            ("seconds", elapsed),
            ("rounds", block["rounds"]),
            ("drafted", block["draft_tokens"]),
            ("accepted", block["accepted_tokens"]),
            ("sent", block["bytes_to_workers"]),
            ("received", block["bytes_from_workers"]),
            ("draft_ms", block["draft_ms"]),
            ("model_ms", block["worker_model_ms"]),
            ("busy_ms", block["worker_busy_ms"]),
            ("prepared", block.get("prepared_drafts", 0)),
            ("used", block.get("prepared_drafts_used", 0)),
        ):
            totals[key] = totals.get(key, 0.0) + value
        if "gamma_chosen_mean" in block:
            gammas.append((block["gamma_chosen_mean"], block["rounds"]))
    rounds = max(totals["rounds"], 1.0)
    cell = {
        "tokens_per_s": totals["tokens"] / totals["seconds"],
        "tokens": totals["tokens"],
        "seconds": totals["seconds"],
        "rounds": totals["rounds"],
        "drafted": totals["drafted"],
        "mean_accepted_length": totals["tokens"] / rounds,
        "acceptance_rate": totals["accepted"] / totals["drafted"] if totals["drafted"] else float("nan"),
        "bytes_up_per_round": totals["sent"] / rounds,
        "bytes_down_per_round": totals["received"] / rounds,
        "draft_ms_per_token": totals["draft_ms"] / totals["drafted"] if totals["drafted"] else 0.0,
        "verify_model_ms_per_round": totals["model_ms"] / rounds,
        "target_ms_per_token": totals["busy_ms"] / totals["tokens"] if totals["tokens"] else 0.0,
        "tokens_per_answer": totals["tokens"] / len(prompts),
        "prepared": totals["prepared"],
        "prepared_used": totals["used"],
    }
    if gammas:
        cell["gamma_mean"] = sum(g * r for g, r in gammas) / max(sum(r for _, r in gammas), 1)
    return cell


def request(
    client: httpx.Client,
    prompt: str | list[dict[str, str]],
    max_tokens: int,
    temperature: float,
    spec: dict[str, Any],
    seed: int | None,
) -> tuple[float, dict[str, Any]]:
    """One chat completion of a prompt (or messages), no seed when ``seed`` is None; its seconds and usage
    block."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    body: dict[str, Any] = {
        "model": "specgate",
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "speculative": spec,
    }
    if seed is not None:
        body["seed"] = seed
    started = time.perf_counter()
    resp = client.post("/v1/chat/completions", json=body)
    elapsed = time.perf_counter() - started
    resp.raise_for_status()
    return elapsed, resp.json()["usage"]
