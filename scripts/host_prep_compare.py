"""The static forward's host preparation and kernels per decoder layer, checkouts side by side (issue 73's
before → after):

  python scripts/host_prep_compare.py /path/to/old/checkout . --shapes 1x1 1x17 16x1 16x17 --json
  docs/bench/host_prep_issue73.json

Each checkout runs in its own process (its own code on ``sys.path``), in turns, ``--rounds`` times: the
built-in's shape with random weights in bf16 on one CPU thread, sessions holding 256 tokens; **host
preparation** is a static step with the forward and the head doing nothing (the crop, the inputs, their
upload, the kept rows); **kernels per decoder layer** the forward's kernel-launching ops
(clients/bench/kernels.py's rule) over all its layers less over one, per layer between. Works on checkouts
from 8030f11 (the static forward before issue 73) on."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

_PROBE = r"""
import json, statistics, sys, time
import numpy as np, torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
sys.path.insert(0, sys.argv[1])
from clients.bench.round_cost import _Vocabulary
from core.runners.base import ForwardItem
from core.runners.models import ModelSource
from core.runners.transformers_runner import TransformersRunner, builtin_architecture_model

class Kernels(TorchDispatchMode):
    def __init__(self): super().__init__(); self.n = 0
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = lambda tree: [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]
        ins = {t.untyped_storage().data_ptr() for t in tensors((args, kwargs))}
        made = any(t.untyped_storage().data_ptr() not in ins for t in tensors(out))
        self.n += made or func._schema.is_mutable
        return out

torch.set_num_threads(1)
batch, positions, repeats = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
model = builtin_architecture_model(dtype=torch.bfloat16).eval()
runner = TransformersRunner(ModelSource("b", None, None), _Vocabulary(), max_context=1024, model=model,
                            forward="static", memory_cap_mb=2048)
rng = np.random.default_rng(0)
prompt = rng.integers(0, 49152, 256).tolist()
for b in range(batch):
    runner.forward_each([ForwardItem(f"s{b}", 0, prompt, logits_at=[255])])
items = lambda: [ForwardItem(f"s{b}", 256, [7] + rng.integers(0, 49152, positions - 1).tolist(),
                             logits_at=list(range(positions))) for b in range(batch)]
after = hasattr(runner, "upload")  # issue 73's runner; before it, StepGraphs.run took the padded tensors
static, graphs, count = runner._static, runner._graphs, {}
wrapped = "hidden" if after else "run"
real = getattr(static if after else graphs, wrapped)
def counting(*args):
    with Kernels() as kernels:
        out = real(*args)
    count["n"] = kernels.n - (0 if after else 5)  # before: run() also copied its five inputs
    return out
setattr(static if after else graphs, wrapped, counting)
runner.forward_each(items()); whole = count["n"]
layers = static.layers; static.layers = layers[:1]
runner.forward_each(items()); one = count["n"]; static.layers = layers
hidden = torch.zeros(16 * 64, 576, dtype=torch.bfloat16)
logits = torch.zeros(16 * 64, 8)
if after:
    graphs.run = lambda key, inputs: hidden[: key[0] * key[1]]
else:
    graphs.run = lambda tokens, *rest: hidden[: tokens.numel()].view(*tokens.shape, 576)
static.logits = lambda states, keep: logits[: keep.numel()]
times = []
for _ in range(repeats):
    step = items()
    started = time.perf_counter()
    runner.forward_each(step)
    times.append((time.perf_counter() - started) * 1e3)
print(json.dumps({"kernels_per_layer": (whole - one) / (len(layers) - 1), "host_ms": times}))
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python scripts/host_prep_compare.py", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("checkouts", nargs="+", help="checkouts to compare (a path each; . is this one)")
    parser.add_argument(
        "--shapes",
        nargs="+",
        default=["1x1", "1x17", "16x1", "16x17"],
        help="sessions x positions (default: 1x1 1x17 16x1 16x17)",
    )
    parser.add_argument("--repeats", type=int, default=40, help="timed steps per run (default: 40)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each checkout, in turns (default: 2)")
    parser.add_argument("--json", dest="json_path", help="write the figures here")
    args = parser.parse_args(argv)
    rows = []
    for shape in args.shapes:
        batch, positions = (int(v) for v in shape.split("x"))
        runs: dict[str, list[dict[str, object]]] = {c: [] for c in args.checkouts}
        for _ in range(args.rounds):
            for checkout in args.checkouts:
                path = str(Path(checkout).resolve())
                out = subprocess.run(
                    [sys.executable, "-c", _PROBE, path, str(batch), str(positions), str(args.repeats)],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                runs[checkout].append(json.loads(out.stdout.strip().splitlines()[-1]))
        for checkout, results in runs.items():
            medians = [statistics.median(r["host_ms"]) for r in results]  # type: ignore[arg-type]
            row = {
                "checkout": checkout,
                "batch": batch,
                "positions": positions,
                "kernels_per_layer": results[0]["kernels_per_layer"],
                "host_ms_medians": medians,
                "repeats": args.repeats,
            }
            rows.append(row)
            print(
                f"{checkout:>30} {batch:>3} × {positions:<3} kernels/layer "
                f"{row['kernels_per_layer']:5.1f}   host ms (median a run) "
                f"{', '.join(f'{m:.3f}' for m in medians)}"
            )
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({"shapes": args.shapes, "rows": rows}, indent=2))
        print(f"wrote {args.json_path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
