"""What one scheduler step costs the worker on a device, by batch × positions, beside the bare model's
forward in the same run (docs/design.md §9; ``specgate bench step-device`` runs ``python -m clients.bench.step_cost``).
A **step**: B calls of distinct sessions cropped to ``PREFIX``, one ``forward_each``, each call scored (``k: full``):
on transformers' modules scored call by call on the host (``step``, the worker on ``--forward hf --scoring host``), on
the static forward (core/runners/static_forward.py, inputs padded to buckets, CUDA graphs on a GPU) scored on the host
(``static``) and scored together where the logits are with one copy back (``device``, workers/device_scoring.py: the
worker's default on a GPU); the **bare forward**: the HF model on ``[B, P]`` ids over a ``DynamicCache`` of the prefix."""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from clients.bench.common import device_args, progress, write_json
from clients.bench.round_cost import random_runner, time_cells
from core.protocol import VerifyRequest
from core.runners.models import ModelSource
from core.runners.transformers_runner import TransformersRunner
from workers.device_scoring import score_step
from workers.scoring import score

PREFIX = 256
SLOT_MB_CPU = 48  # one session's KV slot of the built-in architecture at 1024 cells in fp32 (30 layers × 3 KV heads × 64 × 2 × 4 B a cell)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m clients.bench.step_cost", description=__doc__.splitlines()[0])
    return measure(device_args(parser, "step-device").parse_args(argv))


def measure(args: argparse.Namespace) -> int:
    # every cell's sessions stay cached for the whole run (a session evicted would be prefilled again inside a timed step)
    sessions = sum(args.batches) * len(args.positions)
    cap_mb = max(1024, sessions * SLOT_MB_CPU)
    model, runner, device = random_runner(args, max_context=1024, gpu_memory_utilization=0.3, memory_cap_mb=cap_mb)
    static = TransformersRunner(
        runner_source(runner), runner.tokenizer, max_context=1024, device=device, model=model, forward="static", gpu_memory_utilization=0.6,
        memory_cap_mb=2 * cap_mb,  # the device column's sessions too
    )
    if min(runner.num_slots, static.num_slots // 2) < sessions:
        raise SystemExit(f"step-device: {sessions} sessions need more KV slots than the device holds ({runner.num_slots}, {static.num_slots}): fewer --batches or --positions")
    progress(f"slot caches: {runner.num_slots} and {static.num_slots} slots of {runner.slot_length} cells")
    generator = np.random.default_rng(0)
    prompt = generator.integers(0, 49152, PREFIX).tolist()
    cells: dict[tuple[int, int, str], Callable[[], None]] = {}
    for b in args.batches:
        for p in args.positions:
            cells[(b, p, "bare")] = _bare(model, device, prompt, b, p)
            cells[(b, p, "step")] = _step(runner, f"b{b}p{p}", prompt, b, p, generator)
            cells[(b, p, "static")] = _step(static, f"b{b}p{p}", prompt, b, p, generator)
            cells[(b, p, "device")] = _step(static, f"d{b}p{p}", prompt, b, p, generator, together=True)
    times = time_cells(cells, args.repeats, device)
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    print(f"\nscheduler step vs bare forward on {device} ({args.dtype}, {name}), prefix {PREFIX}, median of {args.repeats}:")
    print(f"{'batch':>5} {'positions':>9} {'bare ms':>8} {'step ms':>8} {'static ms':>9} {'device ms':>9} {'step/bare':>9} {'static/bare':>11} {'device/bare':>11}")
    rows = []
    for b, p in [(b, p) for b, p, kind in times if kind == "bare"]:
        bare_med, step_med, static_med, device_med = (statistics.median(times[(b, p, kind)]) for kind in ("bare", "step", "static", "device"))
        print(
            f"{b:>5} {p:>9} {bare_med:>8.2f} {step_med:>8.2f} {static_med:>9.2f} {device_med:>9.2f} {step_med / bare_med:>9.2f}"
            f" {static_med / bare_med:>11.2f} {device_med / bare_med:>11.2f}"
        )
        rows.append({
            "batch": b, "positions": p, "bare_ms": bare_med, "step_ms": step_med, "static_step_ms": static_med, "device_step_ms": device_med,
            "ratio": step_med / bare_med, "static_ratio": static_med / bare_med, "device_ratio": device_med / bare_med, "repeats": args.repeats,
        })
    results: dict[str, Any] = {"device": device, "dtype": args.dtype, "gpu": name, "prefix": PREFIX, "rows": rows}
    write_json(args.json_path, results)
    return 0


def runner_source(runner: Any) -> ModelSource:
    return ModelSource(runner.info.model_id, None, None)


def _bare(model: Any, device: str, prompt: list[int], batch: int, positions: int) -> Callable[[], None]:
    """The HF model on [batch, positions] over a DynamicCache of the prefix (cropped back)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.inference_mode():
        model(input_ids=torch.tensor([prompt] * batch, device=device), past_key_values=cache, use_cache=True, logits_to_keep=1)
    new = torch.full((batch, positions), 7, dtype=torch.long, device=device)

    @torch.inference_mode()
    def run() -> None:
        model(input_ids=new, past_key_values=cache, use_cache=True)
        cache.crop(-positions)

    return run


def _step(runner: Any, name: str, prompt: list[int], batch: int, positions: int, generator: np.random.Generator, together: bool = False) -> Callable[[], None]:
    """One scheduler step of ``batch`` calls: crop each to its prefix, one forward_each, score each (``together``: all in one
    ``score_step`` where the logits are, as the worker does with ``--scoring device``)."""
    sessions = [f"{name}s{i}" for i in range(batch)]
    for session in sessions:
        runner.prefill(session, prompt)
    reqs = [VerifyRequest.after(s, prompt, [7], generator.integers(0, 49152, positions - 1).tolist(), mode="aggregate") for s in sessions]

    def run() -> None:
        items = []
        for req in reqs:
            runner.crop(req.session_id, len(prompt))
            items.append(runner.append_item(req.session_id, [7, *req.draft.tolist()], positions))
        runner.logits_on_device = together
        try:
            outputs = runner.forward_each(items)
        finally:
            runner.logits_on_device = False
        assert not any(isinstance(logits, Exception) for logits in outputs), outputs
        if together:
            score_step(torch.cat(outputs), reqs, [runner.length(req.session_id) for req in reqs], 0.0)
            return
        for req, logits in zip(reqs, outputs):
            score(logits, req, runner.length(req.session_id), 0.0)

    return run


if __name__ == "__main__":
    sys.exit(main())
