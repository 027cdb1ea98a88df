"""``specgate chat``: an interactive streaming chat against a gateway, acceptance and tokens/s after each
answer. Usage: ``specgate chat --url http://127.0.0.1:8000 [--mode exact]``; ``/quit`` or Ctrl-D ends it."""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import Any, TextIO

import httpx
import orjson

from clients.eval import _auth


@dataclass
class AnswerStats:
    accepted: int = 0
    drafted: int = 0
    rounds: int = 0
    bytes: int = 0
    tokens: int = 0
    seconds: float = 0.0

    def add(self, round_info: dict[str, int]) -> None:
        self.accepted += round_info["accepted"]
        self.drafted += round_info["drafted"]
        self.bytes += round_info["bytes"]
        self.rounds += 1

    def summary(self) -> str:
        parts = [f"acceptance {100 * self.accepted / self.drafted:.0f} %" if self.drafted else "no draft"]
        parts.append(f"{self.tokens / self.seconds:.1f} tok/s" if self.seconds > 0 else "– tok/s")
        parts.append(f"{self.tokens} tokens")
        if self.rounds:
            parts.append(f"{self.bytes // self.rounds:,} B/round")
        return " · ".join(parts)


def parse_data_line(line: str) -> dict[str, Any] | str | None:
    """One SSE line: its JSON payload, the string ``[DONE]``, or None for anything else."""
    if not line.startswith("data: "):
        return None
    data = line[len("data: ") :]
    return data if data == "[DONE]" else orjson.loads(data)


def chat(args: argparse.Namespace, stdin: TextIO = sys.stdin, out: TextIO = sys.stdout) -> int:
    with httpx.Client(
        base_url=args.url, headers=_auth(args.api_key), timeout=httpx.Timeout(600, connect=10)
    ) as client:
        try:
            model = args.model or client.get("/v1/models").json()["data"][0]["id"]
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            print(f"specgate chat: cannot reach a gateway at {args.url}: {exc}", file=sys.stderr)
            return 1
        print(
            f"specgate chat with {model!r} at {args.url}"
            f"{f' (mode {args.mode})' if args.mode else ''}; /quit to leave",
            file=out,
            flush=True,
        )
        history: list[dict[str, str]] = []
        while True:
            print("> ", end="", file=out, flush=True)
            line = stdin.readline()
            if not line or line.strip() in ("/quit", "/exit"):
                return 0
            if not line.strip():
                continue
            history.append({"role": "user", "content": line.strip()})
            answer = _answer(client, _body(args, model, history), out)
            if answer is None:
                history.pop()
            else:
                history.append({"role": "assistant", "content": answer})


def _body(args: argparse.Namespace, model: str, history: list[dict[str, str]]) -> dict[str, Any]:
    body = {
        "model": model,
        "messages": history,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": args.max_tokens,
    }
    return (
        body | {"temperature": args.temperature} | ({"speculative": {"mode": args.mode}} if args.mode else {})
    )


def _answer(client: httpx.Client, body: dict[str, Any], out: TextIO) -> str | None:
    """Stream one answer to ``out``; its text, or None after an error (printed)."""
    stats, text, started = AnswerStats(), "", time.monotonic()
    try:
        with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                print(f"error: {_error_message(resp.read())}", file=out, flush=True)
                return None
            for line in resp.iter_lines():
                event = parse_data_line(line)
                if not isinstance(event, dict):
                    continue
                if "error" in event:
                    print(f"\nerror: {event['error']['message']}", file=out, flush=True)
                    return None
                if event.get("speculative"):
                    stats.add(event["speculative"])
                if event.get("usage"):
                    stats.tokens = event["usage"]["completion_tokens"]
                for choice in event.get("choices") or []:
                    piece = choice["delta"].get("content") or ""
                    text += piece
                    print(piece, end="", file=out, flush=True)
    except httpx.HTTPError as exc:
        print(f"\nerror: {type(exc).__name__}: {exc}", file=out, flush=True)
        return None
    stats.seconds = time.monotonic() - started
    print(f"\n[{stats.summary()}]", file=out, flush=True)
    return text


def _error_message(body: bytes) -> str:
    try:
        return str(orjson.loads(body)["error"]["message"])
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return body[:200].decode(errors="replace")
