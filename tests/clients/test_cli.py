"""The ``specgate`` console script: --help everywhere, one-line errors, ``serve`` end to end."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest
import yaml

from clients import cli
from clients.procs import free_port
from core.cores import usable_cores
from tests.app.helpers import FULL_RUN

SPECGATE = [sys.executable, "-m", "clients.cli"]
ROOT = Path(__file__).resolve().parents[2]
FEDERATED = "config/federated.yaml"


@pytest.mark.parametrize("args", [[], ["worker"], ["gateway"]])
def test_the_console_script_and_each_server_have_help(args: list[str]) -> None:
    """The script itself, and the two servers it execs (each owns its flags)."""
    out = subprocess.run([*SPECGATE, *args, "--help"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0 and "usage: specgate" in out.stdout


def _commands(parser: argparse.ArgumentParser, above: list[str]) -> list[list[str]]:
    """Every command and subcommand the parser knows, the servers' aside (they exec)."""
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                if [*above, name] not in (["worker"], ["gateway"]):
                    out += [[*above, name], *_commands(sub, [*above, name])]
    return out


@pytest.mark.parametrize("args", _commands(cli.build_parser(), []))
def test_every_command_has_help(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """The parser's own commands, in this process (the script's start-up is tested above)."""
    with pytest.raises(SystemExit) as done:
        cli.main([*args, "--help"])
    assert done.value.code == 0 and "usage: specgate" in capsys.readouterr().out


def test_bench_tree_device_times_each_cell_and_writes_json(tmp_path: Path) -> None:
    """The worker's verify round on the built-in architecture (random weights, CPU here): a row
    per cell, the tree cells through the runner's tree forward."""
    out = tmp_path / "device.json"
    args = [
        "bench",
        "tree-device",
        "--device",
        "cpu",
        "--repeats",
        "1",
        "--budgets",
        "1",
        "4",
        "--prefix",
        "8",
        "--json",
        str(out),
    ]
    run = subprocess.run([*SPECGATE, *args], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r["cell"] for r in rows] == ["chain 1", "chain 4", "tree 4"] and all(
        r["ms_median"] > 0 and r["repeats"] == 1 for r in rows
    )
    assert "tree 4" in run.stdout and "ms/round" in run.stdout and "prefix 8" in run.stdout


def test_bench_grammar_measures_each_grammar_and_writes_json(tmp_path: Path) -> None:
    """llguidance on the built-in vocabulary (xgrammar too where it is installed)."""
    out = tmp_path / "grammar.json"
    run = subprocess.run(
        [*SPECGATE, "bench", "grammar", "--repeats", "1", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr
    engine = json.loads(out.read_text())["engines"]["llguidance"]
    assert set(engine["grammars"]) == {"json_schema (6 fields)", "tools (2, generic format)", "regex (phone)"}
    assert all(
        0 < g["mask_ms_median"] and 0 < g["compile_cold_ms"] and g["answer_tokens"] > 1
        for g in engine["grammars"].values()
    )
    assert "llguidance" in run.stdout and "compile" in run.stdout


def test_bench_structured_summarises_a_cell() -> None:
    """The figures of one cell from its requests (the bench itself starts ``specgate serve``)."""
    from clients.bench.structured import _summary

    def sample(tokens: int, rounds: int, forced: int, valid: bool | None) -> dict[str, object]:
        return {
            "tokens": tokens,
            "seconds": 1.0,
            "rounds": rounds,
            "forced": forced,
            "bytes": 100 * tokens,
            "gateway_ms": 1.0,
            "worker_ms": 2.0,
            "valid": valid,
        }

    row = _summary(
        "exact",
        1.0,
        "schema",
        {True: [sample(20, 5, 4, True), sample(20, 5, 2, False)], False: [sample(20, 10, 0, None)] * 2},
    )
    assert (
        row["tokens_per_round_ratio"] == 2.0
        and row["constrained"]["forced_per_answer"] == 3
        and row["valid_share"] == 0.5
    )
    assert (
        row["speed_ratio"] == 1.0
        and row["mask_gateway_ms"] == 0.0
        and row["constrained"]["bytes_per_token"] == 100
    )


def test_bench_workload_runs_each_drafter_and_writes_json(tmp_path: Path) -> None:
    """The smoke test: one summarization prompt, T = 0, zero link, through real workers and a
    gateway: a row per drafter, lookup's with its hit rate; an unknown category is one line."""
    out = tmp_path / "workload.json"
    args = [
        "bench",
        "workload",
        "--quick",
        "--prompts",
        "1",
        "--max-tokens",
        "12",
        "--categories",
        "summarization",
        "--json",
        str(out),
    ]
    run = subprocess.run([*SPECGATE, *args], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    cells = json.loads(out.read_text())["cells"]
    assert [c["drafter"] for c in cells] == ["model", "lookup", "model+lookup"] and all(
        c["category"] == "summarization" for c in cells
    )
    assert all(c["tokens"] > 0 and c["tokens_per_round"] >= 1 for c in cells)
    assert cells[0]["lookup_hit_rate"] is None and cells[1]["lookup_hit_rate"] is not None
    assert "model+lookup / model" in run.stdout
    bad = subprocess.run(
        [*SPECGATE, "bench", "workload", "--categories", "poetry"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert bad.returncode != 0 and "unknown categories ['poetry']" in bad.stderr


def test_worker_with_a_missing_model_is_a_one_line_error() -> None:
    out = subprocess.run(
        [*SPECGATE, "worker", "--model", "/nope/m.gguf"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert out.returncode == 2
    assert out.stderr.strip() == "specgate worker: error: model not found: /nope/m.gguf"


def test_access_fails_closed_at_start(tmp_path: Path) -> None:
    """Issue 76: a gateway on an address other hosts reach served without a key when its secret was missing or
    misspelt, and deployed the example's `change-me` as the key. Now each is a one-line error before anything
    loads: no key (or token) off loopback unless opted out by name, and a placeholder by name; 127.0.0.1 needs
    none (`make run`)."""
    config = tmp_path / "open.yaml"
    config.write_text("host: 0.0.0.0\nworkers: [{url: 'http://127.0.0.1:1'}]\n")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SPECGATE_")}
    cases = [  # the opt-outs and every placeholder: tests/core/test_access.py, on the settings these read
        (
            ["serve", "--config", str(config)],
            {},
            "SPECGATE_API_KEY is unset: set it (`openssl rand -hex 32`), or set "
            "SPECGATE_ALLOW_NO_API_KEY=true",
        ),
        (
            ["gateway", "--config", str(config)],
            {"SPECGATE_API_KEY": "change-me"},
            "SPECGATE_API_KEY is the placeholder 'change-me'",
        ),
        (["worker", "--host", "0.0.0.0", "--model", "/nope/m.gguf"], {}, "SPECGATE_WORKER_TOKEN is unset"),
    ]
    for args, env, message in cases:
        out = subprocess.run(
            [*SPECGATE, *args], capture_output=True, text=True, timeout=60, cwd=ROOT, env=clean | env
        )
        assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr, (
            args,
            out.stderr,
        )


def test_serve_with_a_bad_config_names_the_key(tmp_path: Path) -> None:
    config = tmp_path / "bad.yaml"
    for text, key in [
        ("port: nine\n", "port"),
        ("limits: {max_tokens: -1}\n", "limits.max_tokens"),
        ("colour: red\n", "colour"),
    ]:
        config.write_text(text + "workers: [{url: 'http://127.0.0.1:1'}]\n")
        for command in ("serve", "gateway"):
            out = subprocess.run(
                [*SPECGATE, command, "--config", str(config)],
                capture_output=True,
                text=True,
                timeout=60,
                cwd=ROOT,
            )
            assert out.returncode == 2 and key in out.stderr and "Traceback" not in out.stderr, out.stderr


@pytest.mark.integration
def test_two_serves_side_by_side_one_killed_hard_the_other_restarts_a_dead_worker_and_stops(
    tmp_path: Path,
) -> None:
    """Two serves on one machine (one picks its worker's port, no collision, no WARNING on a normal start).
    SIGKILL of the first: within 10 s its children are gone and their ports bind again. The second, the
    shipped ``config/federated.yaml`` (its two workers on their ports, mode aggregate), meanwhile: its ready
    and curl lines, each process's share of the cores, a chat through the SDK; a worker killed hard is started
    again on its port and the next request succeeds; SIGTERM stops it and its children, exit 0. (One test:
    each serve starts two or three processes.)"""
    shipped = yaml.safe_load((ROOT / FEDERATED).read_text())
    ports = [w["port"] for w in shipped["workers"]]
    names = [w["name"] for w in shipped["workers"]]
    gateway_port = free_port()
    one = tmp_path / "a.yaml"
    # no worker port: serve picks a free one
    one.write_text(f"port: {free_port()}\nworkers:\n  - {{name: w0, model: builtin, backend: llama.cpp}}\n")
    killed = subprocess.Popen(
        [*SPECGATE, "serve", "--config", str(one)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
    )
    proc = subprocess.Popen(
        [*SPECGATE, "serve", "--config", FEDERATED, "--port", str(gateway_port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
    )
    try:
        lines = _read_until(proc, "specgate: ready", timeout_s=240)
        killed_lines = _read_until(killed, "specgate: ready", timeout_s=240)
        for out in (lines, killed_lines):
            assert not [line for line in out if "WARNING" in line or "Traceback" in line], out
        assert sum("specgate serve: starting" in line and "gateway" not in line for line in lines) == len(
            ports
        ), lines
        assert any("curl" in line for line in _read_lines(proc, 1))

        children = psutil.Process(killed.pid).children()
        listening = sorted(
            c.laddr.port
            for child in children
            for c in child.net_connections("tcp")
            if c.status == psutil.CONN_LISTEN
        )
        assert len(children) == 2 and len(listening) == 2, (children, listening)  # its gateway and its worker
        os.kill(killed.pid, signal.SIGKILL)
        killed.wait()
        gone, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, f"still alive 10 s after serve was killed: {alive}"
        for port in listening:
            with socket.socket() as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(("127.0.0.1", port))

        share = max(1, usable_cores() // 2)  # two local workers: each, and the draft, a half of the cores
        for port in ports:
            assert httpx.get(f"http://127.0.0.1:{port}/v1/info", timeout=10).json()["vocab_size"] == 49152
            assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).json()["threads"] == {
                "model": share,
                "torch": share,
            }
        assert httpx.get(f"http://127.0.0.1:{gateway_port}/health", timeout=10).json()["threads"] == {
            "draft": share,
            "torch": share,
        }
        for child in psutil.Process(proc.pid).children():
            assert child.environ()["OMP_NUM_THREADS"] == str(share)
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{gateway_port}/v1", api_key="unused", max_retries=0, timeout=120
        )
        chat = client.chat.completions.create(
            model="specgate", messages=[{"role": "user", "content": "Say hello"}], max_tokens=8, temperature=0
        )
        assert chat.choices[0].message.content and chat.usage is not None
        assert chat.usage.model_extra["speculative"]["mode"] == "aggregate"  # type: ignore[index]
        body = {"model": "specgate", "prompt": "The sea is", "max_tokens": 3, "temperature": 0}

        # a worker killed hard is started again on its port, and the next request succeeds
        w1 = f"http://127.0.0.1:{ports[1]}"
        before = httpx.get(f"{w1}/health", timeout=10).json()["instance_id"]
        (victim,) = [
            c
            for c in psutil.Process(proc.pid).children()
            if any(k.laddr.port == ports[1] for k in c.net_connections("tcp"))
        ]
        victim.kill()
        lines += _read_until(proc, f"worker {names[1]} is back (restart 1)", timeout_s=180)
        assert any(f"worker {names[1]} exited with -9; restarting it in 1 s" in line for line in lines), lines
        after = httpx.get(f"{w1}/health", timeout=10).json()["instance_id"]
        assert after != before and after.endswith("-1")
        assert "specgate:worker_restarts_total 1.0" in httpx.get(f"{w1}/metrics", timeout=10).text
        deadline = time.monotonic() + 60  # the gateway's breaker closes once the worker answers its probe
        while (
            resp := httpx.post(f"http://127.0.0.1:{gateway_port}/v1/completions", json=body, timeout=60)
        ).status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, lines
        for port in [*ports, gateway_port]:
            with pytest.raises(httpx.ConnectError):
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
    finally:
        for each in (killed, proc):
            if each.poll() is None:
                os.kill(each.pid, signal.SIGKILL)
                each.wait()


def _tiny_config(path: Path, gateway_port: int) -> Path:
    """Two local tiny-random workers with no port (serve picks free ones) and a gateway port."""
    path.write_text(
        f"port: {gateway_port}\ndraft: {{model: tiny-random, backend: transformers}}\nworkers:\n"
        + "".join(f"  - {{name: w{i}, model: 'tiny-random:{i}', backend: transformers}}\n" for i in range(2))
    )
    return path


def test_serve_on_a_taken_port_is_a_one_line_error(tmp_path: Path) -> None:
    """A port held by a foreign listener: one line naming the port and the entry, exit 2,
    before anything is started."""
    with socket.socket() as foreign:
        foreign.bind(("127.0.0.1", 0))
        foreign.listen()
        port = foreign.getsockname()[1]
        cases = [
            (_tiny_config(tmp_path / "gateway.yaml", port), f"port {port} of the gateway"),
            (tmp_path / "worker.yaml", f"port {port} of worker w1"),
        ]
        cases[1][0].write_text(
            f"workers:\n  - {{name: w0, model: tiny-random}}\n  - {{name: w1, model: "
            f"tiny-random, port: {port}}}\n"
        )
        for config, named in cases:
            out = subprocess.run(
                [*SPECGATE, "serve", "--config", str(config)],
                capture_output=True,
                text=True,
                timeout=60,
                cwd=ROOT,
            )
            assert out.returncode == 2 and named in out.stderr and out.stderr.count("\n") == 1, out.stderr
            assert "starting" not in out.stdout


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
    out = subprocess.run(
        [*SPECGATE, "worker", "--model", "tiny-random"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=env,
    )
    assert out.returncode == 2 and "max_context" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.integration
@pytest.mark.parametrize(
    ("config", "mode", "started"),
    [
        ("config/pipeline.yaml", "pipeline", 3),
        # federated.yaml: the two-serves test above serves it by default. one-worker.yaml: one local llama.cpp
        # worker, as the first serve of that test; tests/clients/test_shipped_configs.py loads it
        pytest.param("config/federated.yaml", "aggregate", 2, marks=FULL_RUN),
        pytest.param("config/one-worker.yaml", "split", 1, marks=FULL_RUN),
    ],
)
def test_a_shipped_config_starts_and_answers_through_the_openai_api(
    config: str, mode: str, started: int
) -> None:
    """``specgate serve --config config/…``: its local workers or stages, the gateway in the
    config's mode, a chat completion through the SDK. (``config/builtin.yaml``'s two workers and
    mode are federated.yaml's; ``config/engine.yaml`` needs an engine running elsewhere;
    federated.yaml and one-worker.yaml here with SPECGATE_FULL_STATISTICS=1.)"""
    port = free_port()
    proc = subprocess.Popen(
        [*SPECGATE, "serve", "--config", config, "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
    )
    try:
        lines = _read_until(proc, "specgate: ready", timeout_s=300)
        assert (
            sum("specgate serve: starting" in line and "gateway" not in line for line in lines) == started
        ), lines
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120
        )
        chat = client.chat.completions.create(
            model="specgate", messages=[{"role": "user", "content": "Say hello"}], max_tokens=8, temperature=0
        )
        assert chat.choices[0].message.content and chat.usage is not None
        assert chat.usage.model_extra["speculative"]["mode"] == mode  # type: ignore[index]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


def test_serve_restarts_with_backoff_and_gives_up_on_a_worker_that_keeps_dying() -> None:
    from clients.serve import DEATH_WINDOW_S, MAX_BACKOFF_S, MAX_DEATHS, Restarts

    now = [0.0]
    restarts = Restarts(clock=lambda: now[0])
    restarts.add("w1", "http://127.0.0.1:1/health", lambda n: None)  # type: ignore[arg-type, return-value]
    delays = []
    for _ in range(MAX_DEATHS - 1):
        delays.append(restarts.died("w1"))
        now[0] += 10.0
    assert (
        delays == [min(MAX_BACKOFF_S, 2.0**i) for i in range(MAX_DEATHS - 1)]
        and restarts.count["w1"] == MAX_DEATHS - 1
    )
    assert restarts.died("w1") is None  # the MAX_DEATHS-th death within the window: give up
    calm = Restarts(clock=lambda: now[0])
    calm.add("w1", "http://127.0.0.1:1/health", lambda n: None)  # type: ignore[arg-type, return-value]
    for _ in range(3 * MAX_DEATHS):  # deaths further apart than the window never add up
        assert calm.died("w1") == 1.0
        now[0] += DEATH_WINDOW_S
