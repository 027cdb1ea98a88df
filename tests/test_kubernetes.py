"""deploy/kubernetes: every overlay renders with kubectl's Kustomize, validates strictly against
the Kubernetes schemas (offline: kubernetes-validate), and its gateway config is a config
specgate accepts, addressing Services the overlay defines, with probes on endpoints that exist."""

from __future__ import annotations

import copy
import functools
import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from core.config import parse_config

ROOT = Path(__file__).resolve().parents[1]
OVERLAYS = ROOT / "deploy" / "kubernetes" / "overlays"
KUBERNETES_VERSION = "1.30.0"  # the oldest with preStop sleep (the manifests' drain)
BASE_KINDS = {"Namespace": 1, "ConfigMap": 1, "Secret": 1, "Deployment": 1, "PodDisruptionBudget": 1}
KINDS = {  # what each overlay adds to the base's kinds
    "default": {"StatefulSet": 1, "Service": 2, "HorizontalPodAutoscaler": 2},
    "gpu": {"StatefulSet": 1, "Service": 2, "HorizontalPodAutoscaler": 2},
    "federation": {"StatefulSet": 2, "Service": 3, "HorizontalPodAutoscaler": 3},
    "pipeline": {"StatefulSet": 1, "Service": 2, "HorizontalPodAutoscaler": 1},
    "vllm": {"Deployment": 2, "Service": 2, "HorizontalPodAutoscaler": 1},
}
GATEWAY_PATHS = {"/health", "/health/ready", "/metrics"}
WORKER_PATHS = {"/health", "/metrics"}


def render(overlay: str) -> list[dict[str, Any]]:
    return copy.deepcopy(_rendered(overlay))


@functools.cache
def _rendered(overlay: str) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (it carries Kustomize)")
    out = subprocess.run([kubectl, "kustomize", str(OVERLAYS / overlay)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def one(resources: list[dict[str, Any]], kind: str, name_prefix: str) -> dict[str, Any]:
    [found] = [r for r in resources if r["kind"] == kind and r["metadata"]["name"].startswith(name_prefix)]
    return found


def test_every_overlay_is_tested() -> None:
    assert sorted(p.name for p in OVERLAYS.iterdir() if p.is_dir()) == sorted(KINDS)


@pytest.mark.parametrize("overlay", sorted(KINDS))
def test_overlay_renders_and_validates_strictly(overlay: str) -> None:
    resources = render(overlay)
    kinds: dict[str, int] = {}
    for resource in resources:
        kubernetes_validate.validate(resource, KUBERNETES_VERSION, strict=True)
        kinds[resource["kind"]] = kinds.get(resource["kind"], 0) + 1
    assert kinds == BASE_KINDS | KINDS[overlay]
    assert {r["metadata"].get("namespace", "specgate") for r in resources if r["kind"] != "Namespace"} == {"specgate"}


def test_validation_rejects_a_broken_manifest() -> None:
    gateway = one(render("default"), "Deployment", "specgate-gateway")
    broken = copy.deepcopy(gateway)
    broken["spec"]["template"]["spec"]["terminationGracePeriodSecond"] = 45  # a typo
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)
    broken = copy.deepcopy(gateway)
    broken["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("overlay", sorted(KINDS))
def test_gateway_config_is_specgates_and_names_the_overlays_services(overlay: str) -> None:
    resources = render(overlay)
    config_map = one(resources, "ConfigMap", "specgate-gateway")
    config = parse_config(yaml.safe_load(config_map["data"]["config.yaml"]), f"{overlay}: ConfigMap")
    services = {r["metadata"]["name"]: r for r in resources if r["kind"] == "Service"}
    for worker in config.workers:
        for url in worker.urls or ([worker.url] if worker.url else []) or []:
            host = urlsplit(url).hostname or ""
            service = services[host.split(".")[-1] if "." in host else host]
            if worker.discovery_interval_s is not None:  # every address a replica: the pods', never a virtual IP
                assert service["spec"].get("clusterIP") == "None", f"{host} must be a headless Service"
        for stage_url in config.stage_urls(worker) if worker.pipeline else []:
            pod, service_name = (urlsplit(stage_url).hostname or "").split(".")[:2]
            stages = one(resources, "StatefulSet", service_name)
            assert stages["spec"]["serviceName"] == service_name and services[service_name]["spec"]["clusterIP"] == "None"
            assert int(pod.rsplit("-", 1)[1]) < stages["spec"]["replicas"]
    # the gateway's grace period covers its drain and the preStop sleep before it
    gateway = one(resources, "Deployment", "specgate-gateway")["spec"]["template"]["spec"]
    pre_stop = gateway["containers"][0]["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert gateway["terminationGracePeriodSeconds"] >= config.limits.drain_timeout_s + pre_stop + 5
    assert gateway["volumes"][0]["configMap"]["name"] == config_map["metadata"]["name"]


@pytest.mark.parametrize("overlay", sorted(KINDS))
def test_probes_check_endpoints_that_exist(overlay: str) -> None:
    for resource in render(overlay):
        if resource["kind"] not in ("Deployment", "StatefulSet") or resource["metadata"]["name"] == "vllm":
            continue
        container = resource["spec"]["template"]["spec"]["containers"][0]
        paths = GATEWAY_PATHS if container["name"] == "gateway" else WORKER_PATHS
        ports = {p["name"] for p in container["ports"]}
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            check = container[probe]
            if "httpGet" in check:
                assert check["httpGet"]["path"] in paths and check["httpGet"]["port"] in ports
            else:
                assert check["tcpSocket"]["port"] in ports
        assert container["resources"]["requests"]["cpu"] and container["resources"]["requests"]["memory"]
        annotations = resource["spec"]["template"]["metadata"].get("annotations", {})
        assert annotations.get("prometheus.io/path") == "/metrics"
