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
        description="Serve a target model over worker protocol v1 (DESIGN §4).",
    )
    parser.add_argument("--model", default="builtin", help="builtin | builtin-draft | builtin-alt | tiny-random[:SEED] | GGUF file | HF folder (default: builtin)")
    parser.add_argument("--backend", default=Backend.LLAMA_CPP.value, choices=[b.value for b in Backend], help="model runner backend (default: llama.cpp)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8101, help="port to bind (default: 8101)")
    parser.add_argument("--max-context", type=int, default=2048, help="tokens one session may hold (default: 2048)")
    parser.add_argument("--memory-cap-mb", type=int, default=1024, help="memory for KV caches, all sessions (default: 1024)")
    parser.add_argument("--max-sessions", type=int, default=64, help="sessions kept before LRU eviction (default: 64)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import uvicorn

    from core.runners import load_runner
    from workers.server import create_app
    from workers.settings import WorkerSettings

    try:
        settings = WorkerSettings(
            model=args.model,
            backend=Backend(args.backend),
            host=args.host,
            port=args.port,
            max_context=args.max_context,
            memory_cap_mb=args.memory_cap_mb,
            max_sessions=args.max_sessions,
        )
        # load before binding, so a bad model is a one-line error and not a traceback
        runner = load_runner(settings.model, settings.backend.value, settings.max_context, settings.memory_cap_mb)
        runner.fingerprint  # computed once, before the first /v1/info
    except (SpecgateError, ValueError) as exc:
        print(f"specgate worker: error: {exc}", file=sys.stderr)
        return 2
    app = create_app(settings, runner=runner)
    print(f"specgate worker: {settings.model} ({settings.backend.value}) on http://{settings.host}:{settings.port}", flush=True)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=args.log_level, timeout_graceful_shutdown=10)
    runner.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
