"""The default and federation overlays' pods, run here: every container of the rendered manifests starts with
its own command and args and the environment the kubelet would give it — the Secret's keys, the ConfigMap
mounted where the pod mounts it, the cluster's variables and every Service's links (the pods turn them off;
they run with them all the same, as a pod whose spec lost enableServiceLinks would) — each worker pod on a
loopback address of its own with its rendered port, named by a real DNS server as the headless Service names
its pods (tests/dns.py stands in for the cluster's DNS). Then every probe of every container passes, the
gateway needs the Secret's API key, a chat completion succeeds, and each autoscaled pod exports the series its
adapter rule reads. Issue 59: the workers got the un-suffixed Secret name and no namespace, and the gateway
exited on SPECGATE_PORT=tcp://… ."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
import yaml

from clients.procs import free_port, stop_process
from tests.dns import LoopbackDNS
from tests.kube import (
    ENTRYPOINT,
    KUBERNETES,
    Container,
    KubectlMissing,
    by_kind,
    containers,
    flag,
    render,
    with_flag,
    workloads,
)

pytestmark = pytest.mark.integration

OVERLAYS = ("default", "federation")
NAMESPACE = "specgate"
POD_NETWORK = "127.0.59."  # worker pod k listens on 127.0.59.(k + 2), its rendered port: a pod's own address
CHAT = {
    "model": "specgate",
    "messages": [{"role": "user", "content": "Name a colour."}],
    "max_tokens": 8,
    "temperature": 0,
    "seed": 1,
}


class Pod:
    """One container started here as its pod would run it (its entrypoint the venv's CLI), stopped by pid."""

    def __init__(
        self, container: Container, address: str, argv: list[str], extra_env: dict[str, str], log: Path
    ) -> None:
        self.container, self.address = container, address
        # this machine's, less any setting
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SPECGATE_", "KUBERNETES_"))}
        env |= container.env | extra_env
        command = [sys.executable, "-m", "clients.cli", *argv[len(ENTRYPOINT) :]]
        self.log = log
        self.proc = subprocess.Popen(command, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)

    def url(self, port: int) -> str:
        return f"http://{self.address}:{port}"

    def probe(self, name: str, port: int | None = None) -> bool:
        """The container's ``name`` probe (httpGet or tcpSocket) against this pod, once; ``port``: where it
        listens here."""
        check = self.container.spec[name]
        if "httpGet" in check:
            target = port or self.container.port(check["httpGet"]["port"])
            try:
                return (
                    httpx.get(
                        self.url(target) + check["httpGet"]["path"], timeout=check.get("timeoutSeconds", 1)
                    ).status_code
                    == 200
                )
            except httpx.HTTPError:
                return False
        try:
            with socket.create_connection(
                (self.address, port or self.container.port(check["tcpSocket"]["port"])), timeout=1
            ):
                return True
        except OSError:
            return False

    def wait(self, name: str, port: int | None = None, timeout_s: float = 240.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.probe(name, port):
            assert self.proc.poll() is None, (
                f"{self.container.pod} exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}"
            )
            assert time.monotonic() < deadline, (
                f"{self.container.pod}: {name} did not pass in {timeout_s:.0f} "
                f"s:\n{self.log.read_text()[-3000:]}"
            )
            time.sleep(0.2)

    def stop(self) -> None:
        stop_process(self.proc)


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    try:
        return {overlay: render(overlay) for overlay in OVERLAYS}
    except KubectlMissing as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def worker_pods(
    rendered: dict[str, list[dict]], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[LoopbackDNS, dict[str, Pod]]]:
    """Pod 0 of every worker StatefulSet of the overlays (one process for a StatefulSet two overlays render
    alike), and a DNS server naming each headless Service's pods, as the cluster's does."""
    logs = tmp_path_factory.mktemp("pods")
    started: dict[tuple[str, ...], Pod] = {}
    pods: dict[str, Pod] = {}
    with LoopbackDNS() as dns, ExitStack() as stack:
        for objects in rendered.values():
            headless = {
                n: s for n, s in by_kind(objects, "Service").items() if s["spec"].get("clusterIP") == "None"
            }
            for workload in (w for w in workloads(objects) if w["kind"] == "StatefulSet"):
                [container] = containers(objects, workload, links=True)
                key = (*container.argv, *sorted(container.env.items()))
                if key not in started:
                    address = f"{POD_NETWORK}{len(started) + 2}"
                    # 0.0.0.0 in the pod: its own address here
                    argv = with_flag(container.argv, "--host", address)
                    started[key] = Pod(container, address, argv, {}, logs / f"{container.pod}.log")
                    stack.callback(started[key].stop)
                pod = pods[workload["metadata"]["name"]] = started[key]
                service = workload["spec"]["serviceName"]
                assert service in headless
                for name in (service, f"{service}.{NAMESPACE}", f"{service}.{NAMESPACE}.svc.cluster.local"):
                    dns.set(name, [pod.address])
        for pod in started.values():
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                pod.wait(probe)
        yield dns, pods


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_rendered_pods_start_pass_their_probes_and_answer_a_chat(
    overlay: str,
    rendered: dict[str, list[dict]],
    worker_pods: tuple[LoopbackDNS, dict[str, Pod]],
    tmp_path: Path,
) -> None:
    objects = rendered[overlay]
    dns, pods = worker_pods
    [gateway] = [w for w in workloads(objects) if w["metadata"]["name"] == "specgate-gateway"]
    assert gateway["spec"]["template"]["spec"]["enableServiceLinks"] is False
    [container] = containers(objects, gateway, links=True)  # and even so
    assert "SPECGATE_API_KEY" in container.env and "GATEWAY_PORT" in container.env
    # its ConfigMap volume, mounted here under tmp_path; its port a free one on 127.0.0.1 (the pod's own
    # network)
    argv = list(container.argv)
    for mount, files in container.files.items():
        for name, content in files.items():
            local = tmp_path / mount.strip("/") / name
            local.parent.mkdir(parents=True, exist_ok=True)
            local.write_text(content)
            argv = [str(local) if a == f"{mount}/{name}" else a for a in argv]
    config_path = Path(flag(argv, "--config") or "")
    assert config_path.is_file(), argv
    # the metrics port (its config's metrics_port) a free one too
    port, metrics_port = free_port(), free_port()
    argv = with_flag(with_flag(argv, "--host", "127.0.0.1"), "--port", str(port))
    # the pod's resolv.conf points at the cluster's DNS: here, tests/dns.py's server
    extra = {
        "SPECGATE_DISCOVERY__DNS_SERVERS": f'["{dns.server}"]',
        "SPECGATE_METRICS_PORT": str(metrics_port),
    }
    pod = Pod(container, "127.0.0.1", argv, extra, tmp_path / "gateway.log")
    try:
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            pod.wait(probe, port)
        # the metrics port's alone
        assert httpx.get(f"http://127.0.0.1:{port}/health/ready", timeout=10).status_code == 404
        ready = httpx.get(f"http://127.0.0.1:{metrics_port}/health/ready", timeout=10).json()
        targets = {w["name"] for w in yaml.safe_load(config_path.read_text())["workers"]}
        assert ready["status"] == "ready" and {w["name"] for w in ready["workers"]} == targets
        key = container.env["SPECGATE_API_KEY"]
        # the Secret's key is required
        assert (
            httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=CHAT, timeout=120).status_code
            == 401
        )
        resp = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            json=CHAT,
            headers={"Authorization": f"Bearer {key}"},
            timeout=120,
        )
        assert resp.status_code == 200, resp.text
        answer = resp.json()
        assert answer["choices"][0]["message"]["content"] and answer["usage"]["completion_tokens"] >= 1
        # what the autoscalers read: each scaled pod exports its adapter rule's series
        rules = {}
        for path in (KUBERNETES / "monitoring" / "prometheus-adapter").glob("*.yaml"):
            for rule in yaml.safe_load(path.read_text())["rules"]:
                rules[rule["name"]["as"]] = rule["seriesQuery"].split("{")[0]
        for hpa in by_kind(objects, "HorizontalPodAutoscaler").values():
            series = rules[hpa["spec"]["metrics"][0]["pods"]["metric"]["name"]]
            scaled = hpa["spec"]["scaleTargetRef"]["name"]
            where = (
                f"http://127.0.0.1:{metrics_port}" if scaled == "specgate-gateway" else pods[scaled].url(8101)
            )
            assert f"\n{series} " in httpx.get(f"{where}/metrics", timeout=10).text, (scaled, series)
        if overlay == "default":
            _liveness_answers_while_draining(pod, port, key)
        else:
            _readiness_stays_while_a_target_is_down(pod, pods["specgate-worker-w1"], port, metrics_port, key)
    finally:
        pod.stop()
    log = (tmp_path / "gateway.log").read_text()
    assert "Traceback" not in log, log[-3000:]


def _liveness_answers_while_draining(pod: Pod, port: int, key: str) -> None:
    """Issue 76: SIGTERM with a stream open: the readiness probe fails at once (the Service drops the pod),
    the liveness probe still passes (a drain must not end in a restart), and the gateway exits 0 once the
    stream has ended."""
    body = {
        **CHAT,
        "messages": [{"role": "user", "content": "Count from 1 to 300."}],
        "max_tokens": 300,
        "min_tokens": 300,
        "stream": True,
    }
    with httpx.stream(
        "POST",
        f"http://127.0.0.1:{port}/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {key}"},
        timeout=120,
    ) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))
        pod.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while pod.probe("readinessProbe", port):
            assert time.monotonic() < deadline, "readiness still passes while draining"
            time.sleep(0.1)
        assert (
            pod.probe("livenessProbe", port) and pod.probe("startupProbe", port) and pod.proc.poll() is None
        )
    assert pod.proc.wait(timeout=60) == 0


def _readiness_stays_while_a_target_is_down(
    pod: Pod, target: Pod, port: int, metrics_port: int, key: str
) -> None:
    """Issue 76: readiness asked every target, so one target down (a single-pod target drained or restarting)
    took every gateway out of its Service: clients got connection refused. Now the gateway stays ready and
    answers a JSON 503 that names the target, and /health/ready (the metrics port) says which target is
    down."""
    target.stop()
    deadline = time.monotonic() + 30
    while httpx.get(f"http://127.0.0.1:{metrics_port}/health/ready", timeout=10).status_code == 200:
        assert time.monotonic() < deadline, "/health/ready never noticed the target was down"
        time.sleep(0.2)
    assert pod.probe("readinessProbe", port) and pod.probe("livenessProbe", port)
    resp = httpx.post(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        json=CHAT,
        headers={"Authorization": f"Bearer {key}"},
        timeout=60,
    )
    assert resp.status_code == 503 and "w1" in resp.json()["error"]["message"], resp.text
