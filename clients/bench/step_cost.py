"""What one scheduler step costs the worker on a device, by batch × positions, beside the bare model's forward
in the same run (docs/design.md §9; ``specgate bench step-device`` runs ``python -m
clients.bench.step_cost``). A **step**: B calls of distinct sessions cropped to ``PREFIX``, one
``forward_each``, each call scored (``k: full``): on transformers' modules scored call by call on the host
(``step``, the worker on ``--forward hf --scoring host``), on the static forward
(core/runners/static_forward.py, inputs padded to buckets, CUDA graphs on a GPU) scored on the host
(``static``) and scored together where the logits are with one copy back (``device``,
workers/device_scoring.py: the worker's default on a GPU); ``seeded``: the same with every call seeded, each
forwarded alone (the seeded promise's cost); ``host``: the static step with the model and the head replaced by
nothing — what the host does for a step (the crop, the inputs, the one upload, the kept rows). The **bare
forward**: the HF model on ``[B, P]`` ids over a ``DynamicCache`` of the prefix. Printed first: the static
forward's kernels per decoder layer (clients.bench.kernels, counted on a 16 × 17 step)."""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from clients.bench.device import device_args, progress, write_json
from clients.bench.kernels import per_layer
from clients.bench.round_cost import random_runner, time_cells
from core.protocol import VerifyRequest
from core.runners.models import ModelSource
from core.runners.static_forward import BUCKETS
from core.runners.transformers_runner import TransformersRunner
from workers.device_scoring import score_step
from workers.scoring import score

PREFIX = 256
# one session's KV slot of the built-in architecture at 1024 cells in fp32 (30 layers × 3 KV heads × 64 × 2 ×
# 4 B a cell)
SLOT_MB_CPU = 48


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m clients.bench.step_cost", description=__doc__.split("\n\n")[0]
    )
    return measure(device_args(parser, "step-device").parse_args(argv))


def measure(args: argparse.Namespace) -> int:
    # every cell's sessions stay cached for the whole run (a session evicted would be prefilled again inside a
    # timed step): the static columns on two runners of their own (static and device; seeded and host), each
    # with room for two columns'
    sessions = sum(args.batches) * len(args.positions)
    cap_mb = max(1024, sessions * SLOT_MB_CPU)
    model, runner, device = random_runner(
        args, max_context=1024, gpu_memory_utilization=0.3, memory_cap_mb=cap_mb
    )
    static, other = (
        TransformersRunner(
            runner_source(runner),
            runner.tokenizer,
            max_context=1024,
            device=device,
            model=model,
            forward="static",
            gpu_memory_utilization=share,
            # two columns' sessions (and the kernel count's)
            memory_cap_mb=2 * cap_mb + 2 * SLOT_MB_CPU * max(args.batches),
        )
        for share in (0.6, 0.9)
    )
    if min(runner.num_slots, static.num_slots // 2, other.num_slots // 2) < sessions:
        raise SystemExit(
            f"step-device: {sessions} sessions need more KV slots than the device holds "
            f"({runner.num_slots}, {static.num_slots}, {other.num_slots}):"
            " fewer --batches or --positions"
        )
    progress(
        f"slot caches: {runner.num_slots}, {static.num_slots} and {other.num_slots} slots of "
        f"{runner.slot_length} cells"
    )
    generator = np.random.default_rng(0)
    prompt = generator.integers(0, 49152, PREFIX).tolist()
    kernels = _kernels(static, prompt, max(args.batches), max(args.positions), generator)
    progress(
        f"static forward: {kernels['per_layer']:.1f} kernels per decoder layer, "
        f"{kernels['outside_layers']} outside them"
    )
    cells: dict[tuple[int, int, str], Callable[[], None]] = {}
    for b in args.batches:
        for p in args.positions:
            cells[(b, p, "bare")] = _bare(model, device, prompt, b, p)
            cells[(b, p, "step")] = _step(runner, f"b{b}p{p}", prompt, b, p, generator)
            cells[(b, p, "static")] = _step(static, f"b{b}p{p}", prompt, b, p, generator)
            cells[(b, p, "device")] = _step(static, f"d{b}p{p}", prompt, b, p, generator, together=True)
            cells[(b, p, "seeded")] = _step(
                other, f"e{b}p{p}", prompt, b, p, generator, together=True, seeded=True
            )
            cells[(b, p, "host")] = _host_only(
                other, _step(other, f"h{b}p{p}", prompt, b, p, generator, forward_only=True)
            )
    graphs = [g for g in (static._graphs, other._graphs) if g is not None]
    # the prefills; one more inside the timed steps: a session was evicted
    eager_before = [g.counts.eager for g in graphs]
    times = time_cells(cells, args.repeats, device)
    evicted = [g.counts.eager - before for g, before in zip(graphs, eager_before)]
    if any(evicted):
        progress(
            f"warning: {sum(evicted)} sessions were prefilled again inside timed steps "
            "(evicted): the static columns are not steps alone"
        )
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    kinds = ("bare", "step", "static", "device", "seeded", "host")
    print(
        f"\nscheduler step vs bare forward on {device} ({args.dtype}, {name}), prefix {PREFIX}, "
        f"median of {args.repeats} (ms):"
    )
    print(
        f"static forward: {kernels['per_layer']:.1f} kernels per decoder layer, "
        f"{kernels['outside_layers']} outside them"
    )
    print(
        f"{'batch':>5} {'positions':>9} {'bare':>8} {'step':>8} {'static':>8} {'device':>8} "
        f"{'seeded':>8} {'host':>8} {'device/bare':>11}"
    )
    rows = []
    for b, p in [(b, p) for b, p, kind in times if kind == "bare"]:
        med = {kind: statistics.median(times[(b, p, kind)]) for kind in kinds}
        print(
            " ".join(
                [
                    f"{b:>5} {p:>9}",
                    *(f"{med[kind]:>8.2f}" for kind in kinds),
                    f"{med['device'] / med['bare']:>11.2f}",
                ]
            )
        )
        rows.append(
            {
                "batch": b,
                "positions": p,
                "bare_ms": med["bare"],
                "step_ms": med["step"],
                "static_step_ms": med["static"],
                "device_step_ms": med["device"],
                "seeded_step_ms": med["seeded"],
                "host_ms": med["host"],
                "ratio": med["step"] / med["bare"],
                "static_ratio": med["static"] / med["bare"],
                "device_ratio": med["device"] / med["bare"],
                "repeats": args.repeats,
            }
        )
    results: dict[str, Any] = {
        "device": device,
        "dtype": args.dtype,
        "gpu": name,
        "architecture": args.architecture,
        "prefix": PREFIX,
        "kernels": kernels,
        "rows": rows,
        "prefilled_again": sum(evicted),
    }
    write_json(args.json_path, results)
    return 0


def _kernels(
    runner: Any, prompt: list[int], batch: int, positions: int, generator: np.random.Generator
) -> dict[str, Any]:
    """The static forward's kernels per decoder layer on a step of ``batch`` × ``positions`` (its inputs as
    the step made them)."""
    from core.runners.static_forward import StepInputs, layout

    graphs = runner._graphs
    seen: list[tuple[tuple[int, int, int], torch.Tensor]] = []
    real = graphs.run

    def run(key: tuple[int, int, int], inputs: torch.Tensor) -> torch.Tensor:
        seen.append((key, inputs.clone()))
        return real(key, inputs)

    graphs.run = run
    try:
        _step(runner, "kernels", prompt, batch, positions, generator, forward_only=True)()
    finally:
        graphs.run = real
    (sessions, rows, span), inputs = seen[-1]
    per, outside, layer = per_layer(runner._static, StepInputs(*layout(inputs, sessions, rows)), span)
    for i in range(batch):
        runner.free(f"kernelss{i}")
    return {
        "per_layer": per,
        "outside_layers": outside,
        "layer": dict(layer),
        "step": [batch, positions],
        "bucket": [sessions, rows, span],
    }


def _host_only(runner: Any, step: Callable[[], None]) -> Callable[[], None]:
    """``step`` with the forward (a graph's replay, or the eager ops) and the head doing nothing, their
    outputs preallocated: the host's share of it — the crop, the inputs, the one upload, the kept rows."""
    graphs, forward = runner._graphs, runner._static
    hidden = torch.zeros(
        max(BUCKETS.sessions) * max(BUCKETS.rows),
        forward.hidden_size,
        dtype=runner.dtype,
        device=runner.device,
    )
    logits = torch.zeros(max(BUCKETS.sessions) * max(BUCKETS.rows), 8, device=runner.device)

    def run() -> None:
        real_run, real_logits = graphs.run, forward.logits
        graphs.run = lambda key, inputs: hidden[: key[0] * key[1]]
        forward.logits = lambda states, keep: logits[: keep.numel()]
        try:
            step()
        finally:
            graphs.run, forward.logits = real_run, real_logits

    return run


def runner_source(runner: Any) -> ModelSource:
    return ModelSource(runner.info.model_id, None, None)


def _bare(model: Any, device: str, prompt: list[int], batch: int, positions: int) -> Callable[[], None]:
    """The HF model on [batch, positions] over a DynamicCache of the prefix (cropped back)."""
    from transformers import DynamicCache

    from core.runners.transformers_runner import _cache_kwarg

    # ``cache`` since transformers 5.x, else ``past_key_values``
    cache = {_cache_kwarg(model.forward): DynamicCache()}
    with torch.inference_mode():
        model(
            input_ids=torch.tensor([prompt] * batch, device=device), use_cache=True, logits_to_keep=1, **cache
        )
    new = torch.full((batch, positions), 7, dtype=torch.long, device=device)

    @torch.inference_mode()
    def run() -> None:
        model(input_ids=new, use_cache=True, **cache)
        next(iter(cache.values())).crop(-positions)

    return run


def _step(
    runner: Any,
    name: str,
    prompt: list[int],
    batch: int,
    positions: int,
    generator: np.random.Generator,
    together: bool = False,
    seeded: bool = False,
    forward_only: bool = False,
) -> Callable[[], None]:
    """One scheduler step of ``batch`` calls: crop each to its prefix, one forward_each, score each
    (``together``: all in one ``score_step`` where the logits are, as the worker does with ``--scoring
    device``; ``seeded``: each call forwarded alone, as a seeded call is; ``forward_only``: no scoring)."""
    sessions = [f"{name}s{i}" for i in range(batch)]
    for session in sessions:
        runner.prefill(session, prompt)
    reqs = [
        VerifyRequest.after(
            s, prompt, [7], generator.integers(0, 49152, positions - 1).tolist(), mode="aggregate"
        )
        for s in sessions
    ]

    def run() -> None:
        items = []
        for req in reqs:
            runner.crop(req.session_id, len(prompt))
            item = runner.append_item(req.session_id, [7, *req.draft.tolist()], positions)
            items.append(replace(item, alone=True) if seeded else item)
        runner.logits_on_device = together or forward_only
        try:
            outputs = runner.forward_each(items)
        finally:
            runner.logits_on_device = False
        assert not any(isinstance(logits, Exception) for logits in outputs), outputs
        if forward_only:
            return
        if together:
            score_step(torch.cat(outputs), reqs, [runner.length(req.session_id) for req in reqs], 0.0)
            return
        for req, logits in zip(reqs, outputs):
            score(logits, req, runner.length(req.session_id), 0.0)

    return run


if __name__ == "__main__":
    sys.exit(main())
