"""Real tokenizers whose markers are special tokens, from the data that packages ship (no model hub): Llama
3's (the ``llama-models`` package: a tiktoken vocabulary, ``<|python_tag|>`` one special token) and Mistral's
Tekken (the ``mistral-common`` package: Nemo's vocabulary, ``[TOOL_CALLS]`` control token 9). Each is built as
a transformers fast tokenizer, as a gateway loads one, with the packages' own ids, and kept on disk after the
first build (a few seconds): ``make test``'s set-up builds them (``python -m tests.tokenizers``). The packages
are installed without their dependencies (scripts/setup.sh --dev): only their data files are read."""

from __future__ import annotations

import base64
import importlib.util
import json
import os
import re
import sys
from functools import cache
from pathlib import Path
from typing import Any

# mistral-common's Tekkenizer.DEPRECATED_SPECIAL_TOKENS (ranks 0-19) for a v3 Tekken file: the rest
# <SPECIAL_n>
TEKKEN_SPECIALS = (
    "<unk>",
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
    "[TOOL_CALLS]",
    "[IMG]",
    "<pad>",
    "[IMG_BREAK]",
    "[IMG_END]",
    "[PREFIX]",
    "[MIDDLE]",
    "[SUFFIX]",
    "[SYSTEM_PROMPT]",
    "[/SYSTEM_PROMPT]",
    "[TOOL_CONTENT]",
)


def package_dir(name: str) -> Path | None:
    """Where an installed package's files are, without importing it (its dependencies are not installed)."""
    spec = importlib.util.find_spec(name)
    return (
        Path(list(spec.submodule_search_locations)[0])
        if spec is not None and spec.submodule_search_locations
        else None
    )


def _cache_dir() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "specgate" / "test-tokenizers"


def _fast(name: str, build: Any, bos: str, eos: str) -> Any:
    """The transformers tokenizer kept as ``name``.json, built by ``build()`` (a tokenizers.Tokenizer) the
    first time."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    where = _cache_dir() / f"{name}.json"
    if where.exists():
        tokenizer = Tokenizer.from_file(str(where))
    else:
        tokenizer = build()
        where.parent.mkdir(parents=True, exist_ok=True)
        tokenizer.save(str(where.with_suffix(".tmp")))
        where.with_suffix(".tmp").replace(where)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=bos, eos_token=eos)


@cache
def llama3() -> Any:
    """Llama 3's tokenizer: 128,000 BPE tokens, then 256 special tokens (ids 128000-128255)."""
    root = package_dir("llama_models")
    assert root is not None, "llama-models is not installed (scripts/setup.sh --dev installs it)"
    source = (root / "llama3" / "tokenizer.py").read_text()
    pattern = eval(re.search(r'pat_str = (r".*")', source).group(1))  # type: ignore[union-attr]  # noqa: S307 - the package's own literal
    named = re.findall(r'"(<\|[^"]+\|>)"', source[source.index("special_tokens = [") :].split("]", 1)[0])
    specials = named + [f"<|reserved_special_token_{2 + i}|>" for i in range(256 - len(named))]

    def build() -> Any:
        from tokenizers import AddedToken
        from transformers.convert_slow_tokenizer import TikTokenConverter

        tokenizer = TikTokenConverter(
            vocab_file=str(root / "llama3" / "tokenizer.model"), pattern=pattern
        ).converted()
        tokenizer.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
        return tokenizer

    return _fast("llama3", build, "<|begin_of_text|>", "<|eot_id|>")


@cache
def tekken() -> Any:
    """Mistral Nemo's Tekken tokenizer: 1,000 special tokens (ids 0-999; [TOOL_CALLS] is 9), then its
    vocabulary."""
    root = package_dir("mistral_common")
    assert root is not None, "mistral-common is not installed (scripts/setup.sh --dev installs it)"

    def build() -> Any:
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        data = json.loads((root / "data" / "tekken_240718.json").read_text())
        config = data["config"]
        specials = list(TEKKEN_SPECIALS) + [
            f"<SPECIAL_{i}>" for i in range(len(TEKKEN_SPECIALS), config["default_num_special_tokens"])
        ]
        size = config["default_vocab_size"] - len(specials)
        ranks = {base64.b64decode(t["token_bytes"]): t["rank"] for t in data["vocab"][:size]}
        byte_map = bytes_to_unicode()

        def text(token: bytes) -> str:
            return "".join(byte_map[b] for b in token)

        vocab = {s: i for i, s in enumerate(specials)} | {
            text(t): rank + len(specials) for t, rank in ranks.items()
        }
        # as transformers' TikTokenConverter: every split of a token into two tokens, by the token's rank
        merges = []
        for token, rank in ranks.items():
            pairs = [
                (token[:i], token[i:])
                for i in range(1, len(token))
                if token[:i] in ranks and token[i:] in ranks
            ]
            merges += [
                (left, right, rank)
                for left, right in sorted(pairs, key=lambda pair: (ranks[pair[0]], ranks[pair[1]]))
            ]
        merges.sort(key=lambda merge: merge[2])
        tokenizer = Tokenizer(
            models.BPE(vocab, [(text(left), text(right)) for left, right, _ in merges], fuse_unk=False)
        )
        tokenizer.model.ignore_merges = True
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(pattern=_tokenizers_regex(config["pattern"]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        tokenizer.decoder = decoders.ByteLevel()
        tokenizer.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
        return tokenizer

    return _fast("tekken", build, "<s>", "</s>")


def _tokenizers_regex(pattern: str) -> Any:
    from tokenizers import Regex

    return Regex(pattern)


if __name__ == "__main__":  # make test's set-up: build both once, so the suite only loads them
    for make in (llama3, tekken):
        made = make()
        print(f"{make.__name__}: {len(made)} tokens", file=sys.stderr)
