"""``python -m workers`` (what ``specgate worker`` runs): one worker server under uvicorn."""

from __future__ import annotations

import argparse
import logging
import sys

from core.errors import SpecgateError
from core.names import Backend


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specgate worker",
        description="Serve a target model over worker protocol v1 (docs/design.md §4).",
    )
    # defaults live in WorkerSettings, so SPECGATE_WORKER_* variables apply to unset flags
    parser.add_argument(
        "--model",
        help="builtin | builtin-draft | builtin-alt | tiny-random[:SEED] | builtin-random[:SEED] | "
        "GGUF file | HF folder (default: builtin)",
    )
    parser.add_argument(
        "--backend", choices=[b.value for b in Backend], help="model runner backend (default: llama.cpp)"
    )
    parser.add_argument("--host", help="address to bind (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port to bind (default: 8101)")
    parser.add_argument("--max-context", type=int, help="tokens one session may hold (default: 2048)")
    parser.add_argument(
        "--memory-cap-mb", type=int, help="memory for KV caches, all sessions (default: 1024)"
    )
    parser.add_argument("--max-sessions", type=int, help="sessions kept before LRU eviction (default: 64)")
    parser.add_argument(
        "--device", help="transformers: auto | cpu | cuda[:N] (default: auto, a GPU when present)"
    )
    parser.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="transformers: model dtype (default: auto, bfloat16 on a GPU)",
    )
    parser.add_argument(
        "--forward",
        choices=["auto", "hf", "static"],
        help="transformers: the model's forward, its own modules (hf) or the static one for "
        "Llama-family models (default: auto, static on CUDA)",
    )
    parser.add_argument(
        "--scoring",
        choices=["auto", "host", "device"],
        help="where a step's logits are scored: on the host call by call, or all together on the "
        "model's device with one copy back (default: auto, device on a GPU)",
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        help="share of the GPU's memory for the model and its KV slots (default: 0.9)",
    )
    parser.add_argument(
        "--layers",
        help="a pipeline stage: the model's layers first:end, e.g. 0:15 (transformers; default: the "
        "whole model)",
    )
    parser.add_argument(
        "--next", help="a pipeline stage: the next stage's base URL, when the calls do not name it"
    )
    parser.add_argument(
        "--link-rtt-ms", type=float, help="a stage: emulated round trip to the next stage, ms (default: 0)"
    )
    parser.add_argument(
        "--link-mbps",
        type=float,
        help="a stage: emulated bandwidth to the next stage, Mbit/s (default: 0 = no limit)",
    )
    parser.add_argument(
        "--prefill-chunk",
        type=int,
        help="a long prompt's tokens per scheduler step, in the steps other calls leave free and one "
        "in four beside them (default: 16 on llama.cpp, max_batch_tokens on transformers)",
    )
    parser.add_argument(
        "--long-decode",
        choices=["auto", "one-thread", "pad-stream"],
        help="llama.cpp: a long session's decode of one token on one thread, or beside a throwaway "
        "token (default: auto, pad-stream from 3 threads)",
    )
    parser.add_argument(
        "--decode-ahead",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="on the CPU, while idle: decode an autoregressive answer's token before its next call "
        "carries it (default: off; on for a gateway across a link)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        help="CPU threads of the model (default: every core; split the cores between processes on one "
        "machine)",
    )
    parser.add_argument(
        "--drain-timeout-s", type=float, help="on SIGTERM, how long its sessions may go on (default: 30)"
    )
    parser.add_argument(
        "--instance-id", help="an id /health reports (default: a random one; `specgate serve` passes its own)"
    )
    parser.add_argument(
        "--restarts",
        type=int,
        help="how many times `specgate serve` restarted this worker (its /metrics reports it; default: 0)",
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from pydantic import ValidationError

    from core.plugins import load_plugins
    from core.runners.model_thread import ModelThread
    from core.serving import run_server
    from workers.server import create_app
    from workers.settings import WorkerSettings, ready_target

    try:
        load_plugins()  # what they register (a mode's kind of answer) before the first call
        settings = WorkerSettings(
            **{f: v for f, v in vars(args).items() if f != "log_level" and v is not None}
        )
        # fail closed: no token on an address other hosts reach, unless the deployment opted out
        settings.check_access()
        # load before binding (a bad model is a one-line error), on the thread every later call runs on
        thread = ModelThread()
        runner = thread.call(ready_target, settings)
    except ValidationError as exc:
        first = exc.errors()[0]
        print(f"specgate worker: error: {'.'.join(map(str, first['loc']))}: {first['msg']}", file=sys.stderr)
        return 2
    except (SpecgateError, ValueError) as exc:
        print(f"specgate worker: error: {exc}", file=sys.stderr)
        return 2
    app = create_app(settings, runner=runner, thread=thread)
    print(
        f"specgate worker: {settings.model} ({settings.backend.value}) on "
        f"http://{settings.host}:{settings.port}",
        flush=True,
    )
    run_server(
        app,
        settings.host,
        settings.port,
        args.log_level,
        settings.drain_timeout_s,
        app.state.start_drain,
        app.state.worker.is_idle,
    )
    thread.call(runner.close)
    thread.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
