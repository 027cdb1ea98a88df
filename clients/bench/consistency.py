"""``specgate bench consistency``: what long prompts keep (issue 58). A real gateway on two replicas of the
built-in target, each worker and the draft on ``--threads`` threads (where llama.cpp's kernels differ by
thread count), news-like prompts of 300 to 1,500 tokens that this run makes itself:

- **greedy**: every mode and drafter at T = 0, ``--tokens`` tokens, against ``autoregressive`` on the same
  prompt —
  with the late draft (the default: the draft prefills while the first round goes without it) and with a draft
  ready at once (``draft.background_prefill_from: null``);
- **seeded**: ``--seeded`` prompts at T = 1 with a seed, each alone, then all at once beside four short
  streams,
  then all at once again while the replica holding most of them is killed (SIGKILL; their sessions go on at
  the other from zero) — each text against the one it got alone.

A lossless mode at T = 0 returns the target's greedy text, and a seed gives the same text whatever else runs:
each count below says on how many prompts that held."""

from __future__ import annotations

import argparse
import asyncio
import random
from contextlib import ExitStack
from typing import Any

import httpx

from clients.bench.common import Bar, finish, progress, setup, start_gateway
from clients.chat import parse_data_line
from clients.procs import ServerProcess, WorkerProcess
from core.config import builtin_config
from core.cores import usable_cores

EXACT = {"draft_top_k": 32}  # exact's sparse payload needs a truncated draft
CONFIGS: dict[str, dict[str, Any]] = {
    "autoregressive": {"mode": "autoregressive"},
    "aggregate": {"mode": "aggregate", "k": "full"},
    "split": {"mode": "split"},
    "exact": {"mode": "exact", **EXACT},
    "tree": {"mode": "tree"},
    "tree-exact": {"mode": "tree", "tree": {"payload": "exact"}, **EXACT},
    "lookup": {"mode": "exact", "drafter": "lookup", **EXACT},
    "model+lookup": {"mode": "exact", "drafter": "model+lookup", **EXACT},
    "overlap": {"mode": "exact", "overlap": True, **EXACT},
}
TIMINGS = {"late draft": 64, "draft at once": None}  # draft.background_prefill_from per gateway
MAX_PROMPT = 1_600  # the gateways' limits.max_prompt_tokens

_CITIES = ("Harbourton", "Millbridge", "Eastvale", "Corran", "Saltmarsh", "Kestrel Bay", "Dunmore", "Ashford")
_BODIES = (
    "the city council",
    "the port authority",
    "the regional water board",
    "the teachers' union",
    "the transport agency",
    "the hospital trust",
)
_THINGS = (
    "a new bridge",
    "the flood barrier",
    "a school building programme",
    "the tram extension",
    "a desalination plant",
    "the old grain market",
)
_VERBS = ("approved", "delayed", "questioned", "defended", "cut the budget of", "asked for a review of")
_PEOPLE = (
    "a spokesperson",
    "the finance director",
    "an engineer on the project",
    "a local shop owner",
    "the opposition leader",
    "a resident of forty years",
)
_SAYINGS = (
    "the costs had been underestimated from the start",
    "the work would finish before the winter storms",
    "nobody had asked the people who live nearby",
    "the figures would be published in full next month",
    "the decision was the only responsible one",
    "the town could not afford another year of delay",
)
_TASKS = (
    "Summarise the news article below in three sentences.",
    "Read the passage and answer: what did the officials decide, and who disagreed?",
    "List the three most important facts in this report.",
    "Write a headline and a one-paragraph summary of the following story.",
)


def mode_list(text: str) -> list[str]:
    """``--modes``: comma-separated names of ``CONFIGS``, autoregressive first (the greedy reference) whether
    named or not."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown mode {unknown[0]!r}: choose from {', '.join(CONFIGS)}")
    return ["autoregressive", *(n for n in names if n != "autoregressive")]


def article(tokenizer: Any, length: int, index: int) -> str:
    """A news-like user message whose chat prompt is about ``length`` tokens; ``index`` picks its words and
    its task."""
    rng = random.Random(f"article-{index}")
    city = rng.choice(_CITIES)
    lines = [_TASKS[index % len(_TASKS)], "", f"{city} (report {index}) -"]
    while len(chat_ids(tokenizer, "\n".join(lines))) < length:
        lines.append(
            f"On {rng.choice(('Monday', 'Tuesday', 'Wednesday', 'Thursday', 'Friday'))}, "
            f"{rng.choice(_BODIES)} {rng.choice(_VERBS)} "
            f"{rng.choice(_THINGS)}, which is expected to cost {rng.randint(2, 90)} million. "
            f"{rng.choice(_PEOPLE).capitalize()} "
            f"said that {rng.choice(_SAYINGS)}, while {rng.choice(_PEOPLE)} told reporters that "
            f"{rng.choice(_SAYINGS)}."
        )
    return "\n".join(lines)


def chat_ids(tokenizer: Any, text: str) -> list[int]:
    return list(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )


def lengths(count: int, shortest: int = 300, longest: int = 1_500) -> list[int]:
    """``count`` prompt lengths spread over [shortest, longest]."""
    return [shortest + (longest - shortest) * i // max(count - 1, 1) for i in range(count)]


def gateway_config(
    replicas: list[str],
    threads: int,
    late_from: int | None,
    memory_cap_mb: int | None = None,
    read_timeout_s: float = 30.0,
) -> Any:
    """The built-in gateway on one target with ``replicas``, its draft on ``threads`` threads (and
    ``memory_cap_mb``); ``read_timeout_s``: the shipped default (a worker slower than it is waited for while
    it progresses)."""
    base = builtin_config()
    data = base.model_dump(mode="json", exclude_none=True)
    data["draft"] = {**data["draft"], "threads": threads, "background_prefill_from": late_from}
    if memory_cap_mb:
        data["draft"]["memory_cap_mb"] = memory_cap_mb
    data["workers"] = [{"urls": replicas, "weight": 1.0, "read_timeout_s": read_timeout_s}]
    data["limits"] = {**data["limits"], "max_prompt_tokens": MAX_PROMPT}
    return type(base)(**data)


async def complete(
    client: httpx.AsyncClient,
    prompt: str,
    spec: dict[str, Any],
    max_tokens: int,
    temperature: float,
    seed: int | None = None,
    on_token: Any = None,
) -> str:
    """One streamed chat answer of exactly ``max_tokens`` tokens (``ignore_eos``): its text; ``on_token(n)``
    after the n-th chunk."""
    body: dict[str, Any] = {
        "model": "specgate",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": temperature,
        "ignore_eos": True,
        "stream": True,
        "speculative": spec,
    }
    if seed is not None:
        body["seed"] = seed
    text, chunks = "", 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"{resp.status_code}: {(await resp.aread()).decode()[:300]}")
        async for line in resp.aiter_lines():
            event = parse_data_line(line)
            if isinstance(event, dict) and "error" in event:
                raise RuntimeError(f"stream error: {event['error']}")
            if (
                isinstance(event, dict)
                and event.get("choices")
                and event["choices"][0]["delta"].get("content")
            ):
                text += event["choices"][0]["delta"]["content"]
                chunks += 1
                if on_token is not None:
                    on_token(chunks)
    return text


async def all_at_once(
    base: str,
    prompts: list[str],
    spec: dict[str, Any],
    max_tokens: int,
    seed: int,
    short: int,
    on_token: Any = None,
) -> list[str]:
    """The seeded ``prompts`` at once, beside ``short`` short unseeded streams started just before them; their
    texts."""
    async with httpx.AsyncClient(base_url=base, timeout=1800) as client:
        beside = [
            asyncio.create_task(
                complete(client, f"Story {i}: a day at the harbour.", spec, 3 * max_tokens, 1.0)
            )
            for i in range(short)
        ]
        texts = await asyncio.gather(
            *(complete(client, p, spec, max_tokens, 1.0, seed, on_token) for p in prompts)
        )
        await asyncio.gather(*beside)
    return list(texts)


async def one_by_one(
    base: str, prompts: list[str], spec: dict[str, Any], max_tokens: int, temperature: float, seed: int | None
) -> list[str]:
    async with httpx.AsyncClient(base_url=base, timeout=1800) as client:
        return [await complete(client, p, spec, max_tokens, temperature, seed) for p in prompts]


def sessions(url: str) -> float:
    """A worker's live sessions (its ``specgate:sessions`` gauge); 0 if it does not answer."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=5).text
    except httpx.HTTPError:
        return 0.0
    line = next(
        (ln for ln in text.splitlines() if ln.startswith("specgate:sessions ")), "specgate:sessions 0"
    )
    return float(line.split()[1])


def agreement(texts: list[str], against: list[str]) -> dict[str, Any]:
    """How many texts equal their reference, and where the first that does not parts from it."""
    same = sum(a == b for a, b in zip(texts, against))
    first = next(((i, a, b) for i, (a, b) in enumerate(zip(texts, against)) if a != b), None)
    out: dict[str, Any] = {"same": same, "of": len(texts)}
    if first is not None:
        i, a, b = first
        at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        out["first_difference"] = {
            "prompt": i,
            "at_char": at,
            "got": a[max(0, at - 20) : at + 40],
            "expected": b[max(0, at - 20) : at + 40],
        }
    return out


def bench_consistency(args: argparse.Namespace) -> int:
    from core.runners.models import resolve_model
    from core.runners.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model("builtin"))
    configs = {name: CONFIGS[name] for name in args.modes}
    greedy_prompts = [article(tokenizer, n, i) for i, n in enumerate(lengths(args.prompts))]
    seeded_prompts = [article(tokenizer, n, 100 + i) for i, n in enumerate(lengths(args.seeded))]
    threads = args.threads or usable_cores()
    memory = ["--memory-cap-mb", str(args.memory_cap_mb)] if args.memory_cap_mb else []
    plan = {
        "links": [],
        "modes": list(configs),
        "prompts": args.prompts,
        "seeded": args.seeded,
        "tokens": args.tokens,
        "seeded_tokens": args.seeded_tokens,
        "threads": threads,
        "seed": args.seed,
        "short_streams": args.short,
        "memory_cap_mb": args.memory_cap_mb,
    }
    results: dict[str, Any] = {
        "setup": setup(
            plan,
            prompt_tokens=[len(chat_ids(tokenizer, p)) for p in greedy_prompts],
            seeded_prompt_tokens=[len(chat_ids(tokenizer, p)) for p in seeded_prompts],
        ),
        "greedy": {},
        "seeded": {},
    }
    bar = Bar(len(TIMINGS) * len(configs) + 3 * len(configs))
    with ExitStack() as stack:
        progress(
            f"bench consistency: two replicas of the built-in target, {threads} threads each, "
            f"and the draft on {threads}"
        )
        servers = {}
        for _ in range(2):
            server = WorkerProcess("builtin", "llama.cpp", threads=threads, extra=memory)
            servers[stack.enter_context(server)] = server
        workers = list(servers)
        gateways = {
            name: start_gateway(stack, gateway_config(workers, threads, late, args.memory_cap_mb))
            for name, late in TIMINGS.items()
        }
        reference: list[str] | None = None
        for timing, base in gateways.items():
            for name, spec in configs.items():
                texts = asyncio.run(one_by_one(base, greedy_prompts, spec, args.tokens, 0.0, None))
                # the first cell: autoregressive, late draft
                reference = texts if reference is None else reference
                results["greedy"].setdefault(name, {})[timing] = agreement(texts, reference)
                bar.step(
                    f"greedy {timing} {name}: "
                    f"{results['greedy'][name][timing]['same']}/{len(texts)} as autoregressive"
                )
        base = gateways["late draft"]
        for name, spec in configs.items():
            alone = asyncio.run(one_by_one(base, seeded_prompts, spec, args.seeded_tokens, 1.0, args.seed))
            bar.step(f"seeded alone {name}")
            together = asyncio.run(
                all_at_once(base, seeded_prompts, spec, args.seeded_tokens, args.seed, args.short)
            )
            bar.step(
                f"seeded at once {name}: {sum(a == b for a, b in zip(together, alone))}/{len(alone)} as alone"
            )
            failed_over, killed = asyncio.run(
                with_a_failover(
                    stack, servers, base, seeded_prompts, spec, args.seeded_tokens, args.seed, threads, memory
                )
            )
            results["seeded"][name] = {
                "at_once": agreement(together, alone),
                "failover": agreement(failed_over, alone) | {"killed": killed},
            }
            bar.step(
                f"seeded failover {name}: {results['seeded'][name]['failover']['same']}/{len(alone)} as alone"
            )
    return finish(results, args, _print)


async def with_a_failover(
    stack: ExitStack,
    servers: dict[str, ServerProcess],
    base: str,
    prompts: list[str],
    spec: dict[str, Any],
    max_tokens: int,
    seed: int,
    threads: int,
    extra: list[str] | None = None,
    restart: bool = True,
) -> tuple[list[str], int]:
    """The seeded prompts at once; once every stream has a token, the replica holding most of their sessions
    is killed (SIGKILL), then (``restart``) started again on its port for the next cell. Its texts, and how
    many sessions it held (0: none killed)."""
    started: set[int] = set()
    killed: list[tuple[str, float]] = []

    def progressed(index: int) -> Any:
        def note(chunks: int) -> None:
            started.add(index)
            if len(started) == len(prompts) and not killed:
                held = {url: sessions(url) for url in servers}
                holder = max(held, key=held.__getitem__)
                killed.append((holder, held[holder]))
                proc = servers[holder].proc
                assert proc is not None
                proc.kill()

        return note

    async with httpx.AsyncClient(base_url=base, timeout=1800) as client:
        texts = await asyncio.gather(
            *(complete(client, p, spec, max_tokens, 1.0, seed, progressed(i)) for i, p in enumerate(prompts))
        )
    for url, _ in killed if restart else []:
        proc = servers[url].proc
        assert proc is not None
        proc.wait(timeout=30)
        servers[url] = WorkerProcess(
            "builtin", "llama.cpp", port=int(url.rsplit(":", 1)[1]), threads=threads, extra=extra or []
        )
        stack.enter_context(servers[url])
        await asyncio.sleep(1.0)  # the gateway's breaker lets it back in
    return list(texts), int(killed[0][1]) if killed else 0


def _print(results: dict[str, Any]) -> None:
    timings = list(TIMINGS)
    print(
        f"\ngreedy: the same {results['setup']['tokens']} tokens as autoregressive (prompts of "
        f"{min(results['setup']['prompt_tokens'])}"
        f"-{max(results['setup']['prompt_tokens'])} tokens)"
    )
    print(f"{'mode':<16}" + "".join(f"{t:>16}" for t in timings))
    for name, cells in results["greedy"].items():
        print(
            f"{name:<16}"
            + "".join(f"{cells[t]['same']:>13}/{cells[t]['of']:<2}" for t in timings if t in cells)
        )
    print(
        f"\nseeded (T = 1): the text each prompt gets alone ({results['setup']['seeded']} "
        f"prompts, {results['setup']['seeded_tokens']} tokens)"
    )
    print(f"{'mode':<16}{'all at once':>16}{'failover':>16}")
    for name, cells in results["seeded"].items():
        print(
            f"{name:<16}{cells['at_once']['same']:>13}/{cells['at_once']['of']:<2}"
            f"{cells['failover']['same']:>13}/{cells['failover']['of']:<2}"
        )
