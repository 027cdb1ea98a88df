"""``specgate law``: does a gateway's output follow its target? The joint law of the first two
tokens of N seeded answers at T > 0, against the target GGUF evaluated by llama-cpp-python itself
(not specgate's runner), with a chi-square test.

The prompt is sent as token ids (llama.cpp's tokenization of ``--prompt``), so gateway and
reference read the same tokens. The reference law is p(a) p(b | a) at temperature T from the
GGUF's own logits: every first token a of mass ≥ 1e-4 or seen in the answers gets its second
row; cells expected fewer than 5 times are pooled per first token, then all together (a
chi-square law needs no cell that rare). A lossless gateway gives a p-value spread uniformly
over (0, 1); a biased one, a p-value near 0 that shrinks as ``--samples`` grows.

Usage: ``specgate law [--url http://127.0.0.1:8000 | --serve [--config F]] [--gguf PATH]
[--speculative JSON] [--samples 1500] [--json FILE]``
"""

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

from clients.eval import _auth, _gateway
from clients.report import progress, write_json

PROMPT = "The three longest rivers in the world are"
MIN_EXPECTED = 5.0  # a chi-square cell expected fewer times than this is pooled
ROW_MASS = 1e-4  # first tokens below this mass and never seen share one pooled cell

Pair = tuple[int, int | None]  # the first two tokens; None: the answer ended after the first


def check_law(args: argparse.Namespace) -> int:
    from llama_cpp import Llama  # the reference: the GGUF itself, through llama.cpp's own API

    from core.runners.models import builtin_gguf

    gguf = args.gguf or str(builtin_gguf())
    reference = Llama(model_path=gguf, n_ctx=512, logits_all=True, verbose=False, n_threads=args.threads, flash_attn=True)
    prompt = reference.tokenize(args.prompt.encode(), add_bos=False, special=True)
    spec = json.loads(args.speculative) if args.speculative else None
    with _gateway(args) as url:
        if url is None:
            return 1
        pairs = _answers(url, prompt, spec, args)
    if not pairs:
        return 1
    eos = reference.token_eos()
    observed = Counter(pairs)
    expected = _reference_law(reference, prompt, args.temperature, {a for a, _ in pairs}, eos)
    statistic, dof, pvalue = _chi_square(observed, expected, len(pairs))
    results = {
        "url": url, "gguf": gguf, "prompt": args.prompt, "prompt_ids": prompt, "speculative": spec, "temperature": args.temperature,
        "samples": len(pairs), "chi_square": statistic, "degrees_of_freedom": dof, "p_value": pvalue,
        "first_token_tv": _first_token_tv(observed, expected, len(pairs)),
    }
    print(f"{len(pairs)} answers, {json.dumps(spec)}: chi-square {statistic:.1f} on {dof} degrees of freedom, p = {pvalue:.3g}; "
          f"TV of the first token's empirical law to the target {results['first_token_tv']:.4f}")
    write_json(args.json_path, results)
    return 0


def _answers(url: str, prompt: list[int], spec: dict[str, Any] | None, args: argparse.Namespace) -> list[Pair]:
    """The first two tokens of ``--samples`` seeded answers (seeds 0, 1, …), as token ids."""
    with httpx.Client(base_url=url, timeout=httpx.Timeout(600, connect=10), headers=_auth()) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]

        def one(seed: int) -> Pair:
            body: dict[str, Any] = {
                "model": model, "prompt": prompt, "max_tokens": 2, "temperature": args.temperature, "seed": seed,
                "logprobs": 0, "return_tokens_as_token_ids": True,
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


def _reference_law(reference: Any, prompt: list[int], temperature: float, seen: set[int], eos: int) -> dict[Pair, float]:
    """p(a) p(b | a) for every first token worth a row; the rest of the first tokens' mass under
    (−1, None), the pooled cell of first tokens without a row."""
    first = _probs(reference, prompt, temperature)
    rows = sorted({int(a) for a in np.nonzero(first >= ROW_MASS)[0]} | seen)
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


def _chi_square(observed: Counter[Pair], expected: dict[Pair, float], samples: int) -> tuple[float, int, float]:
    """Pearson's statistic over cells expected ≥ MIN_EXPECTED times, rare cells pooled per first
    token and then all together; its degrees of freedom and p-value (the chi-square survival
    function, as the regularised upper incomplete gamma)."""
    cells: dict[Any, list[float]] = {}
    for pair, mass in expected.items():
        key = pair if mass * samples >= MIN_EXPECTED else ("rare", pair[0])
        cells.setdefault(key, [0.0, 0.0])[1] += mass * samples
    for pair, count in observed.items():
        key = pair if pair in cells else ("rare", pair[0]) if ("rare", pair[0]) in cells else ("rare", -1)
        cells.setdefault(key, [0.0, 0.0])[0] += count
    pooled = [0.0, 0.0]
    for key in [k for k, (_, e) in cells.items() if e < MIN_EXPECTED]:
        o, e = cells.pop(key)
        pooled[0] += o
        pooled[1] += e
    if pooled[1] > 0 or pooled[0] > 0:
        cells[("pooled",)] = pooled
    statistic = sum((o - e) ** 2 / e if e > 0 else math.inf for o, e in cells.values())
    dof = len(cells) - 1
    pvalue = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(statistic / 2, dtype=torch.float64)))
    return statistic, dof, pvalue


def _first_token_tv(observed: Counter[Pair], expected: dict[Pair, float], samples: int) -> float:
    seen: Counter[int] = Counter()
    for (a, _), count in observed.items():
        seen[a] += count
    target: dict[int, float] = {}
    for (a, _), mass in expected.items():
        if a >= 0:
            target[a] = target.get(a, 0.0) + mass
    return 0.5 * sum(abs(seen[a] / samples - target.get(a, 0.0)) for a in {*seen, *target})
