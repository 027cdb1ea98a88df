"""``specgate law``: does a gateway's output follow its target? The joint law of the first two tokens of
seeded answers against the target GGUF evaluated by llama-cpp-python itself, by chi-square (docs/modes.md);
the prompt goes as llama.cpp's token ids, so both read the same tokens. Usage: ``specgate law [--url URL |
--serve] [--speculative JSON]...``"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import numpy as np
import torch

from clients.bench.common import progress, write_json
from clients.eval import _auth, _gateway

PROMPT = "The three longest rivers in the world are"
MIN_EXPECTED = 5.0  # a chi-square cell expected fewer times than this is pooled
ROW_MASS = 1e-4  # first tokens below this mass share one cell, (−1, None)

Pair = tuple[int, int | None]  # the first two tokens; None: the answer ended after the first


def check_law(args: argparse.Namespace) -> int:
    from llama_cpp import Llama  # the reference: the GGUF itself, through llama.cpp's own API

    from core.runners.models import builtin_gguf

    gguf = args.gguf or str(builtin_gguf())
    reference = Llama(
        model_path=gguf, n_ctx=512, logits_all=True, verbose=False, n_threads=args.threads, flash_attn=True
    )
    prompt = reference.tokenize(args.prompt.encode(), add_bos=False, special=True)
    specs = [json.loads(text) for text in args.speculative] if args.speculative else [None]
    expected = _reference_law(reference, prompt, args.temperature, reference.token_eos())
    runs: list[dict[str, Any]] = []
    with _gateway(args) as url:
        if url is None:
            return 1
        for spec in specs:
            pairs = _answers(url, prompt, spec, args)
            if not pairs:
                return 1
            observed = Counter(pairs)
            statistic, dof, pvalue = chi_square(observed, expected, len(pairs))
            tv, floor = first_token_tv(observed, expected, len(pairs)), tv_floor(expected, len(pairs))
            runs.append(
                {
                    "speculative": spec,
                    "samples": len(pairs),
                    "chi_square": statistic,
                    "degrees_of_freedom": dof,
                    "p_value": pvalue,
                    "first_token_tv": tv,
                    "first_token_tv_floor": floor,
                    "pairs": [list(pair) for pair in pairs],
                }
            )
            print(
                f"{len(pairs)} answers, {json.dumps(spec)}: chi-square {statistic:.1f} on {dof} "
                f"degrees of freedom, p = {pvalue:.3g}; "
                f"first token's empirical TV to the target {tv:.4f} (noise floor at {len(pairs)} "
                f"draws {floor:.4f})",
                flush=True,
            )
    write_json(
        args.json_path,
        {
            "url": url,
            "gguf": gguf,
            "prompt": args.prompt,
            "prompt_ids": prompt,
            "temperature": args.temperature,
            "max_tokens": args.max_tokens,
            "runs": runs,
        },
    )
    return 0


def _answers(
    url: str, prompt: list[int], spec: dict[str, Any] | None, args: argparse.Namespace
) -> list[Pair]:
    """The first two tokens of ``--samples`` answers (seeds 0, 1, …), as token ids; each ``--max-tokens`` long
    (a gateway drafts at most max_tokens − 1 tokens a round: a deeper tree needs more to be drafted whole)."""
    with httpx.Client(base_url=url, timeout=httpx.Timeout(600, connect=10), headers=_auth()) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]

        def one(seed: int) -> Pair:
            body: dict[str, Any] = {
                "model": model,
                "prompt": prompt,
                "max_tokens": args.max_tokens,
                "temperature": args.temperature,
                "seed": seed,
                "logprobs": 0,
                "return_tokens_as_token_ids": True,
            }
            if spec is not None:
                body["speculative"] = spec
            resp = client.post("/v1/completions", json=body)
            if resp.status_code != 200:
                raise RuntimeError(resp.json()["error"]["message"])
            ids = [int(t.split(":")[1]) for t in resp.json()["choices"][0]["logprobs"]["tokens"]]
            return ids[0], ids[1] if len(ids) > 1 else None

        pairs: list[Pair] = []
        try:
            with ThreadPoolExecutor(args.concurrency) as pool:
                for i, pair in enumerate(pool.map(one, range(args.samples))):
                    pairs.append(pair)
                    if (i + 1) % 250 == 0:
                        progress(f"law: {i + 1}/{args.samples} answers")
        except RuntimeError as exc:
            print(f"specgate law: the gateway refused the request: {exc}", file=sys.stderr)
            return []
    return pairs


def _probs(reference: Any, tokens: list[int], temperature: float) -> np.ndarray:  # [V] float64
    reference.reset()
    reference.eval(tokens)
    logits = np.asarray(reference.scores[len(tokens) - 1], dtype=np.float64) / temperature
    p = np.exp(logits - logits.max())
    return p / p.sum()


def _reference_law(reference: Any, prompt: list[int], temperature: float, eos: int) -> dict[Pair, float]:
    """p(a) p(b | a) for every first token of mass ≥ ROW_MASS; the rest of the first tokens' mass
    under (−1, None), the one cell of first tokens without a row. Chosen from the target alone."""
    first = _probs(reference, prompt, temperature)
    rows = [int(a) for a in np.nonzero(first >= ROW_MASS)[0]]
    law: dict[Pair, float] = {(-1, None): float(first.sum() - first[rows].sum())}
    for i, a in enumerate(rows):
        if a == eos:
            law[(a, None)] = float(first[a])
            continue
        second = _probs(reference, [*prompt, a], temperature)
        for b in np.nonzero(second > 0)[0]:
            law[(a, int(b))] = float(first[a] * second[b])
        if (i + 1) % 20 == 0:
            progress(f"law: reference rows {i + 1}/{len(rows)}")
    return law


def chi_square(
    observed: Counter[Pair], expected: dict[Pair, float], samples: int
) -> tuple[float, int, float]:
    """Pearson's statistic over cells expected ≥ MIN_EXPECTED times (from ``expected`` alone), rare cells
    pooled per first token, then all together; its degrees of freedom and p-value (regularised upper
    incomplete gamma)."""
    cells: dict[Any, list[float]] = {}
    for pair, mass in expected.items():
        key = pair if mass * samples >= MIN_EXPECTED else ("rare", pair[0])
        cells.setdefault(key, [0.0, 0.0])[1] += mass * samples
    rows = {a for a, _ in expected}
    for pair, count in observed.items():
        if pair[0] not in rows:
            pair = (-1, None)
        key = pair if pair in cells else ("rare", pair[0])
        cells.setdefault(key, [0.0, 0.0])[0] += count
    rare = [cells.pop(key) for key in [k for k, (_, e) in cells.items() if e < MIN_EXPECTED]]
    pooled = [sum(o for o, _ in rare), sum(e for _, e in rare)]
    if any(pooled):
        cells[("pooled",)] = pooled
    statistic = sum((o - e) ** 2 / e if e > 0 else math.inf for o, e in cells.values())
    dof = len(cells) - 1
    pvalue = float(
        torch.special.gammaincc(
            torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(statistic / 2, dtype=torch.float64)
        )
    )
    return statistic, dof, pvalue


def _first_token_law(expected: dict[Pair, float]) -> dict[int, float]:
    target: dict[int, float] = {}
    for (a, _), mass in expected.items():
        target[a] = target.get(a, 0.0) + mass
    return target


def first_token_tv(observed: Counter[Pair], expected: dict[Pair, float], samples: int) -> float:
    """TV between the first token's empirical law and the target's (first tokens without a row: one cell,
    −1)."""
    target = _first_token_law(expected)
    seen: Counter[int] = Counter()
    for (a, _), count in observed.items():
        seen[a if a in target else -1] += count
    return 0.5 * sum(abs(seen[a] / samples - target.get(a, 0.0)) for a in {*seen, *target})


def tv_floor(expected: dict[Pair, float], samples: int, draws: int = 200) -> float:
    """The median first-token TV of ``samples`` seeded draws from the target: a lossless gateway's at this
    many."""
    target = _first_token_law(expected)
    mass = np.array(list(target.values()))
    counts = np.random.default_rng(0).multinomial(samples, mass / mass.sum(), size=draws)
    return float(np.median(0.5 * np.abs(counts / samples - mass).sum(axis=1)))
