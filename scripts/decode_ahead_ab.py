"""Decoding ahead on and off, side by side (docs/performance.md, "At the peer's speed"): two workers (builtin,
llama.cpp, ``--decode-ahead`` and ``--no-decode-ahead``), each behind a gateway whose link to it has the given
round trip (emulated by the gateway); ``autoregressive`` answers of ``--tokens`` tokens at T = 0 and T = 1
(seeded), the two alternating prompt by prompt; median tokens/s as the client sees it.

    python scripts/decode_ahead_ab.py --rtt-ms 0,20,50 --json docs/bench/decode_ahead.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from clients.bench.common import gateway_client, progress, request  # noqa: E402
from clients.procs import WorkerProcess  # noqa: E402
from clients.prompts import PROMPTS  # noqa: E402
from core.config import LinkConfig  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--rtt-ms",
        default="0,20,50",
        help="comma-separated round trips of the emulated link (default: 0,20,50)",
    )
    parser.add_argument("--tokens", type=int, default=64, help="tokens per answer (default: 64)")
    parser.add_argument("--runs", type=int, default=2, help="runs over the prompts (default: 2)")
    parser.add_argument(
        "--threads", type=int, default=2, help="each worker's threads (default: 2; the two take turns)"
    )
    parser.add_argument("--json", dest="json_path", default=None, help="write the figures to this JSON file")
    args = parser.parse_args()
    prompts = PROMPTS[:3]
    rows = []
    with ExitStack() as stack:
        progress("starting two workers (builtin): --decode-ahead and --no-decode-ahead")
        workers = {
            "on": stack.enter_context(
                WorkerProcess("builtin", "llama.cpp", threads=args.threads, extra=["--decode-ahead"])
            ),
            "off": stack.enter_context(
                WorkerProcess("builtin", "llama.cpp", threads=args.threads, extra=["--no-decode-ahead"])
            ),
        }
        for rtt in (float(r) for r in args.rtt_ms.split(",")):
            with ExitStack() as gateways:
                clients = {
                    name: gateways.enter_context(gateway_client([url], LinkConfig(rtt_ms=rtt), 4))
                    for name, url in workers.items()
                }
                for client in clients.values():
                    request(client, "Hi", 4, 0.0, {"mode": "autoregressive"}, None)  # warm-up
                rates: dict[tuple[str, float], list[float]] = {}
                for run in range(args.runs):
                    for i, prompt in enumerate(prompts):
                        for name in ("on", "off") if (run + i) % 2 == 0 else ("off", "on"):
                            for t in (0.0, 1.0):
                                text = f"{prompt} (run {run}, {name})"  # a prompt of its own: no prompt cache
                                elapsed, usage = request(
                                    clients[name],
                                    text,
                                    args.tokens,
                                    t,
                                    {"mode": "autoregressive"},
                                    7 if t else None,
                                )
                                rates.setdefault((name, t), []).append(usage["completion_tokens"] / elapsed)
                for t in (0.0, 1.0):
                    on, off = statistics.median(rates["on", t]), statistics.median(rates["off", t])
                    rows.append(
                        {
                            "rtt_ms": rtt,
                            "temperature": t,
                            "on_tokens_per_s": on,
                            "off_tokens_per_s": off,
                            "ratio": on / off,
                            "on_each": rates["on", t],
                            "off_each": rates["off", t],
                        }
                    )
                    print(
                        f"rtt {rtt:g} ms, T = {t:g}: decode ahead on {on:.1f} tok/s, off "
                        f"{off:.1f} tok/s, {on / off:.2f}×",
                        flush=True,
                    )
    if args.json_path:
        setup = {"tokens": args.tokens, "runs": args.runs, "threads": args.threads, "prompts": prompts}
        Path(args.json_path).write_text(json.dumps({"setup": setup, "rows": rows}, indent=1) + "\n")
        print(f"wrote {args.json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
