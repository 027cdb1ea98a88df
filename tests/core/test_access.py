"""Access fails closed (issue 76): a key or token that is a placeholder is refused by name, and a server on an
address other hosts reach needs one unless the deployment opts out (tests/clients/test_cli.py runs the
servers)."""

from __future__ import annotations

import pytest

from core.config import SpecgateConfig, is_loopback, is_placeholder
from core.errors import ConfigError
from workers.settings import WorkerSettings

WORKERS = [{"url": "http://127.0.0.1:1"}]


@pytest.mark.parametrize(
    "value",
    [
        "change-me",
        "CHANGE_ME",
        "changeme",
        "replace-me",
        " secret ",
        "<your-api-key>",
        "xxxx",
        "****",
        "None",
        "your_token",
    ],
)
def test_a_placeholder_is_refused_by_name(value: str) -> None:
    assert is_placeholder(value)
    with pytest.raises(ValueError, match="SPECGATE_API_KEY is the placeholder"):
        SpecgateConfig(workers=WORKERS, api_key=value)
    with pytest.raises(ValueError, match="SPECGATE_WORKER_TOKEN is the placeholder"):
        WorkerSettings(token=value)


@pytest.mark.parametrize(
    "value", ["3f9a0c1e5b7d2a4c6e8f0a1b3c5d7e9f", "sk-right", "change-me-7f3a91", "tokenized", "unused"]
)
def test_a_real_value_is_kept(value: str) -> None:
    assert not is_placeholder(value)
    assert SpecgateConfig(workers=WORKERS, api_key=value).api_key == value


def test_no_key_off_loopback_needs_an_explicit_opt_out() -> None:
    assert [
        is_loopback(h)
        for h in ("127.0.0.1", "127.0.0.2", "::1", "localhost", "0.0.0.0", "::", "10.0.0.7", "gateway.local")
    ] == [True] * 4 + [False] * 4
    SpecgateConfig(workers=WORKERS).check_access()  # 127.0.0.1: `make run`
    with pytest.raises(
        ConfigError, match="binds 0.0.0.0, which other hosts reach, and SPECGATE_API_KEY is unset"
    ):
        SpecgateConfig(workers=WORKERS, host="0.0.0.0").check_access()
    SpecgateConfig(workers=WORKERS, host="0.0.0.0", api_key="3f9a0c1e5b7d").check_access()
    SpecgateConfig(workers=WORKERS, host="0.0.0.0", allow_no_api_key=True).check_access()
    with pytest.raises(ConfigError, match="SPECGATE_WORKER_TOKEN is unset"):
        WorkerSettings(host="0.0.0.0").check_access()
    WorkerSettings(host="0.0.0.0", allow_no_token=True).check_access()
    WorkerSettings().check_access()


def test_with_a_metrics_port_each_port_answers_its_own_paths() -> None:
    """Issue 76: /metrics and /health/ready (which lists the replicas' addresses) were open through the
    gateway's Service. With a metrics port they answer there alone, the API on its own port alone, the probes
    on both (the pod-level run, tests/integration/test_kubernetes_pods.py, asks a real gateway on its two
    sockets)."""
    import asyncio

    from core.serving import PortSplit

    async def app(scope: dict, receive: object, send: object) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})  # type: ignore[operator]
        await send({"type": "http.response.body", "body": b"ok"})  # type: ignore[operator]

    async def status(path: str, port: int) -> int:
        sent: list[dict] = []

        async def send(message: dict) -> None:
            sent.append(message)

        await PortSplit(app, metrics_port=9090)(
            {"type": "http", "path": path, "server": ("10.0.0.5", port)}, None, send
        )  # type: ignore[arg-type]
        return int(sent[0]["status"])

    paths = [
        "/v1/chat/completions",
        "/metrics",
        "/health/ready",
        "/health",
        "/health/live",
        "/health/serving",
        "/",
    ]
    on_api = [asyncio.run(status(p, 8000)) for p in paths]
    on_metrics = [asyncio.run(status(p, 9090)) for p in paths]
    assert on_api == [200, 404, 404, 200, 200, 200, 200]
    assert on_metrics == [404, 200, 200, 200, 200, 200, 404]


def test_a_secrets_newline_is_no_part_of_it_and_the_metrics_port_is_its_own() -> None:
    """`kubectl create secret --from-file` keeps the file's newline: the key compared with a client's
    (stripped) header never matched. A metrics port equal to the API's cannot be bound twice."""
    assert SpecgateConfig(workers=WORKERS, api_key="3f9a0c1e5b7d\n").api_key == "3f9a0c1e5b7d"
    assert WorkerSettings(token=" 3f9a0c1e5b7d\n").token == "3f9a0c1e5b7d"
    with pytest.raises(ValueError, match="metrics_port: 8000 is the API's port too"):
        SpecgateConfig(workers=WORKERS, metrics_port=8000)
    assert SpecgateConfig(workers=WORKERS, metrics_port=9090).metrics_port == 9090
