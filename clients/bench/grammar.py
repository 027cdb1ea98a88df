"""``specgate bench grammar``: the grammar engines installed (llguidance, ours; xgrammar where
``pip install xgrammar`` put it) on the built-in vocabulary, per grammar: the tokenizer set-up,
compile (cold, cached), a row's mask along a real answer (median, worst), accept, rollback 2, fork."""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from app.tools import Tool, generic_schema
from clients.bench.common import progress, write_json

V = 49152
EOS = 2
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 32},
        "age": {"type": "integer"},
        "city": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "married": {"type": "boolean"},
        "score": {"type": "number"},
    },
    "required": ["name", "age", "city", "tags", "married", "score"],
    "additionalProperties": False,
}
TOOLS = [
    Tool(
        "get_weather",
        "",
        {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
        },
    ),
    Tool(
        "get_time", "", {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}
    ),
]
GRAMMARS: dict[str, tuple[str, str, str]] = {  # name: (kind, source, an answer it accepts)
    "json_schema (6 fields)": (
        "json_schema",
        json.dumps(SCHEMA),
        '{"name":"Ada '
        'Lovelace","age":36,"city":"London","tags":["math","poetry"],"married":true,"score":9.5}',
    ),
    "tools (2, generic format)": (
        "json_schema",
        json.dumps(generic_schema(TOOLS, False, True)),
        '{"tool_calls":[{"name":"get_weather","arguments":{"city":"Paris","unit":"celsius"}}]}',
    ),
    "regex (phone)": ("regex", r"\+1-[0-9]{3}-[0-9]{3}-[0-9]{4}", "+1-555-123-4567"),
}


def bench_grammar(args: argparse.Namespace) -> int:
    from core.runners.models import resolve_model
    from core.runners.tokenizer import load_tokenizer

    torch.set_num_threads(1)
    tokenizer = load_tokenizer(resolve_model("builtin"))
    engines: dict[str, Callable[[Any, int], dict[str, Any]]] = {"llguidance": _llguidance}
    if importlib.util.find_spec("xgrammar") is not None:
        engines["xgrammar"] = _xgrammar
    else:
        progress("xgrammar is not installed: measuring llguidance alone (pip install xgrammar to compare)")
    results: dict[str, Any] = {"vocab_size": V, "repeats": args.repeats, "engines": {}}
    for name, measure in engines.items():
        progress(f"measuring {name}")
        results["engines"][name] = measure(tokenizer, args.repeats)
    print_table(results)
    write_json(args.json_path, results)
    return 0


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    out = fn()
    return (time.perf_counter() - started) * 1e3, out


def _llguidance(tokenizer: Any, repeats: int) -> dict[str, Any]:
    from core.grammar import GrammarKind, Grammars, GrammarSpec

    setup_ms, grammars = timed(lambda: Grammars(tokenizer, V, [EOS]))
    out: dict[str, Any] = {"tokenizer_setup_ms": setup_ms, "grammars": {}}
    for name, (kind, source, answer) in GRAMMARS.items():
        spec = GrammarSpec(GrammarKind(kind), source)
        cold = []
        for _ in range(repeats):
            grammars._cache.clear()  # cold: compiled again
            cold.append(timed(partial(grammars.compile, spec))[0])
        cached = [timed(partial(grammars.compile, spec))[0] for _ in range(repeats)]

        def start(spec: Any = spec) -> tuple[Callable[..., Any], ...]:
            matcher = grammars.compile(spec).matcher()
            return (
                matcher.allowed,
                matcher.consume,
                matcher.rollback,
                lambda: grammars.compile(spec).matcher(),
            )

        out["grammars"][name] = _row(cold, cached, tokenizer.encode(answer), repeats, start)
    return out


def _xgrammar(tokenizer: Any, repeats: int) -> dict[str, Any]:
    import xgrammar as xgr

    setup_ms, info = timed(lambda: xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=V))
    out: dict[str, Any] = {"tokenizer_setup_ms": setup_ms, "grammars": {}}
    bitmask, shifts = xgr.allocate_token_bitmask(1, V), torch.arange(32, dtype=torch.int32)
    for name, (kind, source, answer) in GRAMMARS.items():

        def compile_with(compiler: Any, kind: str = kind, source: str = source) -> Any:
            return (
                compiler.compile_json_schema(source, any_whitespace=False)
                if kind == "json_schema"
                else compiler.compile_regex(source)
            )

        cold = [
            timed(lambda: compile_with(xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)))[0]
            for _ in range(repeats)
        ]
        cached_compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True)
        compile_with(cached_compiler)
        cached = [timed(partial(compile_with, cached_compiler))[0] for _ in range(repeats)]
        compiled = compile_with(cached_compiler)

        def start(compiled: Any = compiled) -> tuple[Callable[..., Any], ...]:
            matcher = xgr.GrammarMatcher(compiled, max_rollback_tokens=64)

            def mask() -> torch.Tensor:  # the same [V] bool our Matcher.allowed returns
                matcher.fill_next_token_bitmask(bitmask)
                return ((bitmask[0, :, None] >> shifts) & 1).bool().flatten()[:V]

            return mask, matcher.accept_token, matcher.rollback, matcher.fork

        out["grammars"][name] = _row(cold, cached, tokenizer.encode(answer), repeats, start)
    return out


def _row(
    cold: list[float],
    cached: list[float],
    tokens: list[int],
    repeats: int,
    start: Callable[[], tuple[Callable[..., Any], ...]],
) -> dict[str, Any]:
    """The compiles' medians; per repeat a fresh matcher (``start``) along the answer: each token's mask and
    accept, then a rollback of 2 and a fork."""
    masks, accepts, rollbacks, forks = [], [], [], []
    for _ in range(repeats):
        mask, accept, rollback, fork = start()
        for token in tokens:
            masks.append(timed(mask)[0])
            accepts.append(timed(partial(accept, token))[0])
        rollbacks.append(timed(partial(rollback, min(2, len(tokens))))[0])
        forks.append(timed(fork)[0])
    return {
        "compile_cold_ms": statistics.median(cold),
        "compile_cached_ms": statistics.median(cached),
        "mask_ms_median": statistics.median(masks),
        "mask_ms_max": max(masks),
        "accept_ms": statistics.median(accepts),
        "rollback_2_ms": statistics.median(rollbacks),
        "fork_ms": statistics.median(forks),
        "answer_tokens": len(tokens),
    }


def print_table(results: dict[str, Any]) -> None:
    print(
        f"\nspecgate bench grammar: V = {results['vocab_size']}, medians of {results['repeats']} "
        "(a row's mask: median and worst along a real answer)"
    )
    print(
        f"{'engine':<12}{'grammar':<28}{'compile':>9}{'cached':>9}{'mask':>9}{'worst':>9}"
        f"{'accept':>9}{'rollback2':>10}{'fork':>9}   ms"
    )
    for engine, data in results["engines"].items():
        for name, r in data["grammars"].items():
            print(
                f"{engine:<12}{name:<28}{r['compile_cold_ms']:>9.3f}"
                f"{r['compile_cached_ms']:>9.3f}{r['mask_ms_median']:>9.3f}"
                f"{r['mask_ms_max']:>9.3f}"
                f"{r['accept_ms']:>9.4f}{r['rollback_2_ms']:>10.4f}{r['fork_ms']:>9.4f}"
            )
        print(f"{engine:<12}{'tokenizer set-up':<28}{data['tokenizer_setup_ms']:>9.1f}")
