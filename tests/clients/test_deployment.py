"""compose.yaml and the Dockerfile: the gateway's environment makes a valid config that points
at the worker services, the set-up is the one `make` runs, and `docker compose config`
accepts the file where docker is present."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from secrets import token_hex as secrets_token

import pytest
import yaml

from core.config import SpecgateConfig, load_config

ROOT = Path(__file__).resolve().parents[2]


def test_the_gateways_environment_points_at_the_worker_services(monkeypatch: pytest.MonkeyPatch) -> None:
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    services = compose["services"]
    gateway_env = services["gateway"]["environment"]
    for name, value in gateway_env.items():
        if value is None:  # passed on from the shell when set there, else unset (never an empty key)
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, _compose_default(value))
    config = load_config(None)  # what `specgate gateway` without --config reads, plus the environment
    assert isinstance(config, SpecgateConfig)
    hosts = {w.url.split("//")[1].split(":")[0] for w in config.workers if w.url}
    assert hosts == {"worker-a", "worker-b"} <= set(services)
    assert [w.weight for w in config.workers] == [0.5, 0.5] and config.draft.threads == 1
    for worker in ("worker-a", "worker-b"):
        command = services[worker]["command"]
        assert command[0] == "worker" and command[command.index("--port") + 1] == "8101"
        assert "SPECGATE_WORKER_TOKEN" in services[worker]["environment"]
    assert json.loads(gateway_env["SPECGATE_WORKERS"])  # valid JSON, as pydantic-settings needs


def _compose_default(value: str) -> str:
    """``${NAME:-default}`` → ``default``, as compose resolves it with NAME unset."""
    match = re.fullmatch(r"\$\{\w+:-(.*)\}", value)
    return match.group(1) if match else value


def test_docker_and_make_share_one_set_up_script() -> None:
    assert "bash scripts/setup.sh /opt/specgate/bin/python" in (ROOT / "Dockerfile").read_text()
    assert "bash scripts/setup.sh $(BIN)/python --dev" in (ROOT / "Makefile").read_text()


@pytest.mark.skipif(shutil.which("docker") is None, reason="docker is not installed here")
def test_docker_compose_accepts_the_file() -> None:
    plugin = (
        subprocess.run(
            ["docker", "compose", "version"], capture_output=True, text=True, timeout=60
        ).returncode
        == 0
    )
    command = ["docker", "compose"] if plugin else [shutil.which("docker-compose") or "docker-compose"]
    assert plugin or shutil.which("docker-compose"), (
        "docker without compose: `make test` installs docker-compose"
    )
    # what its comment has you write to .env
    secrets = {"SPECGATE_WORKER_TOKEN": secrets_token(), "SPECGATE_API_KEY": secrets_token()}
    base = {k: v for k, v in os.environ.items() if not k.startswith("SPECGATE_")}
    out = subprocess.run(
        [*command, "-f", str(ROOT / "compose.yaml"), "config", "--quiet"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env=base | secrets,
    )
    assert out.returncode == 0, out.stderr
    # fail closed (issue 76): without the secrets no service is configured, and the error names the one to set
    out = subprocess.run(
        [*command, "-f", str(ROOT / "compose.yaml"), "config", "--quiet"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env=base,
    )
    assert out.returncode != 0 and "set SPECGATE_WORKER_TOKEN (openssl rand -hex 32)" in out.stderr, (
        out.stderr
    )
