"""The llama.cpp runner on the built-in model: chains, trees and keep, bit for bit (docs/design.md §7).

With flash attention pinned on and every decode ≤ 32 tokens, a position scores the same
whichever way it was reached: token by token, in a prefill, rebuilt after an eviction, as a
node of a tree in one decode, or after ``keep`` of a tree path. These tests are that promise;
it depends on the llama.cpp build, so they are what to run after upgrading it (with
test_llama_cpp_numerics.py: these run on the test process's one thread and short contexts;
that module measures the kernels' boundaries and holds long sessions to them on two threads).
"""

from __future__ import annotations

import pytest
import torch

from core.runners import ModelRunner, load_runner
from core.runners.base import ForwardItem, held_by
from core.runners.llama_cpp_runner import DECODE_TOKENS, LlamaCppRunner

TEXT = (
    "The history of the city begins in the early middle ages, when a small settlement grew around a "
    "river crossing."
)

# a tree after the prompt: (token, parent) with parent an index into this list, −1 = the last prompt row
TREE = [(504, -1), (3458, -1), (28, 0), (638, 0), (359, 1), (346, 2), (1485, 2), (47, 3), (378, 6)]


@pytest.fixture
def tokens(builtin_llama: ModelRunner) -> list[int]:
    return list(builtin_llama.tokenizer.encode(TEXT))


def tree_item(session: str, prefix: int, nodes: list[tuple[int, int]]) -> ForwardItem:
    parents = [prefix - 1 if p < 0 else prefix + p for _, p in nodes]
    return ForwardItem(
        session, prefix, [t for t, _ in nodes], parents=parents, logits_at=list(range(len(nodes)))
    )


def prompt_and_tree(session: str, prompt: list[int], nodes: list[tuple[int, int]]) -> ForwardItem:
    """A session's first call: its prompt and a tree after it, every row's logits."""
    parents = [
        *range(-1, len(prompt) - 1),
        *(len(prompt) - 1 if p < 0 else len(prompt) + p for _, p in nodes),
    ]
    return ForwardItem(
        session,
        0,
        prompt + [t for t, _ in nodes],
        parents=parents,
        logits_at=list(range(len(prompt) - 1, len(prompt) + len(nodes))),
    )


def path_to(nodes: list[tuple[int, int]], node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = nodes[node][1]
    return path[::-1]


def test_token_by_token_prefill_and_rebuild_score_alike(
    builtin_llama: ModelRunner, tokens: list[int]
) -> None:
    """chain == re-prefill: why the last-token re-evaluation of the first version could go."""
    long = (tokens * 4)[:90]  # more than 64 positions: one big ubatch would differ here
    stepwise = [builtin_llama.prefill("s", long[:1], 1)[0]]
    for token in long[1:]:
        stepwise.append(builtin_llama.append("s", [token], 1)[0])  # a decode of one token
    assert torch.equal(torch.stack(stepwise[-70:]), builtin_llama.forward_full(long, 70))
    builtin_llama.crop("s", 40)
    assert torch.equal(builtin_llama.append("s", [], 1)[0], stepwise[39])  # a held row fed again
    assert isinstance(builtin_llama, LlamaCppRunner) and builtin_llama.max_decode_tokens <= DECODE_TOKENS


def test_a_tree_in_one_decode_equals_each_path_as_a_chain(
    builtin_llama: ModelRunner, tokens: list[int]
) -> None:
    builtin_llama.prefill("t", tokens, 1)
    tree = builtin_llama.forward([tree_item("t", len(tokens), TREE)])[0]
    for node in range(len(TREE)):
        path = [TREE[i][0] for i in path_to(TREE, node)]
        assert torch.equal(tree[node], builtin_llama.forward_full(tokens + path, 1)[0]), node


def test_a_tree_grown_depth_by_depth_equals_one_decode(builtin_llama: ModelRunner, tokens: list[int]) -> None:
    """How a draft builds its tree: one decode per depth, children of the last depth's rows."""
    builtin_llama.prefill("d", tokens, 1)
    whole = builtin_llama.forward([tree_item("d", len(tokens), TREE)])[0]
    builtin_llama.prefill("g", tokens, 1)
    depth = {i: len(path_to(TREE, i)) for i in range(len(TREE))}
    grown = {}
    for level in sorted(set(depth.values())):
        nodes = [i for i in range(len(TREE)) if depth[i] == level]
        held = builtin_llama.length("g")
        row_of = {i: len(tokens) + i for i in range(len(TREE))}  # nodes come in index order
        parents = [len(tokens) - 1 if TREE[i][1] < 0 else row_of[TREE[i][1]] for i in nodes]
        assert held == len(tokens) + min(nodes)
        out = builtin_llama.forward(
            [ForwardItem("g", held, [TREE[i][0] for i in nodes], parents, list(range(len(nodes))))]
        )[0]
        grown.update(zip(nodes, out))
    assert all(torch.equal(grown[i], whole[i]) for i in range(len(TREE)))


@pytest.mark.parametrize("leaf, cells_kept", [(5, 3), (6, 2)])  # 0 → 2 → 5 are first children; 6 is not
def test_keep_a_path_then_go_on_like_a_plain_sequence(
    builtin_llama: ModelRunner, tokens: list[int], leaf: int, cells_kept: int
) -> None:
    builtin_llama.prefill("k", tokens, 1)
    builtin_llama.forward([tree_item("k", len(tokens), TREE)])
    path = path_to(TREE, leaf)
    builtin_llama.keep("k", [*range(len(tokens)), *(len(tokens) + i for i in path)])
    kept = tokens + [TREE[i][0] for i in path]
    slot = held_by(builtin_llama._slots, "k") if isinstance(builtin_llama, LlamaCppRunner) else None
    assert slot is not None and slot.rows == len(tokens) + cells_kept  # the rest is decoded again
    assert builtin_llama.tokens("k") == kept
    after = builtin_llama.append("k", [11, 12], 2)
    assert torch.equal(after, builtin_llama.forward_full(kept + [11, 12], 2))
    builtin_llama.forward([tree_item("k", len(kept) + 2, TREE)])  # another tree, then keep nothing of it
    builtin_llama.keep("k", range(len(kept) + 2))
    assert torch.equal(builtin_llama.append("k", [13], 1), builtin_llama.forward_full(kept + [11, 12, 13], 1))


def test_keep_rejects_what_is_not_a_path(builtin_llama: ModelRunner, tokens: list[int]) -> None:
    builtin_llama.prefill("b", tokens, 1)
    builtin_llama.forward([tree_item("b", len(tokens), TREE)])
    n = len(tokens)
    for rows in ([*range(n), n, n + 1], [*range(n), n + 2], [*range(1, n)]):
        # siblings, a skipped parent, no row 0
        with pytest.raises(ValueError):
            builtin_llama.keep("b", rows)
    with pytest.raises(ValueError):
        builtin_llama.append("b", [1], 1)  # a chain after an unkept tree


def test_no_decode_reaches_64_tokens(builtin_llama: ModelRunner, tokens: list[int]) -> None:
    wide = [(100 + i, -1) for i in range(40)] + [(200 + i, i) for i in range(30)]  # 70 nodes
    builtin_llama.prefill("w", (tokens * 5)[:100], 1)
    out = builtin_llama.forward([tree_item("w", 100, wide)])[0]
    assert torch.equal(out[45], builtin_llama.forward_full((tokens * 5)[:100] + [105, 205], 1)[0])
    assert isinstance(builtin_llama, LlamaCppRunner) and builtin_llama.max_decode_tokens == DECODE_TOKENS


def test_more_sessions_than_contexts_rebuild_from_their_rows(tokens: list[int]) -> None:
    runner = load_runner("builtin", "llama.cpp", memory_cap_mb=1)
    assert isinstance(runner, LlamaCppRunner) and runner.num_contexts == 1 and runner.num_streams == 1
    long = (tokens * 4)[:90]
    try:
        first = runner.prefill("a", long, 2)
        runner.prefill("b", long[::-1], 2)  # takes the only context
        again = runner.append("a", [42], 3)  # "a" is rebuilt from its rows, in chunks
        assert torch.equal(again[:2], first)
        assert torch.equal(again, runner.forward_full(long + [42], 3))
    finally:
        runner.close()


def test_sessions_batched_in_shared_decodes_score_as_alone(
    builtin_llama: ModelRunner, tokens: list[int]
) -> None:
    """The worker's scheduler step (docs/design.md §9): chain sessions of mixed lengths share decodes —
    one session's rows split across two decodes, batch-mates of every size — and a tree session
    rides in the same call; each scores bit for bit what it scores alone."""
    assert isinstance(builtin_llama, LlamaCppRunner)
    prompts = [(tokens * 3)[k : k + n] for k, n in enumerate([20, 7, 31, 12, 25, 5, 16, 9])]
    news = [[300 + k, 301 + k, 302 + k, 303 + k][: 1 + k % 4] for k in range(8)]
    for k, prompt in enumerate(prompts):
        builtin_llama.prefill(f"s{k}", prompt, 1)
    builtin_llama.prefill("tree", tokens, 1)
    items = [
        ForwardItem(f"s{k}", len(p) - 2, p[-2:] + new, logits_at=list(range(len(new) + 2)))
        for k, (p, new) in enumerate(zip(prompts, news))
    ]
    items.append(tree_item("tree", len(tokens), TREE))
    builtin_llama.max_decode_tokens = 0
    out = builtin_llama.forward_each(items)
    assert builtin_llama.max_decode_tokens == DECODE_TOKENS  # 8 sessions' 36 rows: more than one decode
    for k, (prompt, new) in enumerate(zip(prompts, news)):
        assert torch.equal(out[k], builtin_llama.forward_full(prompt + new, len(new) + 2)), k
    for node in range(len(TREE)):
        path = [TREE[i][0] for i in path_to(TREE, node)]
        assert torch.equal(out[-1][node], builtin_llama.forward_full(tokens + path, 1)[0]), node


def test_a_failing_item_fails_alone_in_a_shared_decode(builtin_llama: ModelRunner, tokens: list[int]) -> None:
    builtin_llama.prefill("a", tokens, 1)
    builtin_llama.prefill("b", tokens[:10], 1)
    out = builtin_llama.forward_each([ForwardItem("a", len(tokens), [5, 6]), ForwardItem("b", 99, [7])])
    assert isinstance(out[1], ValueError) and builtin_llama.length("b") == 10
    assert torch.equal(out[0], builtin_llama.forward_full(tokens + [5, 6], 1))  # type: ignore[arg-type]


def test_crop_and_free(builtin_llama: ModelRunner, tokens: list[int]) -> None:
    builtin_llama.prefill("c", tokens + [1, 2, 3])
    builtin_llama.crop("c", len(tokens))
    assert builtin_llama.length("c") == len(tokens)
    logits = builtin_llama.append("c", [9], 1)
    assert torch.equal(logits, builtin_llama.forward_full(tokens + [9], 1))
    builtin_llama.free("c")
    assert not builtin_llama.has_session("c")


def test_a_warm_up_leaves_nothing_behind(builtin_llama: ModelRunner, tokens: list[int]) -> None:
    """``warm_up`` (what a worker and the gateway run before they bind: issue 33's cold first
    request) holds no session after it and changes no later row."""
    before = builtin_llama.forward_full(tokens, 3)
    builtin_llama.warm_up()
    assert builtin_llama.session_ids() == [] and builtin_llama.memory_bytes() == 0
    assert torch.equal(builtin_llama.forward_full(tokens, 3), before)


def test_a_new_session_takes_the_cells_of_an_ended_one_that_starts_the_same(tokens: list[int]) -> None:
    """The prompt cache: a session that ends leaves its chain's cells; a new session whose tokens
    start the same decodes only the rest — chain sessions (streams) and tree sessions (their own
    contexts) alike — and every row scores bit for bit what it scores afresh."""
    runner = load_runner("builtin", "llama.cpp")
    assert isinstance(runner, LlamaCppRunner)
    system = (tokens * 3)[:70]
    try:
        runner.prefill("first", system + [11, 12], 1)
        runner.free("first")
        before = runner.reused_rows
        chain = runner.prefill("second", system + [13, 14, 15], 3)
        assert runner.reused_rows - before == len(system)
        assert torch.equal(chain, runner.forward_full(system + [13, 14, 15], 3))
        runner.free("second")
        # all of it cached: the rows that return logits are decoded again
        whole = runner.prefill("third", system, 2)
        assert runner.reused_rows - before == 2 * len(system) - 2
        assert torch.equal(whole, runner.forward_full(system, 2))
        runner.free("third")

        # tree sessions: a context of their own
        runner.forward([prompt_and_tree("tree", system + [21], TREE[:3])])
        runner.keep("tree", [*range(len(system) + 1), len(system) + 1])  # a round's path kept
        runner.free("tree")
        before = runner.reused_rows
        out = runner.forward([prompt_and_tree("again", system + [22], TREE)])[0]
        assert runner.reused_rows - before == len(system)  # the chain up to the first token that differs
        for node in range(len(TREE)):
            path = [TREE[i][0] for i in path_to(TREE, node)]
            assert torch.equal(out[1 + node], runner.forward_full(system + [22] + path, 1)[0]), node
        runner.free("again")

        # the gateway's draft: a tree session's prompt is a chain first (a stream), then its tree (a context);
        # the stream it leaves keeps the prompt's cells, and the next request with that prompt decodes only
        # its own rows there
        prompt = system + [31]
        runner.prefill("drafted", prompt, 1)
        parents = [len(prompt) - 1 if p < 0 else len(prompt) + p for _, p in TREE[:3]]
        runner.forward(
            [
                ForwardItem(
                    "drafted", len(prompt), [t for t, _ in TREE[:3]], parents=parents, logits_at=[0, 1, 2]
                )
            ]
        )
        assert "drafted" in runner._tree_sessions
        runner.free("drafted")
        before = runner.reused_rows
        assert torch.equal(
            runner.prefill("drafted again", system + [32], 1), runner.forward_full(system + [32], 1)
        )
        assert runner.reused_rows - before == len(system)
        runner.free("drafted again")

        # a session that shares only a short start (a chat template's first line) takes an empty place, not a
        # long prompt's cells
        runner.prefill("short", system[:3] + [40, 41], 1)
        runner.free("short")
        before = runner.reused_rows
        runner.prefill("long again", system + [42], 1)
        assert runner.reused_rows - before == len(system)
        runner.free("long again")

        # adopt: a session about to start takes the cached rows first, then feeds the rest in chunks
        assert runner.adopt("fifth", system + [23, 24]) == len(system) and runner.tokens("fifth") == system
        assert runner.adopt("fifth", system) == 0  # held already
        adopted = runner.append("fifth", [23, 24], 2)
        assert torch.equal(adopted, runner.forward_full(system + [23, 24], 2))
        runner.free("fifth")

        cold = load_runner("builtin", "llama.cpp")
        try:
            assert torch.equal(
                runner.prefill("fourth", system + [9], 1), cold.prefill("fourth", system + [9], 1)
            )
        finally:
            cold.close()
    finally:
        runner.close()
