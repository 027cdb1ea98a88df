"""Where a round's time goes outside the models: a worker (builtin, llama.cpp) and a gateway (builtin-draft),
one thread each, ``--seconds`` of back-to-back chat requests in ``--mode`` at ``--temperature``, py-spy (``pip
install py-spy``) on both processes; prints each process's busiest frames outside its model, as shares of its
busy samples.

    python scripts/profile_round.py --mode autoregressive --temperature 1 --seconds 20
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

from clients.procs import GatewayProcess, WorkerProcess

MODEL = re.compile(r"llama_cpp|_decode_streams|_compute_each|forward_each", re.I)
IDLE = ("select (selectors", "poll", "wait (threading", "_wait_for_tstate_lock", "acquire")
FRAMEWORK = (
    "_bootstrap",
    "Thread.run",
    "_run_once",
    "run_forever",
    "run_until",
    "<module>",
    "Context.run",
    "_run (events",
    "asyncio_run",
    "run_server",
    "_run_code",
    "_run_module_as_main",
    "main __main__",
    "Server.run",
    "Runner.run",
    "Handle._run",
    "_worker thread",
    "_WorkItem.run",
    "ModelThread.run",
)


def summary(raw: Path, top: int) -> list[str]:
    """The ``top`` frames outside the model by their share of the busy samples (each frame counted once per
    stack)."""
    frames: collections.Counter[str] = collections.Counter()
    busy = outside = 0
    for line in raw.read_text().splitlines():
        stack, count = line.rsplit(" ", 1)
        names = stack.split(";")
        if any(mark in names[-1] for mark in IDLE) or names[-1].startswith("_worker (concurrent"):
            continue
        busy += int(count)
        if any(MODEL.search(name) for name in names):
            continue
        outside += int(count)
        for name in dict.fromkeys(n.split(" (")[0] + " " + n.rsplit("/", 1)[-1].rstrip(")") for n in names):
            frames[name] += int(count)
    lines = [f"{raw.name}: {busy} busy samples, {outside} outside the model"]
    shown = [(name, n) for name, n in frames.most_common() if not any(f in name for f in FRAMEWORK)][:top]
    return lines + [f"  {100 * n / max(outside, 1):5.1f} %  {name}" for name, n in shown]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", default="autoregressive")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seconds", type=int, default=20)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument(
        "--out", default=None, help="a folder for the raw profiles (default: a temporary one)"
    )
    args = parser.parse_args()
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    out = Path(args.out or tempfile.mkdtemp(prefix="specgate-profile-"))
    out.mkdir(parents=True, exist_ok=True)
    with WorkerProcess("builtin", "llama.cpp", threads=1) as worker_url:
        config = out / "gateway.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "workers": [{"url": worker_url, "weight": 1.0}],
                    "draft": {"threads": 1},
                    "speculative": {"mode": "exact", "draft_top_k": 32},
                }
            )
        )
        with GatewayProcess(str(config)) as gateway_url:
            body = {
                "model": "specgate",
                "messages": [{"role": "user", "content": "Explain in two sentences why the sky is blue."}],
                "max_tokens": 32,
                "temperature": args.temperature,
                "speculative": {"mode": args.mode},
            }
            with httpx.Client(base_url=gateway_url, timeout=120) as client:
                for _ in range(3):  # warm-up
                    client.post("/v1/chat/completions", json=body).raise_for_status()
                pids = {"gateway": _listening_pid(gateway_url), "worker": _listening_pid(worker_url)}
                raws = {name: out / f"{name}-{args.mode}-T{args.temperature:g}.raw" for name in pids}
                spies = [
                    subprocess.Popen(
                        [
                            spy,
                            "record",
                            "-r",
                            "500",
                            "-f",
                            "raw",
                            "-d",
                            str(args.seconds),
                            "-o",
                            str(raws[name]),
                            "--pid",
                            str(pid),
                        ],
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                    )
                    for name, pid in pids.items()
                ]
                started, requests = time.monotonic(), 0
                while time.monotonic() - started < args.seconds:
                    client.post("/v1/chat/completions", json=body).raise_for_status()
                    requests += 1
                for each in spies:
                    each.wait()
    print(
        f"{requests} requests of ≤ 32 tokens, mode {args.mode}, T = {args.temperature:g}; raw "
        f"profiles in {out}"
    )
    for raw in raws.values():
        print("\n".join(summary(raw, args.top)))
    return 0


def _listening_pid(url: str) -> int:
    """The pid of the process listening on ``url``'s port."""
    import psutil

    port = int(url.rsplit(":", 1)[1])
    return next(
        c.pid
        for c in psutil.net_connections("tcp")
        if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN and c.pid
    )


if __name__ == "__main__":
    sys.exit(main())
