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
    # fp32 noise of another batch shape
    torch.testing.assert_close(logits, tiny_runner.forward_full(TOKENS, 4), atol=1e-4, rtol=1e-4)


def test_crop_then_append_equals_a_fresh_prefill(tiny_runner: ModelRunner) -> None:
    tiny_runner.prefill("a", TOKENS[:6] + [1, 2, 3])
    tiny_runner.crop("a", 6)
    assert tiny_runner.tokens("a") == TOKENS[:6]
    logits = tiny_runner.append("a", TOKENS[6:], 3)
    # fp32 noise of another batch shape
    torch.testing.assert_close(logits, tiny_runner.forward_full(TOKENS, 3), atol=1e-4, rtol=1e-4)


def test_more_logits_than_new_tokens_rescore_held_positions(tiny_runner: ModelRunner) -> None:
    tiny_runner.prefill("a", TOKENS[:-1])
    logits = tiny_runner.append("a", TOKENS[-1:], 3)
    # fp32 noise of another batch shape
    torch.testing.assert_close(logits, tiny_runner.forward_full(TOKENS, 3), atol=1e-4, rtol=1e-4)


def test_sessions_are_independent(tiny_runner: ModelRunner) -> None:
    tiny_runner.prefill("a", TOKENS)
    tiny_runner.prefill("b", TOKENS[::-1])
    logits = tiny_runner.append("a", [7], 1)
    # fp32 noise of another batch shape
    torch.testing.assert_close(logits, tiny_runner.forward_full(TOKENS + [7], 1), atol=1e-4, rtol=1e-4)


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
    return ForwardItem(
        session, prefix, [t for t, _ in TREE], parents=parents, logits_at=list(range(len(TREE)))
    )


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
        torch.testing.assert_close(
            tree[node], tiny_runner.forward_full(TOKENS + path, 1)[0], atol=1e-4, rtol=1e-4
        )


def test_keep_a_path_then_go_on_like_a_plain_sequence(tiny_runner: ModelRunner) -> None:
    tiny_runner.prefill("k", TOKENS, 1)
    tiny_runner.forward([_tree_item("k", len(TOKENS))])
    path = _path(6)  # 0 → 2 → 6
    tiny_runner.keep("k", [*range(len(TOKENS)), *(len(TOKENS) + i for i in path)])
    kept = TOKENS + [TREE[i][0] for i in path]
    assert tiny_runner.tokens("k") == kept
    torch.testing.assert_close(
        tiny_runner.append("k", [11, 12], 2),
        tiny_runner.forward_full(kept + [11, 12], 2),
        atol=1e-4,
        rtol=1e-4,
    )


def test_sessions_in_one_forward_score_as_alone(tiny_runner: ModelRunner) -> None:
    """The slot cache's batched forward: chains of mixed lengths, a re-fed held row, a tree and
    a session rebuilt from its rows share one forward; each gets its own logits (fp32 noise)."""
    prompts = [(TOKENS * 3)[k : k + n] for k, n in enumerate([9, 4, 15, 6, 11, 3])]
    for k, prompt in enumerate(prompts):
        tiny_runner.prefill(f"s{k}", prompt, 1)
    tiny_runner.prefill("t", TOKENS, 1)
    items = [
        ForwardItem(f"s{k}", len(p) - 1, p[-1:] + [20 + k] * (k % 3), logits_at=list(range(1 + k % 3)))
        for k, p in enumerate(prompts)
    ]
    items.append(_tree_item("t", len(TOKENS)))
    items.append(ForwardItem("fresh", 0, TOKENS[:5], logits_at=[4]))
    out = tiny_runner.forward_each(items)
    for k, prompt in enumerate(prompts):
        want = tiny_runner.forward_full(prompt + [20 + k] * (k % 3), 1 + k % 3)
        torch.testing.assert_close(out[k], want, atol=1e-4, rtol=1e-4)
    for node in range(len(TREE)):
        want = tiny_runner.forward_full(TOKENS + [TREE[i][0] for i in _path(node)], 1)[0]
        torch.testing.assert_close(out[-2][node], want, atol=1e-4, rtol=1e-4)  # type: ignore[index]
    torch.testing.assert_close(out[-1], tiny_runner.forward_full(TOKENS[:5], 1), atol=1e-4, rtol=1e-4)


def test_more_sessions_than_slots_rebuild_from_their_rows() -> None:
    runner = load_runner("tiny-random", "transformers", max_context=64, memory_cap_mb=1)
    from core.runners.transformers_runner import TransformersRunner

    assert isinstance(runner, TransformersRunner)
    runner.num_slots = 2  # as if the cap held two
    for k in range(5):
        runner.prefill(f"s{k}", TOKENS[k:], 1)
    # 5 sessions, 2 slots: in turns
    out = runner.forward_each([ForwardItem(f"s{k}", 10 - k, [7]) for k in range(5)])
    for k in range(5):
        torch.testing.assert_close(out[k], runner.forward_full(TOKENS[k:] + [7], 1), atol=1e-4, rtol=1e-4)


def test_device_and_dtype_are_checked() -> None:
    from core.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="llama.cpp backend runs GGUF files on the CPU"):
        load_runner("builtin", "llama.cpp", device="cuda")
    if not torch.cuda.is_available():
        with pytest.raises(ModelLoadError, match="no CUDA device"):
            load_runner("tiny-random", "transformers", device="cuda")
    runner = load_runner("tiny-random", "transformers", device="cpu", dtype="bfloat16")
    logits = runner.prefill("a", TOKENS, 2)
    assert logits.dtype == torch.float32  # probabilities leave in fp32 whatever the model's dtype
    agree = logits.argmax(-1) == load_runner("tiny-random", "transformers", device="cpu").forward_full(
        TOKENS, 2
    ).argmax(-1)
    assert bool(agree.all())


def test_full_when_live_sessions_hold_every_slot(tiny_runner: ModelRunner) -> None:
    """Chains and trees alike take slots: a new session is refused (the worker's 503) only when
    the live ones hold them all."""
    slots = tiny_runner.num_slots  # type: ignore[attr-defined]
    chains = [f"c{i}" for i in range(slots - 1)]
    assert not tiny_runner.is_full(chains, [])
    assert tiny_runner.is_full(chains, ["t"]) and tiny_runner.is_full([*chains, "c"], [], tree=True)


def test_an_item_refused_for_its_hidden_states_leaves_the_session_as_it_was(tiny_runner: ModelRunner) -> None:
    """Issue 63: the hidden-state check ran after the rows were cut back and extended, so a refused item left
    them changed."""
    tiny_runner.forward([ForwardItem("s", 0, [1, 2, 3])])
    [error] = tiny_runner.forward_each([ForwardItem("s", 1, [5, 6], hidden=torch.zeros(3, 4))])
    assert isinstance(error, ValueError) and "hidden states for 3 rows" in str(error)
    assert tiny_runner.tokens("s") == [1, 2, 3]
    tiny_runner.free("s")
