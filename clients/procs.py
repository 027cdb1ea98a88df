"""Local server processes the CLI (and the tests) start: bounded waits, stopped by pid."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

import httpx


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def worker_command(
    model: str,
    backend: str,
    port: int,
    threads: int | None = None,
    log_level: str = "warning",
    layers: str | None = None,
    link_rtt_ms: float = 0.0,
    link_mbps: float = 0.0,
    host: str = "127.0.0.1",
    extra: Sequence[str] = (),
) -> list[str]:
    """``specgate worker`` on ``host`` (a loopback address); ``layers``: a pipeline stage (with its outgoing
    link's emulation); ``extra``: more flags (``--memory-cap-mb 128``)."""
    command = [
        sys.executable,
        "-m",
        "workers",
        "--model",
        model,
        "--backend",
        backend,
        "--host",
        host,
        "--port",
        str(port),
        "--log-level",
        log_level,
    ]
    if layers:
        command += ["--layers", layers, "--link-rtt-ms", str(link_rtt_ms), "--link-mbps", str(link_mbps)]
    return command + (["--threads", str(threads)] if threads else []) + list(extra)


def child_env(threads: int | None) -> dict[str, str] | None:
    """A child's env with its native thread pools sized to ``threads`` before ``load_runner``'s
    ``torch.set_num_threads``; None (inherit) for every core."""
    if not threads:
        return None
    pools = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
    return {**os.environ, **{name: str(threads) for name in pools}}


def stop_process(proc: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after ``grace_s``; always reaps the child."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class ServerProcess:
    """A server from ``command`` for a ``with`` block, ready when ``url + ready_path`` answers 200; stopped by
    pid. Usage: ``with WorkerProcess("builtin", "llama.cpp") as url: httpx.get(url + "/v1/info")``"""

    def __init__(
        self,
        command: list[str],
        port: int,
        ready_path: str = "/health",
        timeout_s: float = 300.0,
        cwd: str | None = None,
        threads: int | None = None,
        grace_s: float = 10.0,
        host: str = "127.0.0.1",
    ) -> None:
        self.command, self.port, self.ready_path, self.timeout_s = command, port, ready_path, timeout_s
        self.cwd, self.threads, self.grace_s = cwd, threads, grace_s
        self.url = f"http://{host}:{port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> str:
        self.proc = subprocess.Popen(
            self.command, stdout=subprocess.DEVNULL, cwd=self.cwd, env=child_env(self.threads)
        )
        deadline = time.monotonic() + self.timeout_s
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.command[2]} exited with {self.proc.returncode}")
                try:
                    if client.get(f"{self.url}{self.ready_path}").status_code == 200:
                        return self.url
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
        self.__exit__()
        raise RuntimeError(f"{' '.join(self.command[2:4])} not ready after {self.timeout_s:.0f} s")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            stop_process(self.proc, self.grace_s)


def WorkerProcess(
    model: str,
    backend: str,
    port: int | None = None,
    threads: int | None = None,
    timeout_s: float = 300.0,
    cwd: str | None = None,
    host: str = "127.0.0.1",
    extra: Sequence[str] = (),
) -> ServerProcess:
    """A real worker on ``host`` (127.0.0.1; a free port unless given); ``cwd``: the code of another checkout;
    ``extra``: more flags."""
    port = port or free_port()
    return ServerProcess(
        worker_command(model, backend, port, threads, host=host, extra=extra),
        port,
        "/health",
        timeout_s,
        cwd,
        threads,
        host=host,
    )


def StageProcess(
    layers: str,
    model: str = "builtin",
    port: int | None = None,
    threads: int | None = 1,
    link_rtt_ms: float = 0.0,
    timeout_s: float = 300.0,
) -> ServerProcess:
    """A pipeline stage worker (transformers) serving ``layers`` (first:end) on 127.0.0.1."""
    port = port or free_port()
    return ServerProcess(
        worker_command(model, "transformers", port, threads, layers=layers, link_rtt_ms=link_rtt_ms),
        port,
        "/health",
        timeout_s,
        threads=threads,
    )


def GatewayProcess(
    config_path: str, port: int | None = None, timeout_s: float = 300.0, cwd: str | None = None
) -> ServerProcess:
    """A real gateway on 127.0.0.1 for a config file; ready when its workers are."""
    port = port or free_port()
    command = [
        sys.executable,
        "-m",
        "app",
        "--config",
        config_path,
        "--port",
        str(port),
        "--log-level",
        "warning",
    ]
    return ServerProcess(command, port, "/health/ready", timeout_s, cwd)


def serve_process(config: str | None, port: int, timeout_s: float = 600.0) -> ServerProcess:
    """``specgate serve`` (gateway + its local workers) on ``port``, ready when ``/health/ready`` answers;
    SIGTERM at the end: it drains, then stops all."""
    command = [sys.executable, "-m", "clients.cli", "serve", "--port", str(port)] + (
        ["--config", config] if config else []
    )
    return ServerProcess(command, port, "/health/ready", timeout_s, grace_s=60)
