"""``specgate serve``: the local workers of a config, then — once they answer — the gateway;
report when ready.

Every process it starts is stopped by pid when it exits (Ctrl-C, SIGTERM, or a child dying),
and dies with it when it dies hard (``kill -9``, the OOM killer): on Linux each child asks the
kernel for SIGTERM when its parent goes (``prctl(PR_SET_PDEATHSIG)``). Each child gets an
instance id that its ``/health`` reports, so a process left on a port by something else is
never taken for one of ours. Local workers without a ``port`` take free ports.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from types import FrameType

import httpx

from clients.procs import child_env, free_port, stop_process, worker_command
from core.config import SpecgateConfig, StageEntry, WorkerEntry, dump_config, load_config
from core.errors import SpecgateError

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def serve(config_path: str | None, port: int | None, startup_timeout: float) -> int:
    try:
        config = load_config(config_path).with_local_urls(free_port).with_split_cores(os.cpu_count() or 1)
    except SpecgateError as exc:
        print(f"specgate serve: error: {exc}", file=sys.stderr)
        return 2
    if port is not None:
        config.port = port
    taken = taken_port(config)
    if taken:
        print(f"specgate serve: error: {taken}", file=sys.stderr)
        return 2
    stop, instance = _StopFlag(), uuid.uuid4().hex[:12]
    procs: dict[str, subprocess.Popen[bytes]] = {}
    with tempfile.TemporaryDirectory(prefix="specgate-") as tmp:
        try:
            local = [w for w in config.workers if w.is_local]
            for worker in local:
                procs[worker.name or ""] = start_worker(config, worker, f"{instance}-{worker.name}")
            # the gateway checks its workers at start-up: start it once they answer
            workers = {w.name or "": (f"{config.worker_url(w)}/health", f"{instance}-{w.name}") for w in local}
            for name, stage in local_stages(config):
                procs[name] = start_stage(name, stage, f"{instance}-{name}")
                workers[name] = (f"http://127.0.0.1:{stage.port}/health", f"{instance}-{name}")
            if not wait_ready(workers, procs, startup_timeout, stop):
                return 1
            resolved = Path(tmp) / "config.yaml"
            resolved.write_text(dump_config(config))
            print(f"specgate serve: starting the gateway on http://{config.host}:{config.port}", flush=True)
            command = [sys.executable, "-m", "app", "--config", str(resolved), "--log-level", "warning", "--instance-id", f"{instance}-gateway"]
            procs["gateway"] = _start(command, config.draft.threads)
            gateway = {"gateway": (f"http://{config.host}:{config.port}/health/ready", f"{instance}-gateway")}
            if not wait_ready(gateway, procs, startup_timeout, stop):
                return 1
            print(ready_message(config), flush=True)
            return watch(procs, stop)
        finally:
            stop_all(procs, config.limits.drain_timeout_s)


def taken_port(config: SpecgateConfig) -> str | None:
    """What names the first port this config needs that something already listens on."""
    wanted = [(f"worker {w.name}", "127.0.0.1", w.port) for w in config.workers if w.is_local]
    wanted += [(name, "127.0.0.1", stage.port) for name, stage in local_stages(config)]
    for entry, host, port in [*wanted, ("the gateway", config.host, config.port)]:
        assert port is not None
        if not _can_bind(host, port):
            return f"port {port} of {entry} is already in use (another specgate serve, or another program); free it or change the port in the config"
    return None


def _can_bind(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def start_worker(config: SpecgateConfig, entry: WorkerEntry, instance_id: str) -> subprocess.Popen[bytes]:
    assert entry.model is not None and entry.port is not None
    url = config.worker_url(entry)
    print(f"specgate serve: starting worker {entry.name}: {entry.model} ({entry.backend.value}, threads={entry.threads}) on {url}", flush=True)
    return _start([*worker_command(entry.model, entry.backend.value, entry.port, entry.threads), "--instance-id", instance_id], entry.threads)


def local_stages(config: SpecgateConfig) -> list[tuple[str, StageEntry]]:
    """The pipeline stages this config starts, each with its name (``<worker> stage <i>``)."""
    return [(f"{w.name} stage {i + 1}", s) for w in config.workers for i, s in enumerate(w.pipeline or []) if s.is_local]


def start_stage(name: str, stage: StageEntry, instance_id: str) -> subprocess.Popen[bytes]:
    assert stage.model is not None and stage.port is not None
    link = f", link {stage.link_rtt_ms:g} ms rtt" if stage.link_rtt_ms else ""
    print(f"specgate serve: starting {name}: {stage.model} layers {stage.layers} (transformers, threads={stage.threads}{link}) on http://127.0.0.1:{stage.port}", flush=True)
    command = worker_command(stage.model, "transformers", stage.port, stage.threads, layers=stage.layers, link_rtt_ms=stage.link_rtt_ms, link_mbps=stage.link_mbps)
    return _start([*command, "--instance-id", instance_id], stage.threads)


def _start(command: list[str], threads: int | None) -> subprocess.Popen[bytes]:
    # its own process group: a terminal's Ctrl-C reaches `serve` alone, which stops the
    # gateway first (it drains its streams, which still need the workers), then the workers;
    # its share of the cores for every thread pool it has (``child_env``, ``load_runner``)
    return subprocess.Popen(command, process_group=0, preexec_fn=_die_with_parent(), env=child_env(threads))


def _die_with_parent() -> Callable[[], None] | None:
    """For the child, between fork and exec: SIGTERM when this process dies, however it dies
    (Linux's PR_SET_PDEATHSIG; elsewhere None: only a clean exit stops the children)."""
    if not sys.platform.startswith("linux"):
        return None
    libc, parent = ctypes.CDLL(None, use_errno=True), os.getpid()

    def arm() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before the call: nothing will signal
            os.kill(os.getpid(), signal.SIGTERM)

    return arm


def wait_ready(checks: dict[str, tuple[str, str]], procs: dict[str, subprocess.Popen[bytes]], timeout: float, stop: _StopFlag) -> bool:
    """Poll each (URL, instance id) until it answers 200 with that instance id, in order; False
    on timeout, a dead child or a signal."""
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=2.0) as client:
        for name, (url, instance_id) in checks.items():
            while not _answers(client, url, instance_id):
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


def _answers(client: httpx.Client, url: str, instance_id: str) -> bool:
    """200 from the process we started (another one on the port reports another id)."""
    try:
        resp = client.get(url)
        return resp.status_code == 200 and resp.json().get("instance_id") == instance_id
    except (httpx.HTTPError, ValueError, AttributeError):
        return False


def ready_message(config: SpecgateConfig) -> str:
    base = f"http://{config.host}:{config.port}"
    workers = ", ".join(
        f"{w.name}=pipeline({', '.join(config.stage_urls(w))})" if w.pipeline is not None else f"{w.name}={w.model if w.is_local else config.worker_url(w)}"
        for w in config.workers
    )
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
