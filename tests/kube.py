"""deploy/kubernetes as a cluster reads it: the rendered objects of an overlay (kubectl's Kustomize), and what
a container of it gets from the kubelet — its command line, its environment (values, the Secret's and
ConfigMap's keys, the service links of the namespace's Services where the pod takes them, the cluster's own),
the files its ConfigMap volumes mount. Shared by tests/test_kubernetes.py (the objects, and the containers
started locally) and tests/image_check.py (the same containers started from the image)."""

from __future__ import annotations

import atexit
import base64
import copy
import functools
import ipaddress
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from secrets import token_hex
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
KUBERNETES = ROOT / "deploy" / "kubernetes"
OVERLAYS = KUBERNETES / "overlays"
SECRETS = KUBERNETES / "components" / "specgate" / "secrets.env"  # the user's: git ignores it
SECRETS_EXAMPLE = SECRETS.with_name("secrets.env.example")
CLUSTER_SERVICE_IP = "10.96.0.1"  # the `kubernetes` Service every pod is told of, links or not

Object = dict[str, Any]


class KubectlMissing(RuntimeError):
    pass


def render(overlay: str) -> list[Object]:
    """The objects ``kubectl apply -k overlays/<overlay>`` would send, in their order (a copy: change it
    freely)."""
    return copy.deepcopy(_rendered(overlay))


@functools.cache
def _rendered(overlay: str) -> list[Object]:
    return _objects(_tree() / "overlays" / overlay)


def render_own(name: str, kustomization: str) -> list[Object]:
    """What a user's own overlay renders: ``kustomization`` (its kustomization.yaml) in the folder ``name``
    beside the repository's ``deploy/`` (so ``../deploy/kubernetes/overlays/default`` names an overlay), each
    once (a copy)."""
    return copy.deepcopy(_rendered_own(name, kustomization))


@functools.cache
def _rendered_own(name: str, kustomization: str) -> list[Object]:
    folder = _tree().parents[1] / name
    folder.mkdir()
    (folder / "kustomization.yaml").write_text(kustomization)
    return _objects(folder)


def _objects(directory: Path) -> list[Object]:
    out = kustomize(directory)
    if out.returncode != 0:
        raise RuntimeError(f"kubectl kustomize {directory.name}: {out.stderr}")
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def kustomize(directory: Path) -> subprocess.CompletedProcess[str]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        raise KubectlMissing("kubectl is not installed (it carries Kustomize)")
    return subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=60)


@functools.cache
def _tree() -> Path:
    """deploy/kubernetes copied (to <temp>/deploy/kubernetes), with the user's secrets.env where there is one,
    else the example's keys with fresh values, as its comment makes them (git ignores secrets.env; the
    example's placeholders are refused at start)."""
    copy_root = Path(tempfile.mkdtemp(prefix="specgate-kubernetes-"))
    atexit.register(shutil.rmtree, copy_root, True)
    tree = copy_root / "deploy" / "kubernetes"
    shutil.copytree(KUBERNETES, tree)
    if not SECRETS.is_file():
        keys = [
            line.split("=", 1)[0]
            for line in SECRETS_EXAMPLE.read_text().splitlines()
            if "=" in line and not line.startswith("#")
        ]
        (tree / SECRETS.relative_to(KUBERNETES)).write_text(
            "".join(f"{key}={token_hex(32)}\n" for key in keys)
        )
    return tree


def by_kind(objects: list[Object], kind: str) -> dict[str, Object]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def workloads(objects: list[Object]) -> list[Object]:
    return [o for o in objects if o["kind"] in ("Deployment", "StatefulSet")]


def pod_name(workload: Object, ordinal: int = 0) -> str:
    """A pod's name: a StatefulSet's ``<name>-<ordinal>``; a Deployment's gets a hash, ``<name>-0`` stands
    in."""
    return f"{workload['metadata']['name']}-{ordinal}"


def cluster_ips(objects: list[Object]) -> dict[str, str]:
    """A virtual IP for every Service that has one (headless Services have none), as a cluster would assign
    them."""
    network = ipaddress.ip_network("10.96.0.0/16")
    services = sorted(
        n for n, s in by_kind(objects, "Service").items() if s["spec"].get("clusterIP") != "None"
    )
    return {name: str(network[10 + i]) for i, name in enumerate(services)}


def service_links(objects: list[Object]) -> dict[str, str]:
    """The kubelet's variables for every Service with a cluster IP in the namespace (what
    ``enableServiceLinks: true``, the default, puts in every pod): ``<NAME>_SERVICE_HOST``,
    ``<NAME>_PORT=tcp://IP:PORT`` and the rest."""
    env: dict[str, str] = {}
    ips = cluster_ips(objects)
    for name, service in by_kind(objects, "Service").items():
        if name not in ips:
            continue
        prefix, ip = name.upper().replace("-", "_"), ips[name]
        ports = service["spec"]["ports"]
        env[f"{prefix}_SERVICE_HOST"] = ip
        env[f"{prefix}_SERVICE_PORT"] = str(ports[0]["port"])
        env[f"{prefix}_PORT"] = f"{ports[0].get('protocol', 'TCP').lower()}://{ip}:{ports[0]['port']}"
        for port in ports:
            protocol = port.get("protocol", "TCP")
            if "name" in port:
                env[f"{prefix}_SERVICE_PORT_{port['name'].upper().replace('-', '_')}"] = str(port["port"])
            base = f"{prefix}_PORT_{port['port']}_{protocol}"
            env[base] = f"{protocol.lower()}://{ip}:{port['port']}"
            env[f"{base}_PROTO"], env[f"{base}_PORT"], env[f"{base}_ADDR"] = (
                protocol.lower(),
                str(port["port"]),
                ip,
            )
    return env


def cluster_env() -> dict[str, str]:
    """What every pod gets whatever ``enableServiceLinks`` says: the API server's Service."""
    return {
        "KUBERNETES_SERVICE_HOST": CLUSTER_SERVICE_IP,
        "KUBERNETES_SERVICE_PORT": "443",
        "KUBERNETES_SERVICE_PORT_HTTPS": "443",
        "KUBERNETES_PORT": f"tcp://{CLUSTER_SERVICE_IP}:443",
        "KUBERNETES_PORT_443_TCP": f"tcp://{CLUSTER_SERVICE_IP}:443",
        "KUBERNETES_PORT_443_TCP_PROTO": "tcp",
        "KUBERNETES_PORT_443_TCP_PORT": "443",
        "KUBERNETES_PORT_443_TCP_ADDR": CLUSTER_SERVICE_IP,
    }


@dataclass
class Container:
    """One container of one pod as the kubelet starts it."""

    workload: Object
    spec: Object  # the container's own spec
    pod: str  # the pod's name (its HOSTNAME)
    argv: list[str]  # command + args (the image's ENTRYPOINT `specgate` where the container sets no command)
    env: dict[str, str]
    # mount path → {file name: content} of its ConfigMap volumes
    files: dict[str, dict[str, str]] = field(default_factory=dict)

    @property
    def pod_spec(self) -> Object:
        return dict(self.workload["spec"]["template"]["spec"])

    def port(self, name_or_number: str | int) -> int:
        """A named container port's number (probes name them)."""
        if isinstance(name_or_number, int):
            return name_or_number
        return next(int(p["containerPort"]) for p in self.spec["ports"] if p["name"] == name_or_number)


ENTRYPOINT = ["specgate"]  # the Dockerfile's


def containers(
    objects: list[Object], workload: Object, ordinal: int = 0, links: bool | None = None
) -> list[Container]:
    """The containers of ``workload``'s pod ``ordinal``, each with the command line and environment the
    kubelet gives it; ``links``: every Service's links in its environment (True), none (False), or as the
    pod's enableServiceLinks says."""
    pod_spec = workload["spec"]["template"]["spec"]
    secrets, config_maps = by_kind(objects, "Secret"), by_kind(objects, "ConfigMap")
    name = pod_name(workload, ordinal)
    with_links = pod_spec.get("enableServiceLinks") is not False if links is None else links
    base = cluster_env() | (service_links(objects) if with_links else {})
    found = []
    for spec in pod_spec["containers"]:
        env = base | {"HOSTNAME": name}
        for var in spec.get("env", []):
            value = _env_value(var, secrets, config_maps)
            if value is not None:
                env[var["name"]] = value
        argv = (spec.get("command") or ENTRYPOINT) + [_expand(a, env) for a in spec.get("args", [])]
        found.append(Container(workload, spec, name, argv, env, _mounted_files(pod_spec, spec, config_maps)))
    return found


def _env_value(var: Object, secrets: dict[str, Object], config_maps: dict[str, Object]) -> str | None:
    """A variable's value; None for an optional reference that resolves to nothing. A reference to a Secret or
    ConfigMap (or key) the overlay does not make, without ``optional``, is what the kubelet refuses:
    CreateContainerConfigError."""
    if "value" in var:
        return str(var["value"])
    source = var["valueFrom"]
    for ref_kind, objects, decode in (
        ("secretKeyRef", secrets, True),
        ("configMapKeyRef", config_maps, False),
    ):
        if ref_kind in source:
            ref = source[ref_kind]
            data = objects.get(ref["name"], {}).get("data", {})
            if ref["key"] not in data:
                if ref.get("optional"):
                    return None
                raise LookupError(
                    f"CreateContainerConfigError: {var['name']} names {ref_kind} "
                    f"{ref['name']}/{ref['key']}, which the overlay does not make"
                )
            return base64.b64decode(data[ref["key"]]).decode() if decode else str(data[ref["key"]])
    raise LookupError(f"{var['name']}: a valueFrom this harness does not know: {sorted(source)}")


def _expand(arg: str, env: dict[str, str]) -> str:
    """``$(VAR)`` in args, as the kubelet expands it."""
    for name, value in env.items():
        arg = arg.replace(f"$({name})", value)
    return arg


def _mounted_files(
    pod_spec: Object, spec: Object, config_maps: dict[str, Object]
) -> dict[str, dict[str, str]]:
    volumes = {v["name"]: v for v in pod_spec.get("volumes", [])}
    files = {}
    for mount in spec.get("volumeMounts", []):
        volume = volumes[mount["name"]]
        if "configMap" in volume:
            config_map = config_maps.get(volume["configMap"]["name"])
            if config_map is None:
                raise LookupError(
                    f"volume {volume['name']} names ConfigMap {volume['configMap']['name']}, "
                    "which the overlay does not make"
                )
            files[mount["mountPath"]] = dict(config_map["data"])
    return files


def flag(argv: list[str], name: str) -> str | None:
    """The value after ``name`` in a command line."""
    return argv[argv.index(name) + 1] if name in argv else None


def with_flag(argv: list[str], name: str, value: str) -> list[str]:
    """``argv`` with ``name``'s value replaced (or the flag added)."""
    if name in argv:
        argv = list(argv)
        argv[argv.index(name) + 1] = value
        return argv
    return [*argv, name, value]
