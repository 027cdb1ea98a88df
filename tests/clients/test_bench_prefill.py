"""``specgate bench prefill``'s prompts (the run itself is a benchmark: docs/performance.md has its figures):
about the length asked, and no two sharing more than the chat template's start — a prompt cache must not hide
the prefill it times."""

from __future__ import annotations

from clients.bench.prefill import _chat_ids, long_prompt
from core.runners import resolve_model
from core.runners.base import common_prefix
from core.runners.tokenizer import load_tokenizer


def test_each_prompt_is_about_its_length_and_shares_no_prefix() -> None:
    tokenizer = load_tokenizer(resolve_model("builtin"))

    def ids(text: str) -> list[int]:
        return _chat_ids(tokenizer, text)

    template = len(ids(""))
    prompts = {
        (length, nonce): ids(long_prompt(tokenizer, length, nonce))
        for length in (250, 1000)
        for nonce in ("a0", "a1")
    }
    for (length, _), tokens in prompts.items():
        assert length <= len(tokens) <= length + 12, (length, len(tokens))
    # a hex digit or two in common at most
    assert common_prefix(prompts[250, "a0"], prompts[250, "a1"]) <= template + 1
    assert common_prefix(prompts[1000, "a1"], prompts[250, "a0"]) <= template + 1
    assert long_prompt(tokenizer, 250, "a0") == long_prompt(tokenizer, 250, "a0")  # seeded by its nonce
