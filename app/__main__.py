"""``python -m app`` (what ``specgate gateway`` runs): the gateway alone under uvicorn; its workers run
elsewhere (or were started by ``specgate serve``)."""

from __future__ import annotations

import argparse
import logging
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specgate gateway",
        description="Serve the OpenAI API, drafting locally and verifying on the configured workers.",
    )
    parser.add_argument(
        "--config",
        default=None,
        help="YAML config (default: the built-in one, workers on 127.0.0.1:8101/8102)",
    )
    parser.add_argument("--host", default=None, help="address to bind (default: the config's, 127.0.0.1)")
    parser.add_argument("--port", type=int, default=None, help="port to bind (default: the config's, 8000)")
    parser.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1/* (default: $SPECGATE_API_KEY; without one, "
        "only a loopback address is served, unless allow_no_api_key)",
    )
    parser.add_argument(
        "--instance-id",
        default=None,
        help="an id /health reports (default: a random one; `specgate serve` passes its own)",
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from core.config import load_config  # torch-free: a bad config is refused before the app loads
    from core.errors import SpecgateError

    try:
        config = load_config(args.config).with_local_urls()
        if args.host:
            config.host = args.host
        if args.port is not None:
            config.port = args.port
        if args.api_key:
            config.api_key = args.api_key
        # fail closed: no key on an address other hosts reach, unless the deployment opted out
        config.check_access()
        if config.api_key is None and config.allow_no_api_key:
            logging.getLogger("specgate.gateway").warning(
                "clients need no API key on %s (allow_no_api_key)", config.host
            )
        from app.server import create_app, load_draft
        from core.runners.model_thread import ModelThread
        from core.serving import run_server

        thread = ModelThread()  # the draft's every call runs on the thread that loaded it
        draft = thread.call(load_draft, config)
    except SpecgateError as exc:
        print(f"specgate gateway: error: {exc}", file=sys.stderr)
        return 2
    app = create_app(config, draft_runner=draft, instance_id=args.instance_id, model_thread=thread)
    print(
        f"specgate gateway: {config.model} on http://{config.host}:{config.port} (draft "
        f"{config.draft.model}, mode {config.speculative.mode})",
        flush=True,
    )
    drain_s = config.limits.drain_timeout_s
    admission = app.state.admission
    run_server(
        app,
        config.host,
        config.port,
        args.log_level,
        drain_s,
        lambda: admission.start_drain(drain_s),
        admission.is_idle,
        config.metrics_port,
    )
    thread.call(draft.close)
    thread.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
