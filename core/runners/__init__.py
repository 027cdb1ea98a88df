"""Model runners (docs/design.md §7). ``load_runner`` is the one way the draft and targets load."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch

from core.cores import usable_cores
from core.errors import ModelLoadError
from core.names import Backend
from core.runners.base import ModelRunner, RunnerInfo
from core.runners.models import ModelSource, resolve_model
from core.runners.tokenizer import load_tokenizer, tokenizer_fingerprint

__all__ = [
    "ModelRunner",
    "RunnerInfo",
    "ModelSource",
    "load_runner",
    "resolve_model",
    "tokenizer_fingerprint",
]


@functools.cache
def _tokenizer(path: Path | None, hub_id: str | None) -> Any:
    # one per tokenizer file in a process (~0.5 s a load): its runners share it, read-only
    return load_tokenizer(ModelSource(str(path or hub_id), None, path, hub_id))


def load_runner(
    model: str,
    backend: str = Backend.LLAMA_CPP.value,
    max_context: int = 2048,
    memory_cap_mb: int = 1024,
    threads: int | None = None,
    device: str = "auto",
    dtype: str = "auto",
    gpu_memory_utilization: float = 0.9,
    layers: tuple[int, int] | None = None,
    forward: str = "auto",
    long_decode: str = "auto",
) -> ModelRunner:
    """Load ``model`` (a builtin name, GGUF file, HF folder or hub id) on ``backend``, on ``threads`` CPU
    threads (default: every core); ``device``, ``dtype``, ``gpu_memory_utilization``, ``layers`` (a stage's)
    and ``forward`` (its model's forward: auto, hf or static) are transformers'; ``long_decode`` (auto,
    one-thread, pad-stream) llama.cpp's."""
    if backend == Backend.LLAMA_CPP.value and (device not in ("auto", "cpu") or dtype != "auto"):
        raise ModelLoadError(
            "the llama.cpp backend runs GGUF files on the CPU in their own types (asked: device "
            f"{device}, dtype {dtype}): "
            "use --backend transformers for a GPU or another dtype"
        )
    if backend == Backend.LLAMA_CPP.value and forward != "auto":
        raise ModelLoadError(
            f"the llama.cpp backend has one forward, its own (asked: forward {forward}): use "
            "--backend transformers for the hf or static forward"
        )
    if backend == Backend.LLAMA_CPP.value and layers is not None:
        raise ModelLoadError(
            f"the llama.cpp backend cannot run a slice of a model's layers (asked: {layers[0]}:{layers[1]}): "
            "a pipeline stage needs --backend transformers"
        )
    source = resolve_model(model)
    if backend == Backend.LLAMA_CPP.value and source.is_random:
        raise ModelLoadError(f"{source.name.split(':')[0]} is built in code: use --backend transformers")
    tokenizer = _tokenizer(source.tokenizer_path, source.hub_id)
    # processes sharing the cores must split them: pools of every core spin against each other (issue 33: 20×
    # slower)
    threads = threads or usable_cores()
    torch.set_num_threads(threads)
    if backend == Backend.TRANSFORMERS.value:
        from core.runners.transformers_runner import TransformersRunner

        runner: ModelRunner = TransformersRunner(
            source,
            tokenizer,
            max_context=max_context,
            device=device,
            dtype=dtype,
            memory_cap_mb=memory_cap_mb,
            gpu_memory_utilization=gpu_memory_utilization,
            layers=layers,
            forward=forward,
        )
    elif backend == Backend.LLAMA_CPP.value:
        from core.runners.llama_cpp_runner import LlamaCppRunner

        runner = LlamaCppRunner(
            source,
            tokenizer,
            max_context=max_context,
            memory_cap_mb=memory_cap_mb,
            n_threads=threads,
            long_decode=long_decode,
        )
    else:
        raise ModelLoadError(f"unknown backend {backend!r}: use transformers or llama.cpp")
    runner.threads = threads
    check_vocab(len(runner.tokenizer), runner.info.vocab_size, str(source.path or source.name))
    return runner


def check_vocab(num_tokens: int, vocab_size: int, where: str) -> None:
    """A tokenizer with more tokens than the model has rows cannot share ids with it."""
    if num_tokens > vocab_size:
        raise ModelLoadError(
            f"vocabulary mismatch in {where}: the tokenizer has {num_tokens} tokens, the model "
            f"{vocab_size} rows"
        )
