"""`make image-check`: build the image, then run the default overlay's worker and gateway pods as containers
of it — the rendered args, the environment the kubelet gives them (tests/kube.py), the ConfigMap mounted
read-only where the pod mounts it, the pod's user, a read-only root filesystem with a tmpfs /tmp, no
capabilities, no privilege escalation; the worker reachable by its headless Service's name — and answer a chat
request. Prints progress and a JSON line of figures (build seconds, image size, seconds to the first answer);
--json writes them too.

  python -m tests.image_check                         # the Dockerfile's defaults (python:3.11-slim, PyTorch's
  CPU index) python -m tests.image_check --debian-base --build-arg PIP_FIND_LINKS=http://172.17.0.1:8765/ ...
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from clients.procs import free_port
from tests.kube import ROOT, containers, render, workloads

CHAT = {
    "model": "specgate",
    "messages": [{"role": "user", "content": "Name a colour."}],
    "max_tokens": 8,
    "temperature": 0,
    "seed": 1,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.image_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tag", default="specgate:image-check", help="the image to build and run")
    parser.add_argument(
        "--debian-base",
        action="store_true",
        help="build the base from Debian's packages (scripts/debian-base-image.sh; CA_BUNDLE "
        "honoured) instead of pulling python:3.11-slim",
    )
    parser.add_argument(
        "--build-arg", action="append", default=[], help="passed to docker build (repeatable)"
    )
    parser.add_argument("--skip-build", action="store_true", help="run the image as it is")
    parser.add_argument(
        "--no-cache", action="store_true", help="build every layer again (a build's full time)"
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds for the pods to become ready")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here too")
    args = parser.parse_args(argv)
    if shutil.which("docker") is None:
        print("image-check: docker is not installed", file=sys.stderr)
        return 2
    figures: dict[str, object] = {"image": args.tag}
    build_args = list(args.build_arg)
    if args.debian_base:
        base = "specgate-base:bookworm"
        started = time.monotonic()
        _step(f"base image {base} from Debian's packages")
        subprocess.run(["bash", str(ROOT / "scripts" / "debian-base-image.sh"), base], check=True)
        figures["base_build_s"] = round(time.monotonic() - started, 1)
        build_args.append(f"BASE_IMAGE={base}")
    if not args.skip_build:
        _step(f"docker build -t {args.tag} ({', '.join(build_args) or 'defaults'})")
        started = time.monotonic()
        cache = ["--no-cache"] if args.no_cache else []
        subprocess.run(
            ["docker", "build", *cache, "-t", args.tag, *(f"--build-arg={a}" for a in build_args), str(ROOT)],
            check=True,
        )
        figures["build_s"] = round(time.monotonic() - started, 1)
    figures["image_bytes"] = int(_out(["docker", "image", "inspect", "--format", "{{.Size}}", args.tag]))
    figures |= run_default_overlay(args.tag, args.timeout)
    line = json.dumps(figures)
    print(line, flush=True)
    if args.json:
        args.json.write_text(line + "\n")
    return 0


def run_default_overlay(image: str, timeout_s: float) -> dict[str, object]:
    """The default overlay's worker pod 0 and a gateway pod as containers of ``image`` on a network of their
    own."""
    objects = render("default")
    [gateway] = [w for w in workloads(objects) if w["metadata"]["name"] == "specgate-gateway"]
    [worker] = [w for w in workloads(objects) if w["kind"] == "StatefulSet"]
    network = f"specgate-check-{os.getpid()}"
    names: list[str] = []
    with tempfile.TemporaryDirectory() as mounts:
        subprocess.run(["docker", "network", "create", network], check=True, stdout=subprocess.DEVNULL)
        try:
            started = time.monotonic()
            [w] = containers(objects, worker)
            names.append(
                _run(image, w, network, [f"--network-alias={worker['spec']['serviceName']}"], Path(mounts))
            )
            [g] = containers(objects, gateway)
            port, metrics = free_port(), free_port()
            published = [
                f"--publish=127.0.0.1:{port}:{g.port('http')}",
                f"--publish=127.0.0.1:{metrics}:{g.port('metrics')}",
            ]
            names.append(_run(image, g, network, published, Path(mounts)))
            url = f"http://127.0.0.1:{port}"
            _step(
                "waiting for the gateway's readiness probe "
                f"({g.spec['readinessProbe']['httpGet']['path']}) at {url}"
            )
            _wait(f"{url}{g.spec['readinessProbe']['httpGet']['path']}", started, timeout_s, names)
            # readiness no longer asks them
            _step(f"waiting for its targets (/health/ready on the metrics port, {metrics})")
            ready_s = _wait(f"http://127.0.0.1:{metrics}/health/ready", started, timeout_s, names)
            key = g.env.get("SPECGATE_API_KEY")
            resp = httpx.post(
                f"{url}/v1/chat/completions",
                json=CHAT,
                headers={"Authorization": f"Bearer {key}"} if key else {},
                timeout=120,
            )
            resp.raise_for_status()
            answer_s = time.monotonic() - started
            text = resp.json()["choices"][0]["message"]["content"]
            _step(f"answer: {text!r}")
            users = {n: _out(["docker", "exec", n, "id", "-u"]).strip() for n in names}
            stage_s = run_stage(image, network, Path(mounts), timeout_s, names)
            cores = threads_within_a_cpu_quota(image)
            return {
                "ready_s": round(ready_s, 1),
                "first_answer_s": round(answer_s, 1),
                "answer": text,
                "uids": users,
                "pipeline_stage_ready_s": stage_s,
                "usable_cores_at_cpus_1": cores,
            }
        finally:
            for name in names:
                subprocess.run(["docker", "logs", "--tail", "5", name], check=False)
                subprocess.run(["docker", "rm", "-f", name], check=False, stdout=subprocess.DEVNULL)
            subprocess.run(["docker", "network", "rm", network], check=False, stdout=subprocess.DEVNULL)


def threads_within_a_cpu_quota(image: str) -> int:
    """``docker run --cpus 1`` (a CPU quota, as a pod's CPU limit sets, every core of the machine still in its
    affinity): the cores a process of the image sizes its threads from are 1 (issue 76: they were every core
    of the machine)."""
    _step("the cores a process sees under docker run --cpus 1")
    code = "from core.cores import usable_cores; print(usable_cores())"
    cores = int(
        _out(["docker", "run", "--rm", "--cpus", "1", "--entrypoint", "python", image, "-c", code]).strip()
    )
    if cores != 1:
        raise SystemExit(f"image check: under --cpus 1 a process sizes its threads for {cores} cores")
    return cores


def run_stage(image: str, network: str, mounts: Path, timeout_s: float, names: list[str]) -> float:
    """The pipeline overlay's stage 0 (the transformers runner, its shell command picking layers by the pod's
    name) until its readiness probe passes: the image's caches serve it read-only."""
    objects = render("pipeline")
    [stages] = [w for w in workloads(objects) if w["kind"] == "StatefulSet"]
    [stage] = containers(objects, stages)
    port = free_port()
    started = time.monotonic()
    names.append(_run(image, stage, network, [f"--publish=127.0.0.1:{port}:{stage.port('http')}"], mounts))
    _step("waiting for the pipeline's stage 0 (transformers, read-only root)")
    return round(
        _wait(
            f"http://127.0.0.1:{port}{stage.spec['readinessProbe']['httpGet']['path']}",
            started,
            timeout_s,
            names[-1:],
        ),
        1,
    )


def _run(image: str, container, network: str, extra: list[str], mounts: Path) -> str:  # type: ignore[no-untyped-def]
    """``docker run`` of one rendered container, as its pod's and its own securityContext say."""
    pod, own = container.pod_spec.get("securityContext", {}), container.spec.get("securityContext", {})
    name = f"{container.pod}-{os.getpid()}"
    flags = [f"--name={name}", f"--network={network}", f"--hostname={container.pod}", *extra]
    if "runAsUser" in pod:
        flags.append(f"--user={pod['runAsUser']}:{pod.get('runAsGroup', pod['runAsUser'])}")
    if own.get("readOnlyRootFilesystem"):
        flags.append("--read-only")
    if own.get("allowPrivilegeEscalation") is False:
        flags.append("--security-opt=no-new-privileges")
    flags += [f"--cap-drop={cap}" for cap in own.get("capabilities", {}).get("drop", [])]
    # the emptyDirs
    flags += [
        f"--tmpfs={m['mountPath']}"
        for m in container.spec.get("volumeMounts", [])
        if m["mountPath"] not in container.files
    ]
    for mount, files in container.files.items():
        local = mounts / container.pod / mount.strip("/")
        local.mkdir(parents=True)
        for file, content in files.items():
            (local / file).write_text(content)
        os.chmod(local, 0o755)
        flags.append(f"--volume={local}:{mount}:ro")
    env = {k: v for k, v in container.env.items() if k != "HOSTNAME"}
    for key, value in env.items():
        flags.append(f"--env={key}={value}")
    if container.spec.get("command"):  # it replaces the image's ENTRYPOINT (specgate)
        flags.append(f"--entrypoint={container.spec['command'][0]}")
    argv = container.argv[1:]
    _step(f"docker run {container.pod}: {' '.join(argv)}")
    subprocess.run(["docker", "run", "--detach", *flags, image, *argv], check=True, stdout=subprocess.DEVNULL)
    return name


def _wait(url: str, started: float, timeout_s: float, names: list[str]) -> float:
    while True:
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return time.monotonic() - started
        except httpx.HTTPError:
            pass
        for name in names:
            if _out(["docker", "inspect", "--format", "{{.State.Running}}", name]).strip() != "true":
                raise RuntimeError(f"{name} stopped")
        if time.monotonic() - started > timeout_s:
            raise RuntimeError(f"not ready after {timeout_s:.0f} s")
        time.sleep(0.5)


def _out(command: list[str]) -> str:
    return subprocess.run(command, check=True, capture_output=True, text=True).stdout


def _step(message: str) -> None:
    print(f"image-check: {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
