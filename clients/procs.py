"""Local server processes the CLI (and the tests) start: bounded waits, stopped by pid."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def worker_command(model: str, backend: str, port: int, host: str = "127.0.0.1", log_level: str = "warning") -> list[str]:
    return [sys.executable, "-m", "workers", "--model", model, "--backend", backend, "--host", host, "--port", str(port), "--log-level", log_level]


def is_healthy(client: httpx.Client, url: str) -> bool:
    try:
        return client.get(f"{url}/health").status_code == 200
    except httpx.HTTPError:
        return False


def stop_process(proc: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after ``grace_s``; always reaps the child."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class WorkerProcess:
    """A real worker on 127.0.0.1 for the length of a ``with`` block.

    Usage: ``with WorkerProcess("builtin", "llama.cpp") as url: httpx.get(url + "/v1/info")``
    """

    def __init__(self, model: str, backend: str, port: int | None = None, timeout_s: float = 300.0) -> None:
        self.model, self.backend, self.timeout_s = model, backend, timeout_s
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> str:
        self.proc = subprocess.Popen(worker_command(self.model, self.backend, self.port), stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + self.timeout_s
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"worker {self.model} exited with {self.proc.returncode}")
                if is_healthy(client, self.url):
                    return self.url
                time.sleep(0.3)
        self.__exit__()
        raise RuntimeError(f"worker {self.model} not ready after {self.timeout_s:.0f} s")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            stop_process(self.proc)
