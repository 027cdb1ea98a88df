"""The shared tokenizer: loading it and its fingerprint (docs/design.md §4). A GGUF's tokenizer takes tens of
seconds to convert: it is saved once in the user cache dir, keyed by the file, and reloads in a second."""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, TypeVar

from core.errors import ModelLoadError
from core.runners.models import ModelSource, cache_dir, cache_lock, file_key, save_to_cache

log = logging.getLogger(__name__)
T = TypeVar("T")
# (id(tokenizer), what) → (the tokenizer, kept alive: its id stays its own; the thing)
_MADE: OrderedDict[tuple[Any, ...], tuple[Any, Any]] = OrderedDict()
_MADE_LOCK = threading.Lock()


def per_tokenizer(tokenizer: Any, what: tuple[Any, ...], make: Callable[[], T]) -> T:
    """``make()`` once per tokenizer and ``what`` in a process (the last 8 kept): what is read off a tokenizer
    (its fingerprint, llguidance's view, an engine's token table: 0.2–1 s each) is the same for every runner,
    gateway and worker that shares it."""
    with _MADE_LOCK:
        if (key := (id(tokenizer), *what)) not in _MADE:
            _MADE[key] = (tokenizer, make())
            while len(_MADE) > 8:
                _MADE.popitem(last=False)
        return _MADE[key][1]  # type: ignore[no-any-return]


def load_tokenizer(source: ModelSource) -> Any:
    """The HF tokenizer of ``source`` (a ``PreTrainedTokenizerBase``)."""
    from transformers import AutoTokenizer

    path = source.tokenizer_path
    try:
        if path is None:
            return AutoTokenizer.from_pretrained(source.hub_id)
        if path.suffix != ".gguf":
            return AutoTokenizer.from_pretrained(path)
        cached = cache_dir() / "tokenizers" / file_key(path)
        if not (cached / "tokenizer_config.json").is_file():
            with cache_lock(cached):  # processes that start together convert it once
                if not (cached / "tokenizer_config.json").is_file():
                    log.info("converting the tokenizer of %s (first use, cached in %s)", path.name, cached)
                    save_to_cache(AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name), cached)
        return AutoTokenizer.from_pretrained(cached)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot load the tokenizer of {path or source.hub_id}: {exc}") from exc


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 of the vocabulary's id -> token bytes, the merges and the special tokens."""
    digest = hashlib.sha256()
    for token in tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))):
        digest.update(str(token).encode("utf-8") + b"\x00")
    backend = getattr(tokenizer, "backend_tokenizer", None)
    # here, not at the top: tests/gpu and the device benches import this with torch alone
    # (scripts/device_check.py)
    import orjson

    merges = orjson.loads(backend.to_str()).get("model", {}).get("merges", []) if backend is not None else []
    digest.update(orjson.dumps(merges))
    digest.update(orjson.dumps(sorted(map(str, tokenizer.all_special_tokens))))
    return digest.hexdigest()


def eos_ids(tokenizer: Any, extra: list[int] | None = None) -> list[int]:
    """Token ids that end generation: the tokenizer's EOS plus the chat end-of-turn token."""
    ids = set(extra or [])
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    vocab = tokenizer.get_vocab()
    ids.update(vocab[token] for token in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>") if token in vocab)
    return sorted(ids)
