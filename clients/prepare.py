"""``specgate prepare``: the built-in models' caches made now, not on a first start — the requantized
draft and alternative target, each GGUF's tokenizer converted, the target dequantized for transformers
(pipelines, GPU workers). Set-up (``scripts/setup.sh``: ``make run``, ``make test``, the Dockerfile) runs
it once; each entry is made once and reused (core/runners/models.py)."""

from __future__ import annotations

import argparse
import time

BUILTINS = ("builtin", "builtin-draft", "builtin-alt")


def prepare(args: argparse.Namespace) -> int:
    import torch

    from core.runners import load_runner
    from core.runners.models import cache_dir, resolve_model
    from core.runners.tokenizer import load_tokenizer

    torch.set_num_threads(max(1, torch.get_num_threads()))
    print(f"specgate prepare: caches in {cache_dir()}", flush=True)
    for name in BUILTINS:
        started = time.monotonic()
        load_tokenizer(resolve_model(name))
        print(f"  {name}: GGUF and tokenizer ready ({time.monotonic() - started:.1f} s)", flush=True)
    if not args.no_transformers:
        started = time.monotonic()
        load_runner("builtin", "transformers", device="cpu", dtype="float32").close()
        print(f"  builtin for transformers: ready ({time.monotonic() - started:.1f} s)", flush=True)
    return 0
