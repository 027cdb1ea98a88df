"""What one verify round costs the worker, chain vs tree, at equal verified-node budgets, on a device
(docs/design.md §3.6, §9).

``specgate bench tree-device`` runs it: the worker's own path (crop, one runner ``forward``, scoring with ``k:
full``) on the built-in architecture with random weights (a forward costs the same whatever the weights)."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from clients.bench.device import device_args, progress, write_json
from core.protocol import VerifyRequest
from core.runners.base import ModelRunner
from core.runners.models import ModelSource
from workers.scoring import score, tree_item


class _Vocabulary:
    """What the runner asks of a tokenizer, for a model built in code (no special tokens)."""

    eos_token_id = None

    def __len__(self) -> int:
        return 49152

    def get_vocab(self) -> dict[str, int]:
        return {}


def tree_parents(nodes: int, branches: int = 4) -> list[int]:
    """A ``branches``-way root with a chain under each child: node i ≥ branches hangs under node i −
    branches."""
    return [-1 if i < branches else i - branches for i in range(nodes)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m clients.bench.round_cost", description=__doc__.split("\n\n")[0]
    )
    return measure(device_args(parser, "tree-device").parse_args(argv))


def random_runner(
    args: argparse.Namespace,
    max_context: int,
    forward: str = "hf",
    gpu_memory_utilization: float = 0.9,
    memory_cap_mb: int = 1024,
) -> tuple[Any, Any, str]:
    """The built-in architecture with random weights on ``args.device`` in ``args.dtype``: the HF model, a
    runner on ``forward`` (transformers' modules unless told), the device; ``memory_cap_mb``: its KV slots on
    the CPU."""
    from core.runners.transformers_runner import (
        TransformersRunner,
        builtin_architecture_model,
        tiny_random_model,
    )

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    tiny = getattr(args, "architecture", "builtin") == "tiny"
    progress(
        f"building the {'tiny' if tiny else 'built-in'} architecture with random weights "
        f"({args.dtype}) on {device}"
    )
    model = (
        (tiny_random_model(49152) if tiny else builtin_architecture_model())
        .to(getattr(torch, args.dtype))
        .to(device)
        .eval()
    )
    runner = TransformersRunner(
        ModelSource("builtin-architecture", None, None),
        _Vocabulary(),
        max_context=max_context,
        device=device,
        model=model,
        forward=forward,
        gpu_memory_utilization=gpu_memory_utilization,
        memory_cap_mb=memory_cap_mb,
    )
    return model, runner, device


def measure(args: argparse.Namespace) -> int:
    _, runner, device = random_runner(args, max_context=4096)
    generator = np.random.default_rng(0)
    prompt = generator.integers(0, 49152, args.prefix).tolist()
    cells: dict[str, Callable[[], None]] = {}
    for n in args.budgets:
        draft = generator.integers(0, 49152, n).tolist()
        cells[f"chain {n}"] = _round(runner, f"c{n}", prompt, draft, None)
        if n > 1:
            cells[f"tree {n}"] = _round(runner, f"t{n}", prompt, draft, tree_parents(n))
    times = time_cells(cells, args.repeats)
    rows = [
        {
            "cell": name,
            "nodes": int(name.split()[1]),
            "ms_median": statistics.median(ms),
            "ms_min": min(ms),
            "repeats": len(ms),
        }
        for name, ms in times.items()
    ]
    one = statistics.median(times["chain 1"]) if "chain 1" in times else float("nan")
    print(
        f"\nworker verify round on {device} ({args.dtype}, "
        f"{torch.cuda.get_device_name() if device == 'cuda' else 'CPU'}), "
        f"prefix {args.prefix}, median of {args.repeats}:"
    )
    print(f"{'cell':<10} {'ms/round':>9} {'× chain 1':>10}")
    for name, ms in times.items():
        print(f"{name:<10} {statistics.median(ms):>9.2f} {statistics.median(ms) / one:>10.2f}")
    results: dict[str, Any] = {"device": device, "dtype": args.dtype, "prefix": args.prefix, "rows": rows}
    if device == "cuda":
        results["gpu"] = torch.cuda.get_device_name()
    write_json(args.json_path, results)
    return 0


def time_cells(
    cells: dict[Any, Callable[[], None]], repeats: int, device: str | None = None
) -> dict[Any, list[float]]:
    """Each cell's ms per call, the cells alternating within a repeat, after two warm-up calls each;
    ``device``: synchronised around each call."""
    for cell in cells.values():
        cell(), cell()
    sync = torch.cuda.synchronize if device == "cuda" else lambda: None
    times: dict[Any, list[float]] = {key: [] for key in cells}
    for repeat in range(repeats):
        for key, cell in cells.items():
            sync()
            started = time.perf_counter()
            cell()
            sync()
            times[key].append((time.perf_counter() - started) * 1e3)
        progress(f"repeat {repeat + 1}/{repeats}")
    return times


def _round(
    runner: ModelRunner, session: str, prompt: list[int], draft: list[int], parents: list[int] | None
) -> Callable[[], None]:
    """One verify round as the worker runs it: crop to the prefix, forward, score (k: full)."""
    runner.prefill(session, prompt)
    tree = np.array(parents, dtype=np.int32) if parents is not None else None
    req = VerifyRequest.after(
        session, prompt, [7], draft, mode="tree" if parents is not None else "aggregate", parents=tree
    )

    def run() -> None:
        runner.crop(session, len(prompt))
        if parents is not None:
            logits = runner.forward([tree_item(req, runner.tokens(session))])[0]
        else:
            logits = runner.append(session, [7, *draft], len(draft) + 1)
        score(logits, req, runner.length(session), 0.0)

    return run


if __name__ == "__main__":
    raise SystemExit(main())
