"""What every benchmark shares: progress on stderr, JSON on request, medians, a progress bar,
and the chat request a cell-run times through the gateway (its usage block read back)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def write_json(path: str | None, results: dict[str, Any]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(results, indent=2))
        progress(f"wrote {path}")


def device_parser(prog: str, description: str, dtype: str, repeats: int, unit: str) -> argparse.ArgumentParser:
    """The flags the device benches share (``bench tree-device``, ``step-device``)."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--json", dest="json_path", default=None, help="write the figures to this JSON file")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="where the model runs (default: cuda if present)")
    parser.add_argument("--dtype", default=dtype, choices=["float32", "bfloat16", "float16"], help=f"model dtype (default: {dtype})")
    parser.add_argument("--repeats", type=int, default=repeats, help=f"timed {unit} per cell (default: {repeats})")
    return parser


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


def measure(client: httpx.Client, prompts: list[str], max_tokens: int, temperature: float, spec: dict[str, Any], seed: int | None) -> dict[str, float]:
    """One cell-run: the prompts in turn through the gateway; its totals and per-round figures
    from the usage blocks (the DSD fields where the request used them)."""
    totals: dict[str, float] = {}
    gammas = []
    for prompt in prompts:
        elapsed, usage = request(client, prompt, max_tokens, temperature, spec, seed)
        block = usage["speculative"]
        for key, value in (("tokens", usage["completion_tokens"]), ("seconds", elapsed), ("rounds", block["rounds"]),
                           ("drafted", block["draft_tokens"]), ("accepted", block["accepted_tokens"]),
                           ("sent", block["bytes_to_workers"]), ("received", block["bytes_from_workers"]),
                           ("draft_ms", block["draft_ms"]), ("model_ms", block["worker_model_ms"]), ("busy_ms", block["worker_busy_ms"]),
                           ("prepared", block.get("prepared_drafts", 0)), ("used", block.get("prepared_drafts_used", 0))):
            totals[key] = totals.get(key, 0.0) + value
        if "gamma_chosen_mean" in block:
            gammas.append((block["gamma_chosen_mean"], block["rounds"]))
    rounds = max(totals["rounds"], 1.0)
    cell = {
        "tokens_per_s": totals["tokens"] / totals["seconds"],
        "tokens": totals["tokens"], "seconds": totals["seconds"], "rounds": totals["rounds"], "drafted": totals["drafted"],
        "mean_accepted_length": totals["tokens"] / rounds,
        "acceptance_rate": totals["accepted"] / totals["drafted"] if totals["drafted"] else float("nan"),
        "bytes_up_per_round": totals["sent"] / rounds,
        "bytes_down_per_round": totals["received"] / rounds,
        "draft_ms_per_token": totals["draft_ms"] / totals["drafted"] if totals["drafted"] else 0.0,
        "verify_model_ms_per_round": totals["model_ms"] / rounds,
        "target_ms_per_token": totals["busy_ms"] / totals["tokens"] if totals["tokens"] else 0.0,
        "tokens_per_answer": totals["tokens"] / len(prompts),
        "prepared": totals["prepared"], "prepared_used": totals["used"],
    }
    if gammas:
        cell["gamma_mean"] = sum(g * r for g, r in gammas) / max(sum(r for _, r in gammas), 1)
    return cell


def request(client: httpx.Client, prompt: str, max_tokens: int, temperature: float, spec: dict[str, Any], seed: int | None) -> tuple[float, dict[str, Any]]:
    """One chat completion (no seed when ``seed`` is None); its seconds and usage block."""
    body: dict[str, Any] = {
        "model": "specgate", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
        "temperature": temperature, "speculative": spec,
    }
    if seed is not None:
        body["seed"] = seed
    started = time.perf_counter()
    resp = client.post("/v1/chat/completions", json=body)
    elapsed = time.perf_counter() - started
    resp.raise_for_status()
    return elapsed, resp.json()["usage"]
