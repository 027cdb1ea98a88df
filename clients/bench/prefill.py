"""``specgate bench prefill``: long prompts (issue 49). Time to the first token per prompt token, by mode,
against the target alone prefilling the same prompt (llama.cpp on the worker's GGUF and threads, the link's
delay added), at each link; prompts of 250 to 2,000 tokens that the gateway has never seen (each begins with
its own nonce: no prompt cache hides a prefill); with ``--tokens`` above 2, each answer's time per token after
the first (the rounds on a long context). Then the running streams: the inter-token latency of streams that
decode while a long prompt arrives, against the same streams without it (p50 / p99), once per run."""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import random
import statistics
import time
from contextlib import ExitStack, closing
from typing import Any

import httpx

from clients.bench.common import LINKS, Bar, finish, progress, setup, start_gateway
from clients.bench.floors import LlamaFloor
from clients.chat import parse_data_line
from clients.procs import WorkerProcess
from core.config import LinkConfig, builtin_config
from core.cores import usable_cores

MODES = {"autoregressive": {"mode": "autoregressive"}, "exact": {"mode": "exact"}, "tree": {"mode": "tree"}}
WORDS = (
    "the river carried silt past old mills while farmers measured rain and traders argued over "
    "grain prices in "
    "crowded markets where children learned numbers from merchants and scribes copied letters "
    "for distant cousins"
).split()
REQUEST_MAX_TOKENS = 4  # the first token is what is timed (``--tokens``)
MAX_PROMPT = 2_100  # the gateway's limits.max_prompt_tokens for the bench


def long_prompt(tokenizer: Any, length: int, nonce: str) -> str:
    """A user message whose chat prompt is about ``length`` tokens, starting with a hash of ``nonce`` (two
    nonces share no prefix past the template)."""
    rng = random.Random(nonce)
    words = [hashlib.sha256(nonce.encode()).hexdigest()[:12]]
    template = len(_chat_ids(tokenizer, ""))
    while template + len(tokenizer.encode(" ".join(words), add_special_tokens=False)) < length:
        words += rng.sample(WORDS, 8)
    return " ".join(words)


def _chat_ids(tokenizer: Any, text: str) -> list[int]:
    return list(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )


def _ttft(
    client: httpx.Client, prompt: str, spec: dict[str, Any], max_tokens: int = REQUEST_MAX_TOKENS
) -> tuple[float, int, int | None, float | None]:
    """One streamed request of ``max_tokens`` (``ignore_eos``): seconds to its first content chunk, its prompt
    tokens, its rounds without a draft (a late draft's), and its seconds per token after the first (None below
    3 tokens)."""
    body = {
        "model": "specgate",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "speculative": spec,
    }
    started, first, prompt_tokens, waited, last, tokens = time.perf_counter(), None, 0, None, 0.0, 0
    with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            event = parse_data_line(line)
            if not isinstance(event, dict):
                continue
            if any(c["delta"].get("content") for c in event.get("choices", [])):
                last = time.perf_counter() - started
                first = last if first is None else first
            if event.get("usage"):
                prompt_tokens, tokens = event["usage"]["prompt_tokens"], event["usage"]["completion_tokens"]
                waited = event["usage"]["speculative"].get("rounds_without_draft")
    after = (last - first) / (tokens - 1) if first is not None and tokens > 2 else None
    return (first if first is not None else time.perf_counter() - started), prompt_tokens, waited, after


def bench_prefill(args: argparse.Namespace) -> int:
    from core.runners.models import resolve_model
    from core.runners.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model("builtin"))
    links = [LINKS[0], ("50 ms", LinkConfig(rtt_ms=50))] if not args.quick else [LINKS[0]]
    lengths = [250, 1000] if args.quick else args.lengths
    runs = 1 if args.quick else args.runs
    config = builtin_config().with_split_cores(usable_cores())
    # the worker and the draft: a half of the cores each
    threads = args.threads or max(1, usable_cores() // 2)
    plan = {
        "links": links,
        "lengths": lengths,
        "modes": list(MODES),
        "runs": runs,
        "threads": threads,
        "streams": args.streams,
        "tokens": args.tokens,
    }
    results: dict[str, Any] = {"setup": setup(plan), "ttft": [], "alone": {}, "itl": []}
    bar = Bar(runs * len(links) * len(lengths) * (len(MODES) + 1) + 2 * runs)
    with ExitStack() as stack:
        worker = stack.enter_context(WorkerProcess("builtin", "llama.cpp", threads=threads))
        for link_name, link in links:
            data = config.model_dump(mode="json", exclude_none=True)
            data |= {
                "workers": [{"url": worker, "weight": 1.0, "link": link.model_dump()}],
                "limits": {**data["limits"], "max_prompt_tokens": MAX_PROMPT},
            }
            data["draft"] = {**data["draft"], "threads": threads}
            progress(f"bench prefill: a gateway at {link_name}")
            client = stack.enter_context(
                httpx.Client(base_url=start_gateway(stack, type(config)(**data)), timeout=900)
            )
            for run in range(runs):
                for length in lengths:
                    for mode, spec in MODES.items():  # the modes in turn, each on a prompt of its own
                        seconds, tokens, waited, after = _ttft(
                            client,
                            long_prompt(tokenizer, length, f"n{run}-{length}-{mode}-{link_name}"),
                            spec,
                            args.tokens,
                        )
                        results["ttft"].append(
                            {
                                "link": link_name,
                                "length": length,
                                "mode": mode,
                                "run": run,
                                "ttft_s": seconds,
                                "prompt_tokens": tokens,
                                "rounds_without_draft": waited,
                                "after_first_s_per_token": after,
                            }
                        )
                        bar.step(
                            f"{link_name} {length} {mode}: {seconds * 1e3 / max(tokens, 1):.2f} ms/token"
                        )
                    ids = _chat_ids(tokenizer, long_prompt(tokenizer, length, f"a{run}-{length}"))
                    with closing(LlamaFloor("builtin", threads, list(ids), n_ctx=MAX_PROMPT + 64)) as alone:
                        step = statistics.median(alone.draft_step_ms(0)) / 1e3
                        seconds = (
                            link.delay_s(2_000 + 8 * len(ids), upstream=True)
                            + link.delay_s(300, upstream=False)
                            + alone.prefill_ms / 1e3
                            + step
                        )
                    results["alone"].setdefault(link_name, []).append(
                        {"length": length, "run": run, "ttft_s": seconds, "prompt_tokens": len(ids)}
                    )
                    bar.step(f"{link_name} {length} alone: {seconds * 1e3 / len(ids):.2f} ms/token")
            if link_name == links[0][0]:
                results["itl"] = [
                    asyncio.run(_running_streams(client.base_url, tokenizer, args.streams, max(lengths), bar))
                    for _ in range(runs)
                ]
    return finish(results, args, _print)


async def _running_streams(
    base: httpx.URL, tokenizer: Any, streams: int, length: int, bar: Bar
) -> dict[str, Any]:
    """``streams`` greedy streams of 160 tokens, twice: alone, then with a ``length``-token prompt arriving at
    their 20th token."""

    async def stream(
        client: httpx.AsyncClient, index: int, gaps: list[float], reached: asyncio.Event | None
    ) -> None:
        body = {
            "model": "specgate",
            "messages": [{"role": "user", "content": f"Story {index}: tell a long tale of a river town."}],
            "max_tokens": 160,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
            "speculative": {"mode": "exact"},
        }
        last, count = None, 0
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            async for line in resp.aiter_lines():
                event = parse_data_line(line)
                if isinstance(event, dict) and any(
                    c["delta"].get("content") for c in event.get("choices", [])
                ):
                    now = time.perf_counter()
                    if last is not None and (reached is None or reached.is_set()):
                        gaps.append(now - last)
                    last, count = now, count + 1
                    if reached is not None and count == 20:
                        reached.set()

    out: dict[str, Any] = {}
    async with httpx.AsyncClient(base_url=base, timeout=900) as client:
        for label in ("without", "with"):
            gaps: list[float] = []
            reached = asyncio.Event() if label == "with" else None
            # before the streams: building it holds this loop ~1 s
            prompt = long_prompt(tokenizer, length, f"itl-{time.time_ns()}")
            tasks = [asyncio.create_task(stream(client, i, gaps, reached)) for i in range(streams)]
            long_ttft = None
            if reached is not None:
                await reached.wait()
                started = time.perf_counter()
                body = {
                    "model": "specgate",
                    "messages": [{"role": "user", "content": prompt}],
                    "max_tokens": 2,
                    "temperature": 0,
                }
                (await client.post("/v1/chat/completions", json=body)).raise_for_status()
                long_ttft = time.perf_counter() - started
            await asyncio.gather(*tasks)
            out[label] = {
                "itl_p50_s": _quantile(gaps, 50),
                "itl_p99_s": _quantile(gaps, 99),
                "gaps": len(gaps),
            }
            if long_ttft is not None:
                out[label]["long_prompt_s"] = long_ttft
            bar.step(
                f"{streams} streams {label} a {length}-token prompt: ITL p50 "
                f"{out[label]['itl_p50_s']} s, p99 {out[label]['itl_p99_s']} s"
            )
    return out


def _quantile(values: list[float], q: int) -> float | None:
    if len(values) < 2:
        return values[0] if values else None
    return round(statistics.quantiles(values, n=100, method="inclusive")[q - 1], 4)


def _print(results: dict[str, Any]) -> None:
    print(
        "link | prompt tokens | "
        + " | ".join(f"{m} ms/token" for m in MODES)
        + " | alone ms/token | "
        + " | ".join(f"{m} / autoregressive" for m in MODES if m != "autoregressive")
    )
    for link in results["setup"]["links"]:
        for length in results["setup"]["lengths"]:
            per = {
                m: [
                    r["ttft_s"] * 1e3 / max(r["prompt_tokens"], 1)
                    for r in results["ttft"]
                    if r["link"] == link and r["length"] == length and r["mode"] == m
                ]
                for m in MODES
            }
            alone = [
                r["ttft_s"] * 1e3 / r["prompt_tokens"]
                for r in results["alone"].get(link, [])
                if r["length"] == length
            ]
            med = {m: statistics.median(v) for m, v in per.items() if v}
            ratios = " | ".join(
                f"{med[m] / med['autoregressive']:.2f}×" for m in MODES if m != "autoregressive"
            )
            print(
                f"{link} | {length} | "
                + " | ".join(f"{med[m]:.2f}" for m in MODES)
                + f" | {statistics.median(alone):.2f} | {ratios}"
            )
    if any(r.get("after_first_s_per_token") for r in results["ttft"]):
        print(f"after the first token ({results['setup'].get('tokens')} a request): ms per token")
        print("link | prompt tokens | " + " | ".join(MODES))
        for link in results["setup"]["links"]:
            for length in results["setup"]["lengths"]:
                after = {
                    m: [
                        r["after_first_s_per_token"] * 1e3
                        for r in results["ttft"]
                        if r["link"] == link and r["length"] == length and r["mode"] == m
                    ]
                    for m in MODES
                }
                print(
                    f"{link} | {length} | "
                    + " | ".join(f"{statistics.median(v):.1f}" if v else "-" for v in after.values())
                )
    pairs = results.get("itl") or []
    for itl in pairs:
        print(
            "running streams' inter-token latency: without a long prompt p50 "
            f"{itl['without']['itl_p50_s']} s, p99 {itl['without']['itl_p99_s']} s; "
            f"with one p50 {itl['with']['itl_p50_s']} s, p99 {itl['with']['itl_p99_s']} s = "
            f"{_stall(itl):.2f}× the p50 without "
            f"(its answer in {itl['with'].get('long_prompt_s', 0):.2f} s)"
        )
    if pairs:
        print(
            f"p99 with a long prompt / p50 without, median of {len(pairs)} runs: "
            f"{statistics.median(_stall(itl) for itl in pairs):.2f}×"
        )


def _stall(itl: dict[str, Any]) -> float:
    """The streams' p99 during the long prefill over their median without it (issue 49: ≤ 3×)."""
    return float(itl["with"]["itl_p99_s"] / itl["without"]["itl_p50_s"])
