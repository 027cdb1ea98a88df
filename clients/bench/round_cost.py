"""What one verify round costs the worker, chain vs tree, at equal verified-node budgets, on a
device (DESIGN §3.6, §9): ``specgate bench tree-device`` runs it as ``python -m clients.bench.round_cost``.

The round is the worker's own in-process path of a ``tree`` / ``aggregate k: full`` call: crop
the session back to its prefix, one runner ``forward`` of the new token plus the draft (a chain
of N tokens, or a tree of N nodes), then the scoring that builds the response. The model is the
built-in target's architecture (SmolLM2-135M: 30 layers, V = 49,152) with random weights — a
forward costs the same whatever the weights, so a machine without the GGUF (a GPU box) can time
it; the transformers backend, the one that runs on CUDA. Cells alternate within each repeat;
each figure is the median over repeats, in milliseconds.

The tree of N nodes is a 4-way root with a chain under each child (EAGLE-2's trees at depth ≤ 6
look like this); its cost depends on N and the mask, not on which tokens it holds.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from clients.bench.common import device_parser, progress, write_json
from core.protocol import VerifyRequest
from core.runners.base import ModelRunner
from core.runners.models import ModelSource
from workers.scoring import score, tree_item

BUDGETS = [1, 4, 8, 14, 32]
PREFIX = 128  # agreed tokens before each round


class _Vocabulary:
    """What the runner asks of a tokenizer, for a model built in code (no special tokens)."""

    eos_token_id = None

    def __len__(self) -> int:
        return 49152

    def get_vocab(self) -> dict[str, int]:
        return {}


def tree_parents(nodes: int, branches: int = 4) -> list[int]:
    """A ``branches``-way root with a chain under each child: node i < branches hangs at the root,
    node i ≥ branches under node i − branches."""
    return [-1 if i < branches else i - branches for i in range(nodes)]


def main(argv: list[str] | None = None) -> int:
    parser = device_parser("python -m clients.bench.round_cost", __doc__.splitlines()[0], "float32", 30, "rounds")
    parser.add_argument("--budgets", nargs="+", type=int, default=BUDGETS, help="verified nodes per round")
    parser.add_argument("--prefix", type=int, default=PREFIX, help=f"agreed tokens before each round (default: {PREFIX})")
    return measure(parser.parse_args(argv))


def random_runner(args: argparse.Namespace, max_context: int) -> tuple[Any, Any, str]:
    """The built-in architecture with random weights on ``args.device`` in ``args.dtype`` (what
    the device benches time): the HF model, a runner around it, the device."""
    from core.runners.transformers_runner import (
        TransformersRunner,
        builtin_architecture_model,
    )

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    progress(f"building the built-in architecture with random weights ({args.dtype}) on {device}")
    model = builtin_architecture_model(dtype=getattr(torch, args.dtype)).to(device).eval()
    runner = TransformersRunner(ModelSource("builtin-architecture", None, None), _Vocabulary(), max_context=max_context, device=device, model=model)
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
    for cell in cells.values():  # warm-up: kernels, allocator, the first prefill
        cell()
        cell()
    times: dict[str, list[float]] = {name: [] for name in cells}
    for repeat in range(args.repeats):
        for name, cell in cells.items():
            started = time.perf_counter()
            cell()
            times[name].append((time.perf_counter() - started) * 1e3)
        progress(f"repeat {repeat + 1}/{args.repeats}")
    rows = [
        {"cell": name, "nodes": int(name.split()[1]), "ms_median": statistics.median(ms), "ms_min": min(ms), "repeats": len(ms)}
        for name, ms in times.items()
    ]
    one = statistics.median(times["chain 1"]) if "chain 1" in times else float("nan")
    print(f"\nworker verify round on {device} ({args.dtype}, {torch.cuda.get_device_name() if device == 'cuda' else 'CPU'}), "
          f"prefix {args.prefix}, median of {args.repeats}:")
    print(f"{'cell':<10} {'ms/round':>9} {'× chain 1':>10}")
    for name, ms in times.items():
        print(f"{name:<10} {statistics.median(ms):>9.2f} {statistics.median(ms) / one:>10.2f}")
    results: dict[str, Any] = {"device": device, "dtype": args.dtype, "prefix": args.prefix, "rows": rows}
    if device == "cuda":
        results["gpu"] = torch.cuda.get_device_name()
    write_json(args.json_path, results)
    return 0


def _round(runner: ModelRunner, session: str, prompt: list[int], draft: list[int], parents: list[int] | None) -> Callable[[], None]:
    """One verify round as the worker runs it: crop to the prefix, forward, score (k: full)."""
    runner.prefill(session, prompt)
    tree = {"parents": np.array(parents, dtype=np.int32)} if parents is not None else {}
    req = VerifyRequest.after(session, prompt, [7], draft, mode="tree" if parents is not None else "aggregate", **tree)  # type: ignore[arg-type]

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
