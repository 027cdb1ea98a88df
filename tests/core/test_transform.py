"""Transforms (docs/design.md §3.9) on hand-built logits: the wire form, each penalty's definition, a
row's prefix (agreed tokens + its path), the forced token, and min-p."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from core.math.sampling import SamplingParams, apply_sampling
from core.transform import LogitsTransform, TransformSpec, penalise
from tests.app.fakes import TableGrammars, TableMatcher

PROMPT = [1, 0]


def test_the_wire_form_round_trips_and_refuses_garbage() -> None:
    spec = TransformSpec(((0, -1.0), (3, 2.5)), 0.5, -0.25, 1.2, None, 7)
    assert TransformSpec.from_wire(spec.to_wire()) == spec
    assert TransformSpec.from_wire({"prompt_len": 3}).is_identity
    for bad in (
        {"prompt_len": 1, "colour": 1},
        {"logit_bias": [[0, 101]]},
        {"presence_penalty": 2.5},
        {"repetition_penalty": 0},
        "x",
        {"logit_bias": [["a", 1]]},
    ):
        with pytest.raises(ValueError):
            TransformSpec.from_wire(bad)


def test_penalties_follow_their_definitions() -> None:
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0])
    prompt, generated = np.array([4]), np.array([0, 0, 2])
    spec = TransformSpec(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0)
    out = penalise(logits, prompt, generated, spec)
    # repetition over prompt + output (÷ when > 0, × otherwise), then OpenAI's count·f + presence over the
    # output
    expected = torch.tensor([2.0 / 2 - (2 * 0.25 + 0.5), -1.0, 0.5 / 2 - (0.25 + 0.5), 3.0, -2.0 * 2])
    assert torch.allclose(out, expected)
    assert torch.equal(logits, torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0]))  # not in place


def test_each_row_is_transformed_by_its_own_prefix() -> None:
    spec = TransformSpec(
        ((1, 1.0),), presence_penalty=0.0, frequency_penalty=1.0, grammar=None, prompt_len=len(PROMPT)
    )
    transformer = LogitsTransform.build(spec, 4, None)
    logits = torch.zeros(3, 4)
    agreed = [*PROMPT, 2]
    out = transformer.rows(logits, agreed, [[], [1], [1, 1]])
    assert out[:, 1].tolist() == [1.0, 0.0, -1.0]  # the bias, less one per 1 along the path
    assert out[:, 2].tolist() == [-1.0, -1.0, -1.0]  # the agreed 2 counts in every row
    assert out[:, 0].tolist() == [0.0, 0.0, 0.0]  # the prompt's tokens are not counted


def test_the_grammar_masks_each_row_after_its_path_and_forces_single_tokens() -> None:
    transformer = LogitsTransform.build(
        TransformSpec(grammar=_grammar(), prompt_len=len(PROMPT)), 4, TableGrammars()
    )  # type: ignore[arg-type]
    out = transformer.rows(torch.zeros(3, 4), [*PROMPT, 2], [[], [1], [1, 0]])
    allowed = torch.isfinite(out)
    assert torch.equal(allowed[0], TableMatcher.allowed_after((2,)))
    assert allowed[1].nonzero().flatten().tolist() == [0]  # after 1 only 0
    assert torch.equal(allowed[2], TableMatcher.allowed_after((2, 1, 0)))
    assert transformer.forced(list(PROMPT)) == 2  # the first token is forced
    assert transformer.forced([*PROMPT, 1]) == 0
    assert transformer.forced([*PROMPT, 2]) is None


def test_a_bias_id_off_the_vocabulary_or_named_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="outside"):
        LogitsTransform.build(TransformSpec(((4, 1.0),)), 4, None)
    with pytest.raises(ValueError, match="twice"):
        # which would win is a device's choice (an index_put of repeated ids)
        TransformSpec.from_wire({"logit_bias": [[1, 5.0], [1, -3.0]]})


def test_min_p_drops_tokens_below_its_share_of_the_top() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    p = apply_sampling(logits, SamplingParams(temperature=1.0, min_p=0.2))[0]  # keeps p ≥ 0.1
    assert torch.allclose(p, torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95)
    with pytest.raises(ValueError):
        SamplingParams(min_p=1.0)


def _grammar():  # type: ignore[no-untyped-def]
    from core.grammar import GrammarKind, GrammarSpec

    return GrammarSpec(GrammarKind.REGEX, "the table grammar")


def test_the_transform_travels_on_a_sessions_first_call_and_on_a_resend_from_zero() -> None:
    from app.targets.base import resend
    from core.protocol import VerifyRequest, decode, encode

    wire = TransformSpec(((1, 2.0),), frequency_penalty=0.5, prompt_len=2).to_wire()
    first = VerifyRequest.after("s", [], [1, 0], [2], transform=wire)
    later = VerifyRequest.after("s", [1, 0, 2], [3], [2], transform=wire)
    assert first.on_wire().transform == wire and later.on_wire().transform is None
    # per-round bytes unchanged
    assert len(encode(later.on_wire(), 4)[0]) == len(
        encode(VerifyRequest.after("s", [1, 0, 2], [3], [2]), 4)[0]
    )
    again = resend(later, [1, 0, 2, 3], 0)  # the worker lost the session: from zero, with the transform
    assert again.on_wire().transform == wire
    assert decode(VerifyRequest, *encode(again.on_wire(), 4)).transform == wire


# ----------------------------------------------------------------------------- min_tokens (issue 46: vLLM's
# order)

A, B, EOS = 0, 1, 2


def _min_tokens(min_tokens: int = 1, **more: object) -> LogitsTransform:
    spec = TransformSpec(prompt_len=len(PROMPT), min_tokens=min_tokens, eos_ids=(EOS,), **more)  # type: ignore[arg-type]
    return LogitsTransform.build(spec, 3, None)


def test_min_tokens_removes_eos_before_min_p_as_vllm_does() -> None:
    """The issue's example: logits EOS 3, A 1, B 0.5 with min_p 0.1. vLLM removes EOS from the
    logits first, so min_p is taken of A's share of what is left: A 0.62, B 0.38. (Removed after
    min_p, as before, B would fall under 0.1 × EOS's probability: A 1.0.)"""
    logits = torch.tensor([[1.0, 0.5, 3.0]])
    params = SamplingParams(temperature=1.0, min_p=0.1)
    p = apply_sampling(_min_tokens().rows(logits, PROMPT, [[]]), params)[0].double()
    expected = torch.softmax(torch.tensor([1.0, 0.5], dtype=torch.float64), dim=-1)
    assert p[EOS] == 0 and torch.allclose(p[:2], expected, atol=1e-6) and round(float(p[A]), 2) == 0.62
    old = apply_sampling(logits, params)[0].double()
    old[EOS] = 0
    assert float(old[B] / old.sum()) == 0.0  # the order this replaces


def test_min_tokens_removes_eos_before_top_k_and_bias() -> None:
    logits = torch.tensor([[1.0, 0.5, 3.0]])
    p = apply_sampling(_min_tokens().rows(logits, PROMPT, [[]]), SamplingParams(temperature=1.0, top_k=1))[0]
    assert p.tolist() == [1.0, 0.0, 0.0]  # top-1 of what is left (EOS first would have left nothing)
    p = apply_sampling(_min_tokens(logit_bias=((EOS, 100.0),)).rows(logits, PROMPT, [[]]), SamplingParams())[
        0
    ]
    assert p[EOS] == 0  # a bias cannot bring EOS back


def test_min_tokens_counts_each_rows_generated_tokens() -> None:
    """A row's prefix is the agreed tokens plus its path: EOS is out while fewer than min_tokens
    tokens are generated there, and allowed from the row that has them."""
    transformer = _min_tokens(min_tokens=3)
    logits = torch.zeros(4, 3)
    rows = transformer.rows(logits, [*PROMPT, A], [[], [B], [B, A], [B, A, A]])  # 1, 2, 3, 4 generated tokens
    assert [bool(torch.isinf(r[EOS])) for r in rows] == [True, True, False, False]
    assert transformer.masks([*PROMPT, A], [[], [B], [B, A]])[:, EOS].tolist() == [False, False, True]
    assert torch.equal(rows[:, :2], logits[:, :2])  # nothing else moves


def test_min_tokens_travels_in_the_transform() -> None:
    spec = TransformSpec(prompt_len=4, min_tokens=5, eos_ids=(2, 9))
    assert (
        TransformSpec.from_wire(spec.to_wire()) == spec
        and not spec.is_identity
        and replace(spec, min_tokens=0, eos_ids=()).is_identity
    )
    assert not TransformSpec(prompt_len=4, min_tokens=5).suppresses  # no EOS to keep out: the identity
    assert not replace(
        TransformSpec(((1, 1.0),), prompt_len=4, min_tokens=5, eos_ids=(2,)), min_tokens=0, eos_ids=()
    ).is_identity
    with pytest.raises(ValueError):
        LogitsTransform.build(TransformSpec(min_tokens=1, eos_ids=(7,)), 4, None)


@pytest.mark.parametrize("vocab", [4, 3001])
def test_a_transform_planned_for_the_device_gives_the_hosts_rows_bit_for_bit(vocab: int) -> None:
    """``LogitsTransform.device_plan`` (issue 73: what the host knows in the step's one upload, applied where
    the rows are with nothing read back) against ``LogitsTransform.rows``: min_tokens, bias, all three
    penalties and a grammar's mask (vocabulary 4: the table grammar), each row by its own path — equal
    bits."""
    from core.runners.step_upload import StepUpload

    grammar = _grammar() if vocab == 4 else None
    spec = TransformSpec(
        logit_bias=((1, 4.0), (3, -2.5)),
        presence_penalty=0.5,
        frequency_penalty=0.25,
        repetition_penalty=1.3,
        grammar=grammar,
        prompt_len=len(PROMPT),
        min_tokens=3,
        eos_ids=(0,),
    )
    transformer = LogitsTransform.build(spec, vocab, TableGrammars() if grammar else None)  # type: ignore[arg-type]
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(vocab)) * 3
    agreed, paths = [*PROMPT, 2], [[], [1], [1, 0], [2]]
    upload = StepUpload(torch.device("cpu"), words=8)  # grows as the plan needs
    upload.begin()
    plan = transformer.device_plan(agreed, paths, upload)
    upload.send()
    want = transformer.rows(logits, agreed, paths)
    assert torch.equal(plan.apply(logits), want) and not torch.equal(want, logits)
    assert upload.sends == 1 and (grammar is None) == (plan.grammar is None)
