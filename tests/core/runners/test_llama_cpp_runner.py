"""The llama.cpp runner on the built-in model: no batch of one, a bounded context pool."""

from __future__ import annotations

import pytest
import torch

from core.runners import ModelRunner, load_runner
from core.runners.llama_cpp_runner import LlamaCppRunner, _chunks

TEXT = "The history of the city begins in the early middle ages, when a small settlement grew around a river crossing."


@pytest.fixture
def tokens(builtin_llama: ModelRunner) -> list[int]:
    return list(builtin_llama.tokenizer.encode(TEXT))


@pytest.mark.parametrize("total, size", [(1, 4), (2, 4), (5, 4), (9, 4), (513, 512), (1024, 512), (7, 3)])
def test_chunks_cover_everything_with_no_batch_of_one(total: int, size: int) -> None:
    bounds = _chunks(total, size)
    assert bounds[0][0] == 0 and bounds[-1][1] == total
    assert all(e1 == b2 for (_, e1), (b2, _) in zip(bounds, bounds[1:]))
    assert all(1 <= e - b <= size for b, e in bounds)
    assert total == 1 or all(e - b >= 2 for b, e in bounds)


def test_a_position_scores_the_same_alone_or_with_others(builtin_llama: ModelRunner, tokens: list[int]) -> None:
    reference = builtin_llama.forward_full(tokens, 6)
    builtin_llama.prefill("s", tokens[:-1])
    alone = builtin_llama.append("s", tokens[-1:], 1)  # one new token: re-evaluated with the one before
    assert torch.equal(alone[0], reference[-1])
    builtin_llama.crop("s", len(tokens) - 5)
    together = builtin_llama.append("s", tokens[-5:], 6)
    assert torch.equal(together, reference)


def test_greedy_path_scores_identically_token_by_token(builtin_llama: ModelRunner, tokens: list[int]) -> None:
    """Decode 12 tokens one at a time and score them all again in one batch: bit for bit."""
    seq = list(tokens)
    stepwise = []
    logits = builtin_llama.prefill("g", seq, 1)[0]
    for _ in range(12):
        stepwise.append(logits)
        seq.append(int(logits.argmax()))
        logits = builtin_llama.append("g", seq[-1:], 1)[0]
    batched = builtin_llama.forward_full(seq[:-1], 12)
    assert torch.equal(torch.stack(stepwise), batched)


def test_more_sessions_than_contexts_rebuild_from_tokens(tokens: list[int]) -> None:
    runner = load_runner("builtin", "llama.cpp", memory_cap_mb=1)
    assert isinstance(runner, LlamaCppRunner) and runner.num_contexts == 1
    try:
        first = runner.prefill("a", tokens, 2)
        runner.prefill("b", tokens[::-1], 2)  # takes the only context
        again = runner.append("a", [42], 3)  # "a" is rebuilt from its tokens
        assert torch.equal(again[:2], first)
        assert torch.equal(again, runner.forward_full(tokens + [42], 3))
    finally:
        runner.close()


def test_crop_and_free(builtin_llama: ModelRunner, tokens: list[int]) -> None:
    builtin_llama.prefill("c", tokens + [1, 2, 3])
    builtin_llama.crop("c", len(tokens))
    assert builtin_llama.length("c") == len(tokens)
    logits = builtin_llama.append("c", [9], 1)
    assert torch.equal(logits, builtin_llama.forward_full(tokens + [9], 1))
    builtin_llama.free("c")
    assert not builtin_llama.has_session("c")
