"""``specgate bench consistency``'s parts (the run itself is tests/integration/test_long_prompts_real.py's and
a benchmark's: docs/performance.md has its counts): prompts of the lengths asked that share no more than their
task, the modes it takes, and how two sets of texts are compared."""

from __future__ import annotations

import argparse

import pytest

from clients.bench.consistency import (
    CONFIGS,
    agreement,
    article,
    chat_ids,
    gateway_config,
    lengths,
    mode_list,
)
from core.runners import resolve_model
from core.runners.base import common_prefix
from core.runners.tokenizer import load_tokenizer


def test_articles_are_about_their_length_and_each_its_own() -> None:
    tokenizer = load_tokenizer(resolve_model("builtin"))
    spread = lengths(6)
    assert spread[0] == 300 and spread[-1] == 1500 and spread == sorted(spread)
    prompts = [chat_ids(tokenizer, article(tokenizer, n, i)) for i, n in enumerate((300, 700))]
    for tokens, n in zip(prompts, (300, 700)):
        assert n <= len(tokens) <= n + 80, len(tokens)  # a sentence at most past it
    assert common_prefix(*prompts) < 40  # the chat template and little else
    assert article(tokenizer, 300, 0) == article(tokenizer, 300, 0)


def test_the_modes_asked_start_with_autoregressive() -> None:
    assert mode_list("exact,tree") == ["autoregressive", "exact", "tree"]
    assert mode_list("tree-exact, autoregressive") == ["autoregressive", "tree-exact"]
    with pytest.raises(argparse.ArgumentTypeError, match="unknown mode 'fast'"):
        mode_list("exact,fast")
    assert {
        "autoregressive",
        "aggregate",
        "split",
        "exact",
        "tree",
        "tree-exact",
        "lookup",
        "model+lookup",
        "overlap",
    } == set(CONFIGS)


def test_agreement_counts_and_shows_where_texts_part() -> None:
    assert agreement(["a b", "c"], ["a b", "c"]) == {"same": 2, "of": 2}
    out = agreement(["same", "the river rose"], ["same", "the river fell"])
    assert (
        out["same"] == 1
        and out["first_difference"]["prompt"] == 1
        and out["first_difference"]["at_char"] == 10
    )


def test_a_gateway_config_takes_both_replicas_and_the_timing() -> None:
    config = gateway_config(["http://127.0.0.1:1", "http://127.0.0.1:2"], threads=2, late_from=None)
    assert config.workers[0].urls == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    assert config.draft.threads == 2 and config.draft.background_prefill_from is None
