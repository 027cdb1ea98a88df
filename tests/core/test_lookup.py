"""The lookup indexes (core/lookup.py) on small cases: what matches, what is proposed, bounds."""

from __future__ import annotations

import random

import pytest

from core.lookup import LookupParams, PromptLookup, SuffixIndex


def lookup(context: list[int], count: int = 8, **params: int) -> tuple[list[int], int]:
    index = PromptLookup(LookupParams(**params))
    index.sync(context)
    proposal = index.propose(count)
    return proposal.tokens, proposal.match


def test_prompt_lookup_takes_the_longest_n_gram_then_its_most_recent_place() -> None:
    #          0  1  2  3  4  5  6  7  8  9 10 11
    context = [5, 6, 7, 1, 2, 3, 6, 7, 9, 4, 6, 7]
    assert lookup(context) == ([9, 4, 6, 7], 2)  # "6 7" last at 6..7: what followed, to the end
    assert lookup(context, count=2) == ([9, 4], 2)
    assert lookup([1, 2, 3, 9, 9, 2, 3, 8, 3]) == ([8, 3], 1)  # only "3" matches: its latest earlier place
    assert lookup([1, 2, 3, 9, 9, 2, 3, 8, 2, 3]) == ([8, 2, 3], 2)  # "2 3" at 5..6 beats "3" alone
    assert lookup([1, 2, 3, 4]) == ([], 0)  # nothing repeats
    assert lookup([]) == ([], 0) and lookup([7]) == ([], 0)
    assert lookup([4, 4, 4, 4], max_n=2) == ([4], 2)  # the suffix itself is not its own match
    assert lookup(context, min_n=3) == ([], 0)  # no trigram repeats


def test_prompt_lookup_caps_and_validates() -> None:
    assert lookup(list(range(30)) + list(range(5)), max_tokens=3) == ([5, 6, 7], 4)
    for bad in ({"min_n": 0}, {"min_n": 3, "max_n": 2}, {"max_tokens": 0}, {"depth": 1}):
        with pytest.raises(ValueError):
            LookupParams(**bad)


def test_prompt_lookup_follows_a_growing_context_as_a_fresh_index_would() -> None:
    rng = random.Random(3)
    stream = [rng.randrange(6) for _ in range(300)]
    grown = PromptLookup()
    for end in range(0, 300, 7):
        grown.sync(stream[:end])
        fresh = PromptLookup()
        fresh.sync(stream[:end])
        assert grown.propose(5) == fresh.propose(5), end
    for end in (250, 120, 299, 0):  # taken back (a rejected draft), then grown again
        grown.sync(stream[:end])
        fresh = PromptLookup()
        fresh.sync(stream[:end])
        assert grown.propose(5) == fresh.propose(5) and grown._ends == fresh._ends, end
    grown.sync([9, 9, 9])
    assert grown.tokens == [9, 9, 9] and grown.propose(4).tokens == [9]


def test_suffix_index_continues_the_longest_suffix_by_frequency() -> None:
    index = SuffixIndex(LookupParams(depth=6))
    index.add([1, 2, 3, 4])
    index.add([1, 2, 3, 5])
    index.add([9, 2, 3, 5, 6])
    proposal = index.propose([7, 2, 3], 4)
    assert (proposal.tokens, proposal.match) == ([5, 6], 2)  # "2 3" → 5 twice, 4 once; then 6
    proposal = index.propose([1, 2, 3], 4)
    # the longest match first: "1 2 3" → 4 or 5 (tie: the lower id)
    assert (proposal.tokens, proposal.match) == ([4], 3)
    assert index.propose([8, 8], 4).tokens == []
    assert index.propose([1, 2, 3], 1).tokens == [4]


def test_suffix_index_stays_within_its_bound_and_forgets_the_oldest() -> None:
    params = LookupParams(depth=4, max_index_tokens=40)
    index = SuffixIndex(params)
    index.add([1, 2, 3, 4, 5] * 4)  # 20 tokens
    rng = random.Random(0)
    for _ in range(10):
        index.add([rng.randrange(100, 200) for _ in range(10)])
        assert index.num_tokens <= 40
    assert index.propose([1, 2, 3], 3).tokens == []  # the first output has left, counts and nodes
    fresh = SuffixIndex(params)
    for held in index._held:
        fresh.add(held)
    assert index.num_nodes == fresh.num_nodes and index.num_nodes <= 40 * params.depth
