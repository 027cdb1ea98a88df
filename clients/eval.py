"""``specgate eval``: each decoding mode on a fixed prompt set against a gateway — acceptance,
mean accepted length, and for the lossy settings the measured distance to the target next to
its bound — as a table and JSON.

The distance comes from the usage block: per position, Σ w_n e_n with e_n = TV(p̂_n, p_n)
measured by each worker on its full distribution (exactly TV(p̂, p) with one worker, an upper
bound on it with several), next to the bound Σ w_n σ_n from the tail masses. With the default
``renormalize`` reconstruction the two coincide (TV(p̂_n, p_n) = σ_n exactly); ``residual``
spreads the tail and lands below its bound.

Usage: ``specgate eval [--url http://127.0.0.1:8000 | --serve] [--json FILE]``
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

import httpx

from clients.procs import free_port, serve_process
from clients.prompts import PROMPTS as ALL_PROMPTS
from clients.report import progress, write_json

PROMPTS = ALL_PROMPTS[:4]
SETTINGS: list[tuple[str, dict[str, Any]]] = [
    ("autoregressive", {"mode": "autoregressive"}),
    ("aggregate k=full", {"mode": "aggregate", "k": "full"}),
    ("aggregate k=32", {"mode": "aggregate", "k": 32}),
    ("aggregate k=8", {"mode": "aggregate", "k": 8}),
    ("aggregate k=8 residual", {"mode": "aggregate", "k": 8, "reconstruction": "residual"}),
    ("split", {"mode": "split"}),
    ("exact", {"mode": "exact"}),
]


def evaluate(args: argparse.Namespace) -> int:
    with _gateway(args) as url:
        if url is None:
            return 1
        with httpx.Client(base_url=url, timeout=httpx.Timeout(600, connect=10), headers=_auth()) as client:
            model = client.get("/v1/models").json()["data"][0]["id"]
            rows = [_run(client, model, name, spec, args) for name, spec in SETTINGS]
    results = {"url": url, "max_tokens": args.max_tokens, "temperature": args.temperature, "prompts": len(PROMPTS[: args.prompts]), "seeds": args.seeds, "rows": rows}
    _print(rows)
    write_json(args.json_path, results)
    return 0


@contextlib.contextmanager
def _gateway(args: argparse.Namespace) -> Iterator[str | None]:
    """The gateway to evaluate: ``--url``, or a ``specgate serve`` started for the run."""
    if not args.serve:
        try:
            httpx.get(f"{args.url}/health", timeout=5)
        except httpx.HTTPError:
            print(f"specgate eval: no gateway at {args.url} (start one, or pass --serve)", file=sys.stderr)
            yield None
            return
        yield args.url
        return
    with serve_process(args.config, free_port(), args.startup_timeout) as url:
        yield url


def _auth() -> dict[str, str] | None:
    key = os.environ.get("SPECGATE_API_KEY")
    return {"authorization": f"Bearer {key}"} if key else None


def _run(client: httpx.Client, model: str, name: str, spec: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    totals = {"drafted": 0, "accepted": 0, "tokens": 0, "rounds": 0}
    bounds, errors, lossless, note = [], [], True, None
    for prompt in PROMPTS[: args.prompts]:
        for seed in range(args.seeds):
            body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": args.max_tokens, "temperature": args.temperature, "seed": seed, "speculative": spec}
            resp = client.post("/v1/chat/completions", json=body)
            if resp.status_code != 200:
                note = resp.json()["error"]["message"]
                break
            usage = resp.json()["usage"]
            block = usage["speculative"]
            totals["drafted"] += block["draft_tokens"]
            totals["accepted"] += block["accepted_tokens"]
            totals["tokens"] += usage["completion_tokens"]
            totals["rounds"] += block["rounds"]
            lossless = lossless and block["lossless"]
            if not block["lossless"]:
                bounds.append((block["bias_bound_mean"], usage["completion_tokens"]))
                errors.append((block["reconstruction_error_mean"], usage["completion_tokens"]))
        if note:
            break
    progress(f"eval: {name}: {'skipped: ' + note if note else 'done'}")
    return {
        "setting": name,
        "skipped": note,
        "acceptance": totals["accepted"] / totals["drafted"] if totals["drafted"] else None,
        "mean_accepted_length": totals["tokens"] / totals["rounds"] if totals["rounds"] else None,
        "tokens": totals["tokens"],
        "lossless": lossless if not note else None,
        "tv_measured": _weighted(errors),
        "tv_bound": _weighted(bounds),
    }


def _weighted(pairs: list[tuple[float | None, int]]) -> float | None:
    """The mean of per-response means, weighted by each response's tokens."""
    known = [(v, n) for v, n in pairs if v is not None]
    total = sum(n for _, n in known)
    return sum(v * n for v, n in known) / total if total else None


def _print(rows: list[dict[str, Any]]) -> None:
    def fmt(value: float | None, spec: str = ".3f") -> str:
        return "–" if value is None else format(value, spec)

    print(f"{'setting':<24} {'acceptance':>10} {'tokens/round':>12} {'lossless':>8} {'TV measured':>11} {'TV bound':>9}")
    for r in rows:
        if r["skipped"]:
            print(f"{r['setting']:<24} skipped: {r['skipped']}")
            continue
        print(
            f"{r['setting']:<24} {fmt(r['acceptance']):>10} {fmt(r['mean_accepted_length'], '.2f'):>12} "
            f"{'yes' if r['lossless'] else 'no':>8} {fmt(r['tv_measured'], '.4f'):>11} {fmt(r['tv_bound'], '.4f'):>9}"
        )
