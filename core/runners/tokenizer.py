"""The shared tokenizer: loading it (cached), and its fingerprint (DESIGN §4).

transformers turns a GGUF's tokenizer into a fast tokenizer in tens of seconds; the result is
saved once under the user cache dir, keyed by the GGUF file, and reloaded in about a second.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import orjson

from core.errors import ModelLoadError
from core.runners.models import ModelSource, cache_dir, cache_lock, file_key

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
        cached = _tokenizer_cache(path)
        if not (cached / "tokenizer_config.json").is_file():
            with cache_lock(cached):  # processes that start together convert it once
                if not (cached / "tokenizer_config.json").is_file():
                    _convert_gguf_tokenizer(path, cached)
        return AutoTokenizer.from_pretrained(cached)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot load the tokenizer of {path or source.hub_id}: {exc}") from exc


def _tokenizer_cache(gguf: Path) -> Path:
    return cache_dir() / "tokenizers" / file_key(gguf)


def _convert_gguf_tokenizer(gguf: Path, target: Path) -> None:
    from transformers import AutoTokenizer

    log.info("converting the tokenizer of %s (first use, cached in %s)", gguf.name, target)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    tok.save_pretrained(tmp)
    try:
        os.rename(tmp, target)
    except OSError:  # another process got there first with the same files
        shutil.rmtree(tmp, ignore_errors=True)


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 of the vocabulary's id -> token bytes, the merges and the special tokens."""
    digest = hashlib.sha256()
    for token in tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))):
        digest.update(str(token).encode("utf-8") + b"\x00")
    digest.update(orjson.dumps(_merges(tokenizer)))
    digest.update(orjson.dumps(sorted(map(str, tokenizer.all_special_tokens))))
    return digest.hexdigest()


def _merges(tokenizer: Any) -> list[Any]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return []
    model = orjson.loads(backend.to_str()).get("model", {})
    return model.get("merges", [])


def eos_ids(tokenizer: Any, extra: list[int] | None = None) -> list[int]:
    """Token ids that end generation: the tokenizer's EOS plus the chat end-of-turn token."""
    ids = set(extra or [])
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    vocab = tokenizer.get_vocab()
    ids.update(vocab[token] for token in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>") if token in vocab)
    return sorted(ids)
