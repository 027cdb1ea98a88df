"""``specgate serve``: the local workers of a config, then the gateway; report when ready.

Every process it starts is stopped by pid when it exits (Ctrl-C, SIGTERM, or a child dying).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType

import httpx

from clients.procs import stop_process, worker_command
from core.config import SpecgateConfig, WorkerEntry, dump_config, load_config
from core.errors import SpecgateError


def serve(config_path: str | None, port: int | None, startup_timeout: float) -> int:
    try:
        config = load_config(config_path).with_local_urls().with_split_cores(os.cpu_count() or 1)
    except SpecgateError as exc:
        print(f"specgate serve: error: {exc}", file=sys.stderr)
        return 2
    if port is not None:
        config.port = port
    stop = _StopFlag()
    procs: dict[str, subprocess.Popen[bytes]] = {}
    with tempfile.TemporaryDirectory(prefix="specgate-") as tmp:
        try:
            for worker in (w for w in config.workers if w.is_local):
                procs[worker.name or ""] = start_worker(config, worker)
            resolved = Path(tmp) / "config.yaml"
            resolved.write_text(dump_config(config))
            print(f"specgate serve: starting the gateway on http://{config.host}:{config.port}", flush=True)
            procs["gateway"] = subprocess.Popen([sys.executable, "-m", "app", "--config", str(resolved), "--log-level", "warning"], process_group=0)
            if not wait_ready(_ready_urls(config), procs, startup_timeout, stop):
                return 1
            print(ready_message(config), flush=True)
            return watch(procs, stop)
        finally:
            stop_all(procs, config.limits.drain_timeout_s)


def start_worker(config: SpecgateConfig, entry: WorkerEntry) -> subprocess.Popen[bytes]:
    assert entry.model is not None and entry.port is not None
    url = config.worker_url(entry)
    print(f"specgate serve: starting worker {entry.name}: {entry.model} ({entry.backend.value}, threads={entry.threads}) on {url}", flush=True)
    # its own process group: a terminal's Ctrl-C reaches `serve` alone, which stops the
    # gateway first (it drains its streams, which still need the workers), then the workers
    return subprocess.Popen(worker_command(entry.model, entry.backend.value, entry.port, entry.threads), process_group=0)


def _ready_urls(config: SpecgateConfig) -> dict[str, str]:
    """What to poll: each local worker's /health, then the gateway's /health/ready."""
    urls = {w.name or "": f"{config.worker_url(w)}/health" for w in config.workers if w.is_local}
    urls["gateway"] = f"http://{config.host}:{config.port}/health/ready"
    return urls


def wait_ready(urls: dict[str, str], procs: dict[str, subprocess.Popen[bytes]], timeout: float, stop: _StopFlag) -> bool:
    """Poll until each URL answers 200, in order; False on timeout, a dead child or a signal."""
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=2.0) as client:
        for name, url in urls.items():
            while not _answers(client, url):
                dead = [n for n, p in procs.items() if p.poll() is not None]
                if dead:
                    print(f"specgate serve: {dead[0]} exited with {procs[dead[0]].returncode}", file=sys.stderr)
                    return False
                if stop.is_set or time.monotonic() > deadline:
                    print(f"specgate serve: {name} not ready after {timeout:.0f} s", file=sys.stderr)
                    return False
                time.sleep(0.5)
            print(f"specgate serve: {name} ready", flush=True)
    return True


def _answers(client: httpx.Client, url: str) -> bool:
    try:
        return client.get(url).status_code == 200
    except httpx.HTTPError:
        return False


def ready_message(config: SpecgateConfig) -> str:
    base = f"http://{config.host}:{config.port}"
    workers = ", ".join(f"{w.name}={w.model if w.is_local else config.worker_url(w)}" for w in config.workers)
    return (
        f"specgate: ready on {base} — model {config.model!r}, mode {config.speculative.mode.value}, "
        f"draft {config.draft.model}, workers {workers}\n"
        f"  Try: curl -s {base}/v1/chat/completions -H 'Content-Type: application/json' "
        f"-d '{{\"model\": \"{config.model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Say hello\"}}], \"max_tokens\": 32}}'"
    )


def watch(procs: dict[str, subprocess.Popen[bytes]], stop: _StopFlag) -> int:
    while not stop.is_set:
        for name, proc in procs.items():
            if proc.poll() is not None:
                print(f"specgate serve: worker {name} exited with {proc.returncode}", file=sys.stderr)
                return 1
        time.sleep(0.5)
    return 0


def stop_all(procs: dict[str, subprocess.Popen[bytes]], drain_s: float = 30.0) -> None:
    """The gateway first (it drains its streams, which still need the workers), then the workers."""
    gateway = procs.get("gateway")
    if gateway is not None:
        stop_process(gateway, grace_s=drain_s + 10)
    for proc in procs.values():
        if proc.poll() is None:
            proc.terminate()  # the workers at once, then reap each
    for proc in procs.values():
        stop_process(proc)


class _StopFlag:
    """Set by SIGINT / SIGTERM, so the loops above end and the children are stopped."""

    def __init__(self) -> None:
        self.is_set = False
        signal.signal(signal.SIGINT, self._set)
        signal.signal(signal.SIGTERM, self._set)

    def _set(self, signum: int, frame: FrameType | None) -> None:
        self.is_set = True
