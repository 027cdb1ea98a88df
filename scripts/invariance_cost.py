"""What keeping a long session's logits alike costs per decode of one token, by thread count
(docs/performance.md, "Long prompts keep their text"). llama.cpp's CPU flash attention takes a split-KV kernel
for a micro-batch of one token whose stream holds more than 256 cells, summing the cache in one part per
thread: other last bits than every other decode of the same position. The options, each timed as a decode of
one token at ``--cells`` on the built-in target and checked against the position's logits in a decode of two
(the plain kernel):

- ``split`` (the kernel llama.cpp picks; other bits, the floor every option is a cost over);
- ``one thread`` (the runner's choice since issue 58: the split kernel on one thread is the plain one);
- ``pad position`` (the token and a throwaway one after it in its own stream, the throwaway's cell removed
  after);
- ``pad stream`` (the token and a throwaway one in the next stream of the context, which holds as many cells,
  after
  them, removed after: as the runner does it);
- ``V f32``, ``K f32`` (a context whose V, or K, cache is float32: llama.cpp takes the split kernel only where
  K and V
  are of one type, so every decode takes the plain one — checked within that context, whose bits differ from
  the f16 cache's everywhere, not only past 256 cells).

    python scripts/invariance_cost.py --threads 1,2 --cells 600,1500 --json docs/bench/invariance_cost.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.cores import usable_cores  # noqa: E402
from core.runners.llama_cpp_tools import quiet_llama_cpp  # noqa: E402
from core.runners.models import resolve_model  # noqa: E402

OPTIONS = ("split", "one thread", "pad position", "pad stream")
CACHES = {"V f32": ("f16", "f32"), "K f32": ("f32", "f16")}  # option -> the context's (K, V) cache types
TYPES = {"f16": 1, "f32": 0}  # GGML_TYPE_F16, GGML_TYPE_F32
PROMPT = [int(t) for t in np.random.default_rng(74).integers(100, 20_000, 4_096)]


class Context:
    """The built-in target in a bare context as the runner makes its shared one: flash attention, a KV stream
    per sequence."""

    def __init__(self, model: Any, threads: int, cells: int, cache: tuple[str, str] = ("f16", "f16")) -> None:
        import llama_cpp
        from llama_cpp import _internals

        self.api, self.threads = llama_cpp, threads
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = 2 * (-(-(cells + 64) // 256) * 256)  # two streams of cells
        params.n_batch = params.n_ubatch = 32
        params.n_seq_max, params.n_outputs_max = 2, 32
        params.kv_unified = False
        params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
        params.n_threads = params.n_threads_batch = threads
        params.no_perf = True
        params.type_k, params.type_v = TYPES[cache[0]], TYPES[cache[1]]
        self.ctx = _internals.LlamaContext(model=model, params=params, verbose=False)
        self.batch = _internals.LlamaBatch(n_tokens=32, embd=0, n_seq_max=2, verbose=False)
        self.vocab = int(model.n_vocab())
        for seq in (0, 1):
            # the prompt up to the timed position, in decodes of ≥ 2 tokens; the neighbouring stream as long
            for begin in range(0, cells - 1, 16):
                self._decode([(PROMPT[p], p, seq, False) for p in range(begin, min(begin + 16, cells - 1))])
        self.cells = cells

    def reference(self) -> np.ndarray:
        """The position ``cells − 1``'s logits in a decode of two (the plain kernel), the context left as it
        was."""
        p = self.cells - 1
        self.api.llama_memory_seq_rm(self.ctx.memory, 0, p - 1, -1)
        self._decode([(PROMPT[p - 1], p - 1, 0, False), (PROMPT[p], p, 0, True)])
        logits = self._logits(1)
        self.api.llama_memory_seq_rm(self.ctx.memory, 0, p, -1)
        return logits

    def option(self, name: str) -> tuple[float, np.ndarray]:
        """The position's logits by ``name``; its seconds (the decode and the cells it removes)."""
        p, api, ctx = self.cells - 1, self.api, self.ctx
        started = time.perf_counter()
        if name == "one thread":
            api.llama_set_n_threads(ctx.ctx, 1, self.threads)
        if name in ("split", "one thread"):
            self._decode([(PROMPT[p], p, 0, True)])
        elif name == "pad position":
            self._decode([(PROMPT[p], p, 0, True), (PROMPT[p + 1], p + 1, 0, False)])
            api.llama_memory_seq_rm(ctx.memory, 0, p + 1, -1)
        else:  # after what the neighbouring stream holds, as the runner puts it
            self._decode([(PROMPT[p], p, 0, True), (PROMPT[p], p, 1, False)])
            api.llama_memory_seq_rm(ctx.memory, 1, p, -1)
        if name == "one thread":
            api.llama_set_n_threads(ctx.ctx, self.threads, self.threads)
        seconds = time.perf_counter() - started
        logits = self._logits(0)
        api.llama_memory_seq_rm(ctx.memory, 0, p, -1)
        return seconds, logits

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        raw = self.batch.batch
        raw.n_tokens = len(entries)
        for i, (token, position, seq, wanted) in enumerate(entries):
            raw.token[i], raw.pos[i], raw.n_seq_id[i], raw.logits[i] = token, position, 1, wanted
            raw.seq_id[i][0] = seq
        self.ctx.decode(self.batch)

    def _logits(self, index: int) -> np.ndarray:
        row = ctypes.cast(self.ctx.get_logits_ith(index), ctypes.POINTER(ctypes.c_float))
        return np.ctypeslib.as_array(row, shape=(self.vocab,)).copy()

    def close(self) -> None:
        self.batch.close()
        self.ctx.close()


def measure(model: Any, threads: int, cells: int, repeats: int) -> dict[str, Any]:
    contexts = {
        name: Context(model, threads, cells, cache)
        for name, cache in {"f16": ("f16", "f16"), **CACHES}.items()
    }
    try:
        references = {name: context.reference() for name, context in contexts.items()}
        names = [*OPTIONS, *CACHES]
        seconds: dict[str, list[float]] = {name: [] for name in names}
        alike: dict[str, bool] = {}
        for _ in range(repeats):
            for name in names:  # alternating: the host's drift hits every option alike
                where = name if name in CACHES else "f16"
                took, logits = contexts[where].option("split" if name in CACHES else name)
                seconds[name].append(took)
                alike[name] = alike.get(name, True) and bool(np.array_equal(logits, references[where]))
        ms = {name: 1e3 * statistics.median(values) for name, values in seconds.items()}
        return {
            "threads": threads,
            "cells": cells,
            "ms": ms,
            "alike": alike,
            "cost": {name: ms[name] / ms["split"] - 1 for name in names},
        }
    finally:
        for context in contexts.values():
            context.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--threads", default=None, help="comma-separated thread counts (default: 1 up to the usable cores)"
    )
    parser.add_argument("--cells", default="600,1500", help="comma-separated cells held (default: 600,1500)")
    parser.add_argument("--repeats", type=int, default=30, help="decodes per option and cell (default: 30)")
    parser.add_argument("--json", dest="json_path", default=None, help="write the figures to this JSON file")
    args = parser.parse_args()
    import llama_cpp
    from llama_cpp import _internals

    quiet_llama_cpp()
    threads = (
        [int(t) for t in args.threads.split(",")] if args.threads else list(range(1, usable_cores() + 1))
    )
    params = llama_cpp.llama_model_default_params()
    params.n_gpu_layers = 0
    model = _internals.LlamaModel(path_model=str(resolve_model("builtin").path), params=params, verbose=False)
    rows = []
    try:
        for t in threads:
            for cells in (int(c) for c in args.cells.split(",")):
                rows.append(measure(model, t, cells, args.repeats))
                r = rows[-1]
                print(
                    f"{t:>2} threads, {cells:>5} cells: "
                    + ", ".join(
                        f"{name} {r['ms'][name]:.2f} ms ({100 * r['cost'][name]:+.0f} "
                        f"%{', alike' if r['alike'][name] else ', differs'})"
                        for name in r["ms"]
                    ),
                    flush=True,
                )
    finally:
        model.close()
    if args.json_path:
        Path(args.json_path).write_text(
            json.dumps({"usable_cores": usable_cores(), "repeats": args.repeats, "rows": rows}, indent=1)
            + "\n"
        )
        print(f"wrote {args.json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
