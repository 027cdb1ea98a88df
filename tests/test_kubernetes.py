"""deploy/kubernetes read as a cluster reads it: every overlay (and each opt-in component, in an overlay of
the user's around the default one) renders with kubectl's Kustomize and validates strictly against the
Kubernetes schemas (offline: kubernetes-validate); every object lands in the one namespace; every Secret,
ConfigMap and Service reference resolves to an object the overlay makes; every specgate image is the
placeholder an overlay of the user's replaces, as docs/kubernetes.md shows; pods run locked down (Pod
Security's `restricted`), spread, with disruption budgets, probes that ask what each means and NetworkPolicies
that admit whom they should; the API key is required; no overlay stores responses; the autoscalers read
metrics the pods export through the adapter rules in the repository; the settings survive Kubernetes'
service-link variables; the drains cover the longest stream; the image's build context leaves out the
manifests and their secrets. tests/integration/test_kubernetes_pods.py starts the rendered containers."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from core.config import SpecgateConfig, parse_config
from core.errors import ConfigError
from core.serving import LAST_WRITES_S
from tests.kube import (
    KUBERNETES,
    OVERLAYS,
    ROOT,
    SECRETS,
    SECRETS_EXAMPLE,
    KubectlMissing,
    by_kind,
    containers,
    kustomize,
    service_links,
    workloads,
)
from tests.kube import render as _render
from tests.kube import render_own as _render_own

KUBERNETES_VERSION = "1.30.0"  # the oldest with preStop sleep (the manifests' drain)
BASE_KINDS = {
    "Namespace": 1,
    "ConfigMap": 1,
    "Secret": 1,
    "Deployment": 1,
    "Service": 1,
    "PodDisruptionBudget": 1,
    "HorizontalPodAutoscaler": 1,
    "NetworkPolicy": 3,
}
KINDS = {  # what each overlay adds to the base's kinds
    "default": {"StatefulSet": 1, "Service": 1, "HorizontalPodAutoscaler": 1, "PodDisruptionBudget": 1},
    "gpu": {"StatefulSet": 1, "Service": 1, "HorizontalPodAutoscaler": 1, "PodDisruptionBudget": 1},
    "federation": {"StatefulSet": 2, "Service": 2, "HorizontalPodAutoscaler": 2, "PodDisruptionBudget": 2},
    "pipeline": {"StatefulSet": 1, "Service": 1, "PodDisruptionBudget": 1},
    "vllm": {"Deployment": 1, "Service": 1, "PodDisruptionBudget": 1},
}
NAMESPACE = "specgate"
# the gateway's probes: on its API port and its metrics port
PROBE_PATHS = {"/health", "/health/live", "/health/serving"}
METRICS_PATHS = {"/metrics", "/health/ready"}  # the gateway's, with metrics_port: on that port alone
WORKER_PATHS = {"/health", "/health/live", "/metrics"}  # a worker's or stage's, on its one port
DOCS = ROOT / "docs" / "kubernetes.md"
# an overlay of the user's around one of ours with one of the opt-in components: the overlay it wraps, its
# kustomization.yaml
VARIANTS = {
    component: (
        "default",
        "resources: [../deploy/kubernetes/overlays/default]\ncomponents: "
        f"[../deploy/kubernetes/components/{component}]\n",
    )
    for component in ("no-api-key", "responses-store")
}
EVERY = [*sorted(KINDS), *sorted(VARIANTS)]  # what the tests of every rendered object read
# the engines' settings: no Service may be named so that its links start with one
ENV_PREFIXES = ("SPECGATE_", "VLLM_")


def render(overlay: str) -> list[dict[str, Any]]:
    """An overlay's objects, or a variant's (VARIANTS)."""
    if overlay in VARIANTS:
        return render_own(overlay, VARIANTS[overlay][1])
    try:
        return _render(overlay)
    except KubectlMissing as exc:
        pytest.skip(str(exc))


def render_own(name: str, kustomization: str) -> list[dict[str, Any]]:
    try:
        return _render_own(name, kustomization)
    except KubectlMissing as exc:
        pytest.skip(str(exc))


def gateway_config(resources: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> SpecgateConfig:
    """The gateway's config as its pod loads it: the mounted ConfigMap's file under the container's SPECGATE_*
    variables."""
    [container] = containers(resources, one(resources, "Deployment", "specgate-gateway"))
    for name in [n for n in os.environ if n.startswith("SPECGATE_")]:
        monkeypatch.delenv(name)
    for name, value in container.env.items():
        if name.startswith("SPECGATE_"):
            monkeypatch.setenv(name, value)
    [config] = [yaml.safe_load(files["config.yaml"]) for files in container.files.values()]
    return parse_config(config)


def one(resources: list[dict[str, Any]], kind: str, name_prefix: str) -> dict[str, Any]:
    [found] = [r for r in resources if r["kind"] == kind and r["metadata"]["name"].startswith(name_prefix)]
    return found


def component() -> dict[str, Any]:
    return dict(yaml.safe_load((KUBERNETES / "components" / "specgate" / "kustomization.yaml").read_text()))


def is_specgate(container: dict[str, Any]) -> bool:
    return "/specgate" in container["image"]


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether a label selector (matchLabels, matchExpressions with In) selects ``labels``."""
    matches = selector.get("matchLabels", {}).items() <= labels.items()
    for rule in selector.get("matchExpressions", []):
        assert rule["operator"] == "In"
        matches = matches and labels.get(rule["key"]) in rule["values"]
    return matches


def test_every_overlay_and_component_is_tested() -> None:
    assert sorted(p.name for p in OVERLAYS.iterdir() if p.is_dir()) == sorted(KINDS)
    assert sorted(p.name for p in (KUBERNETES / "components").iterdir() if p.is_dir()) == sorted(
        ["specgate", *VARIANTS]
    )


@pytest.mark.parametrize("overlay", EVERY)
def test_overlay_renders_and_validates_strictly(overlay: str) -> None:
    resources = render(overlay)
    kinds: dict[str, int] = {}
    for resource in resources:
        kubernetes_validate.validate(resource, KUBERNETES_VERSION, strict=True)
        kinds[resource["kind"]] = kinds.get(resource["kind"], 0) + 1
    expected = dict(BASE_KINDS)
    for kind, count in KINDS[VARIANTS[overlay][0] if overlay in VARIANTS else overlay].items():
        expected[kind] = expected.get(kind, 0) + count
    assert kinds == expected


def test_validation_rejects_a_broken_manifest() -> None:
    gateway = one(render("default"), "Deployment", "specgate-gateway")
    broken = copy.deepcopy(gateway)
    broken["spec"]["template"]["spec"]["terminationGracePeriodSecond"] = 45  # a typo
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)
    broken = copy.deepcopy(gateway)
    broken["spec"]["template"]["spec"]["enableServiceLinks"] = "no"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("overlay", EVERY)
def test_every_object_is_in_the_one_namespace(overlay: str) -> None:
    """Issue 59: the workers came from targets/ and the overlays, past the base's `namespace:`: they landed in
    kubectl's current namespace while the gateway looked for them in `specgate`."""
    resources = render(overlay)
    assert [r["metadata"]["name"] for r in resources if r["kind"] == "Namespace"] == [NAMESPACE]
    outside = [
        f"{r['kind']}/{r['metadata']['name']}"
        for r in resources
        if r["kind"] != "Namespace" and r["metadata"].get("namespace") != NAMESPACE
    ]
    assert not outside, f"not in namespace {NAMESPACE}: {outside}"


@pytest.mark.parametrize("overlay", EVERY)
def test_every_reference_resolves_to_an_object_the_overlay_makes(overlay: str) -> None:
    """Secret and ConfigMap references name the generated (hash-suffixed) objects and keys that exist (the
    kubelet's CreateContainerConfigError otherwise); Services, PDBs, HPAs and the NetworkPolicies select
    workloads that exist."""
    resources = render(overlay)
    secrets, config_maps = by_kind(resources, "Secret"), by_kind(resources, "ConfigMap")
    assert all(
        re.fullmatch(r"specgate-(secrets|gateway)-[a-z0-9]{10}", name) for name in [*secrets, *config_maps]
    ), [*secrets, *config_maps]
    pods = {w["metadata"]["name"]: w["spec"]["template"]["metadata"]["labels"] for w in workloads(resources)}
    for workload in workloads(resources):
        for container in containers(resources, workload):  # raises on a reference to nothing
            assert container.argv
        assert (
            workload["spec"]["selector"]["matchLabels"].items() <= pods[workload["metadata"]["name"]].items()
        )

    for kind in ("Service", "PodDisruptionBudget"):
        for name, obj in by_kind(resources, kind).items():
            selector = (
                obj["spec"]["selector"]
                if kind == "PodDisruptionBudget"
                else {"matchLabels": obj["spec"]["selector"]}
            )
            assert any(selects(selector, labels) for labels in pods.values()), f"{kind} {name} selects no pod"
    for name, hpa in by_kind(resources, "HorizontalPodAutoscaler").items():
        assert hpa["spec"]["scaleTargetRef"]["name"] in pods, f"HPA {name} scales nothing"
    for name, policy in by_kind(resources, "NetworkPolicy").items():
        assert any(selects(policy["spec"]["podSelector"], labels) for labels in pods.values()), (
            f"NetworkPolicy {name} selects no pod"
        )


# the shipped peer
PROMETHEUS = ({"kubernetes.io/metadata.name": "monitoring"}, {"app.kubernetes.io/name": "prometheus"})
PEERS = {  # a client: its namespace's labels, its own
    "prometheus": PROMETHEUS,
    "grafana beside prometheus": (
        {"kubernetes.io/metadata.name": "monitoring"},
        {"app.kubernetes.io/name": "grafana"},
    ),
    "a gateway": (
        {"kubernetes.io/metadata.name": NAMESPACE},
        {"app.kubernetes.io/component": "gateway", "app.kubernetes.io/part-of": "specgate"},
    ),
    "a stage": (
        {"kubernetes.io/metadata.name": NAMESPACE},
        {"app.kubernetes.io/component": "stage", "app.kubernetes.io/part-of": "specgate"},
    ),
    "another project's gateway": (
        {"kubernetes.io/metadata.name": NAMESPACE},
        {"app.kubernetes.io/component": "gateway"},
    ),
    "another pod of the namespace": ({"kubernetes.io/metadata.name": NAMESPACE}, {"app": "debug"}),
    "a pod elsewhere": ({"kubernetes.io/metadata.name": "default"}, {"app": "client"}),
}


def admitted(
    policies: list[dict[str, Any]],
    pod: dict[str, Any],
    port: str,
    peer: tuple[dict[str, str], dict[str, str]],
) -> bool:
    """Whether NetworkPolicies let ``peer`` (its namespace's labels, its own) connect to ``pod``'s (a pod
    template's) named ``port``: a pod no policy selects takes everything; a selected one what any rule of a
    selecting policy allows."""
    numbers = {p["name"]: p["containerPort"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
    namespace, labels = peer
    selecting = [p for p in policies if selects(p["spec"]["podSelector"], pod["metadata"]["labels"])]

    def source(entry: dict[str, Any]) -> bool:
        assert set(entry) <= {"podSelector", "namespaceSelector"}, entry  # no ipBlock
        in_namespace = (
            selects(entry["namespaceSelector"], namespace)
            if "namespaceSelector" in entry
            else namespace["kubernetes.io/metadata.name"] == NAMESPACE
        )
        return in_namespace and selects(entry.get("podSelector", {}), labels)

    def rule(r: dict[str, Any]) -> bool:
        on_port = "ports" not in r or any(p["port"] in (port, numbers[port]) for p in r["ports"])
        return on_port and ("from" not in r or any(source(e) for e in r["from"]))

    return not selecting or any(rule(r) for p in selecting for r in p["spec"].get("ingress", []))


def allowed_peers(
    resources: list[dict[str, Any]], peers: dict[str, tuple[dict[str, str], dict[str, str]]] = PEERS
) -> dict[tuple[str, str], set[str]]:
    """Which of ``peers`` may connect to each workload's pods, by port: {(workload, port name): {peer}}."""
    policies = list(by_kind(resources, "NetworkPolicy").values())
    return {
        (w["metadata"]["name"], port["name"]): {
            name
            for name, peer in peers.items()
            if admitted(policies, w["spec"]["template"], port["name"], peer)
        }
        for w in workloads(resources)
        for c in w["spec"]["template"]["spec"]["containers"]
        for port in c["ports"]
    }


@pytest.mark.parametrize("overlay", EVERY)
def test_network_policies_open_the_api_and_let_only_prometheus_scrape(overlay: str) -> None:
    """Issue 76: the Prometheus peer was a bare namespace selector (every pod of `monitoring` reached the
    workers), and the gateways' metrics were on their open API port. Now: the gateways' API port from
    anywhere, their metrics port from Prometheus's pods alone; workers, stages and targets from the gateways,
    the stages and Prometheus alone. The Prometheus peer is one policy, specgate-prometheus, whose pod
    selector sits in the namespace selector's entry. Pods are ours by `part-of` too: another project's pod
    labelled `component: gateway` reaches no worker."""
    resources = render(overlay)
    everyone = set(PEERS)
    for (workload, port), peers in allowed_peers(resources).items():
        if workload == "specgate-gateway":
            assert peers == (everyone if port == "http" else {"prometheus"}), (workload, port, peers)
        else:
            assert peers == {"prometheus", "a gateway", "a stage"}, (workload, port, peers)
    for name, policy in by_kind(resources, "NetworkPolicy").items():
        for entry in (e for r in policy["spec"]["ingress"] for e in r.get("from", [])):
            assert "podSelector" in entry, f"{name}: a `from` entry that admits every pod of {entry}"
    [peer] = by_kind(resources, "NetworkPolicy")["specgate-prometheus"]["spec"]["ingress"]
    assert [
        (e["namespaceSelector"]["matchLabels"], e["podSelector"]["matchLabels"]) for e in peer["from"]
    ] == [PROMETHEUS]


def test_an_overlay_of_the_users_moves_the_prometheus_peer_with_one_patch() -> None:
    """docs/kubernetes.md's patch, in an overlay around the default one: Prometheus in `observability`
    scrapes, the one in `monitoring` no longer; nothing else changes."""
    patch = re.search(
        r"```yaml\n(patches:\n  - target: \{kind: NetworkPolicy, name: specgate-prometheus\}.*?)```",
        DOCS.read_text(),
        re.S,
    )
    assert patch, "docs/kubernetes.md shows no patch of specgate-prometheus"
    resources = render_own(
        "prometheus-elsewhere", "resources: [../deploy/kubernetes/overlays/default]\n" + patch.group(1)
    )
    moved = PEERS | {
        "prometheus": ({"kubernetes.io/metadata.name": "observability"}, PROMETHEUS[1]),
        "prometheus in monitoring": PROMETHEUS,
    }
    shipped = allowed_peers(render("default"))
    for key, peers in allowed_peers(resources, moved).items():
        # the one in monitoring: only where every client is let in
        assert peers == shipped[key] | (
            {"prometheus in monitoring"} if shipped[key] == set(PEERS) else set()
        ), (key, peers)


@pytest.mark.parametrize("overlay", sorted(KINDS))
def test_every_specgate_image_is_the_placeholder_the_docs_replace(overlay: str) -> None:
    """The shipped overlays name a placeholder image (the CPU one, and the gpu overlay's CUDA one);
    docs/kubernetes.md builds and pushes the user's and replaces each placeholder in an overlay of the
    user's."""
    [image] = component()["images"]
    reference = f"{image['newName']}:{image['newTag']}"
    readme = DOCS.read_text()  # where the README sends a Kubernetes user
    images = {
        c["name"]: c["image"]
        for w in workloads(render(overlay))
        for c in w["spec"]["template"]["spec"]["containers"]
    }
    for name, found in images.items():
        if name in ("vllm",):
            assert re.fullmatch(r"vllm/vllm-openai:v[0-9.]+", found), found  # pinned
            continue
        expected = (
            reference.replace("/specgate:", "/specgate-cuda:")
            if overlay == "gpu" and name == "worker"
            else reference
        )
        assert found == expected, f"{name}: {found}"
        placeholder, own = found.split(":")[0], "$REGISTRY/" + found.split("/")[-1].split(":")[0] + ":$TAG"
        assert (
            f"-t {own} ." in readme
            and f"docker push {own}" in readme
            and f"kustomize edit set image {placeholder}={own}" in readme
        )


@pytest.mark.parametrize("base", ["default", "gpu"])
def test_an_overlay_of_the_users_sets_the_image(base: str) -> None:
    """Issue 76: the docs told users to edit a tracked file (components/specgate/kustomization.yaml) for their
    image. Now they make an overlay of their own: docs/kubernetes.md shows the kustomization.yaml that
    `kustomize create` and `kustomize edit set image` write, and around the default or the gpu overlay (with
    the CUDA image's entry beside) every specgate container runs the user's image."""
    docs = DOCS.read_text()
    assert "$EDITOR deploy/kubernetes" not in docs
    [own] = [
        block
        for block in re.findall(r"```yaml\n(.*?)```", docs, re.S)
        if "kind: Kustomization" in block and "images:" in block
    ]
    kustomization = yaml.safe_load(own)
    assert kustomization["resources"] == ["../deploy/kubernetes/overlays/default"]
    [image] = kustomization["images"]
    assert image["name"] == component()["images"][0]["newName"]
    if base == "gpu":
        [cuda] = yaml.safe_load((OVERLAYS / "gpu" / "kustomization.yaml").read_text())["images"]
        kustomization["resources"] = ["../deploy/kubernetes/overlays/gpu"]
        kustomization["images"].append(
            {"name": cuda["newName"], "newName": image["newName"] + "-cuda", "newTag": image["newTag"]}
        )
    resources = render_own(f"my-specgate-{base}", yaml.safe_dump(kustomization) if base == "gpu" else own)
    images = {c["image"] for w in workloads(resources) for c in w["spec"]["template"]["spec"]["containers"]}
    assert images == {f"{i['newName']}:{i['newTag']}" for i in kustomization["images"]}


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
            if worker.discovery_interval_s is not None:
                # every address a replica: the pods', never a virtual IP
                assert service["spec"].get("clusterIP") == "None", f"{host} must be a headless Service"
        for stage_url in config.stage_urls(worker) if worker.pipeline else []:
            pod, service_name = (urlsplit(stage_url).hostname or "").split(".")[:2]
            stages = one(resources, "StatefulSet", service_name)
            assert (
                stages["spec"]["serviceName"] == service_name
                and services[service_name]["spec"]["clusterIP"] == "None"
            )
            assert int(pod.rsplit("-", 1)[1]) < stages["spec"]["replicas"]
    gateway = one(resources, "Deployment", "specgate-gateway")["spec"]["template"]["spec"]
    assert gateway["volumes"][0]["configMap"]["name"] == config_map["metadata"]["name"]


@pytest.mark.parametrize("overlay", EVERY)
def test_drains_cover_the_longest_stream(overlay: str) -> None:
    """A 30 s drain cut streams of max_tokens 512, which run minutes at the measured per-gateway rate: the
    drain covers max_tokens of each of max_concurrent_requests streams at the rate `bench load` measured for
    one gateway (docs/bench/load_gateways.json), the workers' drain the gateway's. Each grace period covers
    the preStop sleep, the drain, the last writes after it (core.serving.LAST_WRITES_S) and a margin of 15 s:
    the kubelet's SIGKILL comes then."""
    resources = render(overlay)
    config = parse_config(
        yaml.safe_load(one(resources, "ConfigMap", "specgate-gateway")["data"]["config.yaml"])
    )
    levels = json.loads((ROOT / "docs" / "bench" / "load_gateways.json").read_text())["levels"]
    rate = min(level["tokens_per_s"] for level in levels if level["gateways"] == 1)
    longest = config.limits.max_tokens * config.limits.max_concurrent_requests / rate
    assert config.limits.drain_timeout_s >= longest, (
        f"drain {config.limits.drain_timeout_s} s < {longest:.0f} s"
    )
    for workload in workloads(resources):
        pod = workload["spec"]["template"]["spec"]
        [container] = pod["containers"]
        if not is_specgate(container):
            continue
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        drain = (
            config.limits.drain_timeout_s
            if container["name"] == "gateway"
            else float(env["SPECGATE_WORKER_DRAIN_TIMEOUT_S"])
        )
        assert drain >= config.limits.drain_timeout_s
        pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
        assert pod["terminationGracePeriodSeconds"] >= pre_stop + drain + LAST_WRITES_S + 15, workload[
            "metadata"
        ]["name"]


def served(container: dict[str, Any], config: Any) -> dict[str, set[str]]:
    """What each named port of a specgate container answers: a gateway with metrics_port answers /metrics and
    /health/ready there alone, its probes on both ports; a worker or stage everything on its one port."""
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    if container["name"] != "gateway":
        return {name: WORKER_PATHS for name in ports}
    assert config.metrics_port and ports == {"http": config.port, "metrics": config.metrics_port}, ports
    return {"http": PROBE_PATHS, "metrics": PROBE_PATHS | METRICS_PATHS}


@pytest.mark.parametrize("overlay", EVERY)
def test_probes_check_endpoints_that_exist(overlay: str) -> None:
    """Every probe asks a path the port it names answers; /metrics is scraped where it is served (the
    gateway's metrics port, which the Service does not expose)."""
    resources = render(overlay)
    config = parse_config(
        yaml.safe_load(one(resources, "ConfigMap", "specgate-gateway")["data"]["config.yaml"])
    )
    for resource in workloads(resources):
        container = resource["spec"]["template"]["spec"]["containers"][0]
        if not is_specgate(container):
            continue
        paths = served(container, config)
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            check = container[probe]["httpGet"]
            assert check["path"] in paths[check["port"]], (container["name"], probe, check)
        assert container["resources"]["requests"]["cpu"] and container["resources"]["requests"]["memory"]
        annotations = resource["spec"]["template"]["metadata"].get("annotations", {})
        [scraped] = [
            name
            for name, p in {p["name"]: p["containerPort"] for p in container["ports"]}.items()
            if str(p) == annotations.get("prometheus.io/port")
        ]
        assert annotations.get("prometheus.io/path") == "/metrics" and "/metrics" in paths[scraped]
    [service] = [s for name, s in by_kind(resources, "Service").items() if name == "gateway"]
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["http"]  # the API alone


@pytest.mark.parametrize("overlay", EVERY)
def test_probes_mean_it(overlay: str) -> None:
    """Issue 76: the gateway's readiness asked /health/ready, which checks every target, so one target down
    took every gateway out of the Service; the workers' liveness was a TCP connect, which a hung process still
    accepts. The gateway's readiness is its own state (/health/serving, 503 while it drains); every specgate
    liveness probe is an HTTP request to /health/live (200 while the process answers, draining included),
    every startup probe HTTP too."""
    for workload in workloads(render(overlay)):
        container = workload["spec"]["template"]["spec"]["containers"][0]
        if not is_specgate(container):
            continue
        name = workload["metadata"]["name"]
        assert container["livenessProbe"]["httpGet"]["path"] == "/health/live", name
        assert "httpGet" in container["startupProbe"], name
        readiness = container["readinessProbe"]["httpGet"]["path"]
        assert readiness == ("/health/serving" if container["name"] == "gateway" else "/health"), name


@pytest.mark.parametrize("overlay", EVERY)
def test_pods_run_locked_down(overlay: str) -> None:
    """Non-root, no privilege escalation, no capabilities, a read-only root filesystem (a writable /tmp), no
    service links, no API token; workloads spread over nodes and have a disruption budget."""
    resources = render(overlay)
    budgets = by_kind(resources, "PodDisruptionBudget").values()
    for workload in workloads(resources):
        name, pod = workload["metadata"]["name"], workload["spec"]["template"]["spec"]
        assert pod["enableServiceLinks"] is False and pod["automountServiceAccountToken"] is False, name
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] > 0, (
            name
        )
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
        for container in pod["containers"]:
            security = container["securityContext"]
            assert security["allowPrivilegeEscalation"] is False and security["capabilities"] == {
                "drop": ["ALL"]
            }, name
            assert security["readOnlyRootFilesystem"] is True, name
            assert "/tmp" in {m["mountPath"] for m in container.get("volumeMounts", [])}, name
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert any(
            b["spec"]["selector"]["matchLabels"].items() <= labels.items()
            and b["spec"].get("maxUnavailable") == 1
            for b in budgets
        ), name
        if is_specgate(pod["containers"][0]):
            [spread] = pod["topologySpreadConstraints"]
            assert (
                spread["topologyKey"] == "kubernetes.io/hostname"
                and spread["labelSelector"]["matchLabels"].items() <= labels.items()
            )


RESTRICTED_VOLUMES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}
SAFE_SYSCTLS = {
    "kernel.shm_rmid_forced",
    "net.ipv4.ip_local_port_range",
    "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies",
    "net.ipv4.ping_group_range",
    "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time",
    "net.ipv4.tcp_fin_timeout",
    "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
}


def restricted_violations(template: dict[str, Any]) -> list[str]:
    """What in a pod template the Pod Security Standard `restricted` (Kubernetes 1.30: baseline's controls and
    its own) forbids; [] where Pod Security Admission admits it."""
    spec, found = template["spec"], []
    pod = spec.get("securityContext", {})
    containers_ = [*spec.get("initContainers", []), *spec["containers"], *spec.get("ephemeralContainers", [])]
    found += [f"spec.{key}" for key in ("hostNetwork", "hostPID", "hostIPC") if spec.get(key)]
    found += [
        f"volume {v['name']}: {kind}"
        for v in spec.get("volumes", [])
        for kind in set(v) - {"name"} - RESTRICTED_VOLUMES
    ]
    found += [f"sysctl {s['name']}" for s in pod.get("sysctls", []) if s["name"] not in SAFE_SYSCTLS]
    found += [
        f"annotation {k}"
        for k, v in template["metadata"].get("annotations", {}).items()
        if k.startswith("container.apparmor.security.beta.kubernetes.io/")
        and not (v == "runtime/default" or v.startswith("localhost/"))
    ]
    for where, context in [("pod", pod), *((c["name"], c.get("securityContext", {})) for c in containers_)]:
        if context.get("windowsOptions", {}).get("hostProcess"):
            found.append(f"{where}: hostProcess")
        if context.get("privileged"):
            found.append(f"{where}: privileged")
        if context.get("procMount", "Default") != "Default":
            found.append(f"{where}: procMount")
        if context.get("appArmorProfile", {}).get("type", "RuntimeDefault") not in (
            "RuntimeDefault",
            "Localhost",
        ):
            found.append(f"{where}: appArmorProfile")
        selinux = context.get("seLinuxOptions", {})
        if (
            selinux.get("type", "") not in ("", "container_t", "container_init_t", "container_kvm_t")
            or "user" in selinux
            or "role" in selinux
        ):
            found.append(f"{where}: seLinuxOptions")
        if context.get("runAsUser") == 0 or context.get("runAsNonRoot") is False:
            found.append(f"{where}: runs as root")
        if context.get("seccompProfile", {}).get("type") == "Unconfined":
            found.append(f"{where}: seccomp Unconfined")
    for container in containers_:
        name, context = container["name"], container.get("securityContext", {})
        if context.get("allowPrivilegeEscalation") is not False:
            found.append(f"{name}: allowPrivilegeEscalation is not false")
        if context.get("runAsNonRoot", pod.get("runAsNonRoot")) is not True:
            found.append(f"{name}: runAsNonRoot is not true")
        if context.get("seccompProfile", pod.get("seccompProfile", {})).get("type") not in (
            "RuntimeDefault",
            "Localhost",
        ):
            found.append(f"{name}: no RuntimeDefault or Localhost seccomp profile")
        capabilities = context.get("capabilities", {})
        if "ALL" not in capabilities.get("drop", []) or set(capabilities.get("add", [])) - {
            "NET_BIND_SERVICE"
        }:
            found.append(f"{name}: capabilities not dropped (ALL) or added beyond NET_BIND_SERVICE")
        found += [
            f"{name}: hostPort {p['hostPort']}" for p in container.get("ports", []) if p.get("hostPort")
        ]
    return found


@pytest.mark.parametrize("overlay", EVERY)
def test_the_namespace_enforces_the_restricted_pod_security_standard_and_every_pod_meets_it(
    overlay: str,
) -> None:
    """Issue 76: nothing stopped a pod that runs as root, privileged or on the host's network from landing in
    the namespace. Pod Security Admission enforces `restricted` there (pinned to the oldest supported version,
    warned and audited at the newest), and every pod template of the overlay is one it admits."""
    resources = render(overlay)
    [namespace] = by_kind(resources, "Namespace").values()
    labels = namespace["metadata"]["labels"]
    assert {
        mode: labels.get(f"pod-security.kubernetes.io/{mode}") for mode in ("enforce", "warn", "audit")
    } == dict.fromkeys(("enforce", "warn", "audit"), "restricted")
    assert labels["pod-security.kubernetes.io/enforce-version"] == "v" + KUBERNETES_VERSION.rsplit(".", 1)[0]
    for workload in workloads(resources):
        assert restricted_violations(workload["spec"]["template"]) == [], workload["metadata"]["name"]


def test_the_pod_security_check_sees_what_restricted_forbids() -> None:
    gateway = one(render("default"), "Deployment", "specgate-gateway")["spec"]["template"]
    for path, value in (
        ("spec.hostNetwork", True),
        ("spec.volumes.0", {"name": "h", "hostPath": {"path": "/"}}),
        ("spec.containers.0.securityContext.capabilities", {"drop": ["NET_RAW"]}),
        ("spec.containers.0.securityContext.allowPrivilegeEscalation", True),
        ("spec.securityContext.runAsUser", 0),
        ("spec.securityContext.seccompProfile", {"type": "Unconfined"}),
        ("spec.containers.0.ports.0.hostPort", 80),
    ):
        broken = copy.deepcopy(gateway)
        *parents, key = path.split(".")
        target = broken
        for part in parents:
            target = target[int(part)] if part.isdigit() else target[part]
        target[int(key) if key.isdigit() else key] = value
        assert restricted_violations(broken), path


@pytest.mark.parametrize("overlay", sorted(KINDS))
def test_every_specgate_process_sizes_its_threads_from_its_own_cpu(overlay: str) -> None:
    """Issue 76: threads came from the affinity, which in a pod is the whole node unless the kubelet pins
    CPUs, and the gpu overlay dropped --threads: a pod that requests 4 CPUs ran torch with 100+ threads. Each
    process that runs a model passes its threads (within its CPU request), or has a CPU limit (core.cores
    reads the cgroup quota)."""
    resources = render(overlay)
    config = parse_config(
        yaml.safe_load(one(resources, "ConfigMap", "specgate-gateway")["data"]["config.yaml"]), overlay
    )
    for workload in workloads(resources):
        for container in workload["spec"]["template"]["spec"]["containers"]:
            if not is_specgate(container):
                continue
            resources_ = container.get("resources", {})
            request, limited = (
                _quantity(resources_.get("requests", {}).get("cpu", "0")),
                "cpu" in resources_.get("limits", {}),
            )
            line = " ".join([*container.get("command", []), *map(str, container.get("args", []))])
            threads = [int(t) for t in re.findall(r"--threads[ =]+\"?(\d+)", line)]
            if container["args"][0] == "gateway":
                threads = [config.draft.threads] if config.draft.threads else []
            name = f"{workload['metadata']['name']}/{container['name']}"
            assert limited or (threads and threads[0] <= max(1, int(request))), (
                f"{name}: threads {threads or 'unset'}, cpu request {request}"
            )


def test_no_secret_ships_and_an_empty_key_is_refused(tmp_path: Path) -> None:
    """`SPECGATE_API_KEY=` shipped empty switched client authentication off without a word. The repository
    ships an example (no empty value) and ignores secrets.env: without the user's, an overlay does not render,
    so nothing deploys on the example's known values; an empty key is refused at start. The example's comment
    (and docs/kubernetes.md) give the command that writes secrets.env with two fresh values: it does."""
    text = SECRETS_EXAMPLE.read_text()
    lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert {line.split("=", 1)[0] for line in lines} == {"SPECGATE_WORKER_TOKEN", "SPECGATE_API_KEY"}
    assert all(line.split("=", 1)[1] for line in lines)
    [command] = [line.lstrip("# ") for line in text.splitlines() if "openssl rand -hex 32" in line]
    assert command in DOCS.read_text()
    (tmp_path / SECRETS.parent.relative_to(ROOT)).mkdir(parents=True)
    subprocess.run(["bash", "-c", command], cwd=tmp_path, check=True, timeout=30)
    written = dict(
        line.split("=", 1) for line in (tmp_path / SECRETS.relative_to(ROOT)).read_text().splitlines()
    )
    assert written.keys() == {"SPECGATE_WORKER_TOKEN", "SPECGATE_API_KEY"} and all(
        re.fullmatch("[0-9a-f]{64}", v) for v in written.values()
    )
    assert len(set(written.values())) == 2
    assert (
        "deploy/kubernetes/components/specgate/secrets.env" in (ROOT / ".gitignore").read_text().splitlines()
    )
    if not SECRETS.exists():  # a clean clone: the overlays refuse to render, naming the file
        try:
            out = kustomize(OVERLAYS / "default")
        except KubectlMissing as exc:
            pytest.skip(str(exc))
        assert out.returncode != 0 and "secrets.env" in out.stderr, out.stderr
    config = yaml.safe_load(one(render("default"), "ConfigMap", "specgate-gateway")["data"]["config.yaml"])
    with pytest.raises(ConfigError, match="SPECGATE_API_KEY is set but empty"):
        parse_config(config | {"api_key": ""})


@pytest.mark.parametrize("overlay", sorted(KINDS))
def test_the_api_key_is_required(overlay: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 76: the gateway's key was an optional reference, so a Secret without it served /v1/* to anyone.
    It is required in every overlay: a Secret without it keeps the pod from starting, and the gateway loads
    with the key."""
    resources = render(overlay)
    [container] = one(resources, "Deployment", "specgate-gateway")["spec"]["template"]["spec"]["containers"]
    [key] = [e["valueFrom"]["secretKeyRef"] for e in container["env"] if e["name"] == "SPECGATE_API_KEY"]
    assert not key.get("optional") and key["key"] == "SPECGATE_API_KEY"
    assert "SPECGATE_ALLOW_NO_API_KEY" not in {e["name"] for e in container["env"]}
    config = gateway_config(resources, monkeypatch)
    assert config.api_key and not config.allow_no_api_key


def test_serving_without_a_key_is_a_component_an_overlay_adds(monkeypatch: pytest.MonkeyPatch) -> None:
    """components/no-api-key, added to an overlay of the user's around the default one: the gateway reads no
    key and says SPECGATE_ALLOW_NO_API_KEY=true; nothing else changes."""
    resources = render("no-api-key")
    config = gateway_config(resources, monkeypatch)
    assert config.api_key is None and config.allow_no_api_key is True
    shipped = render("default")
    for objects in (resources, shipped):  # the one difference
        [container] = one(objects, "Deployment", "specgate-gateway")["spec"]["template"]["spec"]["containers"]
        container["env"] = [
            e for e in container["env"] if e["name"] not in ("SPECGATE_API_KEY", "SPECGATE_ALLOW_NO_API_KEY")
        ]
    assert resources == shipped


@pytest.mark.parametrize("overlay", sorted(KINDS))
def test_every_overlay_stores_no_responses(overlay: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 76: each gateway pod kept its own responses (responses.store auto, in its emptyDir) behind a
    Service that spreads requests, so a previous_response_id reached the gateway holding it one time in N and
    got a 404 otherwise. Every shipped overlay stores none; components/responses-store is the deliberate
    choice to store them."""
    resources = render(overlay)
    assert gateway_config(resources, monkeypatch).responses.store == "none"
    [container] = one(resources, "Deployment", "specgate-gateway")["spec"]["template"]["spec"]["containers"]
    assert "XDG_STATE_HOME" not in {e["name"] for e in container["env"]}  # it served the store alone


def test_stored_responses_are_a_component_with_affinity_and_room_on_disk(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """components/responses-store: the Service sends a client's address to one gateway (ClientIP, with a
    timeout); the store lies on an emptyDir of its own, capped (max_bytes at most half its sizeLimit: SQLite's
    journal and WAL need room); the gateway's ephemeral-storage request and limit cover every emptyDir's
    sizeLimit, so the scheduler finds the disk and the kubelet does not evict the pod mid-stream.
    docs/kubernetes.md says what it costs."""
    resources = render("responses-store")
    config = gateway_config(resources, monkeypatch)
    pod = one(resources, "Deployment", "specgate-gateway")["spec"]["template"]["spec"]
    [container] = pod["containers"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    store = PurePosixPath(config.responses.store)
    mount = max(
        (m for m in container["volumeMounts"] if store.is_relative_to(m["mountPath"])),
        key=lambda m: len(m["mountPath"]),
    )
    assert [m["mountPath"] for m in container["volumeMounts"] if m["name"] == mount["name"]] == [
        mount["mountPath"]
    ], "a volume of its own"
    disk = volumes[mount["name"]]["emptyDir"]
    assert "medium" not in disk and 0 < config.responses.max_bytes <= _bytes(disk["sizeLimit"]) / 2
    assert all("sizeLimit" in v["emptyDir"] for v in volumes.values() if "emptyDir" in v)
    disks = sum(_bytes(v["emptyDir"]["sizeLimit"]) for v in volumes.values() if "emptyDir" in v)
    for bound in ("requests", "limits"):
        assert _bytes(container["resources"][bound]["ephemeral-storage"]) >= disks, bound
    service = by_kind(resources, "Service")["gateway"]["spec"]
    assert (
        service["sessionAffinity"] == "ClientIP"
        and service["sessionAffinityConfig"]["clientIP"]["timeoutSeconds"] > 0
    )
    docs = " ".join(DOCS.read_text().split())
    assert "components/responses-store" in docs and "sessionAffinity: ClientIP" in docs


@pytest.mark.parametrize("overlay", sorted(KINDS))
def test_no_service_is_named_after_an_engines_settings_and_the_settings_survive_links(
    overlay: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Service named `specgate` gave every pod SPECGATE_PORT=tcp://10.x.x.x:80: the gateway exited with
    "port: Input should be a valid integer". No Service's links start with an engine's prefix, and with every
    Service's links set (a pod without enableServiceLinks: false) the gateway's config and the worker's
    settings still load, at their own ports."""
    from workers.settings import WorkerSettings

    resources = render(overlay)
    links = service_links(resources)
    assert not [name for name in links if name.startswith(ENV_PREFIXES)], sorted(links)
    # as from Services so named
    hostile = links | {
        "SPECGATE_PORT": "tcp://10.96.0.10:80",
        "SPECGATE_WORKER_PORT": "tcp://10.96.0.11:8101",
    }
    for name, value in hostile.items():
        monkeypatch.setenv(name, value)
    config = parse_config(
        yaml.safe_load(one(resources, "ConfigMap", "specgate-gateway")["data"]["config.yaml"])
    )
    assert config.port == 8000 and WorkerSettings().port == 8101


@pytest.mark.parametrize("overlay", sorted(KINDS))
def test_autoscalers_read_metrics_the_adapter_serves_and_can_reach_their_targets(overlay: str) -> None:
    """Each HPA's metric is one an adapter rule in deploy/kubernetes/monitoring/prometheus-adapter/ serves,
    from a series the scaled pods export (the pod-level run reads their /metrics); the ratio's target lies
    below 1, which it reaches (the worker's at worker_full: tests/workers/test_scheduler.py). No workload an
    HPA scales sets `replicas:`."""
    rules = {}
    for path in sorted((KUBERNETES / "monitoring" / "prometheus-adapter").glob("*.yaml")):
        for rule in yaml.safe_load(path.read_text())["rules"]:
            series = re.match(r"([a-z_:]+)\{", rule["seriesQuery"])
            assert series and re.fullmatch(rule["name"]["matches"].strip("^$"), series.group(1))
            assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}
            rules[rule["name"]["as"]] = (path.stem, series.group(1))
    assert rules == {
        "specgate_requests_running_ratio": ("gateway", "specgate:requests_running_ratio"),
        "specgate_sessions_ratio": ("worker", "specgate:sessions_ratio"),
    }
    resources = render(overlay)
    scaled = {w["metadata"]["name"]: w for w in workloads(resources)}
    for name, hpa in by_kind(resources, "HorizontalPodAutoscaler").items():
        [metric] = hpa["spec"]["metrics"]
        role, _ = rules[metric["pods"]["metric"]["name"]]
        target = scaled[hpa["spec"]["scaleTargetRef"]["name"]]
        assert target["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"] == role, name
        assert 0 < _quantity(metric["pods"]["target"]["averageValue"]) < 1
        assert "replicas" not in target["spec"], (
            f"{target['metadata']['name']} sets replicas beside HPA {name}"
        )


def test_the_adapter_rules_windows_hold_two_scrapes() -> None:
    """Issue 76: `avg_over_time(...[1m])` at a 60 s scrape interval (the usual kubernetes-pods job's) held one
    sample or none, and the HPA lost its metric. Each rule's window holds at least two scrapes at 60 s and at
    the PodMonitors'."""
    intervals = [
        _seconds(e["interval"])
        for m in yaml.safe_load_all((KUBERNETES / "monitoring" / "podmonitor.yaml").read_text())
        for e in m["spec"]["podMetricsEndpoints"]
    ]
    for path in sorted((KUBERNETES / "monitoring" / "prometheus-adapter").glob("*.yaml")):
        for rule in yaml.safe_load(path.read_text())["rules"]:
            windows = re.findall(r"\[(\d+[smh])\]", rule["metricsQuery"])
            assert windows and all(_seconds(w) >= 2 * max(60, *intervals) for w in windows), (
                path.name,
                windows,
            )


def _seconds(duration: str) -> float:
    return float(duration[:-1]) * {"s": 1, "m": 60, "h": 3600}[duration[-1]]


@pytest.mark.parametrize("overlay", EVERY)
def test_the_pod_monitors_scrape_every_pod_where_it_serves_metrics(overlay: str) -> None:
    """One PodMonitor selects each pod (vLLM's too), on the port that answers /metrics: the gateway's metrics
    port."""
    monitors = list(yaml.safe_load_all((KUBERNETES / "monitoring" / "podmonitor.yaml").read_text()))
    assert {m["kind"] for m in monitors} == {"PodMonitor"}
    resources = render(overlay)
    config = parse_config(
        yaml.safe_load(one(resources, "ConfigMap", "specgate-gateway")["data"]["config.yaml"])
    )
    for workload in workloads(resources):
        labels = workload["spec"]["template"]["metadata"]["labels"]
        container = workload["spec"]["template"]["spec"]["containers"][0]
        [monitor] = [m for m in monitors if selects(m["spec"]["selector"], labels)]
        [endpoint] = monitor["spec"]["podMetricsEndpoints"]
        assert endpoint["path"] == "/metrics" and endpoint["port"] in {p["name"] for p in container["ports"]}
        if is_specgate(container):
            assert "/metrics" in served(container, config)[endpoint["port"]]


def test_vllms_pod_runs_as_a_user_it_has_no_passwd_entry_for_and_is_watched() -> None:
    """Issue 76: torch's compile cache calls getpass.getuser(), which fails for uid 10001 (no passwd entry in
    vLLM's image) unless USER or LOGNAME is set; a cache outside the writable emptyDir fails on the read-only
    root; without a liveness probe a dead engine loop stayed; the Deployment's progress deadline (600 s by
    default) fell short of its start-up budget; vLLM's /metrics went unscraped."""
    resources = render("vllm")
    vllm = one(resources, "Deployment", "vllm")
    pod = vllm["spec"]["template"]
    [container] = pod["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env.get("USER") and env.get("LOGNAME")
    [cache] = [m["mountPath"] for m in container["volumeMounts"] if m["name"] == "cache"]
    assert "emptyDir" in next(v for v in pod["spec"]["volumes"] if v["name"] == "cache")
    for name in (
        "HOME",
        "HF_HOME",
        "XDG_CACHE_HOME",
        "VLLM_CACHE_ROOT",
        "TORCHINDUCTOR_CACHE_DIR",
        "TRITON_CACHE_DIR",
    ):
        assert env[name] == cache or env[name].startswith(cache + "/"), name
    assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    startup = container["startupProbe"]
    budget = startup.get("initialDelaySeconds", 0) + startup["periodSeconds"] * startup["failureThreshold"]
    assert vllm["spec"]["progressDeadlineSeconds"] >= budget + 300, (
        vllm["spec"].get("progressDeadlineSeconds"),
        budget,
    )
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/path"] == "/metrics"
    assert annotations["prometheus.io/port"] == str(container["ports"][0]["containerPort"])
    # a saturated API server answers /health slowly: neither probe fails on the kubelet's 1 s default (one
    # pod: unready is connection refused for every gateway round, and a restart costs the whole start-up); the
    # endpoints drop it first
    for probe, least in (("readinessProbe", 15), ("livenessProbe", 60)):
        check = container[probe]
        assert (
            check.get("timeoutSeconds", 1) >= 5
            and check["periodSeconds"] * check["failureThreshold"] >= least
        ), probe
    assert container["lifecycle"]["preStop"]["sleep"]["seconds"] >= 5
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    sized = sum(_bytes(v["emptyDir"]["sizeLimit"]) for v in volumes.values())
    assert sized and _bytes(container["resources"]["requests"]["ephemeral-storage"]) >= sized


def test_the_image_runs_anywhere_as_nobody() -> None:
    """The Dockerfile: its base is a build argument (the official image by default), torch from PyPI's CPU
    index by default (no CUDA libraries in a CPU image), llama.cpp without the build machine's CPU flags, no
    compiler and no root at run time."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "ARG BASE_IMAGE=python:3.11-slim" in dockerfile and dockerfile.count("FROM ${BASE_IMAGE}") == 2
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in dockerfile
    assert "-DGGML_NATIVE=OFF" in dockerfile
    # the caches were 0600 root: uid 10001 could not load them
    assert "chmod -R a+rX /srv/specgate /opt/specgate" in dockerfile
    final = dockerfile.rsplit("FROM ${BASE_IMAGE}", 1)[1]
    assert "build-essential" not in final and re.search(r"^USER 10001", final, re.MULTILINE)


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Whether Docker leaves ``path`` (relative to the context) out of the build context: the last pattern
    that matches it or a folder above it decides (``!`` keeps); ``**`` spans folders, ``*`` and ``?`` stay
    within one (moby's patternmatcher)."""
    ignored = False
    parts = path.split("/")
    for pattern in patterns:
        keep = pattern.startswith("!")
        body = pattern.lstrip("!").strip("/")
        regex = "".join(
            "(.*/)?"
            if token == "**/"
            else ".*"
            if token == "**"
            else "[^/]*"
            if token == "*"
            else "[^/]"
            if token == "?"
            else re.escape(token)
            for token in re.findall(r"\*\*/|\*\*|\*|\?|[^*?]+", body)
        )
        if any(re.fullmatch(regex, "/".join(parts[:n])) for n in range(1, len(parts) + 1)):
            ignored = not keep
    return ignored


def test_the_build_context_leaves_out_the_manifests_and_secrets_and_keeps_what_the_dockerfile_copies() -> (
    None
):
    """Issue 76: the build context carried deploy/ — the user's secrets.env with it — into every build (and
    any layer a COPY . would make). .dockerignore leaves out deploy/, every env file, git's history, virtual
    environments, caches, the tests and the docs; every file the Dockerfile copies stays in."""
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    out = [
        "deploy/kubernetes/components/specgate/secrets.env",
        "deploy/kubernetes/base/gateway.yaml",
        "config/local.env",
        ".env",
        "app/.env",
        ".git/HEAD",
        ".venv/bin/python",
        "tests/test_docs.py",
        "docs/kubernetes.md",
        "app/__pycache__/server.cpython-311.pyc",
        ".pytest_cache/README.md",
        ".mypy_cache/3.11/x.json",
        ".ruff_cache/CACHEDIR.TAG",
        ".hypothesis/examples/x",
    ]
    assert [p for p in out if not dockerignored(p, patterns)] == []
    copied = [
        source
        for line in (ROOT / "Dockerfile").read_text().splitlines()
        if line.startswith("COPY ") and "--from=" not in line
        for source in line.split()[1:-1]
    ]
    assert {"core", "app", "workers", "clients", "config", "scripts", "pyproject.toml"} <= set(copied)
    files = [
        f
        for source in copied
        for f in ([ROOT / source] if (ROOT / source).is_file() else (ROOT / source).rglob("*"))
        if f.is_file()
    ]
    kept = [str(f.relative_to(ROOT)) for f in files if "__pycache__" not in f.parts]
    assert kept and [p for p in kept if dockerignored(p, patterns)] == []


def _bytes(value: str | int) -> int:
    """A storage quantity (``512Mi``, ``1Gi``, ``1G``) in bytes."""
    number, unit = re.fullmatch(r"(\d+)([KMGT]i?)?", str(value)).groups()  # type: ignore[union-attr]
    return int(number) * (1024 if unit and unit.endswith("i") else 1000) ** (
        "KMGT".index(unit[0]) + 1 if unit else 0
    )


def _quantity(value: str | int | float) -> float:
    text = str(value)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)
