"""The transformers runner on tiny-random: sessions, crop, append, limits."""

from __future__ import annotations

import pytest
import torch

from core.errors import ContextOverflow
from core.runners import ModelRunner, load_runner

TOKENS = [504, 3458, 28, 638, 359, 346, 1485, 1834, 47, 378]


def test_prefill_equals_a_full_forward(tiny_runner: ModelRunner) -> None:
    logits = tiny_runner.prefill("a", TOKENS, 4)
    assert logits.shape == (4, 49152) and logits.dtype == torch.float32
    torch.testing.assert_close(logits, tiny_runner.forward_full(TOKENS, 4), atol=1e-4, rtol=1e-4)  # fp32 noise of another batch shape


def test_crop_then_append_equals_a_fresh_prefill(tiny_runner: ModelRunner) -> None:
    tiny_runner.prefill("a", TOKENS[:6] + [1, 2, 3])
    tiny_runner.crop("a", 6)
    assert tiny_runner.tokens("a") == TOKENS[:6]
    logits = tiny_runner.append("a", TOKENS[6:], 3)
    torch.testing.assert_close(logits, tiny_runner.forward_full(TOKENS, 3), atol=1e-4, rtol=1e-4)  # fp32 noise of another batch shape


def test_more_logits_than_new_tokens_rescore_held_positions(tiny_runner: ModelRunner) -> None:
    tiny_runner.prefill("a", TOKENS[:-1])
    logits = tiny_runner.append("a", TOKENS[-1:], 3)
    torch.testing.assert_close(logits, tiny_runner.forward_full(TOKENS, 3), atol=1e-4, rtol=1e-4)  # fp32 noise of another batch shape


def test_sessions_are_independent(tiny_runner: ModelRunner) -> None:
    tiny_runner.prefill("a", TOKENS)
    tiny_runner.prefill("b", TOKENS[::-1])
    logits = tiny_runner.append("a", [7], 1)
    torch.testing.assert_close(logits, tiny_runner.forward_full(TOKENS + [7], 1), atol=1e-4, rtol=1e-4)  # fp32 noise of another batch shape


def test_free_and_memory(tiny_runner: ModelRunner) -> None:
    tiny_runner.prefill("a", TOKENS)
    assert tiny_runner.memory_bytes() == len(TOKENS) * tiny_runner.kv_bytes_per_token()
    tiny_runner.free("a")
    assert not tiny_runner.has_session("a") and tiny_runner.memory_bytes() == 0


def test_context_overflow_and_bad_num_logits(tiny_runner: ModelRunner) -> None:
    with pytest.raises(ContextOverflow):
        tiny_runner.prefill("a", [1] * (tiny_runner.info.max_context + 1))
    with pytest.raises(ValueError):
        tiny_runner.prefill("b", TOKENS, 11)


def test_different_seeds_are_different_models(tiny_runner: ModelRunner) -> None:
    other = load_runner("tiny-random:1", "transformers")
    assert other.fingerprint == tiny_runner.fingerprint
    assert not torch.allclose(other.forward_full(TOKENS, 1), tiny_runner.forward_full(TOKENS, 1))
