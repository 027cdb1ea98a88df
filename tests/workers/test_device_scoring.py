"""``workers.device_scoring.score_step`` (issue 60, item 2) against ``workers.scoring.score``, the reference,
on CPU tensors: one step of calls in every mode and payload — ``aggregate`` (top-k with each reconstruction,
full rows), ``autoregressive`` (samples, with and without rows), ``exact`` (chains and trees) and ``split``
(sampled and greedy; given q̂ on supports, the token at a rejection drawn by the worker), with and without
logprobs — at T ∈ {0, 0.7, 1} with top-k / top-p / min-p, on logits with ties and a grammar's ``-inf``: every
field of every answer the same (ids, samples, verdicts equal; probabilities within 1e-6), from one packed
copy. Mutants of a uniform's purpose and of the accept test fail it."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
import torch

import workers.device_scoring as device_scoring
from core.math.random import Purpose
from core.protocol import VerifyRequest, VerifyResponse
from core.transform import unpack_bits
from workers.device_scoring import handles, score_step
from workers.scoring import score

V = 3000
PAYLOADS = [  # mode, k, reconstruction, return_probs, tree, logprobs
    ("aggregate", 8, "renormalize", True, False, None),
    ("aggregate", 8, "residual", True, False, None),
    ("aggregate", None, "renormalize", True, False, None),
    ("aggregate", V, "renormalize", True, True, None),
    ("autoregressive", 8, "renormalize", True, False, None),
    ("autoregressive", None, "renormalize", False, False, None),
    ("exact", None, "renormalize", True, False, 2),
    ("exact", None, "renormalize", True, True, None),
    ("exact", 8, "residual", True, True, 0),
    ("split", 8, "renormalize", True, False, 3),
    ("split", None, "renormalize", True, False, None),
    ("split", 8, "residual", True, False, 0),
    # q̂ on supports: the worker draws at a rejection
    ("split+q", None, "renormalize", True, False, None),
    ("split+q", None, "renormalize", True, False, 2),
]


def _calls(logits_for: dict[int, torch.Tensor] | None = None) -> list[VerifyRequest]:
    calls = []
    grid = itertools.product(PAYLOADS, [0.0, 0.7, 1.0], [(0, 1.0, 0.0), (40, 0.9, 0.05)])
    for i, ((mode, k, recon, rows, tree, logprobs), temperature, (top_k, top_p, min_p)) in enumerate(grid):
        gamma = 0 if mode == "autoregressive" else 1 + i % 4
        draft = (
            [30 + j for j in range(gamma)]
            if i % 3
            else [int(x) for x in np.random.default_rng(i).integers(0, V, gamma)]
        )
        extra: dict = {}
        if tree and gamma:
            extra["parents"] = np.array([-1, *[(j - 1) // 2 for j in range(1, gamma)]], dtype=np.int32)
        if mode == "exact":
            count = gamma + 1 if tree else gamma
            sizes = [(j % 3) + (1 if j < gamma else 0) for j in range(count)]
            ids = [
                x
                for j, s in enumerate(sizes)
                for x in ([draft[j]] if j < gamma else []) + list(range(1000 + 7 * j, 1000 + 7 * j + s))
            ][: sum(sizes)]
            extra |= {"support_ids": np.array(ids), "support_sizes": np.array(sizes, dtype=np.int32)}
        if mode == "split+q":
            mode = "split"
            sizes = [1 + j % 3 for j in range(gamma)]
            ids = [
                x for j, s in enumerate(sizes) for x in [draft[j], *range(1000 + 7 * j, 1000 + 7 * j + s - 1)]
            ]
            q = np.linspace(0.9, 0.2, gamma) if i % 2 else np.full(gamma, 0.05)
            values = [v for j, s in enumerate(sizes) for v in [q[j], *[(1 - q[j]) / (s - 1)] * (s - 1)]]
            extra |= {
                "support_ids": np.array(ids),
                "support_sizes": np.array(sizes, dtype=np.int32),
                "support_q": np.array(values),
            }
        if mode == "split":
            extra["draft_probs"] = (
                extra["support_q"][np.cumsum([0, *extra["support_sizes"][:-1]])]
                if "support_q" in extra
                else (np.linspace(0.9, 0.2, gamma) if i % 2 else np.full(gamma, 1e-3))
            )
        calls.append(
            VerifyRequest.after(
                f"s{i}",
                [],
                [5, 6, 7][: 1 + i % 3],
                draft,
                mode=mode,
                k=k,
                reconstruction=recon,
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                min_p=min_p,
                seed=1000 + i,
                return_probs=rows,
                logprobs=logprobs,
                **extra,
            )
        )
    return calls


def _logits(rows: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(4)
    logits = torch.randn(rows, V, generator=generator) * 2.5
    logits[:, 30:40] = logits[:, 30:31]  # ties
    logits[::2, 30:40] += 9.0  # where a draft of 30, 31, … is likely (split accepts it all, sometimes)
    logits[1::4, 1000:2000] = float("-inf")  # a grammar's mask
    return logits


def _same(want: VerifyResponse, got: VerifyResponse, where: str) -> None:
    for field in dataclasses.fields(VerifyResponse):
        a, b = getattr(want, field.name), getattr(got, field.name)
        assert (a is None) == (b is None), (where, field.name)
        if isinstance(a, np.ndarray):
            assert a.shape == b.shape and a.dtype == b.dtype, (
                where,
                field.name,
                a.shape,
                b.shape,
                a.dtype,
                b.dtype,
            )
            if np.issubdtype(a.dtype, np.integer):
                assert np.array_equal(a, b), (where, field.name, a, b)
            else:
                assert np.abs(a.astype(np.float64) - b).max(initial=0) <= 1e-6, (where, field.name)
        else:
            assert a == b, (where, field.name, a, b)


def _step(calls: list[VerifyRequest]) -> tuple[torch.Tensor, list[int]]:
    sizes = [len(req.draft) + 1 for req in calls]
    return _logits(sum(sizes)), sizes


def test_a_step_scored_together_answers_each_call_as_score_does() -> None:
    calls = _calls()
    assert all(handles(req) for req in calls)
    logits, sizes = _step(calls)
    helds = [len(req.tokens) + len(req.draft) for req in calls]
    together = score_step(logits, calls, helds, 1.5)
    verdicts = set()
    for req, rows, held, got in zip(calls, torch.split(logits, sizes), helds, together):
        _same(
            score(rows.clone(), req, held, 1.5),
            got,
            f"{req.mode} k={req.k} {req.reconstruction} T={req.temperature} γ={len(req.draft)}",
        )
        if req.mode == "split":
            verdicts.add(
                (req.support_q is not None and req.temperature > 0, got.num_accepted == len(req.draft))
            )
    # split's bonus, its rejected row, the token drawn at a rejection
    assert verdicts == {(False, True), (False, False), (True, True), (True, False)}


@pytest.mark.parametrize("mutant", ["purpose", "accept"])
def test_a_broken_scorer_is_caught(monkeypatch: pytest.MonkeyPatch, mutant: str) -> None:
    if mutant == "purpose":  # the complement's samples drawn from the bonus's stream
        real = device_scoring.stream_key
        monkeypatch.setattr(
            device_scoring,
            "stream_key",
            lambda s, c, purpose, w=0: real(
                s, c, Purpose.WORKER_BONUS if purpose == Purpose.WORKER_COMPLEMENT else purpose, w
            ),
        )
    else:  # u ≤ ratio in place of u < ratio is invisible; accepting on p alone is not
        monkeypatch.setattr(device_scoring, "normalised", lambda p: torch.ones_like(p, dtype=torch.float64))
    with pytest.raises(AssertionError):
        test_a_step_scored_together_answers_each_call_as_score_does()


def test_what_the_host_answers_stays_there() -> None:
    assert not handles(VerifyRequest.after("x", [], [5, 6], [], score_tokens=True, logprobs=1))
    assert not handles(VerifyRequest.after("x", [], [5], [], score_ids=np.array([3, 4])))


@pytest.mark.parametrize("width", [3000, 3001, 7])
def test_a_grammar_mask_packed_on_the_host_unpacks_where_the_logits_are(width: int) -> None:
    mask = torch.from_numpy(np.random.default_rng(width).random((5, width)) < 0.3)
    packed = torch.from_numpy(np.packbits(mask.numpy(), axis=-1, bitorder="little"))
    assert packed.shape[-1] == (width + 7) // 8
    assert torch.equal(unpack_bits(packed, width), mask)


@pytest.mark.parametrize("mode", ["autoregressive", "aggregate", "split"])
def test_a_row_with_no_mass_fails_as_on_the_host_not_as_a_token_0(mode: str) -> None:
    """A row every id of which is −∞ (a grammar that allows nothing here): ``score`` refuses it, and so does
    the step — never a sample of id 0 — so the worker scores that step's calls on the host, where only that
    call fails."""
    extra = {"draft_probs": np.array([1.0, 1.0])} if mode == "split" else {}
    req = VerifyRequest.after(
        "x", [], [5], [] if mode == "autoregressive" else [7, 8], mode=mode, k=4, seed=3, **extra
    )
    logits = torch.full((len(req.draft) + 1, V), float("-inf"))
    for j, token in enumerate(req.draft.tolist()):
        # each draft row sure of its token (split accepts it all); the last row has nothing
        logits[j, token] = 0.0
    with pytest.raises((ValueError, RuntimeError)):
        score(logits.clone(), req, 3, 0.0)
    with pytest.raises(ValueError):
        score_step(logits, [req], [3], 0.0)


def test_the_top_entries_are_compress_top_ks_ties_and_signed_zeros_included() -> None:
    """``top_entries`` (one ``topk`` over distinct keys, issue 73) gives ``compress_top_k``'s ids and values:
    ties to the lowest id, zeros, −0.0 (a tie with +0.0), k up to V."""
    from core.math.compression import compress_top_k
    from workers.device_scoring import top_entries

    rows = torch.tensor(
        [
            [0.25, -0.0, 0.0, 0.75, 0.0],
            [0.2, 0.2, 0.2, 0.2, 0.2],
            [0.0, 0.0, 1.0, 0.0, 0.0],
            [1e-45, 0.0, 1e-45, 0.5, 0.5],
        ]
    )
    rows = torch.cat([rows, torch.softmax(torch.randn(3, 5, generator=torch.Generator().manual_seed(1)), -1)])
    for k in range(1, 6):
        values, ids = top_entries(rows, k)
        want = compress_top_k(rows, k)
        assert torch.equal(ids, want.ids) and torch.equal(values, want.probs), k
