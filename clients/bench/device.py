"""What the device benches share (``specgate bench tree-device`` / ``step-device``): their flags, progress on
stderr, their JSON. Light on purpose: a GPU machine runs these benches with torch and transformers alone
(scripts/device_check.py)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

# bench: (module, dtype, repeats, what a repeat times, its own flags: flag -> (default, help))
DEVICE_BENCHES: dict[str, tuple[str, str, int, str, dict[str, tuple[Any, str]]]] = {
    "tree-device": (
        "clients.bench.round_cost",
        "float32",
        30,
        "rounds",
        {
            "--budgets": ([1, 4, 8, 14, 32], "verified nodes per round"),
            "--prefix": (128, "agreed tokens before each round (default: 128)"),
        },
    ),
    "step-device": (
        "clients.bench.step_cost",
        "bfloat16",
        20,
        "steps",
        {
            "--batches": ([1, 4, 8, 16], "sessions per step"),
            "--positions": ([1, 5, 17], "positions per session (new token + draft)"),
            "--architecture": (
                "builtin",
                "the random-weight model: builtin (SmolLM2-135M's shape) or tiny (2 layers: the "
                "CPU path's smallest)",
            ),
        },
    ),
}


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def write_json(path: str | None, results: dict[str, Any]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(results, indent=2))
        progress(f"wrote {path}")


def device_args(parser: argparse.ArgumentParser, bench: str) -> argparse.ArgumentParser:
    """The flags of a device bench, alike on ``specgate bench BENCH`` and ``python -m MODULE``."""
    _, dtype, repeats, unit, own = DEVICE_BENCHES[bench]
    parser.add_argument("--json", dest="json_path", default=None, help="write the figures to this JSON file")
    parser.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cpu", "cuda"],
        help="where the model runs (default: cuda if present)",
    )
    parser.add_argument(
        "--dtype",
        default=dtype,
        choices=["float32", "bfloat16", "float16"],
        help=f"model dtype (default: {dtype})",
    )
    parser.add_argument(
        "--repeats", type=int, default=repeats, help=f"timed {unit} per cell (default: {repeats})"
    )
    for flag, (default, text) in own.items():
        kind = str if isinstance(default, str) else int
        parser.add_argument(
            flag, nargs="+" if isinstance(default, list) else None, type=kind, default=default, help=text
        )
    return parser


def device_argv(args: argparse.Namespace, bench: str) -> list[str]:
    """``args`` back as the device bench module's command line."""
    argv = []
    for flag in ("--device", "--dtype", "--repeats", *DEVICE_BENCHES[bench][4]):
        value = getattr(args, flag[2:])
        argv += [flag, *map(str, value)] if isinstance(value, list) else [flag, str(value)]
    return argv + (["--json", args.json_path] if args.json_path else [])
