"""The GPU path's first run (issue 73), proven here as far as a CPU can: what a lent GPU machine has (its
image's packages, scripts/device_image_packages.txt) imports tests/gpu, the device benches and the check
itself, and with what the check carries (scripts/device_wheels.py) the end-to-end step's servers; the check's
CPU path (``--quick``) runs every step and keeps each one's command, exit code, seconds and output tails; a
failing step keeps its diagnostics too."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.device_wheels import SKIP, image_packages, needed, project_dependencies
from tests.device_env import ROOT, import_alone, package_site

# what the check runs with the image alone: pytest's conftest, tests/gpu, the step bench, the check
GPU_SIDE = [
    "tests.conftest",
    "tests.gpu.test_cuda",
    "tests.gpu.test_static_graphs",
    "clients.bench.step_cost",
    "clients.bench.round_cost",
    "scripts.device_check",
]
SERVERS = [
    "workers.server",
    "workers.__main__",
    "app.server",
    "app.__main__",
    "clients.procs",
    "clients.bench.common",
    "core.config",
]


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return package_site(image_packages(), tmp_path_factory.mktemp("image"))


def test_tests_gpu_the_device_benches_and_the_check_import_with_the_images_packages_alone(
    image: Path,
) -> None:
    results = import_alone([*GPU_SIDE, *SERVERS], image)
    assert {name: results[name] for name in GPU_SIDE} == dict.fromkeys(GPU_SIDE, "ok")
    # the control: the servers need carried wheels
    assert any("pydantic" in results[name] or "orjson" in results[name] for name in SERVERS), results


def test_the_end_to_end_steps_servers_import_with_what_the_check_carries(tmp_path: Path) -> None:
    carried = set(
        needed(
            project_dependencies() + ["typing-extensions"], (image_packages() - {"typing-extensions"}) | SKIP
        )
    )
    assert {
        "orjson",
        "pydantic",
        "pydantic-core",
        "pydantic-settings",
        "fastapi",
        "uvicorn",
        "sse-starlette",
        "dnspython",
        "llguidance",
    } <= carried
    site = package_site(image_packages() | carried, tmp_path / "site")
    assert import_alone(SERVERS, site) == dict.fromkeys(SERVERS, "ok")


def test_the_checks_cpu_path_keeps_every_steps_diagnostics(tmp_path: Path) -> None:
    out = tmp_path / "check.json"
    run = subprocess.run(
        [sys.executable, "scripts/device_check.py", "--quick", "--target", "tiny-random", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    report = json.loads(out.read_text())
    assert run.returncode == 0, (run.stderr[-3000:], report)
    steps = report["steps"]
    assert list(steps) == ["setup", "env", "tests", "step", "e2e"]
    for name in ("env", "tests", "step", "e2e"):
        assert (
            steps[name]["returncode"] == 0
            and steps[name]["seconds"] > 0
            and steps[name]["command"]
            and "result" in steps[name]
        ), name
        assert {"stdout_tail", "stderr_tail", "timeout_s"} <= set(steps[name]), name
    assert steps["env"]["result"]["project"]["clients.bench.step_cost"] == "imports"
    tests = steps["tests"]["result"]
    # no CUDA here: every GPU test named, skipped
    assert tests["counts"] == {"skipped": len(tests["tests"])} and len(tests["tests"]) >= 8
    bench = steps["step"]["result"]
    assert bench["kernels"]["per_layer"] <= 20 and {
        (row["batch"], row["positions"]) for row in bench["rows"]
    } == {(1, 1), (1, 3)}
    assert all(row["host_ms"] > 0 and row["seeded_step_ms"] > 0 for row in bench["rows"])
    e2e = steps["e2e"]["result"]
    assert {cell["mode"] for cell in e2e["cells"]} == {"autoregressive", "exact", "tree"} and e2e["labels"]
    # the worker's steps, on the static forward's CPU path: every one on a key start-up captures
    worker = e2e["worker_step"]
    assert (
        worker["forward"] == "static"
        and worker["scoring"] == "device"
        and worker["forwards"] > 0
        and worker["eager_forwards"] == 0
    )
    assert report["summary"] and report["seconds"] < report["budget_s"]


def test_a_failing_step_keeps_its_command_exit_code_and_output(monkeypatch: pytest.MonkeyPatch) -> None:
    import scripts.device_check as check

    monkeypatch.setattr(
        check,
        "_command",
        lambda name, args, out: [
            sys.executable,
            "-c",
            "import sys; print('half way'); sys.exit('boom: no GPU')",
        ],
    )
    record = check._step("step", argparse.Namespace(quick=True), 30)
    assert (
        record["returncode"] == 1
        and "half way" in record["stdout_tail"]
        and "boom: no GPU" in record["stderr_tail"]
        and "result" not in record
    )
    monkeypatch.setattr(
        check,
        "_command",
        lambda name, args, out: [
            sys.executable,
            "-c",
            "import time; print('started', flush=True); time.sleep(30)",
        ],
    )
    record = check._step("e2e", argparse.Namespace(quick=True), 1)
    assert record["returncode"] == "timeout" and record["timeout_s"] == 1
