"""The transformers runner on tiny-random: sessions, crop, append, limits."""

from __future__ import annotations

import pytest
import torch

from core.errors import ContextOverflow
from core.runners import ModelRunner, load_runner
from core.runners.base import ForwardItem

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


# (token, parent): parent indexes this list, −1 = the last prompt row
TREE = [(504, -1), (3458, -1), (28, 0), (638, 0), (359, 1), (346, 2), (1485, 2)]


def _tree_item(session: str, prefix: int) -> ForwardItem:
    parents = [prefix - 1 if p < 0 else prefix + p for _, p in TREE]
    return ForwardItem(session, prefix, [t for t, _ in TREE], parents=parents, logits_at=list(range(len(TREE))))


def _path(node: int) -> list[int]:
    out = []
    while node >= 0:
        out.append(node)
        node = TREE[node][1]
    return out[::-1]


def test_a_tree_in_one_forward_equals_each_path(tiny_runner: ModelRunner) -> None:
    tiny_runner.prefill("t", TOKENS, 1)
    tree = tiny_runner.forward([_tree_item("t", len(TOKENS))])[0]
    for node in range(len(TREE)):
        path = [TREE[i][0] for i in _path(node)]
        torch.testing.assert_close(tree[node], tiny_runner.forward_full(TOKENS + path, 1)[0], atol=1e-4, rtol=1e-4)


def test_keep_a_path_then_go_on_like_a_plain_sequence(tiny_runner: ModelRunner) -> None:
    tiny_runner.prefill("k", TOKENS, 1)
    tiny_runner.forward([_tree_item("k", len(TOKENS))])
    path = _path(6)  # 0 → 2 → 6
    tiny_runner.keep("k", [*range(len(TOKENS)), *(len(TOKENS) + i for i in path)])
    kept = TOKENS + [TREE[i][0] for i in path]
    assert tiny_runner.tokens("k") == kept
    torch.testing.assert_close(tiny_runner.append("k", [11, 12], 2), tiny_runner.forward_full(kept + [11, 12], 2), atol=1e-4, rtol=1e-4)
