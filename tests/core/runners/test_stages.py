"""Pipeline stages (docs/design.md §3.7): a model's layers split over stage runners give the whole
model's distributions at every row of a tree, before and after FlowSpec's prune (a prefix, the
accepted path and the subtree below it kept), on the built-in model."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from core.errors import ModelLoadError, SessionShort
from core.runners import ModelRunner, load_runner, resolve_model
from core.runners.base import ForwardItem
from core.runners.transformers_runner import TransformersRunner

PROMPT = [504, 3458, 28, 638, 359, 346, 1485, 1834, 47, 378]
# a tree below the prompt's last token (row 9): parents are absolute rows
TREE = [12, 907, 260, 31, 4000, 77, 1180, 52]
TREE_PARENTS = [9, 9, 10, 10, 11, 12, 14, 14]
SPLITS = {"2 stages": [(0, 13), (13, 30)], "3 stages": [(0, 7), (7, 19), (19, 30)]}


@pytest.fixture(scope="module")
def whole() -> Iterator[ModelRunner]:
    runner = load_runner("builtin", "transformers", memory_cap_mb=64)
    yield runner
    runner.close()


def _stages(whole: ModelRunner, split: list[tuple[int, int]]) -> list[TransformersRunner]:
    assert isinstance(whole, TransformersRunner)
    return [
        TransformersRunner(
            resolve_model("builtin"), whole.tokenizer, model=whole.model, memory_cap_mb=64, layers=layers
        )
        for layers in split
    ]


def _through(stages: list[TransformersRunner], item: ForwardItem) -> torch.Tensor:
    """One item through every stage, each passing its new rows' states to the next."""
    hidden = None
    for stage in stages:
        out = stage.forward(
            [ForwardItem(item.session_id, item.prefix_len, item.tokens, item.parents, item.logits_at, hidden)]
        )[0]
        hidden = out
    assert hidden is not None
    return hidden


def _probs(logits: torch.Tensor) -> torch.Tensor:
    return torch.softmax(logits.double(), dim=-1)


@pytest.mark.parametrize("split", SPLITS)
def test_a_split_gives_the_whole_models_distributions_before_and_after_a_prune(
    whole: ModelRunner, split: str
) -> None:
    stages = _stages(whole, SPLITS[split])
    everything = list(range(len(PROMPT) - 1, len(PROMPT) + len(TREE)))
    first = ForwardItem(
        "s", 0, PROMPT + TREE, list(range(-1, len(PROMPT) - 1)) + TREE_PARENTS, [i for i in everything]
    )
    expected = whole.forward([first])[0]
    got = _through(stages, first)
    assert got.shape == expected.shape == (len(TREE) + 1, 49152)
    torch.testing.assert_close(_probs(got), _probs(expected), atol=1e-4, rtol=0)

    # the verdict took node row 10 (token 12): keep the prompt, that node and its subtree (rows 12,
    # 13, 15), then a new segment below the kept rows
    kept = list(range(len(PROMPT))) + [10, 12, 13, 15]
    for runner in [whole, *stages]:
        runner.keep("s", kept)
    assert all(runner.tokens("s") == whole.tokens("s") for runner in stages)
    assert whole.tokens("s") == PROMPT + [12, 260, 31, 77]
    segment = ForwardItem("s", len(kept), [9, 640, 5], [11, 11, 14], [0, 1, 2])
    expected = whole.forward([segment])[0]
    torch.testing.assert_close(_probs(_through(stages, segment)), _probs(expected), atol=1e-4, rtol=0)

    # the reference: a fresh session holding exactly the pruned tree and the new segment
    fresh_tokens = PROMPT + [12, 260, 31, 77, 9, 640, 5]
    fresh_parents = list(range(-1, len(PROMPT) - 1)) + [9, 10, 10, 11, 11, 11, 14]
    fresh = whole.forward([ForwardItem("f", 0, fresh_tokens, fresh_parents, [14, 15, 16])])[0]
    torch.testing.assert_close(_probs(expected), _probs(fresh), atol=1e-4, rtol=0)
    for runner in [whole, *stages]:
        runner.free_all()


def test_a_later_stage_that_lost_its_rows_is_short(whole: ModelRunner) -> None:
    first, second = _stages(whole, SPLITS["2 stages"])
    states = first.forward([ForwardItem("t", 0, PROMPT)])[0]
    # every new row's states (the next stage needs them all), whatever logits_at says
    assert states.shape == (len(PROMPT), 576)
    second.forward([ForwardItem("t", 0, PROMPT, hidden=states)])
    second._free_cache("t")  # its slot lent to another session (LRU): the rows stay, their states are gone
    with pytest.raises(SessionShort):
        second.forward([ForwardItem("t", len(PROMPT), [5], hidden=torch.zeros(1, 576))])
    with pytest.raises(ValueError, match="hidden states"):
        second.forward([ForwardItem("u", 0, PROMPT)])


def test_a_loaded_stage_keeps_only_its_layers_and_matches_the_whole_model() -> None:
    whole = load_runner("tiny-random", "transformers")
    first = load_runner("tiny-random", "transformers", layers=(0, 1))
    last = load_runner("tiny-random", "transformers", layers=(1, 2))
    assert first.layer_range == (0, 1) and last.layer_range == (1, 2)
    assert isinstance(first, TransformersRunner) and isinstance(
        first.model.get_decoder().layers[1], torch.nn.Identity
    )
    assert first.kv_bytes_per_token() * 2 == whole.kv_bytes_per_token()
    states = first.forward([ForwardItem("s", 0, PROMPT, logits_at=list(range(len(PROMPT))))])[0]
    logits = last.forward([ForwardItem("s", 0, PROMPT, logits_at=[7, 8, 9], hidden=states)])[0]
    torch.testing.assert_close(
        logits, whole.forward([ForwardItem("s", 0, PROMPT, logits_at=[7, 8, 9])])[0], atol=1e-4, rtol=1e-4
    )
    # all of them: the whole model
    assert load_runner("tiny-random", "transformers", layers=(0, 2)).layer_range is None
    for runner in (first, last, whole):
        # a stage's warm-up does nothing (it takes hidden states); the whole model's forgets its session
        runner.warm_up()
        assert "__warm_up__" not in runner.session_ids()


@pytest.mark.parametrize("layers", [(0, 0), (1, 3), (-1, 1)])
def test_a_range_outside_the_model_is_refused(layers: tuple[int, int]) -> None:
    with pytest.raises(ModelLoadError, match="not a slice"):
        load_runner("tiny-random", "transformers", layers=layers)


def test_llama_cpp_cannot_be_a_stage() -> None:
    with pytest.raises(ModelLoadError, match="--backend transformers"):
        load_runner("builtin", "llama.cpp", layers=(0, 15))


def test_a_forward_warns_of_nothing(whole: ModelRunner) -> None:
    """The KV cache goes by transformers' current name: no FutureWarning on every forward of a
    stage or the whole model (a normal run's log stays clean)."""
    import warnings

    stages = _stages(whole, SPLITS["2 stages"])
    item = ForwardItem("quiet", 0, PROMPT, list(range(-1, len(PROMPT) - 1)), [len(PROMPT) - 1])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _through(stages, item)
        whole.forward(
            [ForwardItem("quiet-whole", 0, PROMPT, list(range(-1, len(PROMPT) - 1)), [len(PROMPT) - 1])]
        )
