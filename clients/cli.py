"""``specgate``: the one console script (``specgate --help``; each command has its own).

The CLI is the composition root: it starts servers as processes (``python -m workers``,
``python -m app``) and speaks HTTP to them, so it imports neither ``app/`` nor ``workers/``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys

# command (or bench) -> (module, function); each module is imported only when its command runs
COMMANDS: dict[str | None, tuple[str, str]] = {
    "eval": ("clients.eval", "evaluate"),
    "law": ("clients.law", "check_law"),
    "chat": ("clients.chat", "chat"),
    "prepare": ("clients.prepare", "prepare"),
    None: ("clients.bench.modes", "bench_modes"),
    "worker": ("clients.bench.worker", "bench_worker"),
    **{
        bench: (f"clients.bench.{bench}", f"bench_{bench}")
        for bench in (
            "load",
            "grammar",
            "structured",
            "workload",
            "overhead",
            "dsd",
            "tree",
            "pipeline",
            "prefill",
            "consistency",
            "peer",
        )
    },
}


def build_parser() -> argparse.ArgumentParser:
    from clients.bench.consistency import CONFIGS as CONSISTENCY_MODES
    from clients.bench.consistency import mode_list
    from clients.bench.device import device_args
    from clients.bench.load import concurrency_levels

    parser = argparse.ArgumentParser(
        prog="specgate", description="Distributed speculative decoding behind the OpenAI API."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.add_parser(
        "worker",
        add_help=False,
        help="serve a target model over worker protocol v1 (see specgate worker --help)",
    )
    commands.add_parser(
        "gateway",
        add_help=False,
        help="serve the OpenAI API; workers run elsewhere (see specgate gateway --help)",
    )
    serve = commands.add_parser(
        "serve", help="start the gateway and a local worker for each config entry with a model"
    )
    serve.add_argument(
        "--config",
        default=None,
        help="YAML config (default: the built-in one: two local workers, builtin and builtin-alt)",
    )
    serve.add_argument("--port", type=int, default=None, help="gateway port (default: the config's, 8000)")
    serve.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' (default: $SPECGATE_API_KEY, else none on "
        "127.0.0.1; other addresses need one or allow_no_api_key)",
    )
    serve.add_argument(
        "--startup-timeout", type=float, default=600.0, help="seconds to wait for every worker (default: 600)"
    )
    prepare = commands.add_parser(
        "prepare",
        help="make the built-in models' caches now (set-up runs it): requantizations, tokenizers, "
        "transformers weights",
    )
    prepare.add_argument(
        "--no-transformers",
        action="store_true",
        help="skip the target's dequantized weights for transformers",
    )
    chat = commands.add_parser(
        "chat", help="an interactive streaming chat with a running gateway, with acceptance and tokens/s"
    )
    chat.add_argument(
        "--url", default="http://127.0.0.1:8000", help="the gateway (default: http://127.0.0.1:8000)"
    )
    chat.add_argument("--model", default=None, help="model id (default: the gateway's first)")
    chat.add_argument(
        "--mode", default=None, help="speculative mode for every answer (default: the gateway's)"
    )
    chat.add_argument("--api-key", default=None, help="bearer key (default: $SPECGATE_API_KEY)")
    chat.add_argument("--max-tokens", type=int, default=256, help="tokens per answer (default: 256)")
    chat.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (default: 0.7)")
    evaluate = _with_json(
        commands.add_parser(
            "eval",
            help="each mode on a fixed prompt set: acceptance, accepted length, TV to the target vs "
            "its bound",
        )
    )
    evaluate.add_argument(
        "--url", default="http://127.0.0.1:8000", help="the gateway (default: http://127.0.0.1:8000)"
    )
    evaluate.add_argument(
        "--serve", action="store_true", help="start `specgate serve` for the run instead of using --url"
    )
    evaluate.add_argument(
        "--config", default=None, help="with --serve: its config (default: the built-in one)"
    )
    evaluate.add_argument(
        "--startup-timeout", type=float, default=600.0, help="with --serve: seconds to wait (default: 600)"
    )
    evaluate.add_argument("--prompts", type=int, default=4, help="prompts of the fixed set, 1–4 (default: 4)")
    evaluate.add_argument("--seeds", type=int, default=2, help="seeds per prompt (default: 2)")
    evaluate.add_argument("--max-tokens", type=int, default=48, help="tokens per answer (default: 48)")
    evaluate.add_argument(
        "--temperature", type=float, default=1.0, help="sampling temperature (default: 1.0)"
    )
    law = _with_json(
        commands.add_parser(
            "law",
            help="the joint law of the first two tokens against the target GGUF evaluated by "
            "llama.cpp itself: chi-square",
        )
    )
    law.add_argument(
        "--url", default="http://127.0.0.1:8000", help="the gateway (default: http://127.0.0.1:8000)"
    )
    law.add_argument(
        "--serve", action="store_true", help="start `specgate serve` for the run instead of using --url"
    )
    law.add_argument("--config", default=None, help="with --serve: its config (default: the built-in one)")
    law.add_argument(
        "--startup-timeout", type=float, default=600.0, help="with --serve: seconds to wait (default: 600)"
    )
    law.add_argument("--gguf", default=None, help="the target's GGUF file (default: the built-in target)")
    law.add_argument(
        "--speculative",
        action="append",
        default=None,
        help="the request's \"speculative\" object, as JSON (default: the gateway's mode); repeat it "
        "to check several against one reference",
    )
    law.add_argument("--samples", type=int, default=1500, help="seeded answers of two tokens (default: 1500)")
    law.add_argument(
        "--max-tokens",
        type=int,
        default=2,
        help="tokens per answer, of which the first two are read: above a tree's depth to draft it "
        "whole (default: 2)",
    )
    law.add_argument(
        "--prompt",
        default="The three longest rivers in the world are",
        help="the prompt, tokenized by llama.cpp (default: 'The three longest rivers in the world are')",
    )
    law.add_argument("--temperature", type=float, default=1.0, help="T > 0 (default: 1.0)")
    law.add_argument("--concurrency", type=int, default=4, help="requests in flight (default: 4)")
    law.add_argument("--threads", type=int, default=1, help="llama.cpp threads of the reference (default: 1)")
    bench = _with_json(
        commands.add_parser(
            "bench", help="benchmarks that print figures and write JSON (default: the decoding modes)"
        )
    )
    bench.add_argument("--runs", type=int, default=3, help="runs per cell, ≥ 3 (default: 3)")
    bench.add_argument("--max-tokens", type=int, default=32, help="tokens per request (default: 32)")
    bench.add_argument("--prompts", type=int, default=1, help="prompts per cell, 1–3 (default: 1)")
    bench.add_argument(
        "--gamma", type=int, default=4, help="num_draft_tokens of the drafting cells (default: 4)"
    )
    bench.add_argument("--plots", default=None, help="write PNG plots into this folder (e.g. docs/bench)")
    bench.add_argument(
        "--quick",
        action="store_true",
        help="1 worker, links 0 ms and 50 ms / 10 Mbps, T = 1, three modes: about a minute",
    )
    benches = bench.add_subparsers(dest="bench", metavar="BENCH")
    worker = _with_json(
        benches.add_parser("worker", help="verify latency over HTTP vs in-process; draft acceptance α")
    )
    worker.add_argument("--repeats", type=int, default=20, help="timed calls per cell (default: 20)")
    worker.add_argument(
        "--backends", nargs="+", default=["llama.cpp", "transformers"], help="backends to measure"
    )
    worker.add_argument(
        "--positions", nargs="+", type=int, default=[1, 4, 6, 9], help="positions scored per call"
    )
    worker.add_argument("--quick", action="store_true", help="fewer repeats and tokens: about a minute")
    tree = _with_json(
        benches.add_parser(
            "tree",
            help="token trees vs chains at equal verified-node budgets (4, 8, 14, 32), T = 0 and 1, per link",
        )
    )
    tree.add_argument("--runs", type=int, default=1, help="runs per cell (default: 1)")
    tree.add_argument("--max-tokens", type=int, default=32, help="tokens per request (default: 32)")
    tree.add_argument("--prompts", type=int, default=2, help="prompts per cell, 1–3 (default: 2)")
    tree.add_argument("--plots", default=None, help="write PNG plots into this folder (e.g. docs/bench)")
    tree.add_argument(
        "--quick",
        action="store_true",
        help="one run, one prompt, T = 0, budgets 4 and 14, no link: about a minute",
    )
    pipe = _with_json(
        benches.add_parser(
            "pipeline",
            help="FlowSpec's pipeline vs pipelined autoregressive through the same 2 and 3 stages at "
            "0/5/20 ms per hop",
        )
    )
    pipe.add_argument("--stages", default="2,3", help="stage counts, comma-separated (default: 2,3)")
    pipe.add_argument(
        "--hop-ms", default="0,5,20", help="one-way delay per hop in ms, comma-separated (default: 0,5,20)"
    )
    pipe.add_argument("--runs", type=int, default=3, help="runs per cell (default: 3)")
    pipe.add_argument("--max-tokens", type=int, default=32, help="tokens per request (default: 32)")
    pipe.add_argument("--prompts", type=int, default=1, help="prompts per cell, 1–3 (default: 1)")
    devices = {
        "tree-device": "a worker's verify round, chain vs tree",
        "step-device": "a worker's scheduler step (batch × positions) beside the bare model forward",
    }
    for name, text in devices.items():
        device_args(
            benches.add_parser(
                name, help=f"{text}, on a device (random weights of the built-in architecture)"
            ),
            name,
        )
    dsd = _with_json(
        benches.add_parser(
            "dsd", help="DSD: overlap on/off and auto vs fixed draft lengths per link, against autoregressive"
        )
    )
    dsd.add_argument("--runs", type=int, default=5, help="runs per cell, ≥ 3 (default: 5)")
    dsd.add_argument("--max-tokens", type=int, default=32, help="tokens per request (default: 32)")
    dsd.add_argument(
        "--prompts",
        type=int,
        default=1,
        help="prompts per cell and run, 1–5; each run starts one prompt further (default: 1)",
    )
    dsd.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default: 1.0)")
    dsd.add_argument("--plots", default=None, help="write PNG plots into this folder (e.g. docs/bench)")
    dsd.add_argument(
        "--quick", action="store_true", help="one run, one prompt, the 50 ms link only: a few minutes"
    )
    overhead = _with_json(
        benches.add_parser(
            "overhead",
            help="where a round's time goes, part by part, beside llama.cpp's and bare HTTP's floors "
            "(zero link)",
        )
    )
    overhead.add_argument("--runs", type=int, default=3, help="runs per cell (default: 3)")
    overhead.add_argument("--max-tokens", type=int, default=32, help="tokens per request (default: 32)")
    overhead.add_argument("--prompts", type=int, default=2, help="prompts per cell and run, 1–5 (default: 2)")
    overhead.add_argument(
        "--baseline",
        default=None,
        help="a checkout of an earlier commit: its servers run beside ours, cell by cell",
    )
    overhead.add_argument(
        "--quick", action="store_true", help="one run, one prompt, 16 tokens: under 3 minutes"
    )
    overhead.add_argument(
        "--verify-ms",
        type=float,
        default=None,
        help="also show each mode's round with a verify step of this many ms (a GPU worker's), the "
        "rest as measured",
    )
    overhead.add_argument(
        "--link-rtt-ms", type=float, default=0.0, help="... over a link of this round trip (default: 0)"
    )
    overhead.add_argument(
        "--link-mbps", type=float, default=0.0, help="... and this bandwidth, Mbit/s (default: 0 = no limit)"
    )
    grammar = _with_json(
        benches.add_parser(
            "grammar",
            help="the grammar engines on the built-in vocabulary: compile, mask, accept, rollback, fork",
        )
    )
    grammar.add_argument("--repeats", type=int, default=5, help="timed repeats per figure (default: 5)")
    structured = _with_json(
        benches.add_parser(
            "structured", help="json_schema and tool calls vs the same prompts unconstrained, per mode and T"
        )
    )
    structured.add_argument("--runs", type=int, default=2, help="seeds per prompt and cell (default: 2)")
    structured.add_argument("--max-tokens", type=int, default=96, help="tokens per request (default: 96)")
    structured.add_argument(
        "--quick", action="store_true", help="one seed, T = 1 only, exact and autoregressive"
    )
    peer = _with_json(
        benches.add_parser(
            "peer",
            help="the engine alone (llama-cpp-python, same GGUF, same threads) beside specgate's "
            "modes and drafters, short and long prompts",
        )
    )
    peer.add_argument("--runs", type=int, default=2, help="runs over the prompts (default: 2)")
    peer.add_argument("--prompts", type=int, default=4, help="prompts per set, 1 to 4 (default: 4)")
    peer.add_argument("--max-tokens", type=int, default=64, help="tokens per answer (default: 64)")
    peer.add_argument("--quick", action="store_true", help="two prompts per set, one run")
    workload = _with_json(
        benches.add_parser(
            "workload",
            help="drafters model, lookup and model+lookup per category of a bundled prompt set, T = 0 "
            "and 1, two links",
        )
    )
    workload.add_argument("--prompts", type=int, default=8, help="prompts per category, 1 to 8 (default: 8)")
    workload.add_argument("--max-tokens", type=int, default=64, help="tokens per request (default: 64)")
    workload.add_argument("--quick", action="store_true", help="zero link and T = 0 only")
    workload.add_argument(
        "--mode",
        choices=["exact", "aggregate", "tree"],
        default="exact",
        help="the mode every request asks for (default: exact; tree: the lookup joins the default trees)",
    )
    workload.add_argument(
        "--categories", default=None, help="a comma-separated subset of the categories (default: all six)"
    )
    prefill = _with_json(
        benches.add_parser(
            "prefill",
            help="long prompts: time to the first token per prompt token by mode vs the target alone; "
            "running streams' ITL during a long prefill",
        )
    )
    prefill.add_argument(
        "--lengths",
        type=concurrency_levels,
        default=[250, 500, 1000, 2000],
        help="prompt tokens, comma-separated (default: 250,500,1000,2000)",
    )
    prefill.add_argument(
        "--runs",
        type=int,
        default=2,
        help="prompts per length, mode and link; runs of the running streams (default: 2)",
    )
    prefill.add_argument(
        "--streams", type=int, default=4, help="running streams for the inter-token latency (default: 4)"
    )
    prefill.add_argument("--quick", action="store_true", help="250 and 1,000 tokens, zero link, one run")
    prefill.add_argument(
        "--tokens",
        type=int,
        default=4,
        help="tokens per timed answer; above 2, each answer's ms per token after the first too (default: 4)",
    )
    prefill.add_argument(
        "--threads",
        type=int,
        default=None,
        help="the worker's and the draft's threads (default: half the cores each)",
    )
    consistency = _with_json(
        benches.add_parser(
            "consistency",
            help="long prompts: greedy text of every mode against autoregressive; seeded text alone, "
            "at once with others, and across a failover",
        )
    )
    consistency.add_argument(
        "--modes",
        type=mode_list,
        default=list(CONSISTENCY_MODES),
        help=f"comma-separated (default: all: {','.join(CONSISTENCY_MODES)})",
    )
    consistency.add_argument(
        "--prompts", type=int, default=6, help="greedy prompts, 300 to 1,500 tokens (default: 6)"
    )
    consistency.add_argument("--tokens", type=int, default=48, help="greedy tokens per answer (default: 48)")
    consistency.add_argument(
        "--seeded", type=int, default=8, help="seeded prompts, 300 to 1,500 tokens (default: 8)"
    )
    consistency.add_argument(
        "--seeded-tokens", type=int, default=32, help="seeded tokens per answer (default: 32)"
    )
    consistency.add_argument(
        "--seed", type=int, default=1234, help="the seeded requests' seed (default: 1234)"
    )
    consistency.add_argument(
        "--short", type=int, default=4, help="short streams beside the seeded ones (default: 4)"
    )
    consistency.add_argument(
        "--threads",
        type=int,
        default=None,
        help="each worker's and the draft's threads (default: every core, as serve with one worker)",
    )
    consistency.add_argument(
        "--memory-cap-mb",
        type=int,
        default=4096,
        help="each worker's and the draft's KV memory cap (default: 4096; at 1024 eight long tree "
        "sessions outnumber the contexts and rebuild every round)",
    )
    load = _with_json(
        benches.add_parser(
            "load", help="concurrent streaming clients against `specgate serve`: errors, TTFT, tokens/s, RSS"
        )
    )
    load.add_argument(
        "--concurrency",
        type=concurrency_levels,
        default=[64],
        help="streaming clients at once; several levels, comma-separated (1,4,8,16), run in turn "
        "against one server (default: 64)",
    )
    load.add_argument(
        "--gateways",
        type=concurrency_levels,
        default=[1],
        help="gateways on the same workers: 1,2 runs every level through one, then through two, side "
        "by side (default: 1)",
    )
    load.add_argument("--duration", type=float, default=300.0, help="seconds of load (default: 300)")
    load.add_argument("--max-tokens", type=int, default=32, help="tokens per request (default: 32)")
    load.add_argument("--config", default=None, help="config for specgate serve (default: the built-in one)")
    load.add_argument("--port", type=int, default=None, help="gateway port (default: a free one)")
    load.add_argument(
        "--startup-timeout", type=float, default=600.0, help="seconds to wait for the server (default: 600)"
    )
    return parser


def _with_json(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--json", dest="json_path", default=None, help="write the figures to this JSON file")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    servers = {"worker": "workers", "gateway": "app"}
    if argv[:1] and argv[0] in servers:
        # each server owns its flags (and their --help); run it in this process's place
        os.execv(sys.executable, [sys.executable, "-m", servers[argv[0]], *argv[1:]])
    args = build_parser().parse_args(argv)
    from clients.bench.device import DEVICE_BENCHES, device_argv

    if args.command == "serve":
        from clients.serve import serve

        if args.api_key:
            os.environ["SPECGATE_API_KEY"] = args.api_key  # the gateway child reads it; never on disk
        return serve(args.config, args.port, args.startup_timeout)
    if args.command == "bench" and args.bench in DEVICE_BENCHES:
        return subprocess.call(
            [sys.executable, "-m", DEVICE_BENCHES[args.bench][0], *device_argv(args, args.bench)]
        )
    module, function = COMMANDS[args.bench if args.command == "bench" else args.command]
    return int(getattr(importlib.import_module(module), function)(args))


if __name__ == "__main__":
    sys.exit(main())
