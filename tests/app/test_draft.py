"""The draft's step loop (app/drafting/batcher.py): concurrent drafts share the runner's decodes, each
draft's tokens and q̂ are those it gets alone, a step keeps to its token budget, and a failing
or abandoned draft ends alone without leaving its session in use."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest
import torch

from app.drafting import DraftModel, DraftRequest
from core.math.sampling import SamplingParams
from core.math.shapes import ChildRule, TreeShape
from core.math.tree import TokenTree
from core.runners.base import ForwardItem, ModelRunner, Rows
from core.runners.model_thread import ModelThread
from core.transform import LogitsTransform
from tests.app.fakes import MarkovRunner, random_table

TEXTS = [
    "The quick brown fox jumps over the lazy dog, and then",
    "Speculative decoding drafts tokens with a small model and",
    "Once upon a time",
    "In 1969 the first humans walked on the Moon; the mission was",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Paris is the capital of France. Berlin is the capital of",
    "Water boils at",
    "A list of prime numbers: 2, 3, 5, 7,",
]


async def propose(
    draft: DraftModel,
    session_id: str,
    sequence: list[int],
    gamma: int,
    params: SamplingParams,
    seed: int,
    choice: int,
    truncation: tuple[int, float] = (0, 1.0),
    *,
    transformer: LogitsTransform | None = None,
    limit: int | None = None,
    drafter: str = "model",
    shared: bool = True,
) -> TokenTree:
    """A chain from ``draft``, asked with the fields of a ``DraftRequest`` in a row."""
    return await draft.propose(
        DraftRequest(session_id, sequence, params, seed, choice, truncation, transformer, drafter, shared),
        gamma,
        limit,
    )


async def propose_tree(
    draft: DraftModel,
    session_id: str,
    sequence: list[int],
    shape: TreeShape,
    params: SamplingParams,
    seed: int,
    choice: int,
    truncation: tuple[int, float] = (0, 1.0),
    *,
    transformer: LogitsTransform | None = None,
    depth_limit: int | None = None,
    extra: int = 0,
    drafter: str = "model",
    shared: bool = True,
) -> TokenTree:
    """A tree from ``draft``, likewise."""
    return await draft.propose_tree(
        DraftRequest(session_id, sequence, params, seed, choice, truncation, transformer, drafter, shared),
        shape,
        depth_limit,
        extra,
    )


def _trees_equal(a: TokenTree, b: TokenTree) -> bool:
    return all(
        torch.equal(x, y)
        for x, y in [(a.tokens, b.tokens), (a.parents, b.parents), (a.q_ids, b.q_ids), (a.q_probs, b.q_probs)]
    )


def _calls(runner: ModelRunner, sequences: list[list[int]]) -> list[tuple[str, tuple]]:
    """Six chains (sampled, greedy, truncated) and two trees (sampled, EAGLE-2)."""
    t1, greedy = SamplingParams(temperature=1.0), SamplingParams(temperature=0.0)
    calls: list[tuple[str, tuple]] = []
    for i, seq in enumerate(sequences[:6]):
        params = greedy if i % 3 == 1 else t1
        truncation = (32, 1.0) if i % 3 == 2 else (0, 1.0)
        calls.append(("chain", (f"s{i}", seq, 3 + i % 4, params, 100 + i, 0, truncation)))
    calls.append(
        ("tree", ("s6", sequences[6], TreeShape(ChildRule.SAMPLED_DISTINCT, widths=(2, 1, 1)), t1, 106, 0))
    )
    calls.append(("tree", ("s7", sequences[7], TreeShape.default(True), greedy, 107, 0)))
    return calls


async def _draft(draft: DraftModel, kind: str, args: tuple) -> TokenTree:
    return await (propose(draft, *args) if kind == "chain" else propose_tree(draft, *args))


async def _alone_then_together(
    runner: ModelRunner, max_batch_tokens: int = 128
) -> tuple[list[TokenTree], list[TokenTree], DraftModel, DraftModel]:
    sequences = [runner.tokenizer.encode(text) for text in TEXTS]
    calls = _calls(runner, sequences)
    alone_draft, together_draft = (
        DraftModel(runner, ModelThread(), max_batch_tokens),
        DraftModel(runner, ModelThread(), max_batch_tokens),
    )
    alone = []
    for kind, args in calls:
        alone.append(await _draft(alone_draft, kind, args))
    runner.free_all()
    together = await asyncio.gather(*(_draft(together_draft, kind, args) for kind, args in calls))
    return alone, list(together), alone_draft, together_draft


async def test_on_the_builtin_model_concurrent_drafts_share_steps_bit_for_bit(
    builtin_llama: ModelRunner,
) -> None:
    alone, together, alone_draft, together_draft = await _alone_then_together(builtin_llama)
    for i, (a, b) in enumerate(zip(alone, together)):
        assert len(a) > 0 and _trees_equal(a, b), f"draft {i} changed when it shared steps"
    assert max(alone_draft.batcher.steps) == 1
    assert max(together_draft.batcher.steps) == 8  # every draft in the first steps
    assert len(together_draft.batcher.steps) < len(alone_draft.batcher.steps) / 3


async def test_on_two_threads_long_drafts_share_steps_with_a_background_prefill_bit_for_bit(
    builtin_llama_two_threads: ModelRunner,
) -> None:
    """Issue 58 on two threads (llama.cpp's one-token kernel sums a cache of more than 256 cells in one part
    per thread): chains and a tree drafted after long prompts — a decode of one token per chain step — alone,
    then together beside a short draft and a late draft's background prefill of another long prompt (their
    prompts now from the prompt cache): the same tokens and q̂, and no decode reached 64 tokens."""
    from core.runners.llama_cpp_runner import DECODE_TOKENS, LlamaCppRunner

    runner = builtin_llama_two_threads
    assert isinstance(runner, LlamaCppRunner)
    rng = torch.Generator().manual_seed(58)
    long = [torch.randint(100, 20_000, (n,), generator=rng).tolist() for n in (262, 266, 270)]
    short = [runner.tokenizer.encode(text) for text in TEXTS]
    # long: a sampled chain and the sampled tree
    calls = _calls(runner, [long[0], *short[1:6], long[1], short[7]])
    alone_draft, together_draft = DraftModel(runner, ModelThread()), DraftModel(runner, ModelThread())
    alone = [await _draft(alone_draft, kind, args) for kind, args in calls]
    runner.free_all()
    one_thread, runner.max_decode_tokens = runner.one_thread_decodes, 0
    late = asyncio.create_task(together_draft.prefill("late", long[2]))
    together = await asyncio.gather(*(_draft(together_draft, kind, args) for kind, args in calls))
    await late
    for i, (a, b) in enumerate(zip(alone, together)):
        assert len(a) > 0 and _trees_equal(a, b), f"draft {i} changed when it shared steps"
    assert runner.one_thread_decodes > one_thread and runner.max_decode_tokens <= DECODE_TOKENS
    assert max(together_draft.batcher.steps) >= 5


async def test_a_step_keeps_to_its_token_budget(
    builtin_llama: ModelRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    step_tokens: list[int] = []
    forward_each = builtin_llama.forward_each

    def counting(items: Sequence[ForwardItem]) -> list[torch.Tensor | Exception]:
        step_tokens.append(sum(len(item.tokens) for item in items))
        return forward_each(items)

    monkeypatch.setattr(builtin_llama, "forward_each", counting)
    alone, together, _, together_draft = await _alone_then_together(builtin_llama, max_batch_tokens=12)
    assert all(_trees_equal(a, b) for a, b in zip(alone, together))
    assert together_draft.batcher.prefill_chunk == 6
    assert max(step_tokens) <= 12 and max(together_draft.batcher.steps) > 1


class _Failing(MarkovRunner):
    """A Markov draft whose forward fails for the sessions named ``bad*``."""

    def _compute(self, session_id: str, rows: Rows, start: int, logits_rows: list[int]) -> torch.Tensor:
        if session_id.startswith("bad"):
            raise RuntimeError(f"decode failed for {session_id}")
        return super()._compute(session_id, rows, start, logits_rows)


async def test_a_failing_draft_fails_alone() -> None:
    runner = _Failing(random_table(64, seed=3))
    draft = DraftModel(runner, ModelThread())
    t1 = SamplingParams(temperature=1.0)
    expected = await propose(draft, "ok", [1, 2, 3], 4, t1, 5, 0)
    runner.free_all()
    results = await asyncio.gather(
        propose(draft, "ok", [1, 2, 3], 4, t1, 5, 0),
        propose(draft, "bad", [4, 5], 4, t1, 5, 0),
        propose_tree(draft, "bad-tree", [6, 7], TreeShape.default(False), t1, 5, 0),
        return_exceptions=True,
    )
    assert isinstance(results[0], TokenTree) and _trees_equal(results[0], expected)
    assert isinstance(results[1], RuntimeError) and "bad" in str(results[1])
    assert isinstance(results[2], RuntimeError)
    assert await propose(draft, "ok", [1, 2, 3], 4, t1, 5, 0) is not None  # the loop keeps serving
    assert not draft.batcher.busy


class _Slow(MarkovRunner):
    """A Markov draft whose every forward takes 20 ms (so a draft spans several loop turns)."""

    def forward_each(self, items: Sequence[ForwardItem]) -> list[torch.Tensor | Exception]:
        import time

        time.sleep(0.02)
        return super().forward_each(items)


async def test_an_abandoned_draft_ends_at_its_next_step_and_free_waits_for_it() -> None:
    runner = _Slow(random_table(64, seed=4))
    draft = DraftModel(runner, ModelThread())
    t1 = SamplingParams(temperature=1.0)
    task = asyncio.create_task(propose(draft, "a", [1, 2, 3], 8, t1, 1, 0))
    await asyncio.sleep(0.03)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert "a" in draft.batcher.busy  # still in its step: the session is not free yet
    await draft.free("a")  # waits for the step loop to close it
    assert not draft.batcher.busy and not runner.has_session("a")
    # free while a draft is in progress: the draft finishes whole, then the session goes
    drafted, _ = await asyncio.gather(propose(draft, "b", [1, 2], 5, t1, 2, 0), draft.free("b"))
    assert len(drafted) == 5 and not runner.has_session("b")
    # two drafts of one session run one after the other, each as if alone
    first, second = await asyncio.gather(
        propose(draft, "c", [1, 2], 3, t1, 3, 0), propose(draft, "c", [1, 2, 9], 3, t1, 3, 0)
    )
    runner.free_all()
    assert _trees_equal(second, await propose(draft, "c", [1, 2, 9], 3, t1, 3, 0))
    assert len(first) == 3


async def test_a_seeded_draft_leaves_the_suffix_index_of_other_sessions_out() -> None:
    """Other sessions' outputs may come from the same seed: a seeded request's lookup uses its own
    context only (``shared=False``), so its answer does not depend on what ran before."""

    draft = DraftModel(MarkovRunner(random_table(4, 1), eos_ids=[3]), ModelThread())
    draft.lookup.suffixes.add([0, 2, 1, 0, 2])
    greedy = SamplingParams(temperature=0.0)
    # "1 0" then 2, in the outputs
    assert (await propose(draft, "a", [1, 0], 2, greedy, 1, 0, drafter="lookup")).ids() == [2]
    assert (await propose(draft, "b", [1, 0], 2, greedy, 1, 0, drafter="lookup", shared=False)).ids() == []
    assert (
        await propose(draft, "c", [1, 0, 2, 1, 0], 2, greedy, 1, 0, drafter="lookup", shared=False)
    ).ids() == [2, 1]


async def test_tokens_a_grammar_forces_ride_free_in_a_chain() -> None:
    """docs/design.md §3.9: a run of forced tokens takes no draft step of its own and does not count in
    γ; its q̂ rows are point masses; ``limit`` caps the chain (the room left)."""
    from core.grammar import GrammarKind, GrammarSpec
    from core.transform import LogitsTransform, TransformSpec
    from tests.app.fakes import TableGrammars

    table = torch.full((4, 4), -5.0, dtype=torch.float64)
    # greedy: 1 after 2 and after 0; after 1 the grammar forces 0
    table[2, 1] = table[0, 1] = table[1, 0] = 5.0
    runner = MarkovRunner(table, eos_ids=[3])
    draft = DraftModel(runner, ModelThread())
    sequence = [0, 2]  # a prompt of one token, then the forced first token
    spec = TransformSpec(grammar=GrammarSpec(GrammarKind.REGEX, "the table grammar"), prompt_len=1)
    greedy = SamplingParams(temperature=0.0)

    def transformer() -> LogitsTransform:
        return LogitsTransform.build(spec, 4, TableGrammars())  # type: ignore[arg-type]

    appended: list[list[int]] = []
    real = runner.append_item

    def recording(session_id: str, tokens: list[int], num_logits: int) -> ForwardItem:
        appended.append(list(tokens))
        return real(session_id, tokens, num_logits)

    runner.append_item = recording  # type: ignore[method-assign]
    chain = await propose(draft, "g", sequence, 2, greedy, 1, 0, transformer=transformer(), limit=10)
    assert chain.ids() == [1, 0, 1, 0]
    q = chain.q_values().tolist()
    assert q[1] == q[3] == 1.0
    # two draft steps: the prompt's, then the sampled 1 with the forced 0
    assert appended == [sequence, [1, 0]]
    assert (
        await propose(draft, "g", sequence, 2, greedy, 1, 0, transformer=transformer(), limit=3)
    ).ids() == [1, 0, 1]
    # no grammar: γ tokens, each a step
    assert (await propose(draft, "g", sequence, 2, greedy, 1, 0)).ids() == [1, 0]

    # a tree: the run hangs below its leaf, drawn from δ (the leaf's q̂ row), within depth_limit and extra
    shape = TreeShape(ChildRule.FIXED, nodes=1, depth=1, top_k=1)
    tree = await propose_tree(
        draft, "t", sequence, shape, greedy, 1, 0, transformer=transformer(), depth_limit=4, extra=8
    )
    assert tree.ids() == [1, 0] and tree.parents.tolist() == [-1, 0] and tree.q_values().tolist()[1] == 1.0
    assert tree.rule is ChildRule.FIXED and tree.support(0)[0].tolist() == [0]
    for limit, extra in ((1, 8), (4, 0)):
        assert (
            await propose_tree(
                draft,
                "t",
                sequence,
                shape,
                greedy,
                1,
                0,
                transformer=transformer(),
                depth_limit=limit,
                extra=extra,
            )
        ).ids() == [1]

    # inside a tree: a node's run is fed with it, takes no depth of the shape, its children follow the run
    appended.clear()
    items: list[ForwardItem] = []
    real_each = runner.forward_each

    def recording_each(batch: Sequence[ForwardItem]) -> list[torch.Tensor | Exception]:
        items.extend(batch)
        return real_each(batch)

    runner.forward_each = recording_each  # type: ignore[method-assign]
    deep = TreeShape(ChildRule.FIXED, nodes=2, depth=2, top_k=1)
    tree = await propose_tree(
        draft, "t", sequence, deep, greedy, 1, 0, transformer=transformer(), depth_limit=6, extra=8
    )
    # nodes=2 counts the drafted nodes only
    assert tree.ids() == [1, 0, 1, 0] and tree.parents.tolist() == [-1, 0, 1, 2]
    # one draft step below the prompt's: the node and its run
    assert [item.tokens for item in items[1:]] == [[1, 0]]
    assert (
        await propose_tree(
            draft, "t", sequence, deep, greedy, 1, 0, transformer=transformer(), depth_limit=6, extra=1
        )
    ).ids() == [1, 0, 1]
    assert (
        await propose_tree(
            draft, "t", sequence, deep, greedy, 1, 0, transformer=transformer(), depth_limit=2, extra=8
        )
    ).ids() == [1, 0]
    # sampled children: each path has its own budget (a shared one let one branch's draws shape another's
    # round)
    two = TreeShape(ChildRule.SAMPLED, widths=(2,))
    assert (
        await propose_tree(
            draft, "t", sequence, two, greedy, 1, 0, transformer=transformer(), depth_limit=6, extra=1
        )
    ).ids() == [1, 1, 0, 0]
    # sampled: a one-wide tree is the chain, draw for draw (a draw is keyed by its position)
    t1 = SamplingParams(temperature=1.0)
    for seed in range(6):
        chain = await propose(draft, "g", sequence, 3, t1, seed, 0, transformer=transformer(), limit=12)
        tree = await propose_tree(
            draft,
            "t",
            sequence,
            TreeShape(ChildRule.SAMPLED, widths=(1, 1, 1)),
            t1,
            seed,
            0,
            transformer=transformer(),
            depth_limit=12,
            extra=9,
        )
        assert tree.ids() == chain.ids() and tree.parents.tolist() == list(range(-1, len(chain) - 1)), seed
        assert torch.equal(tree.q_values(), chain.q_values()), seed


# ----------------------------------------------------------------------------- lookup branches in trees
# (docs/design.md §3.10)


def _tested(draft: DraftModel, key: tuple[object, ...]) -> float:
    """Candidates of ``key``'s kind the walks tested (the measured count, halved past the horizon)."""
    counts = draft.lookup.acceptance._counts.get(key)
    return counts[0] if counts is not None else 0.0


def _lookup_draft() -> tuple[DraftModel, list[int]]:
    """A Markov draft and a context whose last token came before: prompt lookup proposes what followed."""
    draft = DraftModel(MarkovRunner(random_table(16, 7, sharpness=3.0), eos_ids=[15]), ModelThread())
    return draft, [3, 9, 4, 8, 2, 5, 3]  # "3" then 9 4 8 2 5 3


async def test_a_fixed_tree_takes_the_lookup_branch_first_within_its_budget() -> None:

    draft, context = _lookup_draft()
    greedy = SamplingParams(temperature=0.0)
    shape = TreeShape(ChildRule.FIXED, nodes=8, depth=3, top_k=2)
    alone = await propose_tree(draft, "a", context, shape, greedy, 1, 0)
    mixed = await propose_tree(draft, "b", context, shape, greedy, 1, 0, drafter="model+lookup")
    assert mixed.deterministic is not None and len(mixed) <= shape.nodes
    first = mixed.children(-1)[0]
    # the branch: 9 4 8 …, first at the root
    assert int(mixed.tokens[first]) == 9 and bool(mixed.deterministic[first])
    run = [first]
    while below := [c for c in mixed.children(run[-1]) if bool(mixed.deterministic[c])]:
        run.append(below[0])
    assert [int(mixed.tokens[n]) for n in run] == [9, 4, 8, 2, 5, 3][: len(run)] and len(run) >= 2
    model_only = {tuple(int(alone.tokens[n]) for n in alone.path_to(v)) for v in range(len(alone))}
    kept = {
        tuple(int(mixed.tokens[n]) for n in mixed.path_to(v))
        for v in range(len(mixed))
        if not bool(mixed.deterministic[v])
    }
    assert kept <= model_only  # the budget is shared: the model's nodes that stay are its best ones
    for _ in range(500):  # measured: the lookup's tokens are never accepted here
        draft.lookup.acceptance.observe(("lookup", True, 1, 0), False)
    low = await propose_tree(draft, "c", context, shape, greedy, 1, 0, drafter="model+lookup")
    # a weak branch displaces nothing
    assert _trees_equal(low, alone) and (low.deterministic is None or not bool(low.deterministic.any()))
    seeded = await propose_tree(
        draft, "d", context, shape, greedy, 1, 0, drafter="model+lookup", shared=False
    )
    # a seeded request weighs by the priors: what ran before does not count
    assert _trees_equal(seeded, mixed)


async def test_a_sampled_tree_draws_its_root_children_without_the_lookup_token_and_keeps_its_size() -> None:

    draft, context = _lookup_draft()
    t1 = SamplingParams(temperature=1.0)
    shape = TreeShape(ChildRule.SAMPLED_DISTINCT, widths=(2, 1, 1, 1))
    for seed in range(20):
        tree = await propose_tree(
            draft, f"s{seed}", context, shape, t1, seed, 0, drafter="model+lookup", shared=False
        )
        assert tree.deterministic is not None and len(tree) <= shape.size
        lookups = [n for n in range(len(tree)) if bool(tree.deterministic[n])]
        assert lookups and int(tree.tokens[lookups[0]]) == 9 and tree.children(-1)[0] == lookups[0]
        drawn = [int(tree.tokens[c]) for c in tree.children(-1)[1:]]
        assert 9 not in drawn and len(drawn) == 2  # the root's places stay; deep ones gave way
    for _ in range(100):
        draft.lookup.acceptance.observe(("lookup", False, 1, 0), False)
    tree = await propose_tree(draft, "w", context, shape, t1, 3, 0, drafter="model+lookup")
    assert not bool(tree.deterministic.any()) and _trees_equal(
        tree, await propose_tree(draft, "m", context, shape, t1, 3, 0)
    )  # type: ignore[union-attr]


async def test_observe_counts_the_lookup_tokens_tested_and_the_places_accepted() -> None:

    draft, context = _lookup_draft()
    shape = TreeShape(ChildRule.SAMPLED_DISTINCT, widths=(2, 1, 1, 1))
    tree = await propose_tree(
        draft, "s", context, shape, SamplingParams(temperature=1.0), 5, 0, drafter="model+lookup"
    )
    lookups = [n for n in range(len(tree)) if bool(tree.deterministic[n])]  # type: ignore[index]
    draft.observe("s", [lookups[0]])  # the first accepted, the second rejected, the rest never tested
    assert (
        _tested(draft, ("lookup", False, 1, 0)) == 1
        and draft.lookup.acceptance.rate(("lookup", False, 1, 0), 0.5) > 0.5
    )
    assert (
        _tested(draft, ("lookup", False, 1, 1)) == 1
        and draft.lookup.acceptance.rate(("lookup", False, 1, 1), 0.5) < 0.5
    )
    assert _tested(draft, ("lookup", False, 1, 2)) == 0
    assert _tested(draft, ("slot", "sampled_distinct", (2, 1, 1, 1), (0,))) == 1
    # below a rejected node: never tested, not counted
    assert _tested(draft, ("slot", "sampled_distinct", (2, 1, 1, 1), (0, 0))) == 0
    draft.observe("s", [])  # once per tree
    assert _tested(draft, ("lookup", False, 1, 0)) == 1


async def test_a_chain_keeps_a_lookup_token_the_model_disagrees_with_once_lookups_measure_better() -> None:
    """model+lookup: a lookup token stays while it is the model's top-1 — or while its measured
    acceptance is at least a model token's; a seeded request (the priors) keeps to the first rule."""

    draft, context = _lookup_draft()
    greedy = SamplingParams(temperature=0.0)
    plain = await propose(draft, "p", context, 4, greedy, 1, 0)
    assert plain.ids()[0] != 9  # the model's top-1 after "3" is not the lookup's 9
    first = await propose(draft, "a", context, 4, greedy, 1, 0, drafter="model+lookup")
    assert first.ids() == plain.ids()
    draft.observe("a", [0])  # a model token accepted, the next rejected
    assert _tested(draft, ("model", True)) == 2
    for _ in range(40):
        draft.lookup.acceptance.observe(("lookup", True, 1, 0), True)
        draft.lookup.acceptance.observe(("lookup", True, 1, 1), True)
    trusted = await propose(draft, "b", context, 4, greedy, 1, 0, drafter="model+lookup")
    # δ rows: exact under any rule
    assert trusted.ids()[:2] == [9, 4] and trusted.q_values()[:2].tolist() == [1.0, 1.0]
    seeded = await propose(draft, "c", context, 4, greedy, 1, 0, drafter="model+lookup", shared=False)
    assert seeded.ids() == plain.ids()
    tested = _tested(draft, ("lookup", True, 1, 0))
    # the first lookup token accepted, the second rejected, the model's after it never tested
    draft.observe("b", [0])
    assert _tested(draft, ("lookup", True, 1, 0)) == tested + 1 and _tested(draft, ("model", True)) == 2


async def test_rates_measured_past_the_walks_end_do_not_steer_the_next_rounds_draft(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The cold counter-example hunt's case, exactly: a sampled ⟨1,1,1,1⟩ tree whose second node
    may be EOS (drawn with U, at a position the walk does not reach, which the next round draws
    again with U). If ``observe`` counted the nodes below an EOS-free path as rejected, the next
    round's plan (a lookup child in or out) would depend on U: TV 0.095 at its first token.
    Counting only the candidates the walk tested, the law over U is the target's."""
    from app.drafting import tree as draft_module
    from tests.oracles import tree_step_law

    V, EOS, d, c, a, b = 5, 4, 0, 1, 2, 3
    table = torch.zeros(V, V, dtype=torch.float64)
    table[a] = -200.0
    table[a, b] = 0.0  # after a: b, surely
    table[b] = torch.tensor([0.0, 0.3, -0.2, 0.1, 0.4])  # after b: EOS has mass
    table[d] = torch.tensor([0.2, 0.9, -0.5, 0.4, -0.3])  # the next round's root q̂
    table[c] = table[EOS] = torch.tensor([0.1, 0.2, 0.3, -0.1, -1.0])
    p_next = torch.tensor([0.10, 0.15, 0.40, 0.30, 0.05], dtype=torch.float64)
    reused = {"u": 0.5}
    monkeypatch.setattr(
        draft_module,
        "uniform",
        lambda seed, choice, position, purpose, worker=0, lane=0: (
            reused["u"] if position == 4 else {3: 0.3}.get(position, 0.0)
        ),
    )
    shape = TreeShape(ChildRule.SAMPLED, widths=(1, 1, 1, 1))

    async def law(u: float) -> torch.Tensor:
        reused["u"] = u
        draft = DraftModel(MarkovRunner(table.float(), eos_ids=[EOS]), ModelThread())
        for _ in range(2):  # earlier requests' measurements
            draft.lookup.acceptance.observe(("slot", "sampled", (1, 1, 1, 1), (0, 0, 0, 0)), True)
        await propose_tree(
            draft, "s", [d, c, a], shape, SamplingParams(temperature=1.0), 7, 0, drafter="model+lookup"
        )
        draft.observe("s", [])  # its root child rejected: d recovered
        # lookup: c
        tree = await propose_tree(
            draft, "s", [d, c, a, d], shape, SamplingParams(temperature=1.0), 7, 0, drafter="model+lookup"
        )
        return tree_step_law(
            p_next,
            tree.q_row(-1, V),
            [int(tree.tokens[k]) for k in tree.children(-1)],
            tree.rule,
            tree.num_deterministic(-1),
        )

    def q_hat(row: torch.Tensor) -> torch.Tensor:  # the draft's q̂ there, as it samples it
        q = torch.softmax(row.float()[None], -1)[0].double()
        return q / q.sum()

    cuts = {0.0, 1.0}
    without_c = q_hat(table[d])
    without_c[c] = 0
    for q in (q_hat(table[b]), q_hat(table[d]), without_c):
        cuts |= set((torch.cumsum(q, 0) / q.sum()).clamp(max=1.0).tolist())
    edges = sorted(cuts)
    total = torch.zeros(V, dtype=torch.float64)
    for lo, hi in zip(edges, edges[1:]):
        if hi > lo:
            total += (hi - lo) * await law((lo + hi) / 2)
    assert torch.allclose(total, p_next, atol=1e-9, rtol=0), total


def test_a_background_prefill_goes_behind_the_drafts_waiting() -> None:
    """A late draft's prefill (app.engine.late) is background work: a draft that arrives beside it takes every
    step, the prefill one chunk (``background_chunk``, 32 rows) in every fourth, and the draft's tokens are
    those it gets alone; alone again, the prefill takes every step, and a caller that waits on it (``idle``)
    makes it a draft's peer."""
    runner = MarkovRunner(random_table(6, 3), name="draft")

    async def run(with_prefill: bool) -> tuple[TokenTree, list[int], bool, int]:
        draft = DraftModel(runner, ModelThread())
        prefill = asyncio.create_task(draft.prefill("late", [1, 2] * 100)) if with_prefill else None
        await asyncio.sleep(0)
        tree = await draft.propose(DraftRequest("now", [2, 3], SamplingParams(temperature=1.0), 5, 0), 8)
        steps = list(draft.batcher.steps)
        pending = prefill is not None and not prefill.done()
        if prefill is not None:
            await draft.batcher.idle("late")
        return tree, steps, pending, runner.length("late") if runner.has_session("late") else 0

    alone, _, _, _ = asyncio.run(run(False))
    tree, steps, pending, held = asyncio.run(run(True))
    assert tree.ids() == alone.ids() and torch.equal(tree.q_rows(6), alone.q_rows(6))
    assert pending and held == 200  # the draft was done first; the prefill finished after it
    # the draft's eight steps (its prompt, then seven tokens): the prefill in two
    assert steps[:8] == [1, 1, 1, 2, 1, 1, 1, 2]
    assert set(steps[8:]) <= {1}  # then the prefill alone


@pytest.mark.parametrize("greedy", [True, False])
async def test_a_trees_rows_are_its_nodes_q_on_their_supports_and_its_children_the_whole_rows(
    greedy: bool,
) -> None:
    """Issue 61: a tree's q̂ stays on supports from the first row. Over 300 tokens (more than a greedy row
    keeps) the reference is each node's whole row from the table: greedy (EAGLE-2), a node's row is its 32
    most likely tokens at their whole-row probabilities bit for bit, and its children and their order the
    whole row's top-k; sampled and truncated to 32, the chain's ``truncated_support`` of the whole row, and
    each child a draw from that row."""
    from app.drafting.request import GREEDY_ROW
    from core.math.random import Purpose, sample_index, uniform
    from core.math.sampling import apply_sampling, normalised, truncated_support

    vocab = 300
    runner = MarkovRunner(random_table(vocab, 61, sharpness=3.0))
    draft = DraftModel(runner, ModelThread())
    params = SamplingParams(temperature=0.0 if greedy else 0.8)
    shape = TreeShape.default(True) if greedy else TreeShape(ChildRule.SAMPLED_DISTINCT, widths=(3, 2, 1))
    truncation = (0, 1.0) if greedy else (32, 1.0)
    sequence = [5, 17]
    tree = await propose_tree(draft, "t", sequence, shape, params, 9, 0, truncation)
    assert len(tree) == shape.size

    def whole(node: int) -> torch.Tensor:  # the q̂ the node's children were drawn from, as a whole row
        last = sequence[-1] if node < 0 else int(tree.tokens[node])
        return apply_sampling(runner.table[last].float()[None], params)[0]

    lanes: dict[int, int] = {}
    for node in [-1, *range(len(tree))]:
        children = tree.children(node)
        if not children:
            continue
        ids, probs = tree.support(node)
        row = whole(node)
        if greedy:
            assert len(ids) == GREEDY_ROW and set(ids.tolist()) == set(
                torch.topk(row, GREEDY_ROW).indices.tolist()
            )
            assert torch.equal(probs, normalised(row)[ids])  # the whole row's numbers, not renormalised
            assert [int(tree.tokens[c]) for c in children] == torch.topk(row, len(children)).indices.tolist()
            continue
        expected_ids, expected = truncated_support(row, 32)
        assert torch.equal(ids, expected_ids) and torch.equal(probs, expected)
        position = len(sequence) + (len(tree.path_to(node)) if node >= 0 else 0)
        left = expected.clone()
        for child in children:  # SAMPLED_DISTINCT: each draw from what the draws before left
            lane = lanes.get(position, 0)
            lanes[position] = lane + 1
            index = sample_index(left, uniform(9, 0, position, Purpose.DRAFT_SAMPLE, lane=lane))
            assert int(tree.tokens[child]) == int(expected_ids[index])
            left[index] = 0
