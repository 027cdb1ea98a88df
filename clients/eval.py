"""``specgate eval``: each decoding mode on a fixed prompt set against a gateway — acceptance, mean accepted
length, and for the lossy settings the measured distance to the target beside its bound (docs/modes.md,
"specgate eval"). Usage: ``specgate eval [--url http://127.0.0.1:8000 | --serve] [--json FILE]``"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

import httpx

from clients.bench.common import progress, write_json
from clients.procs import free_port, serve_process
from clients.prompts import PROMPTS as ALL_PROMPTS

PROMPTS = ALL_PROMPTS[:4]
SETTINGS: list[tuple[str, dict[str, Any]]] = [
    ("autoregressive", {"mode": "autoregressive"}),
    ("aggregate k=full", {"mode": "aggregate", "k": "full"}),
    ("aggregate k=32", {"mode": "aggregate", "k": 32}),
    ("aggregate k=8", {"mode": "aggregate", "k": 8}),
    ("aggregate k=8 residual", {"mode": "aggregate", "k": 8, "reconstruction": "residual"}),
    ("split", {"mode": "split"}),
    ("exact", {"mode": "exact"}),
    ("aggregate k=full relaxed τ≤0.5", {"mode": "aggregate", "k": "full", "relaxation": {"tau_max": 0.5}}),
    ("exact relaxed τ≤0.5", {"mode": "exact", "relaxation": {"tau_max": 0.5}}),
    ("exact relaxed τ≤0.9", {"mode": "exact", "relaxation": {"tau_max": 0.9}}),
]
STRICT = {
    "aggregate k=full relaxed τ≤0.5": "aggregate k=full",
    "exact relaxed τ≤0.5": "exact",
    "exact relaxed τ≤0.9": "exact",
}


def evaluate(args: argparse.Namespace) -> int:
    with _gateway(args) as url:
        if url is None:
            return 1
        with httpx.Client(base_url=url, timeout=httpx.Timeout(600, connect=10), headers=_auth()) as client:
            model = client.get("/v1/models").json()["data"][0]["id"]
            rows = [_run(client, model, name, spec, args) for name, spec in SETTINGS]
    _compare_with_strict(rows)
    results = {
        "url": url,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "prompts": len(PROMPTS[: args.prompts]),
        "seeds": args.seeds,
        "rows": rows,
    }
    _print(rows)
    write_json(args.json_path, results)
    return 0


@contextlib.contextmanager
def _gateway(args: argparse.Namespace) -> Iterator[str | None]:
    """The gateway to evaluate: ``--url``, or a ``specgate serve`` started for the run (None: none
    answers)."""
    if args.serve:
        with serve_process(args.config, free_port(), args.startup_timeout) as url:
            yield url
        return
    try:
        httpx.get(f"{args.url}/health", timeout=5)
    except httpx.HTTPError:
        print(f"specgate eval: no gateway at {args.url} (start one, or pass --serve)", file=sys.stderr)
        yield None
        return
    yield args.url


def _auth(key: str | None = None) -> dict[str, str] | None:
    """The bearer header of ``key``, else of $SPECGATE_API_KEY (None: no key)."""
    key = key or os.environ.get("SPECGATE_API_KEY")
    return {"authorization": f"Bearer {key}"} if key else None


def _run(
    client: httpx.Client, model: str, name: str, spec: dict[str, Any], args: argparse.Namespace
) -> dict[str, Any]:
    totals = {"drafted": 0, "accepted": 0, "tokens": 0, "rounds": 0}
    bounds, errors, relaxed, taus, lossless, note = [], [], [], [], True, None
    for prompt in PROMPTS[: args.prompts]:
        for seed in range(args.seeds):
            body = {
                "model": model,
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": args.max_tokens,
                "temperature": args.temperature,
                "seed": seed,
                "speculative": spec,
            }
            resp = client.post("/v1/chat/completions", json=body)
            if resp.status_code != 200:
                note = resp.json()["error"]["message"]
                break
            usage = resp.json()["usage"]
            block, n = usage["speculative"], usage["completion_tokens"]
            for key, value in (
                ("drafted", block["draft_tokens"]),
                ("accepted", block["accepted_tokens"]),
                ("tokens", n),
                ("rounds", block["rounds"]),
            ):
                totals[key] += value
            lossless = lossless and block["lossless"]
            if "relaxation" in block:  # exactly τ(1 − β) per position, on top of any reconstruction error
                relaxed.append((block["relaxed_tv_mean"], n))
                taus.append((block["tau_mean"], n))
                bounds.append(((block["bias_bound_mean"] or 0.0) + block["relaxation"]["tau_max"] / 4, n))
                errors.append(((block["reconstruction_error_mean"] or 0.0) + block["relaxed_tv_mean"], n))
            elif not block["lossless"]:
                bounds.append((block["bias_bound_mean"], n))
                errors.append((block["reconstruction_error_mean"], n))
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
        "relaxed_tv": _weighted(relaxed),
        "tau_mean": _weighted(taus),
    }


def _compare_with_strict(rows: list[dict[str, Any]]) -> None:
    """The relaxed rows' acceptance change against the strict row of their mode (same prompts and seeds)."""
    by_name = {r["setting"]: r for r in rows}
    for name, strict in STRICT.items():
        row, base = by_name.get(name), by_name.get(strict)
        if row is None or base is None or row["acceptance"] is None or base["acceptance"] is None:
            continue
        row["strict"] = strict
        row["acceptance_change"] = row["acceptance"] - base["acceptance"]
        row["accepted_length_ratio"] = row["mean_accepted_length"] / base["mean_accepted_length"]


def _weighted(pairs: list[tuple[float | None, int]]) -> float | None:
    """The mean of per-response means, weighted by each response's tokens."""
    known = [(v, n) for v, n in pairs if v is not None]
    total = sum(n for _, n in known)
    return sum(v * n for v, n in known) / total if total else None


def _print(rows: list[dict[str, Any]]) -> None:
    def fmt(value: float | None, spec: str = ".3f") -> str:
        return "–" if value is None else format(value, spec)

    print(
        f"{'setting':<31} {'acceptance':>10} {'vs strict':>9} {'tokens/round':>12} "
        f"{'lossless':>8} {'mean τ':>7} {'TV measured':>11} {'TV bound':>9}"
    )
    for r in rows:
        if r["skipped"]:
            print(f"{r['setting']:<31} skipped: {r['skipped']}")
            continue
        change = f"{r['acceptance_change']:+.3f}" if "acceptance_change" in r else ""
        print(
            f"{r['setting']:<31} {fmt(r['acceptance']):>10} {change:>9} "
            f"{fmt(r['mean_accepted_length'], '.2f'):>12} "
            f"{'yes' if r['lossless'] else 'no':>8} {fmt(r['tau_mean']):>7} "
            f"{fmt(r['tv_measured'], '.4f'):>11} {fmt(r['tv_bound'], '.4f'):>9}"
        )
