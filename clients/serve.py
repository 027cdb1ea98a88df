"""``specgate serve``: start the local workers of a config, wait until each answers, report.

Every process it starts is stopped by pid when it exits (Ctrl-C, SIGTERM, or a child dying).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from types import FrameType

import httpx

from clients.procs import is_healthy, stop_process, worker_command
from core.config import SpecgateConfig, WorkerEntry, load_config
from core.errors import SpecgateError


def serve(config_path: str, port: int | None, startup_timeout: float) -> int:
    try:
        config = load_config(config_path)
    except SpecgateError as exc:
        print(f"specgate serve: error: {exc}", file=sys.stderr)
        return 2
    if port is not None:
        config.gateway.port = port
    local = [w for w in config.workers if w.launch]
    procs = {w.name: start_worker(w) for w in local}
    stop = _StopFlag()
    try:
        if not wait_ready(local, procs, startup_timeout, stop):
            return 1
        print(ready_message(config, local), flush=True)
        return watch(procs, stop)
    finally:
        stop_all(procs)


def start_worker(entry: WorkerEntry) -> subprocess.Popen[bytes]:
    cmd = worker_command(entry.model, entry.backend.value, entry.port)
    print(f"specgate serve: starting worker {entry.name}: {entry.model} ({entry.backend.value}) on {entry.url}", flush=True)
    return subprocess.Popen(cmd)


def wait_ready(entries: list[WorkerEntry], procs: dict[str, subprocess.Popen[bytes]], timeout: float, stop: _StopFlag) -> bool:
    """Poll each worker's /health until it answers; False on timeout, a dead child or a signal."""
    deadline = time.monotonic() + timeout
    pending = {w.name: w for w in entries}
    with httpx.Client(timeout=2.0) as client:
        while pending and not stop.is_set:
            for name, entry in list(pending.items()):
                if procs[name].poll() is not None:
                    print(f"specgate serve: worker {name} exited with {procs[name].returncode}", file=sys.stderr)
                    return False
                if is_healthy(client, entry.url):
                    print(f"specgate serve: worker {name} ready", flush=True)
                    del pending[name]
            if time.monotonic() > deadline:
                print(f"specgate serve: workers not ready after {timeout:.0f} s: {sorted(pending)}", file=sys.stderr)
                return False
            time.sleep(0.5)
    return not pending


def ready_message(config: SpecgateConfig, local: list[WorkerEntry]) -> str:
    workers = ", ".join(f"{w.name}={w.model}@{w.url}" for w in local)
    first = local[0].url if local else "http://127.0.0.1:8101"
    return (
        f"specgate: ready — workers {workers}\n"
        f"  The OpenAI gateway (http://{config.gateway.host}:{config.gateway.port}) lands with issue 4;"
        " until then `serve` runs the workers only.\n"
        f"  Try: curl -s {first}/v1/info"
    )


def watch(procs: dict[str, subprocess.Popen[bytes]], stop: _StopFlag) -> int:
    while not stop.is_set:
        for name, proc in procs.items():
            if proc.poll() is not None:
                print(f"specgate serve: worker {name} exited with {proc.returncode}", file=sys.stderr)
                return 1
        time.sleep(0.5)
    return 0


def stop_all(procs: dict[str, subprocess.Popen[bytes]]) -> None:
    for proc in procs.values():
        if proc.poll() is None:
            proc.terminate()  # all at once, then reap each
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
