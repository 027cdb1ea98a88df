"""``specgate serve``: the local workers of a config, then — once they answer — the gateway. Every child is
stopped by pid on exit and dies with ``serve`` (``PR_SET_PDEATHSIG``); its instance id, in its ``/health``,
tells it from a stranger on its port; a local worker or stage that dies is restarted with backoff
(``Restarts``)."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from functools import partial
from pathlib import Path

import httpx

from clients.procs import child_env, free_port, stop_process, worker_command
from core.config import SpecgateConfig, StageEntry, WorkerEntry, dump_config, load_config
from core.cores import usable_cores
from core.errors import ConfigError, SpecgateError

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def serve(config_path: str | None, port: int | None, startup_timeout: float) -> int:
    try:
        config = load_config(config_path).with_local_urls(free_port).with_split_cores(usable_cores())
        if port is not None:
            config.port = port
        config.check_access()
        if taken := taken_port(config):
            raise ConfigError(taken)
        for secret, variable in (("api_key", "SPECGATE_API_KEY"), ("worker_token", "SPECGATE_WORKER_TOKEN")):
            if (value := getattr(config, secret)) is not None:
                # the config file the children read leaves secrets out
                os.environ[variable] = value
    except SpecgateError as exc:
        print(f"specgate serve: error: {exc}", file=sys.stderr)
        return 2
    stop, instance = threading.Event(), uuid.uuid4().hex[:12]
    for signum in (signal.SIGINT, signal.SIGTERM):  # the loops below end, and the children are stopped
        signal.signal(signum, lambda *_: stop.set())
    procs: dict[str, subprocess.Popen[bytes]] = {}
    restarts = Restarts()
    with tempfile.TemporaryDirectory(prefix="specgate-") as tmp:
        try:
            for worker in (w for w in config.workers if w.is_local):
                restarts.add(
                    worker.name or "",
                    f"{config.worker_url(worker)}/health",
                    partial(start_worker, config, worker, instance),
                )
            for name, stage in local_stages(config):
                restarts.add(
                    name, f"http://127.0.0.1:{stage.port}/health", partial(start_stage, name, stage, instance)
                )
            for name in restarts.starters:
                procs[name] = restarts.start(name)
            # the gateway checks its workers at start-up: start it once they answer
            workers = {name: (restarts.health[name], f"{instance}-{name}-0") for name in restarts.starters}
            if not wait_ready(workers, procs, startup_timeout, stop):
                return 1
            resolved = Path(tmp) / "config.yaml"
            resolved.write_text(dump_config(config))
            print(f"specgate serve: starting the gateway on http://{config.host}:{config.port}", flush=True)
            command = [sys.executable, "-m", "app", "--config", str(resolved), "--log-level", "warning"]
            procs["gateway"] = _start(command, config.draft.threads, f"{instance}-gateway")
            gateway = {
                "gateway": (
                    f"http://{config.host}:{config.metrics_port or config.port}/health/ready",
                    f"{instance}-gateway",
                )
            }
            if not wait_ready(gateway, procs, startup_timeout, stop):
                return 1
            print(ready_message(config), flush=True)
            return watch(procs, stop, restarts)
        finally:
            stop_all(procs, config.limits.drain_timeout_s)


def taken_port(config: SpecgateConfig) -> str | None:
    """What names the first port this config needs that something already listens on."""
    wanted = [(f"worker {w.name}", "127.0.0.1", w.port) for w in config.workers if w.is_local]
    wanted += [(name, "127.0.0.1", stage.port) for name, stage in local_stages(config)]
    wanted += [("the gateway", config.host, config.port)] + (
        [("the gateway's metrics", config.host, config.metrics_port)] if config.metrics_port else []
    )
    for entry, host, port in wanted:
        assert port is not None
        if not _can_bind(host, port):
            return (
                f"port {port} of {entry} is already in use (another specgate serve, or another "
                "program); free it or change the port in the config"
            )
    return None


def _can_bind(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def start_worker(
    config: SpecgateConfig, entry: WorkerEntry, instance: str, restarts: int = 0
) -> subprocess.Popen[bytes]:
    """A local worker, as ``Restarts`` starts it: its instance id names the restart."""
    assert entry.model is not None and entry.port is not None
    print(
        f"specgate serve: starting worker {entry.name}: {entry.model} ({entry.backend.value}, "
        f"threads={entry.threads}) on {config.worker_url(entry)}",
        flush=True,
    )
    command = worker_command(entry.model, entry.backend.value, entry.port, entry.threads)
    return _start(command, entry.threads, f"{instance}-{entry.name}-{restarts}", restarts)


def local_stages(config: SpecgateConfig) -> list[tuple[str, StageEntry]]:
    """The pipeline stages this config starts, each with its name (``<worker> stage <i>``)."""
    return [
        (f"{w.name} stage {i + 1}", s)
        for w in config.workers
        for i, s in enumerate(w.pipeline or [])
        if s.is_local
    ]


def start_stage(name: str, stage: StageEntry, instance: str, restarts: int = 0) -> subprocess.Popen[bytes]:
    assert stage.model is not None and stage.port is not None
    link = f", link {stage.link_rtt_ms:g} ms rtt" if stage.link_rtt_ms else ""
    print(
        f"specgate serve: starting {name}: {stage.model} layers {stage.layers} (transformers, "
        f"threads={stage.threads}{link}) on http://127.0.0.1:{stage.port}",
        flush=True,
    )
    command = worker_command(
        stage.model,
        "transformers",
        stage.port,
        stage.threads,
        layers=stage.layers,
        link_rtt_ms=stage.link_rtt_ms,
        link_mbps=stage.link_mbps,
    )
    return _start(command, stage.threads, f"{instance}-{name}-{restarts}", restarts)


def _start(
    command: list[str], threads: int | None, instance_id: str, restarts: int = 0
) -> subprocess.Popen[bytes]:
    # its own process group: a terminal's Ctrl-C reaches `serve` alone, which stops the
    # gateway first (it drains its streams, which still need the workers), then the workers;
    # its share of the cores for every thread pool it has (``child_env``, ``load_runner``)
    command = [*command, "--instance-id", instance_id] + (["--restarts", str(restarts)] if restarts else [])
    return subprocess.Popen(command, process_group=0, preexec_fn=_die_with_parent(), env=child_env(threads))


def _die_with_parent() -> Callable[[], None] | None:
    """For the child, between fork and exec: SIGTERM when this process dies, however (None off Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    libc, parent = ctypes.CDLL(None, use_errno=True), os.getpid()

    def arm() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before the call: nothing will signal
            os.kill(os.getpid(), signal.SIGTERM)

    return arm


def wait_ready(
    checks: dict[str, tuple[str, str]],
    procs: dict[str, subprocess.Popen[bytes]],
    timeout: float,
    stop: threading.Event,
) -> bool:
    """Poll each (URL, instance id) in order until it answers; False on timeout, a dead child or a signal."""
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=2.0) as client:
        for name, (url, instance_id) in checks.items():
            while not _answers(client, url, instance_id):
                dead = [n for n, p in procs.items() if p.poll() is not None]
                if dead:
                    print(
                        f"specgate serve: {dead[0]} exited with {procs[dead[0]].returncode}", file=sys.stderr
                    )
                    return False
                if stop.is_set() or time.monotonic() > deadline:
                    print(f"specgate serve: {name} not ready after {timeout:.0f} s", file=sys.stderr)
                    return False
                time.sleep(0.1)
            print(f"specgate serve: {name} ready", flush=True)
    return True


def _answers(client: httpx.Client, url: str, instance_id: str | None = None) -> bool:
    """200 (from the process we started: another one on the port reports another id)."""
    try:
        resp = client.get(url)
        return resp.status_code == 200 and (
            instance_id is None or resp.json().get("instance_id") == instance_id
        )
    except (httpx.HTTPError, ValueError, AttributeError):
        return False


def ready_message(config: SpecgateConfig) -> str:
    base = f"http://{config.host}:{config.port}"
    workers = ", ".join(
        f"{w.name}=pipeline({', '.join(config.stage_urls(w))})"
        if w.pipeline is not None
        else f"{w.name}={w.model if w.is_local else config.worker_url(w)}"
        for w in config.workers
    )
    return (
        f"specgate: ready on {base} — model {config.model!r}, mode {config.speculative.mode}, "
        f"draft {config.draft.model}, workers {workers}\n"
        f"  Try: curl -s {base}/v1/chat/completions -H 'Content-Type: application/json' "
        f'-d \'{{"model": "{config.model}", "messages": [{{"role": "user", "content": "Say '
        f'hello"}}], "max_tokens": 32}}\''
    )


MAX_DEATHS = 5  # a worker that dies this often …
DEATH_WINDOW_S = 300.0  # … within this long is given up on: serve stops, saying why
FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0


class Restarts:
    """Restarts of ``serve``'s local workers and stages: a death waits FIRST_BACKOFF_S, doubled per earlier
    death in the window (≤ MAX_BACKOFF_S); the MAX_DEATHS-th death within DEATH_WINDOW_S is final."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.starters: dict[str, Callable[[int], subprocess.Popen[bytes]]] = {}
        self.health: dict[str, str] = {}
        self.count: dict[str, int] = {}  # restarts so far (what the worker's /metrics reports)
        self.deaths: dict[str, list[float]] = {}
        self.due: dict[str, float] = {}  # name -> when to start it again

    def add(self, name: str, health_url: str, starter: Callable[[int], subprocess.Popen[bytes]]) -> None:
        self.starters[name], self.health[name], self.count[name], self.deaths[name] = (
            starter,
            health_url,
            0,
            [],
        )

    def start(self, name: str) -> subprocess.Popen[bytes]:
        self.due.pop(name, None)
        return self.starters[name](self.count[name])

    def died(self, name: str) -> float | None:
        """Record a death: the seconds until the restart, or None to give up."""
        now = self.clock()
        recent = [t for t in self.deaths[name] if now - t < DEATH_WINDOW_S] + [now]
        self.deaths[name] = recent
        if len(recent) >= MAX_DEATHS:
            return None
        delay = min(MAX_BACKOFF_S, FIRST_BACKOFF_S * 2 ** (len(recent) - 1))
        self.count[name] += 1
        self.due[name] = now + delay
        return delay

    def ready_to_start(self) -> list[str]:
        now = self.clock()
        return [name for name, at in self.due.items() if at <= now]


def watch(procs: dict[str, subprocess.Popen[bytes]], stop: threading.Event, restarts: Restarts) -> int:
    """Until a signal, restart what died (``Restarts``); a dead gateway, or a worker that keeps dying, ends
    ``serve`` (1)."""
    back: dict[str, str] = {}  # restarted, not yet answering: name -> its health URL
    with httpx.Client(timeout=2.0) as client:
        while not stop.is_set():
            for name, proc in procs.items():
                if proc.poll() is None or name in restarts.due:
                    continue
                if name not in restarts.starters:
                    print(
                        f"specgate serve: {name} exited with {proc.returncode}; stopping",
                        file=sys.stderr,
                        flush=True,
                    )
                    return 1
                delay = restarts.died(name)
                back.pop(name, None)
                if delay is None:
                    print(
                        f"specgate serve: worker {name} exited with {proc.returncode}, its "
                        f"{MAX_DEATHS}th death within "
                        f"{DEATH_WINDOW_S:.0f} s: giving up, stopping everything (see its log above)",
                        file=sys.stderr,
                        flush=True,
                    )
                    return 1
                print(
                    f"specgate serve: worker {name} exited with {proc.returncode}; restarting it "
                    f"in {delay:.0f} s (restart {restarts.count[name]})",
                    file=sys.stderr,
                    flush=True,
                )
            for name in restarts.ready_to_start():
                procs[name] = restarts.start(name)
                back[name] = restarts.health[name]
            for name, url in list(back.items()):
                if procs[name].poll() is None and _answers(client, url):
                    print(
                        f"specgate serve: worker {name} is back (restart {restarts.count[name]})", flush=True
                    )
                    del back[name]
            time.sleep(0.5)
    return 0


def stop_all(procs: dict[str, subprocess.Popen[bytes]], drain_s: float = 30.0) -> None:
    """The gateway first (it drains its streams, which still need the workers), then the workers."""
    if "gateway" in procs:
        stop_process(procs["gateway"], grace_s=drain_s + 10)
    for proc in procs.values():
        if proc.poll() is None:
            proc.terminate()  # the workers at once, then reap each
    for proc in procs.values():
        stop_process(proc)
