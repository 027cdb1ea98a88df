"""The ``specgate`` console script: --help everywhere, one-line errors, ``serve`` end to end."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from clients.procs import free_port

SPECGATE = [sys.executable, "-m", "clients.cli"]
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("args", [[], ["worker"], ["gateway"], ["serve"], ["bench"], ["bench", "worker"], ["bench", "dsd"], ["bench", "load"]])
def test_every_command_has_help(args: list[str]) -> None:
    out = subprocess.run([*SPECGATE, *args, "--help"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0 and "usage: specgate" in out.stdout


def test_worker_with_a_missing_model_is_a_one_line_error() -> None:
    out = subprocess.run([*SPECGATE, "worker", "--model", "/nope/m.gguf"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 2
    assert out.stderr.strip() == "specgate worker: error: model not found: /nope/m.gguf"


def test_serve_with_a_bad_config_names_the_key(tmp_path: Path) -> None:
    config = tmp_path / "bad.yaml"
    for text, key in [("port: nine\n", "port"), ("limits: {max_tokens: -1}\n", "limits.max_tokens"), ("colour: red\n", "colour")]:
        config.write_text(text + "workers: [{url: 'http://127.0.0.1:1'}]\n")
        for command in ("serve", "gateway"):
            out = subprocess.run([*SPECGATE, command, "--config", str(config)], capture_output=True, text=True, timeout=60, cwd=ROOT)
            assert out.returncode == 2 and key in out.stderr and "Traceback" not in out.stderr, out.stderr


@pytest.mark.integration
def test_serve_starts_gateway_and_workers_prints_ready_and_stops_them(tmp_path: Path) -> None:
    ports = [free_port(), free_port()]
    gateway_port = free_port()
    config = tmp_path / "two.yaml"
    config.write_text(
        f"port: {gateway_port}\ndraft: {{model: tiny-random, backend: transformers}}\nworkers:\n"
        + "".join(f"  - {{name: w{i}, port: {p}, model: 'tiny-random:{i}', backend: transformers}}\n" for i, p in enumerate(ports))
    )
    proc = subprocess.Popen([*SPECGATE, "serve", "--config", str(config)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    try:
        lines = _read_until(proc, "specgate: ready", timeout_s=240)
        assert any("curl" in line for line in _read_lines(proc, 1))
        for port in ports:
            assert httpx.get(f"http://127.0.0.1:{port}/v1/info", timeout=10).json()["vocab_size"] == 49152
        body = {"model": "specgate", "prompt": "Hi", "max_tokens": 3}
        resp = httpx.post(f"http://127.0.0.1:{gateway_port}/v1/completions", json=body, timeout=60)
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, lines
        for port in [*ports, gateway_port]:
            with pytest.raises(httpx.ConnectError):
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


def _read_until(proc: subprocess.Popen[str], marker: str, timeout_s: float) -> list[str]:
    deadline, lines = time.monotonic() + timeout_s, []
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        lines.append(line)
        if marker in line:
            return lines
    raise AssertionError(f"no {marker!r} within {timeout_s} s: {lines}")


def _read_lines(proc: subprocess.Popen[str], count: int) -> list[str]:
    assert proc.stdout is not None
    return [proc.stdout.readline() for _ in range(count)]


def test_worker_settings_from_the_environment_are_validated() -> None:
    env = {**os.environ, "SPECGATE_WORKER_MAX_CONTEXT": "lots"}
    out = subprocess.run([*SPECGATE, "worker", "--model", "tiny-random"], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert out.returncode == 2 and "max_context" in out.stderr and "Traceback" not in out.stderr
