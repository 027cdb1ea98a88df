"""The shared tokenizer: loading it and its fingerprint (docs/design.md §4). A GGUF's tokenizer takes tens of
seconds to convert: it is saved once in the user cache dir, keyed by the file, and reloads in a second."""

from __future__ import annotations

import hashlib
import logging
from typing import Any

import orjson

from core.errors import ModelLoadError
from core.runners.models import ModelSource, cache_dir, cache_lock, file_key, save_to_cache

log = logging.getLogger(__name__)


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
