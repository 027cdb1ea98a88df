"""What one scheduler step costs the worker on a device, by batch × positions, beside the bare
model's forward in the same run (DESIGN §9): ``specgate bench step-device`` runs it as
``python -m clients.bench.step_cost``.

A **step** is what the worker's ``VerifyScheduler`` runs for B waiting calls of distinct
sessions, each holding ``PREFIX`` agreed tokens and bringing one new token and P − 1 draft
tokens: crop each session back to its prefix, **one** runner ``forward_each`` over all of them
(the transformers runner's slot KV cache), then each call's scoring (``k: full``, the heaviest
payload). The **bare forward** is the HF model itself on ``[B, P]`` input ids over a
``DynamicCache`` of the same prefix (cropped back after each call): what the model costs with
nothing of ours around it. The model is the built-in target's architecture (SmolLM2-135M: 30
layers, V = 49,152) with random weights — a forward costs the same whatever the weights.
Cells alternate within each repeat; each figure is the median over repeats, in milliseconds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from clients.bench.common import device_parser, progress, write_json
from clients.bench.round_cost import random_runner
from core.protocol import VerifyRequest
from workers.scoring import score

BATCHES = [1, 4, 8, 16]
POSITIONS = [1, 5, 17]
PREFIX = 256


def main(argv: list[str] | None = None) -> int:
    parser = device_parser("python -m clients.bench.step_cost", __doc__.splitlines()[0], "bfloat16", 20, "steps")
    parser.add_argument("--batches", nargs="+", type=int, default=BATCHES, help="sessions per step")
    parser.add_argument("--positions", nargs="+", type=int, default=POSITIONS, help="positions per session (new token + draft)")
    return measure(parser.parse_args(argv))


def measure(args: argparse.Namespace) -> int:
    model, runner, device = random_runner(args, max_context=1024)
    progress(f"slot cache: {runner.num_slots} slots of {runner.slot_length} cells")
    generator = np.random.default_rng(0)
    prompt = generator.integers(0, 49152, PREFIX).tolist()
    cells: dict[tuple[int, int], tuple[Callable[[], None], Callable[[], None]]] = {}
    for b in args.batches:
        for p in args.positions:
            cells[(b, p)] = (_bare(model, device, prompt, b, p), _step(runner, f"b{b}p{p}", prompt, b, p, generator))
    for bare, step in cells.values():  # warm-up: kernels, allocator, the prefills
        for _ in range(2):
            bare(), step()
    times: dict[tuple[int, int], tuple[list[float], list[float]]] = {key: ([], []) for key in cells}
    for repeat in range(args.repeats):
        for key, (bare, step) in cells.items():
            for fn, into in ((bare, times[key][0]), (step, times[key][1])):
                _sync(device)
                started = time.perf_counter()
                fn()
                _sync(device)
                into.append((time.perf_counter() - started) * 1e3)
        progress(f"repeat {repeat + 1}/{args.repeats}")
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    print(f"\nscheduler step vs bare forward on {device} ({args.dtype}, {name}), prefix {PREFIX}, median of {args.repeats}:")
    print(f"{'batch':>5} {'positions':>9} {'bare ms':>8} {'step ms':>8} {'step/bare':>9}")
    rows = []
    for (b, p), (bare_ms, step_ms) in times.items():
        bare_med, step_med = statistics.median(bare_ms), statistics.median(step_ms)
        print(f"{b:>5} {p:>9} {bare_med:>8.2f} {step_med:>8.2f} {step_med / bare_med:>9.2f}")
        rows.append({"batch": b, "positions": p, "bare_ms": bare_med, "step_ms": step_med, "ratio": step_med / bare_med, "repeats": len(step_ms)})
    results: dict[str, Any] = {"device": device, "dtype": args.dtype, "gpu": name, "prefix": PREFIX, "rows": rows}
    write_json(args.json_path, results)
    return 0


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


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


def _step(runner: Any, name: str, prompt: list[int], batch: int, positions: int, generator: np.random.Generator) -> Callable[[], None]:
    """One scheduler step of ``batch`` calls: crop each to its prefix, one forward_each, score each."""
    sessions = [f"{name}s{i}" for i in range(batch)]
    for session in sessions:
        runner.prefill(session, prompt)
    reqs = [VerifyRequest.after(s, prompt, [7], generator.integers(0, 49152, positions - 1).tolist(), mode="aggregate") for s in sessions]

    def run() -> None:
        items = []
        for req in reqs:
            runner.crop(req.session_id, len(prompt))
            items.append(runner.append_item(req.session_id, [7, *req.draft.tolist()], positions))
        for req, logits in zip(reqs, runner.forward_each(items)):
            assert not isinstance(logits, Exception), logits
            score(logits, req, runner.length(req.session_id), 0.0)

    return run


if __name__ == "__main__":
    sys.exit(main())
