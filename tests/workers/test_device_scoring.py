"""``workers.device_scoring.score_step`` (issue 60, item 2, its first payloads) against ``workers.scoring.score``, the
reference: a step of calls in ``aggregate`` (top-k, full rows) and ``autoregressive`` (samples, with and without rows),
T ∈ {0, 0.7, 1} with top-k / top-p / min-p, on logits with ties and a grammar's ``-inf`` — the same ids and samples, the
same probabilities and tail masses (to 1e-6), from one packed copy; what it does not answer yet, ``handles`` says."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from core.protocol import VerifyRequest
from workers.device_scoring import handles, score_step
from workers.scoring import score

V = 3000


def _calls() -> list[VerifyRequest]:
    calls = []
    grid = itertools.product(
        [("aggregate", 8, True), ("aggregate", None, True), ("aggregate", V, True), ("autoregressive", 8, True), ("autoregressive", None, False)],
        [0.0, 0.7, 1.0], [(0, 1.0, 0.0), (40, 0.9, 0.05)],
    )
    for i, ((mode, k, rows), temperature, (top_k, top_p, min_p)) in enumerate(grid):
        draft = list(range(100, 100 + i % 4)) if mode == "aggregate" else []
        calls.append(VerifyRequest.after(
            f"s{i}", [], [5, 6, 7][: 1 + i % 3], draft, mode=mode, k=k, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
            seed=1000 + i, return_probs=rows,
        ))
    return calls


def _logits(rows: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(4)
    logits = torch.randn(rows, V, generator=generator) * 2.5
    logits[:, 30:40] = logits[:, 30:31]  # ties
    logits[1::4, 1000:2000] = float("-inf")  # a grammar's mask
    return logits


def test_a_step_scored_together_answers_each_call_as_score_does() -> None:
    calls = _calls()
    assert all(handles(req) for req in calls)
    sizes = [len(req.draft) + 1 for req in calls]
    logits = _logits(sum(sizes))
    helds = [len(req.tokens) + len(req.draft) for req in calls]
    together = score_step(logits, calls, helds, 1.5)
    for req, rows, held, got in zip(calls, torch.split(logits, sizes), helds, together):
        want = score(rows.clone(), req, held, 1.5)
        for name in ("ids", "samples"):
            assert (getattr(want, name) is None) == (getattr(got, name) is None), (req.mode, req.k, name)
            if getattr(want, name) is not None:
                assert np.array_equal(getattr(want, name), getattr(got, name)), (req.mode, req.k, req.temperature, name)
        for name in ("probs", "tail_mass", "recon_error"):
            assert (getattr(want, name) is None) == (getattr(got, name) is None), (req.mode, req.k, name)
            if getattr(want, name) is not None:
                assert getattr(want, name).shape == getattr(got, name).shape
                assert np.abs(getattr(want, name) - getattr(got, name)).max() <= 1e-6, (req.mode, req.k, req.temperature, name)
        assert got.held == held and got.model_ms == 1.5


@pytest.mark.parametrize("req", [
    VerifyRequest.after("x", [], [5], [6], mode="exact", support_ids=np.array([6]), support_sizes=np.array([1], dtype=np.int32)),
    VerifyRequest.after("x", [], [5], [6], mode="aggregate", k=8, reconstruction="residual"),
    VerifyRequest.after("x", [], [5], [6, 7], mode="aggregate", parents=np.array([-1, -1])),
])
def test_what_it_does_not_answer_yet_goes_to_score(req: VerifyRequest) -> None:
    assert not handles(req)
